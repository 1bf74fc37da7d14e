"""The block files of the engine fault bench (bench/faults/engine_driver.py): find a prompt's files,
damage them as a fault would, and compare every valid file's KV with a reference folder's."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def block_files(store: str, keys: list[bytes]) -> list[Path]:
    out = []
    for k in keys:
        h = k.hex()
        out += list(Path(store).glob(f"kvstore-*/{h[:2]}/{h}.kvb"))
    return out


def damage(files: list[Path], how: str) -> int:
    from kvstore.tiers import fileformat as ff

    n = 0
    for i, f in enumerate(files):
        if not f.exists():
            continue
        xattr = ff.XATTR in os.listxattr(f)
        size = f.stat().st_size
        if how == "payload":  # a run of bytes flipped in the payload, header intact
            off = (0 if xattr else ff.HEADER_BYTES) + 1000
            with open(f, "r+b") as fh:
                fh.seek(off)
                b = fh.read(64)
                fh.seek(off)
                fh.write(bytes(x ^ 0x5A for x in b))
        elif how == "header":
            if xattr:
                h = bytearray(os.getxattr(f, ff.XATTR))
                h[20] ^= 0xFF
                os.setxattr(f, ff.XATTR, bytes(h))
            else:
                with open(f, "r+b") as fh:
                    fh.seek(20)
                    b = fh.read(1)
                    fh.seek(20)
                    fh.write(bytes([b[0] ^ 0xFF]))
        elif how == "truncated":
            os.truncate(f, size // 2)
        elif how == "replaced":  # another key's valid file, renamed over this one
            other = files[(i + 1) % len(files)]
            if other == f:
                continue
            tmp = f.with_suffix(".swap")
            tmp.write_bytes(other.read_bytes())
            if xattr:
                os.setxattr(tmp, ff.XATTR, os.getxattr(other, ff.XATTR))
            os.chmod(tmp, 0o600)
            os.replace(tmp, f)
        n += 1
    return n


def payloads(store: str) -> dict[bytes, np.ndarray]:
    """Every valid block file's payload, by key (header and checksum checked)."""
    from kvstore.tiers import fileformat as ff
    from kvstore.tiers.nvme.folder import read_header

    out = {}
    for f in Path(store).glob("kvstore-*/??/*.kvb"):
        try:
            h = read_header(f)
            data = f.read_bytes()
        except Exception:
            continue
        off = 0 if ff.XATTR in os.listxattr(f) else ff.HEADER_BYTES
        payload = data[off:off + h.payload_len]
        if len(payload) == h.payload_len and ff.checksum(np.frombuffer(payload, np.uint8)) == h.checksum:
            out[h.key] = np.frombuffer(payload, np.uint8)
    return out


def poisoned(store: str, ref_store: str) -> tuple[int, int, int, list[dict]]:
    """(blocks compared, blocks whose KV differs from the reference's under the same key, not
    comparable, a few of the differing blocks described: how far off, and whether the bytes are
    another reference block's, so that a failure says what kind of wrong it is)."""
    mine, ref = payloads(store), payloads(ref_store)
    compared = bad = unknown = 0
    examples: list[dict] = []
    for k, v in mine.items():
        r = ref.get(k)
        if r is None or r.size != v.size:
            unknown += 1
            continue
        compared += 1
        a, b = v.view(np.float32), r.view(np.float32)
        if not np.allclose(a, b, rtol=1e-3, atol=1e-3, equal_nan=True):
            bad += 1
            if len(examples) < 3:
                off = ~np.isclose(a, b, rtol=1e-3, atol=1e-3, equal_nan=True)
                examples.append({
                    "key": k.hex()[:16], "elements_off": round(float(off.mean()), 4),
                    "max_abs_diff": float(np.nanmax(np.abs(a - b))), "ref_max_abs": float(np.nanmax(np.abs(b))),
                    "first_off": int(np.argmax(off)), "zeros": round(float((a == 0).mean()), 4),
                    "is_another_ref_block": next((o.hex()[:16] for o, x in ref.items()
                                                  if x.size == v.size and np.array_equal(x, v)), None)})
    return compared, bad, unknown, examples
