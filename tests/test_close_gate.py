"""A store's close waits for the calls in flight and the handles open (issue 47; kvstore.store.gate).

Before, close closed the tiers under a call: an NVMe write still running met a closed folder fd
(EBADF, or a reused fd number put its file in another folder), queued jobs ran after close, and a
slab could be unregistered under a running copy. Now a call in flight ends first, a new call is
refused with a clear error, a handle ended while the close waits is published (and written down),
and one never ended keeps the DRAM slab mapped (its views stay writable) and publishes nothing."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvstore import failpoints
from kvstore.store import KVStore

from conftest import BLOCK, FP, block_for, blocks_for, make_keys, one_key, tiny_config


def _store(path, **kw) -> KVStore:
    return KVStore(tiny_config(path, **kw), block_bytes=BLOCK, fingerprint=FP, block_tokens=16)


@pytest.fixture
def gate():
    failpoints.close_gate()
    yield
    failpoints.clear()


def test_a_write_in_flight_ends_before_the_close_and_new_calls_are_refused(tmp_path, gate):
    s = _store(tmp_path / "c", dram_blocks=0)  # NVMe only: a put writes the file in the calling thread
    k = one_key(1)
    failpoints.arm("nvme.write=hold")  # every write: a leftover thread of another test may write too
    done: dict = {}
    t = threading.Thread(target=lambda: done.setdefault("n", s.put([k], block_for(k)[None])))
    t.start()
    give_up = time.monotonic() + 10
    while t.ident not in failpoints.holding():  # this put's own write, not another thread's
        assert time.monotonic() < give_up
        time.sleep(0.01)
    closer = threading.Thread(target=s.close)
    closer.start()
    time.sleep(0.3)
    assert closer.is_alive()  # waiting for the put
    with pytest.raises(RuntimeError, match="closed"):
        s.contains_prefix([k])
    failpoints.open_gate()
    t.join(10)
    closer.join(10)
    assert done == {"n": 1} and not closer.is_alive()
    with _store(tmp_path / "c", dram_blocks=0) as again:  # the file was written whole, in its folder
        out = np.zeros((1, BLOCK), np.uint8)
        assert again.get([k], out) == 1 and np.array_equal(out[0], block_for(k))


def test_a_handle_ended_while_the_close_waits_is_published_and_written_down(tmp_path):
    s = _store(tmp_path / "c")
    keys = make_keys(2, seed=3)
    h = s.begin_store(keys)
    closer = threading.Thread(target=s.close)
    closer.start()
    time.sleep(0.2)
    assert closer.is_alive()
    for v, x in zip(h.views, blocks_for(keys)):
        v[:] = x
    assert s.end_store(h, True) == 2
    closer.join(10)
    assert not closer.is_alive()
    with _store(tmp_path / "c") as again:  # persisted at close: DRAM written down to NVMe
        out = np.zeros((2, BLOCK), np.uint8)
        assert again.get(keys, out) == 2 and np.array_equal(out, blocks_for(keys))


def test_a_handle_never_ended_keeps_the_slab_and_publishes_nothing(tmp_path, caplog):
    s = _store(tmp_path / "c")
    keys = make_keys(2, seed=4)
    h = s.begin_store(keys)
    t0 = time.monotonic()
    s.close(wait_s=0.2)
    assert time.monotonic() - t0 < 5
    assert "handles open" in caplog.text and "left mapped" in caplog.text
    for v, x in zip(h.views, blocks_for(keys)):  # still mapped: a late copy lands, harmlessly
        v[:] = x
    assert s.end_store(h, True) == 0  # after the close: nothing published
    with pytest.raises(RuntimeError, match="closed"):
        s.begin_store(keys)
    with _store(tmp_path / "c") as again:
        assert again.contains_prefix(keys).num_blocks == 0


def test_ordinary_use_leaves_nothing_for_the_close_to_wait_for(tmp_path, caplog):
    """Every handle the store's own calls open is ended (a leaked count would hold every close for
    its whole wait): puts past DRAM (written below), gets, loads, an aborted store, a prefetch."""
    s = _store(tmp_path / "c", dram_blocks=2)
    keys = make_keys(6, seed=5)
    assert s.put(keys, blocks_for(keys)) == 6
    out = np.zeros((6, BLOCK), np.uint8)
    assert s.get(keys, out) == 6 and np.array_equal(out, blocks_for(keys))
    s.end_store(s.begin_store(make_keys(2, seed=6)), False)
    s.end_load(s.pin_load(keys))
    h = s.begin_load(keys[:3])
    s.end_load(h)
    s.prefetch(keys).result(10)
    s.flush()
    assert s._gate.handles == 0 and s._gate.calls == 0
    t0 = time.monotonic()
    s.close()
    assert time.monotonic() - t0 < 5 and "handles open" not in caplog.text


_EXIT_WITH_A_PIN = """
import sys, time
sys.path.insert(0, "tests")
from conftest import BLOCK, FP, block_for, one_key, tiny_config
from kvstore.offload import acquire_shared
s = acquire_shared("exit-test", tiny_config(sys.argv[1]), FP, BLOCK, 16)
k = one_key(7)
assert s.store.put([k], block_for(k)[None]) == 1
s.put_handle(s.store.pin_load([k]))  # a pinned load nobody took (its worker never ran)
print("pinned", flush=True)
"""


def test_a_process_that_exits_with_a_pinned_load_closes_at_once_and_writes_down(tmp_path):
    """The exit hook ends the handle table's loads, as release_shared does (it closed with them
    still counted: 30 s at exit, and the slab left mapped, the block never written down)."""
    import subprocess
    import sys

    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", _EXIT_WITH_A_PIN, str(tmp_path / "c")], capture_output=True,
                       text=True, timeout=120, env={**__import__("os").environ, "KVSTORE_FAILPOINTS": ""})
    took = time.monotonic() - t0
    assert p.returncode == 0 and "pinned" in p.stdout, p.stderr[-2000:]
    assert took < 20 and "handles open" not in p.stderr, (took, p.stderr[-2000:])
    k = one_key(7)
    with _store(tmp_path / "c", dram_blocks=0) as again:  # persisted at exit: on NVMe
        out = np.zeros((1, BLOCK), np.uint8)
        assert again.get([k], out) == 1 and np.array_equal(out[0], block_for(k))


def test_the_close_store_failpoint_does_not_wait_for_the_handles_open(tmp_path, gate):
    """``store.pin=close_store`` shuts the store down under a call (bench faults' tier_shut_down);
    an engine's handle open meanwhile held that close for its whole 30 s wait."""
    s = _store(tmp_path / "c")
    keys = make_keys(2, seed=8)
    assert s.put(keys, blocks_for(keys)) == 2
    h = s.begin_store(make_keys(1, seed=9))  # a save in flight in the engine
    failpoints.arm("store.pin=close_store*1")
    t0 = time.monotonic()
    try:
        s.end_load(s.pin_load(keys))
    except RuntimeError as e:
        assert "closed" in str(e)
    assert time.monotonic() - t0 < 5
    with pytest.raises(RuntimeError, match="closed"):
        s.contains_prefix(keys)
    assert s.end_store(h, True) == 0
