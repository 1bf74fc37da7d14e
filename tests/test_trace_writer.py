"""The request trace the connector appends (``trace_path``): private, never written through a
planted link, and a write that fails (a full disk) is dropped and counted, never raised into vLLM's
scheduler, and leaves no torn line for ``kvstore tune``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from kvstore.trace import TraceWriter, read_trace


def test_a_trace_file_is_private_and_its_folders_too(tmp_path):
    w = TraceWriter(tmp_path / "a" / "b" / "t.jsonl")
    w.write(0.0, "s", [b"k" * 16], 16, 16, 1)
    w.close()
    assert (tmp_path / "a" / "b" / "t.jsonl").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "a").stat().st_mode & 0o777 == 0o700 and (tmp_path / "a" / "b").stat().st_mode & 0o777 == 0o700


def test_this_users_own_link_is_followed(tmp_path):
    target = tmp_path / "data" / "t.jsonl"
    target.parent.mkdir()
    (tmp_path / "t.jsonl").symlink_to(target)  # the operator's choice
    w = TraceWriter(tmp_path / "t.jsonl")
    w.write(0.0, "s", [b"k" * 16], 16, 16, 1)
    w.close()
    assert len(list(read_trace(target))) == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: to make a link owned by another user")
def test_a_link_another_user_planted_is_never_written_through(tmp_path):
    from kvstore.config import ConfigError  # noqa: F401
    from kvstore.store import machine

    victim = tmp_path / "victim"
    victim.write_text("keep")
    link = tmp_path / "link.jsonl"
    link.symlink_to(victim)
    os.lchown(link, 65534, 65534)  # nobody's link, in a folder nobody may write here: as planted
    with pytest.raises(OSError):
        TraceWriter(link)
    assert victim.read_text() == "keep"
    _, errors = machine.config_errors(overrides={"trace_path": str(link), "tiers": {"dram": {"capacity_gb": 0.1}}})
    assert [e.key for e in errors] == ["trace_path"] and "another user" in str(errors[0])

def test_a_failed_write_is_dropped_counted_and_cut_back_then_writing_resumes(tmp_path):
    """A file-size limit (RLIMIT_FSIZE, in a child process) makes writes past 4 KiB fail with EFBIG,
    as a full disk fails them with ENOSPC: whole lines up to the limit are kept, a write that would
    cross it is dropped and cut back, and once the limit is lifted the writer goes on."""
    path = tmp_path / "t.jsonl"
    script = textwrap.dedent(f"""
        import resource, signal, json
        from kvstore.trace import TraceWriter
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process at the limit
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        w = TraceWriter({str(path)!r}, flush_every=4)
        for i in range(200):
            w.write(float(i), "s", [bytes([i % 256]) * 16], 16, 16, 1)
        full = w.dropped
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        for i in range(200, 208):
            w.write(float(i), "s", [b"k" * 16], 16, 16, 1)
        w.close()
        print(json.dumps([full, w.dropped]))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    full, dropped = eval(r.stdout.strip().splitlines()[-1])
    assert full > 0 and dropped == full and "a write failed" in r.stderr and r.stderr.count("a write failed") == 1
    got = [rec.t for rec in read_trace(path)]  # every line whole: a torn one would raise here
    assert len(got) == 208 - dropped and got[-8:] == [float(i) for i in range(200, 208)]
    assert len(got) - 8 > 0 and all(b - a == 1.0 for a, b in zip(got, got[1:len(got) - 8]))


def test_buffered_lines_are_bounded_in_bytes(tmp_path):
    """flush_every lines, or 64 KiB, whichever comes first: a line with a long prompt's tokens
    (trace_tokens) is ~1 MB, and 256 of them were held in the scheduler before a write."""
    w = TraceWriter(tmp_path / "t.jsonl")
    w.write(0.0, "s", [b"k" * 16], 16, 16, 1, tokens=tuple(range(20000)))  # one line of ~100 KB
    assert len(list(read_trace(tmp_path / "t.jsonl"))) == 1  # written before close
    w.write(1.0, "s", [b"k" * 16], 16, 16, 1)
    assert len(list(read_trace(tmp_path / "t.jsonl"))) == 1  # a small one waits
    w.close()
    assert len(list(read_trace(tmp_path / "t.jsonl"))) == 2


# -- issue 45, finding 5: a file found at trace_path must be this user's and private --------------


