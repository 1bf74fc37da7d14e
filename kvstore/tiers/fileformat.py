"""The NVMe block file: a fixed 4 KiB header, then the payload padded to 4 KiB.

Header (little endian)::

    0   8s   magic            b"KVSTBLK\\x01"
    8   I    format version   1
    12  I    header length    4096
    16  I    codec id
    20  I    flags            0; FLAG_MAC (remote values only): an HMAC follows the payload
    24  Q    payload length   bytes that matter (the file is padded past them)
    32  Q    payload checksum xxh3-64 of the payload bytes
    40  d    created          wall-clock seconds
    48  16s  fingerprint      digest of the tier namespace (model fingerprint + codec)
    64  16s  key              the block key (also the file name)
    80  Q    header checksum  xxh3-64 of bytes [0, 80)

Two layouts, never mixed in one folder: "inline" files carry the header in their first 4 KiB;
"xattr" files are exactly the padded payload and keep the header's first HEADER_CORE bytes in
the extended attribute ``user.kvstore.hdr`` (a file whose size is a multiple of 2 MiB reads
twice as fast as one 4 KiB longer on the disks measured here).

Nothing in a file is ever unpickled; a file that fails any check is not served.

Event metadata (optional, issue 32): what a KV-event consumer needs to announce the block after a
restart (the engine's block hash, its parent, the token ids: opaque bytes here, written by
:mod:`kvstore.store.events`). Inline files keep it in the header's spare bytes at META_OFFSET, xattr
files in the attribute ``user.kvstore.ev``; either way ``u32 length, u64 xxh3-64, body``. It is
advisory: a file without it, or with a damaged one, is served as before and only not announced.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

MAGIC = b"KVSTBLK\x01"
VERSION = 1
HEADER_BYTES = 4096
ALIGN = 4096
_FMT = struct.Struct("<8sIIIIQQd16s16s")
_HCHK = struct.Struct("<Q")
SUFFIX = ".kvb"


class BadBlockFile(Exception):
    """A block file failed a check. ``reason`` is a short metric label."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        super().__init__(f"{reason}: {detail}" if detail else reason)


@dataclass(frozen=True, slots=True)
class Header:
    codec_id: int
    payload_len: int
    checksum: int
    created: float
    fingerprint: bytes
    key: bytes
    flags: int = 0


FLAG_MAC = 1  # a remote value whose header and payload are followed by their HMAC-SHA256 (kvstore.tiers.redis.value)


def round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def checksum(payload) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def pack_header(h: Header, buf) -> None:
    """Write the header into the first HEADER_BYTES of ``buf`` (a writable buffer)."""
    mv = memoryview(buf).cast("B")
    body = _FMT.pack(MAGIC, VERSION, HEADER_BYTES, h.codec_id, h.flags, h.payload_len, h.checksum, h.created,
                     h.fingerprint, h.key)
    mv[: len(body)] = body
    mv[len(body): len(body) + 8] = _HCHK.pack(xxhash.xxh3_64_intdigest(body))
    mv[len(body) + 8: HEADER_BYTES] = bytes(HEADER_BYTES - len(body) - 8)


HEADER_CORE = _FMT.size + _HCHK.size  # the bytes that matter (the rest of the 4 KiB is zeros)
XATTR = "user.kvstore.hdr"  # where the header lives in "xattr" files


def header_bytes(h: Header) -> bytes:
    """The HEADER_CORE bytes of a header (what an "xattr" file keeps in its extended attribute)."""
    buf = bytearray(HEADER_BYTES)
    pack_header(h, buf)
    return bytes(buf[:HEADER_CORE])


def unpack_header(buf) -> Header:
    mv = memoryview(buf).cast("B")
    if len(mv) < _FMT.size + 8:
        raise BadBlockFile("truncated", "short header")
    body = bytes(mv[: _FMT.size])
    magic, version, hlen, codec_id, flags, plen, chk, created, fp, key = _FMT.unpack(body)
    if magic != MAGIC:
        raise BadBlockFile("bad_magic")
    if _HCHK.unpack(mv[_FMT.size: _FMT.size + 8])[0] != xxhash.xxh3_64_intdigest(body):
        raise BadBlockFile("bad_header")
    if version != VERSION or hlen != HEADER_BYTES:
        raise BadBlockFile("bad_version", f"version {version}, header {hlen}")
    return Header(codec_id, plen, chk, created, fp, key, flags)


META_OFFSET = 128  # inline files: where the event metadata starts in the 4 KiB header
XATTR_META = "user.kvstore.ev"  # xattr files: where it lives
_META = struct.Struct("<IQ")
META_MAX = HEADER_BYTES - META_OFFSET - _META.size  # a longer body is not kept (the block is just not announced)


def pack_meta(body: bytes, key: bytes) -> bytes:
    """Event metadata framed with its length and a checksum over the block key and the body ("" when
    it does not fit): a recycled file's or a moved file's metadata never passes for another key's."""
    if not body or len(body) > META_MAX:
        return b""
    return _META.pack(len(body), xxhash.xxh3_64_intdigest(key + body)) + body


def unpack_meta(buf, key: bytes) -> bytes | None:
    """The body of framed event metadata of ``key``, or None (absent, truncated, damaged, another key's)."""
    mv = memoryview(buf).cast("B")
    if len(mv) < _META.size:
        return None
    n, chk = _META.unpack(mv[: _META.size])
    if n == 0 or n > META_MAX or len(mv) < _META.size + n:
        return None
    body = bytes(mv[_META.size: _META.size + n])
    return body if xxhash.xxh3_64_intdigest(key + body) == chk else None


def file_bytes(payload_len: int) -> int:
    return HEADER_BYTES + round_up(payload_len)
