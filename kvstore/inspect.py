"""``kvstore inspect DIR``: what an NVMe tier folder holds, read from file headers only."""

from __future__ import annotations

import os
import time

from kvstore import fileformat as ff
from kvstore.codecs.registry import CODEC_NAMES

AGE_BUCKETS = ((60, "<1m"), (600, "1m-10m"), (3600, "10m-1h"), (86400, "1h-1d"), (7 * 86400, "1d-7d"),
               (float("inf"), ">7d"))


def inspect_folder(path: str, now: float | None = None) -> dict:
    """Summarize every ``kvstore-<namespace>`` folder under ``path`` (no payload is read)."""
    from kvstore.tiers.folder import read_header

    now = time.time() if now is None else now
    out: dict = {"path": os.path.abspath(path), "namespaces": {}, "blocks": 0, "bytes": 0, "bad_files": 0,
                 "temp_files": 0}
    if not os.path.isdir(path):
        raise SystemExit(f"kvstore inspect: not a folder: {path}")
    for ns in sorted(os.scandir(path), key=lambda d: d.name):
        if not ns.name.startswith("kvstore-") or not ns.is_dir(follow_symlinks=False):
            continue
        info = {"blocks": 0, "bytes": 0, "payload_bytes": 0, "fingerprints": {}, "codecs": {},
                "age": {name: 0 for _, name in AGE_BUCKETS}, "bad_files": 0, "temp_files": 0,
                "oldest_s": None, "newest_s": None}
        for root, dirs, files in os.walk(ns.path, followlinks=False):
            in_tmp = os.path.basename(root) == "tmp"
            for name in files:
                p = os.path.join(root, name)
                if in_tmp:
                    info["temp_files"] += 1
                    continue
                if not name.endswith(ff.SUFFIX) or os.path.islink(p):
                    info["bad_files"] += 1
                    continue
                try:
                    st = os.lstat(p)
                    h = read_header(p)
                except (OSError, ff.BadBlockFile):
                    info["bad_files"] += 1
                    continue
                info["blocks"] += 1
                info["bytes"] += st.st_size
                info["payload_bytes"] += h.payload_len
                fp = h.fingerprint.hex()
                info["fingerprints"][fp] = info["fingerprints"].get(fp, 0) + 1
                codec = CODEC_NAMES.get(h.codec_id, str(h.codec_id))
                info["codecs"][codec] = info["codecs"].get(codec, 0) + 1
                age = max(0.0, now - st.st_mtime)
                for limit, label in AGE_BUCKETS:
                    if age < limit:
                        info["age"][label] += 1
                        break
                info["oldest_s"] = age if info["oldest_s"] is None else max(info["oldest_s"], age)
                info["newest_s"] = age if info["newest_s"] is None else min(info["newest_s"], age)
        out["namespaces"][ns.name] = info
        for k in ("blocks", "bytes", "bad_files", "temp_files"):
            out[k] += info[k]
    return out


def render(info: dict) -> str:
    lines = [f"{info['path']}: {info['blocks']} blocks, {info['bytes'] / 2**20:.1f} MiB, "
             f"{len(info['namespaces'])} namespace(s), {info['bad_files']} bad file(s), "
             f"{info['temp_files']} temp file(s)"]
    for name, ns in info["namespaces"].items():
        lines.append(f"  {name}: {ns['blocks']} blocks, {ns['bytes'] / 2**20:.1f} MiB "
                     f"(payload {ns['payload_bytes'] / 2**20:.1f} MiB), codecs {ns['codecs'] or '{}'}")
        for fp, n in ns["fingerprints"].items():
            lines.append(f"    fingerprint {fp}: {n} blocks")
        ages = "  ".join(f"{k} {v}" for k, v in ns["age"].items())
        lines.append(f"    age (since last use): {ages}")
    return "\n".join(lines)
