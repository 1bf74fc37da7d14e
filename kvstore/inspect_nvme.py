"""``kvstore inspect DIR``: what an NVMe tier folder holds, read from file headers only."""

from __future__ import annotations

import os
import time

from kvstore import fileformat as ff
from kvstore.inspect_common import count_block, namespace_lines, new_namespace


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
        info = new_namespace(fingerprints={}, bad_files=0, temp_files=0)
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
                count_block(info, st.st_size, h.payload_len, h.codec_id, now - st.st_mtime)
                fp = h.fingerprint.hex()
                info["fingerprints"][fp] = info["fingerprints"].get(fp, 0) + 1
        out["namespaces"][ns.name] = info
        for k in ("blocks", "bytes", "bad_files", "temp_files"):
            out[k] += info[k]
    return out


def render(info: dict) -> str:
    lines = [f"{info['path']}: {info['blocks']} blocks, {info['bytes'] / 2**20:.1f} MiB, "
             f"{len(info['namespaces'])} namespace(s), {info['bad_files']} bad file(s), "
             f"{info['temp_files']} temp file(s)"]
    for name, ns in info["namespaces"].items():
        head, ages = namespace_lines(name, ns, "last use")
        lines.append(head)
        for fp, n in ns["fingerprints"].items():
            lines.append(f"    fingerprint {fp}: {n} blocks")
        lines.append(ages)
    return "\n".join(lines)