def _refused(path) -> str:
    """The ConfigError the writer and the config check give for ``path`` (the same words)."""
    from kvstore.config import ConfigError
    from kvstore.store import machine

    with pytest.raises(ConfigError) as ei:
        TraceWriter(path)
    _, errors = machine.config_errors(overrides={"trace_path": str(path), "tiers": {"dram": {"capacity_gb": 0.1}}})
    assert [e.key for e in errors] == ["trace_path"] and ei.value.key == "trace_path"
    assert ei.value.why == errors[0].why and "mode 0600" in ei.value.allowed
    return ei.value.why


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: to make a file owned by another user")
def test_a_trace_file_another_user_made_first_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # sticky and world-writable, as /tmp
    path = shared / "t.jsonl"
    for mode in (0o666, 0o600):  # whatever its mode: its owner reads it
        path.write_text("")
        os.chown(path, 65534, 65534)
        path.chmod(mode)
        assert "owned by uid 65534" in _refused(path)
        assert path.read_text() == ""  # nothing appended
        path.unlink()


def test_a_trace_file_open_to_others_is_refused_until_it_is_0600(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("")
    for mode in (0o666, 0o644, 0o620):
        path.chmod(mode)
        assert f"mode {mode:04o}" in _refused(path)
    assert path.read_text() == ""
    path.chmod(0o600)
    w = TraceWriter(path)
    w.write(0.0, "s", [b"k" * 16], 16, 16, 1)
    w.close()
    assert len(list(read_trace(path))) == 1


# -- issue 45, finding 10: lines reach the file within flush_s, with no close and no more writes -----


def test_a_line_older_than_flush_s_is_written_at_the_next_write(tmp_path):
    """By the writer's clock (injected: no sleeping; the flusher thread waits an hour here)."""
    now = [0.0]
    path = tmp_path / "t.jsonl"
    w = TraceWriter(path, flush_s=3600.0, clock=lambda: now[0])
    try:
        w.write(0.0, "s", [b"a" * 16], 16, 16, 1)
        now[0] = 3599.0
        w.write(1.0, "s", [b"b" * 16], 16, 16, 1)
        assert path.read_text() == ""  # the oldest is younger than flush_s: both wait
        now[0] = 3600.0
        w.write(2.0, "s", [b"c" * 16], 16, 16, 1)
        assert [r.t for r in read_trace(path)] == [0.0, 1.0, 2.0]  # written, not closed
    finally:
        w.close()


def test_an_idle_writers_lines_reach_the_file_by_the_flusher_thread(tmp_path):
    """No write follows and nothing closes the writer (an idle server, then a SIGKILL): the flusher
    thread writes the line. Asserted structurally: the line shows up (within a 30 s deadline)."""
    path = tmp_path / "t.jsonl"
    w = TraceWriter(path, flush_s=0.05)
    try:
        w.write(0.0, "s", [b"a" * 16], 16, 16, 1)
        deadline = time.monotonic() + 30
        while path.stat().st_size == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [r.t for r in read_trace(path)] == [0.0]
    finally:
        w.close()


def test_flush_writes_what_is_buffered_and_close_after_it_writes_nothing_more(tmp_path):
    path = tmp_path / "t.jsonl"
    w = TraceWriter(path, flush_s=None)
    w.write(0.0, "s", [b"a" * 16], 16, 16, 1)
    assert path.read_text() == ""
    w.flush()  # the planner, when its last request in flight finished
    assert len(list(read_trace(path))) == 1
    w.close()
    w.write(1.0, "s", [b"b" * 16], 16, 16, 1)  # after close: ignored, as before
    w.flush()
    assert len(list(read_trace(path))) == 1


def test_the_planner_writes_the_lines_when_its_last_request_in_flight_finishes(tmp_path):
    """While other requests run, lines wait (cheap on the scheduler); when the last one finishes
    the engine is idle and they go to the file, before vLLM answers that request: a stop then
    (vLLM's default SIGKILLs the engine core) loses none. No store call is made on this path."""
    from conftest import FP, prompt
    from kvstore.offload.planner import Planner

    path = tmp_path / "t.jsonl"
    planner = Planner(None, FP, FP.block_size, trace=TraceWriter(path, flush_s=None))
    for rid in ("a", "b"):
        planner.track(rid, prompt(40, ord(rid)), 40)
    planner.finished("a")
    assert path.read_text() == ""  # b still runs
    planner.finished("b")
    assert [r.session for r in read_trace(path)] == ["a", "b"]
    planner.close()
