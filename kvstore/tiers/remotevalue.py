"""The remote tier's values: the compact header of :mod:`kvstore.fileformat` (HEADER_CORE
bytes: codec id, payload length, xxh3-64 of the payload, created, namespace, key, header
checksum) followed by the payload (the raw block, or the codec's encoding).

``encode`` gives the header and the payload apart, so the put sends the block from its own
memory (:mod:`.setpipe`); ``decode`` checks a value read back (length, header, namespace, key,
codec, size, checksum) and names what is wrong, or decodes it. Nothing is unpickled.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from kvstore import fileformat as ff
from kvstore.codecs import Codec

log = logging.getLogger(__name__)

_POOLED_BYTES = 64 << 20  # encode buffers kept for reuse, at most (a bigger batch allocates the rest)


class ValueFormat:
    def __init__(self, namespace: bytes, block_bytes: int, codec: Codec | None = None, codec_id: int = 0):
        self.namespace = bytes(namespace)
        self.block_bytes = int(block_bytes)
        self.codec = codec if codec is not None and codec.name != "none" else None
        self.codec_id = self.codec.id if self.codec is not None else codec_id
        self.payload_max = self.codec.encoded_bytes if self.codec is not None else self.block_bytes
        self.fixed_size = self.codec is None or self.codec.fixed_size
        self._lock = threading.Lock()
        self._bufs: list[np.ndarray] = []
        self._pool_max = max(4, _POOLED_BYTES // self.payload_max)

    def decode(self, key: bytes, value: bytes, out: np.ndarray) -> str | None:
        """Check one value and decode it into ``out``; the reason it is bad, or None."""
        if len(value) < ff.HEADER_CORE:
            return "truncated"
        try:
            h = ff.unpack_header(value[: ff.HEADER_CORE])
        except ff.BadBlockFile as e:
            return e.reason
        plen = len(value) - ff.HEADER_CORE
        if h.fingerprint != self.namespace or h.key != key:
            return "foreign"
        if h.codec_id != self.codec_id:
            return "codec"
        if h.payload_len != plen or plen > self.payload_max or (self.fixed_size and plen != self.payload_max):
            return "length"
        payload = np.frombuffer(value, np.uint8, offset=ff.HEADER_CORE)
        if ff.checksum(payload) != h.checksum:
            return "checksum"
        if self.codec is None:
            np.copyto(out[: self.block_bytes], payload, casting="no")
            return None
        try:
            self.codec.decode(payload, plen, out[: self.block_bytes])
        except ValueError as e:  # CodecError, or bytes of the wrong shape
            log.debug("kvstore remote: %s decode failed: %s", self.codec.name, e)
            return "decode"
        return None

    def take_bufs(self, n: int) -> list:
        """``n`` buffers to encode into (pooled); Nones without a codec (nothing is copied)."""
        if self.codec is None:
            return [None] * n
        with self._lock:
            got = [self._bufs.pop() for _ in range(min(n, len(self._bufs)))]
        return got + [np.empty(self.payload_max, np.uint8) for _ in range(n - len(got))]

    def give_bufs(self, bufs: list) -> None:
        """Back to the pool, once the memoryviews of their values are released."""
        bufs = [b for b in bufs if b is not None]
        with self._lock:
            self._bufs.extend(bufs[: max(0, self._pool_max - len(self._bufs))])

    def encode(self, key: bytes, block: np.ndarray, buf: np.ndarray) -> tuple[bytes, memoryview] | None:
        """(header, payload): without a codec the payload is the block's own memory (no copy, see
        :mod:`.setpipe`), else its encoding in ``buf`` (a pooled buffer, so no fresh pages: fresh
        2 MiB values cost most of a put's time in page faults, 0.33-0.50 of a raw SET)."""
        src = np.ascontiguousarray(block.reshape(-1)[: self.block_bytes])
        if self.codec is None:
            assert src.dtype == np.uint8 and src.nbytes == self.block_bytes, (src.dtype, src.nbytes)
            payload = src
        else:
            try:
                plen = self.codec.encode(src, buf)
            except ValueError as e:
                log.warning("kvstore remote: %s encode failed: %s", self.codec.name, e)
                return None
            payload = buf[:plen]
        h = ff.Header(self.codec_id, payload.nbytes, ff.checksum(payload), time.time(), self.namespace, key)
        return ff.header_bytes(h), memoryview(payload)
