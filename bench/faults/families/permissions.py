"""Fault family 8, ``permissions``: the folders the other families left: files 0600, folders
0700, no symlink; every key maps to a path inside its namespace folder; no unpickling in the core."""

from __future__ import annotations

import os
import random
import re
import stat
from pathlib import Path
from typing import Callable

from kvstore.bench.faults.families.common import REPO, walk_cache

_BANNED = re.compile(r"\b(pickle|cPickle|marshal|shelve|dill|cloudpickle|joblib)\b|allow_pickle|np\.load\(|"
                     r"torch\.load\(|numpy\.load\(")


def permissions(folders: list, *, advance: Callable[[], None] | None = None) -> dict:
    """Modes and symlinks of what the other families left; key paths; no unpickling in the core."""
    files = dirs = 0
    bad = []
    for f in folders:
        for d in Path(f).rglob("kvstore-*"):  # every namespace folder (each tier's own files)
            if d.is_symlink() or not d.is_dir():
                continue
            w = walk_cache(d)
            files += w["files"]
            dirs += w["dirs"] + 1
            if stat.S_IMODE(os.lstat(d).st_mode) != 0o700:
                bad.append(str(d))
            bad += w["bad_file_mode"] + w["bad_dir_mode"] + w["symlinks"] + w["other"]
    # every key maps to a path inside the namespace folder, from its hex digits only
    from kvstore.tiers.nvme import NvmeTier

    escapes = 0
    root = Path("/x/kvstore-0")
    tier = NvmeTier.__new__(NvmeTier)
    tier.root = root
    rng = random.Random(0)
    for i in range(10000):
        k = b"../../etc/passwd" if i == 0 else (b"/" * 16 if i == 1 else rng.randbytes(16))
        p = tier.path_of(k)
        if p.parent.parent != root or not re.fullmatch(r"[0-9a-f]{32}\.kvb", p.name) or ".." in p.parts:
            escapes += 1
    core = [p for p in Path(REPO, "kvstore").rglob("*.py")]
    pickles = [f"{p.name}:{i + 1}" for p in core for i, line in enumerate(p.read_text().splitlines())
               if _BANNED.search(line)]
    if advance:
        advance()
    return {"perm_files_checked": files, "perm_dirs_checked": dirs, "perm_violations": len(bad),
            "perm_examples": bad[:5], "perm_key_path_escapes": escapes, "perm_unpickling_sites": pickles}
