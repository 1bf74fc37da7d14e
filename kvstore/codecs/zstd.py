"""zstd on top of any fixed-size codec (none, int8, fp8): a variable-length payload.

Stored bytes: one mode byte (0 = stored as is, because zstd did not shrink it; 1 = zstd frame),
then the data. Over ``none`` with 2- or 4-byte elements the bytes are shuffled first (all first
bytes of every element, then all second bytes, ...): exponent bytes are far more alike than
mantissa bytes, so zstd finds much more to squeeze.

One frame per block, one thread per frame: the store already compresses blocks in parallel on
its I/O pool (zstd releases the GIL), which pays more than splitting one block's frame.

Decoding is bounded before it allocates: the stored bytes may come from any writer to Redis (or
to the tier's files), and python-zstandard's ``decompress`` allocates the size a frame's header
declares, ignoring ``max_output_size`` (a 131 KB frame declaring 4 GiB took 9-10 s and 4.1 GiB of
RSS here; one declaring 1 TiB raised MemoryError). So a frame must declare exactly the inner
block's size (ours always do: the compressor writes the content size) and decodes in one call into
a buffer of that size, with nothing after the frame (a frame that holds more fails there, one that
holds less fails the length check); a frame that declares no size (never ours) is streamed with
a window of at most the block (or 128 KiB), capped at one byte past the block and refused at that
byte. Anything else is a CodecError before a byte is decoded. Measured on a 2 MiB float16 block
(best of 7, 20 decodes each): the header check costs 0.14 us, and a decode went from 4.28 to
4.18 ms (zstd) and 1.09 to 1.05 ms (int8+zstd): the frame is no longer copied out first.
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from kvstore.codecs.base import Codec, CodecError

RAW, ZSTD = 0, 1
UNKNOWN = zstandard.CONTENTSIZE_UNKNOWN


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
        # the streamed decode's window: a frame needs none larger than its content, nor than zstd's
        # largest block (128 KiB) to hold one; zstd refuses a frame asking for more before allocating
        self._window_max = 1 << max(17, self.inner.encoded_bytes.bit_length())

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
                                 np.empty(self.inner.encoded_bytes + 1, np.uint8))  # +1: a streamed decode's cap
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
            self._shuffle(src[: self.block_bytes], scratch[:m])
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
            self._inflate(dctx, src[1:nbytes], scratch)
            body = scratch[:m]
        else:
            raise CodecError(f"{self.name}: unknown mode byte {mode}")
        if self.shuffle:
            self._unshuffle(body, dst[: self.block_bytes])
        else:
            self.inner.decode(body, m, dst)

    def _inflate(self, dctx, frame: np.ndarray, scratch: np.ndarray) -> None:
        """One frame into ``scratch[:m]``, never more than ``m + 1`` bytes decoded or allocated
        (see the module's notes); CodecError for anything but exactly ``m`` bytes."""
        m = self.inner.encoded_bytes
        try:
            declared = zstandard.get_frame_parameters(frame).content_size
            if declared == m:  # ours: one call into a buffer of m bytes, nothing after the frame
                raw = dctx.decompress(frame, allow_extra_data=False)
                n = len(raw)
                if n == m:
                    scratch[:m] = np.frombuffer(raw, np.uint8)
            elif declared == UNKNOWN:
                n = self._stream(frame, scratch[: m + 1])
            else:
                raise CodecError(f"{self.name}: the zstd frame declares {declared} bytes; a block of this "
                                 f"codec is exactly {m}")
        except zstandard.ZstdError as e:
            raise CodecError(f"{self.name}: {e}") from None
        if n != m:
            raise CodecError(f"{self.name}: the zstd frame holds {f'more than {m}' if n > m else n} bytes; a block "
                             f"of this codec is exactly {m}")

    def _stream(self, frame: np.ndarray, out: np.ndarray) -> int:
        """A frame that declares no size, decoded into ``out`` until it is full (one byte past a
        block: too long) or the frame ends; the bytes decoded."""
        dctx = zstandard.ZstdDecompressor(max_window_size=self._window_max)
        n, view = 0, memoryview(out)
        with dctx.stream_reader(frame, read_across_frames=False, closefd=False) as r:
            while n < len(out):
                k = r.readinto(view[n:])
                if not k:
                    break
                n += k
        return n
