"""The remote tier's values: the compact header of :mod:`kvstore.tiers.fileformat` (HEADER_CORE
bytes: codec id, flags, payload length, xxh3-64 of the payload, created, namespace, key, header
checksum), the payload (the raw block, or the codec's encoding), and with a secret its MAC.

``encode`` gives the header, the payload and the MAC apart, so the put sends the block from its
own memory (:mod:`.pipe`); ``decode`` checks a value read back (length, header, namespace,
key, codec, size, checksum, MAC) and names what is wrong, or decodes it. Nothing is unpickled.

Authentication. xxh3 is not a keyed check: anyone who may write to the shared Redis can build a
value with a valid header and checksum for any key (the key name shows namespace and key). With
``KVSTORE_REMOTE_SECRET`` set, each value carries HMAC-SHA256 (keyed with a key derived from the
secret) over its header and payload, after the payload, and the header's flags say so
(``FLAG_MAC``). A value without it, or whose MAC does not match the key of its namespace (below),
is refused as ``unauthenticated``. The header inside the MAC
names the namespace and the key, so a MAC'd value cannot be replayed under another key. Measured
here per 2 MiB block: HMAC-SHA256 1.33 ms (1.57 GB/s: this CPU has SHA-NI), keyed BLAKE2b 2.58 ms
(0.81 GB/s), xxh3 0.04 ms; keyed BLAKE3 0.51 ms (4.1 GB/s) but it is not a dependency.

Namespaces. Values signed with a key live under a namespace of their own, derived from the
engine's namespace and the key's id (:func:`authenticated_namespace`; the id is an HMAC of the MAC
key, so neither the key nor the secret can be found from it): engines with different secrets (or
with one and without) never share a key name, so none refuses, deletes or overwrites the others'
values, and a MAC'd engine never even looks at a value no holder of its secret could have written.
During a rotation (``KVSTORE_REMOTE_SECRET_PREVIOUS``) the previous secret's namespace is read too,
checked with that secret's key only; writes go to the current one. Before issue 45 every MAC'd
engine shared one namespace: an engine with another secret refused every block of the fleet and
deleted it (8 of 8 in the issue's test), then overwrote the keys with its own.

What is deleted. A value that is not of this format under its name (the wrong length, header,
namespace, key, flags or codec, or a payload that does not decode: :class:`Refused` ``kept``
False) is garbage no kvstore engine writes there, and the reader deletes it. A value of the format
whose checksum or MAC fails is counted and kept (``kept``): that it fails here is not proof that
its writer had no right to write it, and a later store overwrites it.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from typing import NamedTuple

import numpy as np
import xxhash

from kvstore.tiers import fileformat as ff
from kvstore.codecs import Codec

log = logging.getLogger(__name__)

_POOLED_BYTES = 64 << 20  # encode buffers kept for reuse, at most (a bigger batch allocates the rest)
MAC_BYTES = 32  # HMAC-SHA256
ENV_SECRET, ENV_PREVIOUS = "KVSTORE_REMOTE_SECRET", "KVSTORE_REMOTE_SECRET_PREVIOUS"
SECRET_MIN = 32  # characters: e.g. `openssl rand -base64 32` (44)


def mac_key(secret: bytes) -> bytes:
    """The MAC key derived from a secret (the secret itself is kept nowhere)."""
    return hmac.digest(bytes(secret), b"kvstore remote value mac v1", "sha256")


def key_id(key: bytes) -> bytes:
    """The public name of a MAC key (16 bytes): an HMAC of it, from which neither the key nor the
    secret it came from can be found."""
    return hmac.digest(bytes(key), b"kvstore remote key id v1", "sha256")[:16]


def authenticated_namespace(namespace: bytes, key: bytes) -> bytes:
    """The namespace of values MAC'd with ``key`` (see the module's notes)."""
    return xxhash.xxh3_128_digest(bytes(namespace) + b"|auth=hmac-sha256|key=" + key_id(key))


class Refused(NamedTuple):
    """Why a value read back is not served (``reason``: the metric label), and whether it is kept
    (a value of our format whose checksum or MAC fails) or deleted (anything else)."""
    reason: str
    kept: bool = False


def secrets_from_env(environ) -> tuple[bytes | None, bytes | None]:
    """(secret, previous) from the environment; a ConfigError naming the variable for one too
    short, or a previous secret without a current one (rotation half done would turn checks off)."""
    from kvstore.config import ConfigError

    got = []
    for name in (ENV_SECRET, ENV_PREVIOUS):
        v = environ.get(name) or None
        if v is not None and len(v) < SECRET_MIN:
            raise ConfigError(name, "<not shown>", f"a secret of at least {SECRET_MIN} characters "
                              "(e.g. `openssl rand -base64 32`), the same in every engine")
        got.append(None if v is None else v.encode("utf-8", "surrogateescape"))
    if got[1] is not None and got[0] is None:
        raise ConfigError(ENV_PREVIOUS, "<not shown>", f"only beside {ENV_SECRET} (it is the secret being rotated out)")
    return got[0], got[1]


class ValueFormat:
    """The values of one namespace: signed and checked with ``mac_key`` (None: no MAC)."""

    def __init__(self, namespace: bytes, block_bytes: int, codec: Codec | None = None, codec_id: int = 0,
                 mac_key: bytes | None = None):
        self.namespace = bytes(namespace)
        self.block_bytes = int(block_bytes)
        self.codec = codec if codec is not None and codec.name != "none" else None
        self.codec_id = self.codec.id if self.codec is not None else codec_id
        self.payload_max = self.codec.encoded_bytes if self.codec is not None else self.block_bytes
        self.fixed_size = self.codec is None or self.codec.fixed_size
        self._key = bytes(mac_key) if mac_key else None
        self.flags = ff.FLAG_MAC if self._key is not None else 0
        self.tail = MAC_BYTES if self._key is not None else 0
        self.value_max = ff.HEADER_CORE + self.payload_max + self.tail
        self.value_min = self.value_max if self.fixed_size else ff.HEADER_CORE + self.tail + 1
        self._lock = threading.Lock()
        self._bufs: list[np.ndarray] = []
        self._pool_max = max(4, _POOLED_BYTES // self.payload_max)

    def __repr__(self) -> str:  # never the keys
        return f"<ValueFormat codec={self.codec_id} mac={'on' if self._key is not None else 'off'}>"

    @property
    def authenticated(self) -> bool:
        return self._key is not None

    def length_bad(self, n: int) -> str | None:
        """Why a value of ``n`` bytes cannot be one of ours (read before the value: ``STRLEN``),
        or None: "unauthenticated" for the length of an unMAC'd one where MACs are required."""
        if self.value_min <= n <= self.value_max:
            return None
        if self._key is not None and self.value_min <= n + MAC_BYTES <= self.value_max:
            return "unauthenticated"
        return "length"

    def decode(self, key: bytes, value: bytes, out: np.ndarray) -> Refused | None:
        """Check one value and decode it into ``out``; why it is refused, or None."""
        n = len(value)
        if n > self.value_max:
            return Refused("length")
        if n < ff.HEADER_CORE:
            return Refused("truncated")
        try:
            h = ff.unpack_header(value[: ff.HEADER_CORE])
        except ff.BadBlockFile as e:
            return Refused(e.reason)
        if h.fingerprint != self.namespace or h.key != key:
            return Refused("foreign")
        if h.flags != self.flags:  # no MAC where one is required (or one where none can be checked)
            return Refused("unauthenticated" if self._key is not None else "foreign")
        if h.codec_id != self.codec_id:
            return Refused("codec")
        plen = n - ff.HEADER_CORE - self.tail
        if h.payload_len != plen or plen > self.payload_max or (self.fixed_size and plen != self.payload_max):
            return Refused("length")
        payload = np.frombuffer(value, np.uint8, count=plen, offset=ff.HEADER_CORE)
        if ff.checksum(payload) != h.checksum:
            return Refused("checksum", kept=True)  # damage; the MAC below would fail too, but this names it
        if self._key is not None and not self._authentic(value):
            return Refused("unauthenticated", kept=True)
        if self.codec is None:
            np.copyto(out[: self.block_bytes], payload, casting="no")
            return None
        try:
            self.codec.decode(payload, plen, out[: self.block_bytes])
        except Exception as e:  # noqa: BLE001 - CodecError, MemoryError, anything: a payload that does not decode
            log.debug("kvstore remote: %s decode of %s failed: %s: %s", self.codec.name, key.hex(), type(e).__name__, e)
            return Refused("decode")
        return None

    def _authentic(self, value: bytes) -> bool:
        body, tag = memoryview(value)[: len(value) - MAC_BYTES], value[len(value) - MAC_BYTES:]
        return hmac.compare_digest(hmac.digest(self._key, body, "sha256"), tag)

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

    def encode(self, key: bytes, block: np.ndarray, buf: np.ndarray) -> tuple[bytes, memoryview, bytes] | None:
        """(header, payload, MAC or b""): without a codec the payload is the block's own memory (no
        copy, see :mod:`.pipe`), else its encoding in ``buf`` (a pooled buffer, so no fresh
        pages: fresh 2 MiB values cost most of a put's time in page faults, 0.33-0.50 of a raw SET)."""
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
        head = ff.header_bytes(ff.Header(self.codec_id, payload.nbytes, ff.checksum(payload), time.time(),
                                         self.namespace, key, self.flags))
        view = memoryview(payload)
        if self._key is None:
            return head, view, b""
        mac = hmac.new(self._key, head, "sha256")
        mac.update(view)
        return head, view, mac.digest()
