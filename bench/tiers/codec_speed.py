"""Codec encode/decode GB/s on one block, beside a memcpy of the same block (best of N, one process).

    .venv/bin/python -m kvstore.bench.tiers.codec_speed [--block-mib 2] [--threads 1,2] [--reps 30] [--kv-data synthetic]

Rows: each codec of the store (torch paths), a numpy int8 encode/decode (the alternative that was
considered) and torch's own fp8 -> float cast (what the fp8 decoder replaced). GB/s counts raw
(uncompressed) block bytes. A small 2 MiB block stays in cache, so memcpy here is the cache-resident
copy rate, an upper bound for any pass over the block.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from kvstore.bench.common.report import markdown_table
from kvstore.bench.tiers.kvdata import fill
from kvstore.codecs import Geometry, make_codec


def _best(fn, nbytes: int, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return nbytes / min(ts) / 1e9


def run(block_mib: float = 2, threads=(1, 2), reps: int = 30, kv_data: str = "synthetic") -> list[dict]:
    head, tokens = 128, 16
    layers = max(1, int(block_mib * (1 << 20)) // (2 * 8 * head * 2 * tokens))
    bb = 2 * layers * 8 * head * 2 * tokens
    src2 = np.empty((1, bb), np.uint8)
    fill(src2, kv_data, layers=layers, tokens=tokens, kv_heads=8, head_size=head, dtype="float16")
    src, dst = src2[0], np.empty(bb, np.uint8)
    rows = []
    saved = torch.get_num_threads()
    try:
        for th in threads:
            torch.set_num_threads(th)
            mem = _best(lambda: np.copyto(dst, src), bb, reps)
            for name in ("int8", "fp8", "zstd", "fp8+zstd"):
                c = make_codec(name, Geometry(bb, "float16", head))
                enc = np.empty(c.encoded_bytes, np.uint8)
                n = c.encode(src, enc)
                rows.append({"impl": f"{name} (store)", "threads": th, "encode": _best(lambda: c.encode(src, enc), bb, reps),
                             "decode": _best(lambda: c.decode(enc, n, dst), bb, reps), "memcpy": mem})
            x16 = src.view(np.float16).reshape(-1, head)
            st = {}

            def np_enc():
                x = x16.astype(np.float32)
                s = np.abs(x).max(axis=1, keepdims=True) / 127
                inv = np.divide(1.0, s, out=np.zeros_like(s), where=s > 0)
                st["q"], st["s"] = np.rint(x * inv).astype(np.int8), s

            def np_dec():
                dst.view(np.float16).reshape(-1, head)[...] = st["q"].astype(np.float32) * st["s"]

            rows.append({"impl": "int8 (numpy)", "threads": th, "encode": _best(np_enc, bb, reps),
                         "decode": _best(np_dec, bb, reps), "memcpy": mem})
            c = make_codec("fp8", Geometry(bb, "float16", head))
            enc = np.empty(c.encoded_bytes, np.uint8)
            c.encode(src, enc)
            q = torch.from_numpy(enc[c.scale_bytes:]).view(torch.float8_e4m3fn).view(-1, head)
            sc = torch.from_numpy(enc[:c.scale_bytes]).view(torch.float32).view(-1, 1)
            d = torch.from_numpy(dst).view(torch.float16).view(-1, head)
            rows.append({"impl": "fp8 decode by torch cast", "threads": th, "encode": None,
                         "decode": _best(lambda: d.copy_(q.float().mul_(sc)), bb, reps), "memcpy": mem})
    finally:
        torch.set_num_threads(saved)
    return rows


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m kvstore.bench.tiers.codec_speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--block-mib", type=float, default=2)
    p.add_argument("--threads", default="1,2", help="torch intra-op threads, comma list")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--kv-data", default="synthetic", choices=["synthetic", "tiny-llama"])
    a = p.parse_args(argv)
    rows = run(a.block_mib, [int(t) for t in a.threads.split(",")], a.reps, a.kv_data)
    print(markdown_table(rows, ["impl", "threads", "encode", "decode", "memcpy"],
                         ["codec", "torch threads", "encode GB/s", "decode GB/s", "memcpy GB/s (same block)"]))
    return rows


if __name__ == "__main__":
    main()
