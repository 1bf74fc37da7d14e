"""Fault family 7, ``bad_input``: bad configs, wrong types, negative sizes, unusable or unsafe
folders, malformed traces: each must be refused with a clear error (ConfigError/ValueError/TraceError)."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Callable

import numpy as np

from kvstore.bench.faults.families.common import FP, MountError, key_of, make_config, open_store, tmpfs
from kvstore.config import ConfigError, from_dict

def _expect(cases: list, name: str, fn: Callable[[], object], exc, must: tuple[str, ...] = ()) -> None:
    """Run one bad input; record whether it was refused with ``exc`` and a message naming ``must``."""
    try:
        fn()
    except exc as e:
        msg = str(e)
        ok = all(m in msg for m in must)
        cases.append({"case": name, "ok": ok, "error": f"{type(e).__name__}: {msg}"[:300]})
        return
    except Exception as e:
        cases.append({"case": name, "ok": False, "error": f"UNEXPECTED {type(e).__name__}: {e}"[:300]})
        return
    cases.append({"case": name, "ok": False, "error": "accepted"})


BAD_CONFIGS = {
    "negative capacity": ({"tiers": {"dram": {"capacity_gb": -1}}}, "tiers.dram.capacity_gb"),
    "capacity as text": ({"tiers": {"nvme": {"capacity_gb": "10GB"}}}, "tiers.nvme.capacity_gb"),
    "capacity as list": ({"tiers": {"nvme": {"capacity_gb": [1]}}}, "tiers.nvme.capacity_gb"),
    "capacity inf": ({"tiers": {"nvme": {"capacity_gb": float("inf")}}}, "tiers.nvme.capacity_gb"),
    "capacity bool": ({"tiers": {"dram": {"capacity_gb": True}}}, "tiers.dram.capacity_gb"),
    "negative ttl": ({"tiers": {"nvme": {"ttl_s": -5}}}, "tiers.nvme.ttl_s"),
    "ttl as text": ({"tiers": {"dram": {"ttl_s": "1h"}}}, "tiers.dram.ttl_s"),
    "unknown policy": ({"tiers": {"dram": {"policy": "mru"}}}, "tiers.dram.policy"),
    "unknown codec": ({"tiers": {"nvme": {"codec": "gzip"}}}, "tiers.nvme.codec"),
    "io_threads 0": ({"tiers": {"nvme": {"io_threads": 0}}}, "tiers.nvme.io_threads"),
    "io_threads float": ({"tiers": {"nvme": {"io_threads": 2.5}}}, "tiers.nvme.io_threads"),
    "zstd level 99": ({"tiers": {"nvme": {"zstd_level": 99}}}, "tiers.nvme.zstd_level"),
    "path as int": ({"tiers": {"nvme": {"path": 5}}}, "tiers.nvme.path"),
    "path empty": ({"tiers": {"nvme": {"path": "  "}}}, "tiers.nvme.path"),
    "o_direct maybe": ({"tiers": {"nvme": {"o_direct": "maybe"}}}, "tiers.nvme.o_direct"),
    "port too big": ({"metrics": {"port": 70000}}, "metrics.port"),
    "port text": ({"metrics": {"port": "http"}}, "metrics.port"),
    "tiers not a mapping": ({"tiers": [1, 2]}, "tiers"),
    "dram not a mapping": ({"tiers": {"dram": 4}}, "tiers.dram"),
    "unknown top key": ({"tier": {}}, "tier"),
    "unknown nvme key": ({"tiers": {"nvme": {"size": 1}}}, "tiers.nvme.size"),
    "root not a mapping": (["tiers"], "<root>"),
    "trace_path int": ({"trace_path": 3}, "trace_path"),
}

BAD_TRACE_LINES = {
    "not json": "{t: 1",
    "binary": "\x00\xff\xfe",
    "array": "[1, 2, 3]",
    "string": '"hello"',
    "missing keys": '{"t": 1}',
    "blocks not a list": '{"t":1,"session":"s","blocks":"abcd","block_tokens":16,"prompt_tokens":1}',
    "blocks of lists": '{"t":1,"session":"s","blocks":[[1]],"block_tokens":16,"prompt_tokens":1}',
    "blocks of objects": '{"t":1,"session":"s","blocks":[{"a":1}],"block_tokens":16,"prompt_tokens":1}',
    "blocks not hex": '{"t":1,"session":"s","blocks":["zz"],"block_tokens":16,"prompt_tokens":1}',
    "blocks ints": '{"t":1,"session":"s","blocks":[1,2],"block_tokens":16,"prompt_tokens":1}',
    "t text": '{"t":"soon","session":"s","blocks":[],"block_tokens":16,"prompt_tokens":1}',
    "t nan": '{"t":"nan","session":"s","blocks":[],"block_tokens":16,"prompt_tokens":1}',
    "t infinite": '{"t":1e400,"session":"s","blocks":[],"block_tokens":16,"prompt_tokens":1}',
    "block_tokens 0": '{"t":1,"session":"s","blocks":[],"block_tokens":0,"prompt_tokens":1}',
    "prompt_tokens negative": '{"t":1,"session":"s","blocks":[],"block_tokens":16,"prompt_tokens":-4}',
    "prompt_tokens text": '{"t":1,"session":"s","blocks":[],"block_tokens":16,"prompt_tokens":"many"}',
}


def bad_input(folder, *, advance: Callable[[], None] | None = None) -> dict:
    """Bad configs, wrong types, negative sizes, unusable/unsafe folders, malformed traces."""
    from kvstore.config import load_config
    from kvstore.store import KVStore
    from kvstore.trace import TraceError, parse_line
    from kvstore.tune.cli import main as tune_main
    from kvstore.tune.trace_memory import load_trace

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    cases: list[dict] = []
    for name, (data, key) in BAD_CONFIGS.items():
        _expect(cases, f"config: {name}", lambda d=data: from_dict(d), ConfigError, (key,))
    # files
    files = {"yaml list": "- a\n- b\n", "yaml syntax": "tiers: {dram: [\n", "binary": "\x00\x01\x02"}
    for name, text in files.items():
        p = folder / f"bad-{name.replace(' ', '_')}.yaml"
        p.write_text(text)
        _expect(cases, f"config file: {name}", lambda p=p: load_config(p, environ={}), ConfigError, ("config",))
    _expect(cases, "config file: missing", lambda: load_config(folder / "nope.yaml", environ={}), ConfigError,
            ("nope.yaml",))
    _expect(cases, "env: bad value", lambda: load_config(None, environ={"KVSTORE__TIERS__DRAM__CAPACITY_GB": "-3"}),
            ConfigError, ("tiers.dram.capacity_gb",))
    # the store's own arguments
    cfg = make_config(None, block_bytes=4096, dram_blocks=4, nvme_blocks=8)
    _expect(cases, "store: negative block_bytes", lambda: KVStore(cfg, block_bytes=-1, fingerprint=FP), ValueError,
            ("block_bytes",))
    _expect(cases, "store: zero block_bytes", lambda: KVStore(cfg, block_bytes=0, fingerprint=FP), ValueError,
            ("block_bytes",))
    s = KVStore(cfg, block_bytes=4096, fingerprint=FP)
    try:
        good = [key_of("bad", 0)]
        blk = np.zeros((1, 4096), np.uint8)
        _expect(cases, "keys: too short", lambda: s.put([b"short"], blk), ValueError, ("16-byte",))
        _expect(cases, "keys: a path", lambda: s.put([b"../../../etc/passwd"], blk), ValueError, ("16-byte",))
        _expect(cases, "keys: text", lambda: s.get(["0" * 32], blk), ValueError, ("16-byte",))
        _expect(cases, "keys: int", lambda: s.contains_prefix([12345]), ValueError, ("16-byte",))
        _expect(cases, "blocks: float32", lambda: s.put(good, np.zeros((1, 1024), np.float32)), ValueError,
                ("blocks",))
        _expect(cases, "blocks: too small", lambda: s.put(good, np.zeros((1, 100), np.uint8)), ValueError,
                ("blocks",))
        _expect(cases, "blocks: too few", lambda: s.put(good * 2, blk), ValueError, ("blocks",))
        ro = np.zeros((1, 4096), np.uint8)
        ro.flags.writeable = False
        _expect(cases, "out: read-only", lambda: s.get(good, ro), ValueError, ("read-only",))
        _expect(cases, "out: 1-D", lambda: s.get(good, np.zeros(4096, np.uint8)), ValueError, ("out",))
    finally:
        s.close()
    # folders: unusable or unsafe
    nv = "tiers.nvme.path"

    def store_at(p):
        st = open_store(p, block_bytes=4096, nvme_blocks=4)
        st.close()

    a_file = folder / "a-file"
    a_file.write_bytes(b"x")
    _expect(cases, "folder: is a file", lambda: store_at(a_file), ConfigError, (nv,))
    _expect(cases, "folder: under a file", lambda: store_at(a_file / "sub"), ConfigError, (nv,))
    other = folder / "owned-by-nobody"
    other.mkdir(mode=0o700, exist_ok=True)
    try:
        os.chown(other, 65534, 65534)
        _expect(cases, "folder: owned by another user", lambda: store_at(other), ConfigError, (nv, "owned"))
    except PermissionError:
        cases.append({"case": "folder: owned by another user", "ok": None, "error": "skipped: needs root"})
    ww = folder / "world-writable"
    ww.mkdir(exist_ok=True)
    os.chmod(ww, 0o777)
    _expect(cases, "folder: world-writable", lambda: store_at(ww), ConfigError, (nv, "world-writable"))
    sticky = folder / "sticky-tmp-like"
    sticky.mkdir(exist_ok=True)
    os.chmod(sticky, 0o1777)
    _expect(cases, "folder: world-writable sticky (like /tmp)", lambda: store_at(sticky), ConfigError, (nv,))
    try:
        with tmpfs(folder / "ro-mnt", 1, "ro"):
            _expect(cases, "folder: read-only file system", lambda: store_at(folder / "ro-mnt"), ConfigError,
                    (nv, "writable"))
            _expect(cases, "folder: missing under a read-only fs", lambda: store_at(folder / "ro-mnt" / "x"),
                    ConfigError, (nv,))
    except MountError as e:
        cases.append({"case": "folder: read-only file system", "ok": None, "error": f"skipped: {e}"})
    # malformed traces: the tuner's loader and the trace reader
    for name, line in BAD_TRACE_LINES.items():
        p = folder / "bad-trace.jsonl"
        good = '{"t":0,"session":"a","blocks":["' + "ab" * 16 + '"],"block_tokens":16,"prompt_tokens":20}'
        p.write_text(good + "\n" + line + "\n")
        _expect(cases, f"trace (tuner): {name}", lambda p=p: load_trace(p), TraceError, ("line 2",))
        _expect(cases, f"trace (reader): {name}", lambda line=line: parse_line(line, 2), TraceError, ("line 2",))
    p = folder / "bad-trace.jsonl"
    p.write_text(BAD_TRACE_LINES["blocks of lists"] + "\n")
    import contextlib
    import io

    with contextlib.redirect_stderr(io.StringIO()) as err, contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = tune_main(["--trace", str(p), "--quiet", "--out", str(folder / "tune-out")])
        except SystemExit as e:
            rc = e.code
        except Exception as e:
            rc = f"crash {e!r}"
    cases.append({"case": "kvstore tune on a malformed trace", "ok": rc not in (0, None) and isinstance(rc, int)
                  and "Traceback" not in err.getvalue(), "error": f"exit {rc}: {err.getvalue().strip()[:200]}"})
    # random nested data: only ConfigError, never anything else
    rng = random.Random(1)
    fuzz_bad = 0
    for i in range(2000):
        d = _random_config(rng)
        try:
            from_dict(d)
        except ConfigError:
            pass
        except Exception as e:
            fuzz_bad += 1
            cases.append({"case": f"config fuzz #{i}", "ok": False, "error": f"{type(e).__name__}: {e}; {d!r}"[:300]})
    if advance:
        advance()
    checked = [c for c in cases if c["ok"] is not None]
    return {"bad_input_cases": len(checked), "bad_input_refused_clearly": sum(1 for c in checked if c["ok"]),
            "bad_input_unclear": [c for c in checked if not c["ok"]], "bad_input_config_fuzz": 2000,
            "bad_input_skipped": [c for c in cases if c["ok"] is None], "bad_input_detail": cases}


_SCALARS = [None, True, 0, -1, 1, 2.5, float("nan"), float("inf"), "", "x", "auto", "lru", "none", "/tmp/x", [],
            [1], {}, 10**30, -10**30, "true", b"bytes"]
_KEYS = ["tiers", "dram", "nvme", "metrics", "port", "trace_path", "capacity_gb", "ttl_s", "ttl_shared_s", "policy",
         "codec", "path", "io_threads", "o_direct", "header", "write_mode", "zstd_level", "pin_memory", "other", 3]


def _random_config(rng: random.Random, depth: int = 0):
    if depth > 3 or rng.random() < 0.3:
        return rng.choice(_SCALARS)
    if rng.random() < 0.1:
        return [_random_config(rng, depth + 1) for _ in range(rng.randint(0, 2))]
    d = {}
    for _ in range(rng.randint(0, 3)):
        d[rng.choice(_KEYS)] = _random_config(rng, depth + 1)
    if depth == 0 and rng.random() < 0.7:  # mostly well-shaped, so the value checks are reached
        d = {"tiers": {"dram": {rng.choice(_KEYS[6:-2]): rng.choice(_SCALARS)},
                       "nvme": {rng.choice(_KEYS[6:-2]): rng.choice(_SCALARS)}},
             "metrics": {"port": rng.choice(_SCALARS)}}
    return d
