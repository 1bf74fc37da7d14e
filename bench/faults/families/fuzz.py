"""Fault family 3, ``fuzz``: the file-header parser (and the tier's checks behind it) on random
and mutated headers; then fuzzed headers written into real block files, read and scanned."""

from __future__ import annotations

import os
import random
import traceback
from pathlib import Path
from typing import Callable

import numpy as np
import xxhash

from kvstore.bench.faults.families.common import Hang, alarm, block_of, key_of, open_store, read_check
from kvstore.bench.faults.families.corruption import craft_header, get_header
from kvstore.tiers import fileformat as ff

def _fuzz_header(rng: random.Random, valid: bytes) -> bytes:
    r = rng.random()
    if r < 0.15:
        return rng.randbytes(rng.choice([0, 1, 7, 8, 40, 87, 88, 89, 200, 4096]))
    if r < 0.35:  # flips, checksum left broken
        b = bytearray(valid)
        for _ in range(rng.randint(1, 6)):
            b[rng.randrange(len(b))] ^= rng.randrange(1, 256)
        return bytes(b)
    if r < 0.45:
        return valid[: rng.randrange(len(valid))]
    if r < 0.55:
        return valid + rng.randbytes(rng.randint(1, 64))
    # structured: any field values, with a valid header checksum (reaches every later check)
    body = bytearray(valid[:80])
    for _ in range(rng.randint(1, 4)):
        off = rng.randrange(80)
        body[off:off + 8] = rng.randbytes(8)[: len(body[off:off + 8])]
    if rng.random() < 0.5:
        body[:8] = ff.MAGIC
    return bytes(body[:80]) + xxhash.xxh3_64_intdigest(bytes(body[:80])).to_bytes(8, "little")


def _meaning(raw: bytes):
    """What a reader acts on in a header (not ``created``, not padding); None if it is refused."""
    try:
        h = ff.unpack_header(raw)
    except ff.BadBlockFile:
        return None
    return h.codec_id, h.payload_len, h.checksum, h.fingerprint, h.key


def fuzz(folder, *, inputs: int, files: int, seed: int = 0, block_bytes: int = 8192,
         advance: Callable[[int], None] | None = None) -> dict:
    """Header parser + tier checks on ``inputs`` fuzzed headers; ``files`` fuzzed real files."""
    from kvstore.tiers.nvme.folder import probe_xattr

    rng = random.Random(seed)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    res = {"fuzz_inputs": 0, "fuzz_parser_inputs": 0, "fuzz_file_inputs": 0, "fuzz_accepted_headers": 0,
           "fuzz_crashes": 0, "fuzz_hangs": 0, "fuzz_served": 0, "fuzz_wrong_reads": 0, "fuzz_examples": []}
    s = open_store(folder / "parser", block_bytes=block_bytes, nvme_blocks=8, header="inline")
    tier = s.nvme
    k0 = key_of("fuzz", 0)
    valid = craft_header(plen=block_bytes, chk=123, created=1.0, fp=s.namespace, key=k0)
    step = max(1, inputs // 100)
    try:
        for i in range(inputs):
            data = _fuzz_header(rng, valid)
            try:
                h = ff.unpack_header(data)
                res["fuzz_accepted_headers"] += 1
                tier._check(h, k0)  # what a read/scan checks next
            except ff.BadBlockFile:
                pass
            except Exception:
                res["fuzz_crashes"] += 1
                res["fuzz_examples"].append(f"{data.hex()}: {traceback.format_exc()[-800:]}")
            res["fuzz_parser_inputs"] += 1
            if advance and (i + 1) % step == 0:
                advance(step)
    finally:
        s.close()
    layouts = ["inline"] + (["xattr"] if probe_xattr(folder) else [])
    per = max(1, files // len(layouts))
    for layout in layouts:
        path = folder / f"files-{layout}"
        s = open_store(path, block_bytes=block_bytes, nvme_blocks=64, header=layout)
        planted = []
        try:
            keys = [key_of(f"fuzzfile-{layout}", i) for i in range(16)]
            s.put(keys, np.stack([block_of(k, block_bytes) for k in keys]))
            valid = {k: get_header(s.nvme, s.nvme.path_of(k)) for k in keys}
            for i in range(per):
                k = keys[i % len(keys)]
                p = s.nvme.path_of(k)
                data = _fuzz_header(rng, valid[k])
                try:
                    if s.nvme.header == "xattr":
                        if data:
                            os.setxattr(p, ff.XATTR, data[:1024])  # file systems cap attribute sizes
                        elif get_header(s.nvme, p):
                            os.removexattr(p, ff.XATTR)
                    else:
                        with open(p, "r+b") as f:
                            f.write(data[: ff.HEADER_BYTES])
                            if len(data) > ff.HEADER_CORE and rng.random() < 0.3:
                                f.truncate(rng.randrange(len(data) // 2, ff.file_bytes(block_bytes) + 1))
                    same = _meaning(get_header(s.nvme, p)) == _meaning(valid[k]) and os.path.getsize(p) == s.nvme.file_bytes
                    with alarm(20):
                        n, wrong = read_check(s, [k])
                    res["fuzz_wrong_reads"] += wrong
                    if n and not same:
                        res["fuzz_served"] += 1
                    if not n:  # gone (counted): write it back for the next input
                        s.put([k], block_of(k, block_bytes)[None])
                except Hang:
                    res["fuzz_hangs"] += 1
                except Exception:
                    res["fuzz_crashes"] += 1
                    res["fuzz_examples"].append(f"file {layout}: {traceback.format_exc()[-800:]}")
                res["fuzz_file_inputs"] += 1
                if advance and (i + 1) % max(1, per // 20) == 0:
                    advance(0)
            # the start-up scan on fuzzed headers
            for i, k in enumerate(keys):
                planted.append(k)
                p = s.nvme.path_of(k)
                data = _fuzz_header(rng, valid[k])
                if s.nvme.header == "xattr":
                    if data:
                        os.setxattr(p, ff.XATTR, data[:1024])
                else:
                    with open(p, "r+b") as f:
                        f.write(data[: ff.HEADER_BYTES])
                res["fuzz_file_inputs"] += 1
        finally:
            s.close()
        try:
            with alarm(20):
                s2 = open_store(path, block_bytes=block_bytes, nvme_blocks=64, header=layout)
            try:
                for k in planted:
                    n, wrong = read_check(s2, [k])
                    res["fuzz_wrong_reads"] += wrong
            finally:
                s2.close()
        except Hang:
            res["fuzz_hangs"] += 1
        except Exception:
            res["fuzz_crashes"] += 1
            res["fuzz_examples"].append(f"scan {layout}: {traceback.format_exc()[-800:]}")
    res["fuzz_inputs"] = res["fuzz_parser_inputs"] + res["fuzz_file_inputs"]
    res["fuzz_examples"] = res["fuzz_examples"][:5]
    return res
