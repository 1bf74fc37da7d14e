"""NVMe block files whose header lives in an extended attribute (``header: xattr``).

The file is exactly the padded payload; the header (magic, version, namespace, key, codec,
payload length and checksum) is in ``user.kvstore.hdr``. Every damage is a counted miss and
the file is removed, as for inline headers.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvstore.tiers import fileformat as ff
from kvstore.tiers.nvme.folder import probe_xattr, read_header

from conftest import BLOCK, block_for, blocks_for, check_store, make_keys

pytestmark = pytest.mark.skipif(not probe_xattr(os.environ.get("TMPDIR", "/tmp")),
                                reason="this file system keeps no user xattrs")


def xstore(make_store, **kw):
    kw.setdefault("nvme_blocks", 16)
    s = make_store(dram_blocks=0, header="xattr", **kw)
    assert s.nvme.header == "xattr" and s.nvme.root.name.endswith("-x")
    return s


def corrupt(store, reason):
    return store.metrics.value("kvstore_corrupt_files_total", tier="nvme", reason=reason)


def read_n(store, keys):
    out = np.zeros((len(keys), BLOCK), np.uint8)
    n = store.get(keys, out)
    for i in range(n):
        assert (out[i] == block_for(keys[i])).all()
    return n


def _flip_xattr(p, off):
    h = bytearray(os.getxattr(p, ff.XATTR))
    h[off] ^= 0x5A
    os.setxattr(p, ff.XATTR, bytes(h))


def _flip(p, off):
    with open(p, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x5A]))


def _foreign_header(p):
    h = ff.unpack_header(os.getxattr(p, ff.XATTR))
    other = ff.Header(h.codec_id, h.payload_len, h.checksum, h.created, b"F" * 16, h.key)
    os.setxattr(p, ff.XATTR, ff.header_bytes(other))


DAMAGE = {
    "payload": ("bad_checksum", lambda p: _flip(p, 123)),
    "header_byte": ("bad_header", lambda p: _flip_xattr(p, 30)),
    "header_magic": ("bad_magic", lambda p: _flip_xattr(p, 0)),
    "header_removed": ("bad_header", lambda p: os.removexattr(p, ff.XATTR)),
    "truncate": ("truncated", lambda p: os.truncate(p, p.stat().st_size - 4096)),
    "extend": ("bad_size", lambda p: open(p, "ab").write(b"\0" * 4096)),
    "foreign": ("foreign", _foreign_header),
}


def test_file_is_exactly_the_payload(make_store):
    s = xstore(make_store)
    keys = make_keys(2)
    s.put(keys, blocks_for(keys))
    p = s.nvme.path_of(keys[0])
    assert p.stat().st_size == ff.round_up(BLOCK)
    assert p.read_bytes()[:BLOCK] == block_for(keys[0]).tobytes()
    h = read_header(p)
    assert h.key == keys[0] and h.fingerprint == s.namespace and h.payload_len == BLOCK
    assert oct(p.stat().st_mode & 0o777) == "0o600"


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damage_is_a_counted_miss_at_read(make_store, kind):
    reason, damage = DAMAGE[kind]
    s = xstore(make_store)
    keys = make_keys(4)
    s.put(keys, blocks_for(keys))
    p = s.nvme.path_of(keys[2])
    damage(p)
    assert read_n(s, keys) == 2
    assert corrupt(s, reason) == 1 and not p.exists()
    assert s.contains_prefix(keys).miss_reason == "corrupt"
    check_store(s)


@pytest.mark.parametrize("kind", sorted(set(DAMAGE) - {"payload"}))
def test_damage_is_dropped_at_restart(make_store, kind):
    reason, damage = DAMAGE[kind]
    s = xstore(make_store)
    keys = make_keys(4)
    s.put(keys, blocks_for(keys))
    s.close()
    p = s.nvme.path_of(keys[1])
    damage(p)
    s2 = xstore(make_store)
    assert corrupt(s2, reason) == 1 and not p.exists() and len(s2.nvme) == 3
    assert read_n(s2, keys) == 1


def test_restart_reads_back_and_layouts_never_mix(make_store):
    s = xstore(make_store)
    keys = make_keys(6)
    s.put(keys, blocks_for(keys))
    s.close()
    inline = make_store(dram_blocks=0, nvme_blocks=16, header="inline")
    assert inline.contains_prefix(keys).num_blocks == 0  # another folder: never read as inline files
    inline.close()
    s2 = xstore(make_store)
    assert s2.nvme.stats["scanned"] == 6 and read_n(s2, keys) == 6
