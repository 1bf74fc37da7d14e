"""zstd on top of any fixed-size codec (none, int8, fp8): a variable-length payload.

Stored bytes: one mode byte (0 = stored as is, because zstd did not shrink it; 1 = zstd frame),
then the data. Over ``none`` with 2- or 4-byte elements the bytes are shuffled first (all first
bytes of every element, then all second bytes, ...): exponent bytes are far more alike than
mantissa bytes, so zstd finds much more to squeeze.

One frame per block, one thread per frame: the store already compresses blocks in parallel on
its I/O pool (zstd releases the GIL), which pays more than splitting one block's frame.
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from kvstore.codecs.base import Codec, CodecError

RAW, ZSTD = 0, 1


class ZstdCodec(Codec):
    fixed_size = False

    def __init__(self, inner: Codec, level: int = 3):
        super().__init__(inner.geometry)
        if not inner.fixed_size:
            raise ValueError("zstd stacks on a fixed-size codec")
        self.inner = inner
        self.level = int(level)
        self.name = "zstd" if inner.name == "none" else f"{inner.name}+zstd"
        # shuffle bytes by element only over raw elements (quantized codes are single bytes)
        self.shuffle = inner.name == "none" and inner.geometry.itemsize > 1 \
            and self.block_bytes % inner.geometry.itemsize == 0
        self._tls = threading.local()

    @property
    def encoded_bytes(self) -> int:
        return 1 + self.inner.encoded_bytes

    @property
    def lossless(self) -> bool:
        return self.inner.lossless

    def _state(self):
        st = getattr(self._tls, "st", None)
        if st is None:
            st = self._tls.st = (zstandard.ZstdCompressor(level=self.level),
                                 zstandard.ZstdDecompressor(),
                                 np.empty(self.inner.encoded_bytes, np.uint8))
        return st

    def _shuffle(self, a: np.ndarray, out: np.ndarray) -> None:
        k = self.inner.geometry.itemsize
        out.reshape(k, -1)[...] = a.reshape(-1, k).T

    def _unshuffle(self, a: np.ndarray, out: np.ndarray) -> None:
        k = self.inner.geometry.itemsize
        out.reshape(-1, k)[...] = a.reshape(k, -1).T

    def encode(self, src: np.ndarray, dst: np.ndarray) -> int:
        cctx, _, scratch = self._state()
        m = self.inner.encoded_bytes
        if self.shuffle:
            self._shuffle(src[: self.block_bytes], scratch)
        else:
            self.inner.encode(src, scratch)
        frame = cctx.compress(scratch[:m])
        if len(frame) < m:
            dst[0] = ZSTD
            dst[1: 1 + len(frame)] = np.frombuffer(frame, np.uint8)
            return 1 + len(frame)
        dst[0] = RAW
        dst[1: 1 + m] = scratch[:m]
        return 1 + m

    def decode(self, src: np.ndarray, nbytes: int, dst: np.ndarray) -> None:
        _, dctx, scratch = self._state()
        m = self.inner.encoded_bytes
        if nbytes < 1 or nbytes > self.encoded_bytes:
            raise CodecError(f"{self.name}: {nbytes} bytes, at most {self.encoded_bytes}")
        mode = int(src[0])
        if mode == RAW:
            if nbytes != 1 + m:
                raise CodecError(f"{self.name}: stored block of {nbytes - 1} bytes, expected {m}")
            body = src[1: 1 + m]
        elif mode == ZSTD:
            try:
                raw = dctx.decompress(src[1:nbytes].tobytes(), max_output_size=m)
            except zstandard.ZstdError as e:
                raise CodecError(f"{self.name}: {e}") from None
            if len(raw) != m:
                raise CodecError(f"{self.name}: decompressed {len(raw)} bytes, expected {m}")
            scratch[:m] = np.frombuffer(raw, np.uint8)
            body = scratch
        else:
            raise CodecError(f"{self.name}: unknown mode byte {mode}")
        if self.shuffle:
            self._unshuffle(body, dst[: self.block_bytes])
        else:
            self.inner.decode(body, m, dst)
