"""An NVMe tier with no configured path keeps its blocks in a private temp folder, removed at
close. A store that dies without closing (SIGKILL, OOM) cannot remove it: the next store of this
user removes it, knowing its owner is gone because nobody holds the folder's lock. Before this,
every unclean exit left up to the tier's capacity (100 GiB by default) in the temp folder."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from kvstore.config import from_dict
from kvstore.store import KVStore
from kvstore.tiers.nvme import folder as folder_mod
from kvstore.tiers.nvme.folder import LOCK_NAME, TEMP_PREFIX, make_temp_folder, sweep_temp_folders
from tests.conftest import BLOCK, FP

CFG = {"tiers": {"dram": {"capacity_gb": 0}, "nvme": {"path": None, "capacity_gb": 0.01}}}


def _child(tmp: Path, body: str) -> subprocess.Popen:
    """A python child with TMPDIR=tmp that runs ``body`` after making a store with CFG."""
    script = textwrap.dedent(f"""
        import os, signal, sys, numpy as np
        from kvstore.config import from_dict
        from kvstore.store import KVStore
        from tests.conftest import BLOCK, FP
        s = KVStore(from_dict({CFG!r}), block_bytes=BLOCK, fingerprint=FP, block_tokens=16)
        s.put([os.urandom(16) for _ in range(4)], np.ones((4, BLOCK), np.uint8)); s.flush()
        print("ready", flush=True)
    """) + textwrap.dedent(body)
    env = dict(os.environ, TMPDIR=str(tmp))
    return subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1])


def _temp_folders(tmp: Path) -> list[Path]:
    return sorted(p for p in tmp.iterdir() if p.name.startswith(TEMP_PREFIX))


def test_a_killed_stores_folder_is_removed_by_the_next_store_and_a_live_ones_is_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(folder_mod, "YOUNG_S", 0.0)  # the killed store's folder is seconds old here
    dead = _child(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)\n")
    assert dead.stdout.readline().strip() == "ready"
    dead.wait(timeout=60)
    left = _temp_folders(tmp_path)
    assert len(left) == 1 and any(f.suffix == ".kvb" for f in left[0].rglob("*"))  # its blocks, left behind
    live = _child(tmp_path, "signal.pause()\n")
    assert live.stdout.readline().strip() == "ready"
    try:
        live_folder = [p for p in _temp_folders(tmp_path) if p not in left]
        assert len(live_folder) == 1
        monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
        s = KVStore(from_dict(CFG), block_bytes=BLOCK, fingerprint=FP, block_tokens=16)  # sweeps first
        try:
            now = _temp_folders(tmp_path)
            assert left[0] not in now and live_folder[0] in now and len(now) == 2  # the live one and s's own
            assert sweep_temp_folders(str(tmp_path)) == 0  # s's own folder is locked by s, in this process
        finally:
            s.close()
        assert _temp_folders(tmp_path) == live_folder  # s removed its own at close
    finally:
        live.kill()
        live.wait(timeout=60)
    assert sweep_temp_folders(str(tmp_path)) == 1 and _temp_folders(tmp_path) == []


def test_the_sweep_touches_nothing_that_is_not_a_private_folder_of_this_user(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (target / LOCK_NAME).write_text("")
    (tmp_path / f"{TEMP_PREFIX}link").symlink_to(target)  # a planted link to a lockable folder
    loose = tmp_path / f"{TEMP_PREFIX}loose"
    loose.mkdir()
    loose.chmod(0o755)  # not a folder this code made (0700)
    (loose / LOCK_NAME).write_text("")
    nolock = tmp_path / f"{TEMP_PREFIX}nolock"
    nolock.mkdir(mode=0o700)  # being made: mkdtemp, then its lock
    (tmp_path / f"{TEMP_PREFIX}file").write_text("")
    assert sweep_temp_folders(str(tmp_path)) == 0
    assert target.exists() and (target / LOCK_NAME).exists() and loose.exists() and nolock.exists()


def test_a_temporary_folder_is_not_persisted_into_at_close(tmp_path, monkeypatch):
    monkeypatch.setattr(folder_mod, "YOUNG_S", 0.0)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    cfg = from_dict({"tiers": {"dram": {"capacity_gb": 0.001}, "nvme": {"path": None, "capacity_gb": 0.01}}})
    s = KVStore(cfg, block_bytes=BLOCK, fingerprint=FP, block_tokens=16)
    s.put([os.urandom(16) for _ in range(4)], np.ones((4, BLOCK), np.uint8))
    calls = []
    monkeypatch.setattr(s, "persist", lambda: calls.append(1) or 0)
    s.close()
    assert calls == [] and _temp_folders(tmp_path) == []
    folder, fd = make_temp_folder()  # the helper itself: 0700, locked
    try:
        assert os.stat(folder).st_mode & 0o777 == 0o700 and sweep_temp_folders(str(tmp_path)) == 0
    finally:
        os.close(fd)
    assert sweep_temp_folders(str(tmp_path)) == 1


def test_a_folder_whose_lock_was_just_made_is_left_alone(tmp_path):
    """Between making a folder's lock file and locking it, its owner holds no lock: a store
    starting at that moment (another tensor-parallel rank) must not take the folder for a dead
    one. A lock file younger than YOUNG_S is left alone."""
    young = tmp_path / f"{TEMP_PREFIX}young"
    young.mkdir(mode=0o700)
    (young / LOCK_NAME).write_text("")  # made, not yet locked
    assert sweep_temp_folders(str(tmp_path)) == 0 and young.exists()
    os.utime(young / LOCK_NAME, (0, 0))  # mtime only: ctime stays now, and the sweep reads ctime
    assert sweep_temp_folders(str(tmp_path)) == 0 and young.exists()
