"""Hostile zstd frames, built by hand from the frame format (RFC 8878), as a writer to Redis (or
to a tier's files) could: no compressor is run, so a frame that decodes to 4 GiB takes
milliseconds to build and ~131 KB to store.

A frame here is the magic number, a frame header (a window of 128 KiB; the content size it
declares, or none), then RLE blocks: each is 4 bytes (a 3-byte block header and the byte to repeat)
that decode to up to 128 KiB. ``frame(declared, actual)`` declares one size and holds another:

- the bomb: declares 4 GiB (or 1 TiB) and holds as much (or a few blocks of it);
- the lying frame: declares the block's own size and holds more or less, or declares nothing and
  holds gigabytes.

The zstd codec's payload is a mode byte (1: a zstd frame) then the frame: :func:`payload`.
"""

from __future__ import annotations

import struct

MAGIC = 0xFD2FB528
BLOCK_MAX = 128 << 10  # the largest block a 128 KiB window allows, and what one RLE block decodes to
UNKNOWN = None  # no content size in the frame header
GiB, TiB = 1 << 30, 1 << 40
HEADER_BYTES = 4 + 2 + 8  # magic, descriptor and window, content size


def frame(declared: int | None, actual: int, *, byte: int = 0) -> bytes:
    """A frame that declares ``declared`` bytes (``UNKNOWN``: none) and decodes to ``actual`` bytes
    of ``byte`` (RLE blocks; ``actual`` may be anything, whatever ``declared`` says)."""
    # descriptor: FCS flag 3 (8-byte content size) or 0 (none), no single segment, no checksum,
    # no dictionary; then the window descriptor: exponent 7 -> windowLog 17 (128 KiB)
    head = struct.pack("<I", MAGIC)
    head += bytes([0xC0 if declared is not None else 0x00, 7 << 3])
    if declared is not None:
        head += struct.pack("<Q", declared)
    blocks = []
    left = actual
    while True:
        n = min(left, BLOCK_MAX)
        left -= n
        last = left == 0
        blocks.append(struct.pack("<I", (n << 3) | (1 << 1) | int(last))[:3] + bytes([byte]))  # RLE
        if last:
            break
    return head + b"".join(blocks)


def payload(declared: int | None, actual: int, *, byte: int = 0) -> bytes:
    """The zstd codec's stored bytes for such a frame: the mode byte 1, then the frame."""
    return b"\x01" + frame(declared, actual, byte=byte)


def holds_at_most(room: int) -> int:
    """The most bytes a payload of ``room`` bytes can decode to (its RLE blocks of 128 KiB)."""
    return max(1, (room - 1 - HEADER_BYTES) // 4) * BLOCK_MAX


def hostile_payloads(block_bytes: int, room: int) -> dict[str, bytes]:
    """The frames of issue 45 for a zstd codec whose inner block is ``block_bytes`` and whose
    payload is at most ``room`` bytes (its ``encoded_bytes``), by name: the bombs (declaring
    4 GiB and 1 TiB, holding as much of it as fits: all 4 GiB in 131 KB, so a 2 MiB block's value
    holds it whole) and the lying frames."""
    m, most = block_bytes, holds_at_most(room)
    return {"bomb_4gib": payload(4 * GiB, min(4 * GiB, most)),
            "bomb_1tib": payload(TiB, min(4 * BLOCK_MAX, most)),  # ~30 bytes: the allocation is the bomb
            "lie_more": payload(m, min(4 * GiB, most)),  # declares the block's size, holds more
            "lie_less": payload(m, max(1, m // 2)),
            "lie_size": payload(m + 1, m + 1),  # declares (and holds) one byte too many
            "unknown_huge": payload(UNKNOWN, min(4 * GiB, most)),  # declares nothing, holds all it can
            "unknown_short": payload(UNKNOWN, max(1, m - 1))}
