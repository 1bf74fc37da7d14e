"""NVMe folder modes and owners (issue 29): the configured folder must be private, parents the
store creates are 0700, a world-writable parent without the sticky bit is refused, and at the
start-up scan (and at read time) what is not 0600/0700 or not this user's is fixed or dropped.
Real files, real chmod/chown (the chown cases need root and skip without it)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

import numpy as np
import pytest

from kvstore.config import ConfigError
from kvstore.tiers.nvme import NvmeTier

from conftest import BLOCK, blocks_for, check_store, make_keys, nvme_files
from test_nvme_files import M, _key_with_prefix, _mode, nvme_only, read_n

NOBODY = 65534


def corrupt(store, reason):
    return M(store, "kvstore_corrupt_files_total", tier="nvme", reason=reason)


def _give_away(p: Path) -> None:
    try:
        os.chown(p, NOBODY, NOBODY, follow_symlinks=False)
    except PermissionError:
        pytest.skip("needs root to give a file away")


# -- the configured folder and its parents ---------------------------------------------------------


@pytest.mark.parametrize("mode", [0o770, 0o720, 0o775, 0o777, 0o1770])
def test_a_folder_others_can_write_is_refused(make_store, tmp_path, mode):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, mode)
    with pytest.raises(ConfigError, match=r"tiers\.nvme\.path.*(group|world)-writable.*(chmod 700|subfolder)") as ei:
        nvme_only(make_store, path=d)
    assert ei.value.key == "tiers.nvme.path"
    assert not any(d.iterdir())  # nothing was created in it
    os.chmod(d, 0o700)  # the fix the message names works
    s = nvme_only(make_store, path=d)
    keys = make_keys(2)
    assert s.put(keys, blocks_for(keys)) == 2 and read_n(s, keys) == 2


@pytest.mark.parametrize("mode", [0o700, 0o750, 0o755, 0o705])
def test_a_folder_others_can_only_read_is_accepted(make_store, tmp_path, mode):
    d = tmp_path / "mine"
    d.mkdir()
    os.chmod(d, mode)
    s = nvme_only(make_store, path=d)
    assert _mode(d) == mode  # the operator's folder is left as it is; the store's own is 0700
    assert _mode(s.nvme.root) == 0o700


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o000, 0o077])
def test_missing_parents_are_created_0700(make_store, tmp_path, umask):
    existing = tmp_path / "var"
    existing.mkdir(mode=0o755)
    os.chmod(existing, 0o755)
    path = existing / "a" / "b" / "cache"
    old = os.umask(umask)
    try:
        s = nvme_only(make_store, path=path)
    finally:
        os.umask(old)
    assert [_mode(p) for p in (existing / "a", existing / "a" / "b", path)] == [0o700] * 3
    assert _mode(existing) == 0o755  # an existing parent is not the store's to change
    keys = make_keys(1)
    assert s.put(keys, blocks_for(keys)) == 1


def test_a_world_writable_parent_without_the_sticky_bit_is_refused(make_store, tmp_path, caplog):
    parent = tmp_path / "open"
    parent.mkdir()
    os.chmod(parent, 0o777)
    with pytest.raises(ConfigError, match=r"tiers\.nvme\.path.*open.*world-writable without the sticky bit"):
        nvme_only(make_store, path=parent / "deep" / "cache")
    assert list(parent.iterdir()) == []  # refused before anything was created
    os.chmod(parent, 0o1777)  # like /tmp: others cannot rename what is ours
    nvme_only(make_store, path=parent / "cache").close()
    os.chmod(parent, 0o775)  # a group could swap it: allowed, said once at start
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        nvme_only(make_store, path=parent / "cache2").close()
    assert sum("can be swapped by others" in r.getMessage() for r in caplog.records) == 1


def test_a_symlinked_path_checks_the_parents_of_its_target(make_store, tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    (open_dir / "real").mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(open_dir / "real")
    with pytest.raises(ConfigError, match=r"tiers\.nvme\.path.*world-writable without the sticky bit"):
        nvme_only(make_store, path=link)


# -- the scan: ours are fixed, others' are dropped -----------------------------------------------


def _stored(make_store, n=4):
    s = nvme_only(make_store)
    keys = make_keys(n)
    assert s.put(keys, blocks_for(keys)) == n
    s.close()
    return s, keys


def test_our_files_and_folders_with_loose_read_modes_are_fixed_at_the_scan(make_store):
    s, keys = _stored(make_store)
    root = Path(s.nvme.root)
    files = [s.nvme.path_of(k) for k in keys]
    os.chmod(files[0], 0o644)
    os.chmod(files[1], 0o604)
    os.chmod(files[2], 0o700)
    leaf = files[3].parent
    other = next(f.parent for f in files if f.parent != leaf)  # (4 keys: two folders at least)
    os.chmod(leaf, 0o755)
    os.chmod(other, 0o777)
    os.chmod(root, 0o755)
    os.chmod(root / "tmp", 0o777)
    s2 = nvme_only(make_store)
    assert read_n(s2, keys) == 4  # kept and served: only this user could have written them
    assert [_mode(f) for f in files] == [0o600] * 4
    assert [_mode(d) for d in (leaf, other, root, root / "tmp")] == [0o700] * 4
    assert s2.nvme.stats["modes_fixed"] == 6 and s2.nvme.stats["corrupt"] == 0
    check_store(s2)


@pytest.mark.parametrize("mode", [0o666, 0o777, 0o620, 0o602])
def test_our_files_others_could_write_are_dropped_at_the_scan(make_store, mode):
    s, keys = _stored(make_store)
    bad = s.nvme.path_of(keys[1])
    os.chmod(bad, mode)
    s2 = nvme_only(make_store)
    assert not bad.exists() and corrupt(s2, "loose_mode") == 1
    assert read_n(s2, keys[:1]) == 1 and s2.contains_prefix(keys).num_blocks == 1  # a miss from there on
    assert s2.put(keys[1:2], blocks_for(keys[1:2])) == 1  # stored again, private, served
    assert _mode(bad) == 0o600 and read_n(s2, keys) == 4
    check_store(s2)


def test_another_users_file_is_never_read_and_dropped_at_the_scan(make_store):
    s, keys = _stored(make_store)
    theirs = s.nvme.path_of(keys[1])
    _give_away(theirs)  # a valid block file: served if it were read
    s2 = nvme_only(make_store)
    assert not theirs.exists() and corrupt(s2, "foreign_owner") == 1
    assert len(s2.nvme) == 3 and read_n(s2, keys[:1]) == 1 and s2.contains_prefix(keys).num_blocks == 1
    assert s2.put(keys[1:2], blocks_for(keys[1:2])) == 1
    assert os.stat(theirs).st_uid == os.geteuid() and read_n(s2, keys) == 4
    check_store(s2)


def test_another_users_or_loose_file_is_refused_at_read_time(make_store):
    s = nvme_only(make_store)
    keys = make_keys(3)
    s.put(keys, blocks_for(keys))
    _give_away(s.nvme.path_of(keys[1]))
    os.chmod(s.nvme.path_of(keys[2]), 0o646)
    assert read_n(s, keys) == 1  # the prefix stops at the first refused block
    assert corrupt(s, "foreign_owner") == 1 and not s.nvme.path_of(keys[1]).exists()
    assert read_n(s, keys[2:]) == 0 and corrupt(s, "loose_mode") == 1
    assert s.put(keys, blocks_for(keys)) == 2 and read_n(s, keys) == 3  # storable again, served
    check_store(s)


def test_another_users_folder_is_removed_at_the_scan(make_store):
    s = nvme_only(make_store)
    ka, kb, kc = (_key_with_prefix(p, i) for i, p in enumerate(["abcd", "abce", "1234"]))
    s.put([ka, kb, kc], blocks_for([ka, kb, kc]))
    s.close()
    root = Path(s.nvme.root)
    _give_away(root / "ab")
    s2 = nvme_only(make_store)
    assert corrupt(s2, "foreign_owner") == 1  # removed with what it held: never read
    assert os.stat(root / "ab").st_uid == os.geteuid() and not os.listdir(root / "ab")  # made again, empty
    assert read_n(s2, [kc]) == 1 and read_n(s2, [ka]) == 0 and len(s2.nvme) == 1
    assert s2.put([ka, kb], blocks_for([ka, kb])) == 2 and read_n(s2, [ka, kb, kc]) == 3
    assert os.stat(root / "ab").st_uid == os.geteuid() and _mode(root / "ab") == 0o700
    check_store(s2)


def test_another_users_folder_while_running_is_moved_aside_by_the_next_write(make_store):
    s = nvme_only(make_store)
    ka, kb = _key_with_prefix("abcd", 1), _key_with_prefix("abcd", 2)
    s.put([ka, kb], blocks_for([ka, kb]))
    leaf = Path(s.nvme.path_of(ka)).parent
    _give_away(leaf)
    assert read_n(s, [ka]) == 0 and corrupt(s, "foreign_owner") == 1  # a counted miss, never read
    assert s.put([ka], blocks_for([ka])) == 1 and corrupt(s, "foreign_owner") == 2  # the writer's count
    assert os.stat(leaf).st_uid == os.geteuid() and read_n(s, [ka]) == 1
    aside = [d for d in leaf.parent.iterdir() if d.name.startswith(".discard.")]
    assert len(aside) == 1 and os.stat(aside[0]).st_uid == NOBODY
    s.close()
    s2 = nvme_only(make_store)  # the scan removes what was moved aside
    assert not any(d.name.startswith(".discard.") for d in leaf.parent.iterdir())
    assert read_n(s2, [ka]) == 1 and read_n(s2, [kb]) == 0
    assert nvme_files(s2) == [s2.nvme.path_of(ka)]


# -- a store that is not root: what it cannot remove is moved aside ---------------------------------


def _as_nobody(fn) -> dict:
    """Run ``fn()`` in a forked child whose uid is ``nobody`` (the interpreter is loaded already:
    nobody cannot read root's Python); its dict comes back through a pipe."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(w, json.dumps(fn()).encode())
            code = 0
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            os.write(w, json.dumps({"error": repr(e)}).encode())
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = json.loads(f.read() or b"{}")
    os.waitpid(pid, 0)
    assert "error" not in out, out
    return out


def test_a_non_root_store_moves_aside_what_it_cannot_remove(clock):
    if os.geteuid() != 0:
        pytest.skip("needs root to play both users")
    base = Path(tempfile.mkdtemp(prefix="kvs-nobody-", dir="/tmp"))  # /tmp: sticky, reachable by nobody
    os.chown(base, NOBODY, NOBODY)
    ka, kb = _key_with_prefix("abcd", 1), _key_with_prefix("1234", 2)

    def tier():
        return NvmeTier(path=base / "c", namespace=b"u" * 16, capacity_bytes=1 << 20, ttl_s=None, policy="lru",
                        block_bytes=BLOCK, clock=clock, header="inline")

    def store():
        t = tier()
        n = t.put([ka, kb], blocks_for([ka, kb]))
        t.close()
        return {"stored": n, "root": str(t.root)}

    def reopen():
        t = tier()
        got = {"corrupt": dict(t.corrupt_reasons), "held": len(t)}
        got["stored"] = t.put([ka, kb], blocks_for([ka, kb]))
        out = np.zeros((2, BLOCK), np.uint8)
        got["served"] = sum(t.get([ka, kb], out))
        got["right"] = bool(np.array_equal(out, blocks_for([ka, kb])))
        t.close()
        return got

    warm = NvmeTier(path=base / "warm", namespace=b"w" * 16, capacity_bytes=1 << 20, ttl_s=None, policy="lru",
                    block_bytes=BLOCK, clock=clock, header="inline")  # every lazy import done here, as root
    warm.put([ka], blocks_for([ka]))
    warm.get([ka], np.zeros((1, BLOCK), np.uint8))
    warm.close()
    shutil.rmtree(base / "warm")
    try:
        root = Path(_as_nobody(store)["root"])
        # root plants what nobody cannot remove: a full folder at kb's block path, a fan-out folder of its own
        pb = root / "12" / (kb.hex() + ".kvb")
        pb.unlink()
        pb.mkdir(mode=0o700)
        (pb / "x").write_bytes(b"root's")
        shutil.rmtree(root / "ab")
        (root / "ab").mkdir(mode=0o755)
        (root / "ab" / "y").write_bytes(b"root's")
        first = _as_nobody(reopen)
        assert first["corrupt"] == {"not_a_file": 1, "foreign_owner": 1} and first["held"] == 0
        assert first["stored"] == 2 and first["served"] == 2 and first["right"]
        aside = sorted(p.name.split(".")[2] for p in root.rglob(".discard.*"))
        assert aside == sorted(["ab", kb.hex()])  # moved aside, whole and untouched
        assert (pb.parent / [p for p in os.listdir(pb.parent) if p.startswith(".discard.")][0] / "x").exists()
        again = _as_nobody(reopen)  # not counted again, not renamed again, both keys served
        assert again["corrupt"] == {} and again["held"] == 2 and again["stored"] == 0 and again["right"]
        assert sorted(p.name.split(".")[2] for p in root.rglob(".discard.*")) == aside
    finally:
        shutil.rmtree(base)
