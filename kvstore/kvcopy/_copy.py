"""Validation and dispatch of gather/scatter to the native modules."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Sequence

import numpy as np

from . import reference
from ._buffers import Meta, tensor_meta
from ._blocks import _Blocks, _ids
from .layout import KVLayout


log = logging.getLogger("kvstore.kvcopy")

_MODES = {"auto": 0, "kernel": 1, "dma": 2}

# ---------------------------------------------------------------- native modules
try:
    from kvstore import _kvcopy_cpu as _cpu  # type: ignore[attr-defined]

    _cpu_error: BaseException | None = None
except ImportError as e:  # pragma: no cover - exercised only without a build
    _cpu = None
    _cpu_error = e

_cuda_mod: Any = None
_cuda_error: BaseException | None = None
_cuda_lock = threading.Lock()
_warned: set[str] = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg)


def cpu_module():
    """The compiled CPU module, or None (then the slow reference is used)."""
    return _cpu


def cuda_module():
    """The compiled CUDA module (imported on first use), or None."""
    global _cuda_mod, _cuda_error
    if _cuda_mod is None and _cuda_error is None:
        with _cuda_lock:
            if _cuda_mod is None and _cuda_error is None:
                try:
                    from kvstore import _kvcopy_cuda  # type: ignore[attr-defined]

                    _cuda_mod = _kvcopy_cuda
                except ImportError as e:
                    _cuda_error = e
    return _cuda_mod


def native_error(device: str = "cpu") -> BaseException | None:
    if device == "cpu":
        return _cpu_error
    cuda_module()
    return _cuda_error


def _force_reference() -> bool:
    return os.environ.get("KVSTORE_KVCOPY_REFERENCE", "") not in ("", "0")


# --------------------------------------------------------------------- helpers
def _same_strides(shape, a, b) -> bool:
    return all(n <= 1 or x == y for n, x, y in zip(shape, a, b))


def _check_dtype(m: Meta, layout: KVLayout, what: str) -> None:
    if m.itemsize != layout.elem_size:
        raise ValueError(
            f"{what}: element size {m.itemsize} B ({m.dtype_name}) does not match the "
            f"layout's {layout.elem_size} B ({layout.dtype})"
        )
    if layout.dtype and layout.elem_size > 1 and m.dtype_name != layout.dtype:
        raise ValueError(f"{what}: dtype {m.dtype_name} does not match the layout's {layout.dtype}")


class CopyEvent:
    """Completion of an asynchronous CUDA copy (a CUDA event recorded behind it).

    Holds references to the cache and the store blocks until the copy is known to
    be done.  Dropping an unfinished event waits for it (that event only, never
    the device), so ignoring the return value makes the call synchronous but
    always safe; keep the event and ``query()``/``wait(stream)`` to overlap.
    """

    def __init__(self, ev: Any, keep: tuple):
        self._ev = ev
        self._keep = keep

    @property
    def mode(self) -> str:
        return self._ev.mode

    def query(self) -> bool:
        done = self._ev.query()
        if done:
            self._keep = ()
        return done

    def synchronize(self) -> None:
        self._ev.synchronize()
        self._keep = ()

    def wait(self, stream: Any) -> None:
        """Make `stream` wait for the copy (no host blocking)."""
        self._ev.wait(_stream_handle(stream, self._ev.device))

    def __del__(self):
        # Never free buffers under an in-flight copy.
        try:
            if self._keep and not self._ev.query():
                self._ev.synchronize()
        except Exception:
            pass


def _stream_handle(stream: Any, device_index: int) -> int:
    if stream is None:
        import torch

        return int(torch.cuda.current_stream(device_index).cuda_stream)
    if isinstance(stream, int):
        return stream
    h = getattr(stream, "cuda_stream", None)  # torch.cuda.Stream
    if h is None:
        h = getattr(stream, "ptr", None)  # cupy
    if h is None:
        raise TypeError(f"stream must be an int handle or a torch.cuda.Stream, got {stream!r}")
    return int(h)


# ------------------------------------------------------------------- the copier
class KVCopier:
    """Gather/scatter for one registered KV cache.  Validates the cache once; each
    call then only checks the block ids and the store blocks.

    ``kv_caches`` is a list of per-layer tensors or one stacked tensor (see the
    layout's constructors for the shapes).
    """

    def __init__(self, kv_caches: Any, layout: KVLayout):
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
        self.layout = layout
        self.kv_caches = kv_caches
        L = layout.num_layers
        es = layout.elem_size
        if isinstance(kv_caches, (list, tuple)):
            if len(kv_caches) != L:
                raise ValueError(f"expected {L} per-layer caches, got {len(kv_caches)}")
            metas = [tensor_meta(t, f"kv_caches[{l}]") for l, t in enumerate(kv_caches)]
            for l, m in enumerate(metas):
                if m.shape != layout.layer_shape:
                    raise ValueError(
                        f"kv_caches[{l}]: shape {m.shape} does not match the layout "
                        f"({layout.kind}) per-layer shape {layout.layer_shape}"
                    )
                if not _same_strides(m.shape, m.strides, layout.layer_strides):
                    raise ValueError(
                        f"kv_caches[{l}]: strides {m.strides} do not match the layout's "
                        f"{layout.layer_strides} (build the layout with KVLayout.from_tensor)"
                    )
                _check_dtype(m, layout, f"kv_caches[{l}]")
            ptrs = [m.ptr for m in metas]
            devs = {(m.device, m.device_index) for m in metas}
        else:
            m = tensor_meta(kv_caches, "kv_caches")
            if layout.stacked_shape is None or layout.layer_stride is None:
                raise ValueError(f"layout {layout.kind} has no stacked form; pass a list")
            if m.shape != layout.stacked_shape:
                raise ValueError(
                    f"kv_caches: shape {m.shape} does not match the layout ({layout.kind}) "
                    f"stacked shape {layout.stacked_shape}"
                )
            if not _same_strides(m.shape, m.strides, layout.stacked_strides):
                raise ValueError(
                    f"kv_caches: strides {m.strides} do not match the layout's "
                    f"{layout.stacked_strides}"
                )
            _check_dtype(m, layout, "kv_caches")
            ptrs = [m.ptr + l * layout.layer_stride * es for l in range(L)]
            devs = {(m.device, m.device_index)}
        if len(devs) != 1:
            raise ValueError(f"kv_caches: layers on several devices {sorted(devs)}")
        self.device, self.device_index = devs.pop()
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"kv_caches: unsupported device type {self.device!r}")
        self.layer_ptrs = np.asarray(ptrs, dtype=np.uint64)
        self._geom = layout.geometry()
        self._paged = layout.paged_strides()
        self._store = layout.store_strides()

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    def _prepare(self, block_ids, blocks, *, write: bool, what: str):
        ids = _ids(block_ids, self.layout.num_blocks, unique=not write)
        b = _Blocks(blocks, self.layout.block_bytes, write=write, what=what)
        if b.n != ids.size:
            raise ValueError(f"{what} holds {b.n} blocks but block_ids has {ids.size}")
        if self.device == "cpu" and b.device != "cpu":
            raise ValueError(f"{what}: store blocks on {b.device}, the KV cache is on the CPU")
        if self.device == "cuda" and b.device == "cuda" and b.device_index != self.device_index:
            raise ValueError(
                f"{what}: store blocks on cuda:{b.device_index}, the KV cache on "
                f"cuda:{self.device_index}"
            )
        return ids, b

    def _run(self, to_store: bool, ids, b: _Blocks, *, num_threads, mode, stream, nt, ctas=None):
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {sorted(_MODES)}, got {mode!r}")
        if ctas is not None and (isinstance(ctas, bool) or not isinstance(ctas, int) or ctas < 1):
            raise ValueError(f"ctas must be a positive int or None, got {ctas!r}")
        if ids.size == 0:
            return None
        if self.device == "cpu":
            if _cpu is not None and not _force_reference():
                _cpu.copy_blocks(
                    to_store, self.layer_ptrs, self._geom, self._paged, self._store,
                    ids, b.ptrs, int(num_threads or 0), -1 if nt is None else int(bool(nt)),
                )  # fmt: skip
                return None
            _warn_once(
                "cpu",
                f"kvstore._kvcopy_cpu is not available ({_cpu_error}); using the slow "
                "reference copy",
            )
            return self._reference(to_store, ids, b)
        cu = cuda_module()
        if cu is None or _force_reference():
            _warn_once(
                "cuda",
                f"kvstore._kvcopy_cuda is not available ({_cuda_error}); using the slow "
                "reference copy",
            )
            return self._reference(to_store, ids, b)
        ev = cu.copy_blocks(
            to_store, self.layer_ptrs, self._geom, self._paged, self._store, ids, b.ptrs,
            _MODES[mode], _stream_handle(stream, self.device_index), self.device_index, int(ctas or 0),
        )  # fmt: skip
        return CopyEvent(ev, (self.kv_caches, b.objs, ids))

    def _reference(self, to_store, ids, b: _Blocks):
        if to_store:
            reference.gather(self.kv_caches, self.layout, ids, b.objs)
        else:
            reference.scatter(b.objs, self.layout, ids, self.kv_caches)
        return None

    def gather(
        self, block_ids: Sequence[int], dst: Any, *, num_threads: int | None = None,
        mode: str = "auto", stream: Any = None, nt: bool | None = None, ctas: int | None = None,
    ) -> CopyEvent | None:  # fmt: skip
        """dst[i] <- cache block block_ids[i] (all layers, K and V) in the store format.
        ``ctas`` (CUDA, kernel mode): the most thread blocks the copy runs (None: 8 per SM); a copy
        beside the engine's kernels takes fewer SMs from them."""
        ids, b = self._prepare(block_ids, dst, write=True, what="dst")
        return self._run(True, ids, b, num_threads=num_threads, mode=mode, stream=stream, nt=nt, ctas=ctas)

    def scatter(
        self, src: Any, block_ids: Sequence[int], *, num_threads: int | None = None,
        mode: str = "auto", stream: Any = None, nt: bool | None = None, ctas: int | None = None,
    ) -> CopyEvent | None:  # fmt: skip
        """cache block block_ids[i] <- src[i] (all layers, K and V). ``ctas``: as in :meth:`gather`."""
        ids, b = self._prepare(block_ids, src, write=False, what="src")
        return self._run(False, ids, b, num_threads=num_threads, mode=mode, stream=stream, nt=nt, ctas=ctas)

    def plan_info(self) -> dict:
        """How the native CPU module decomposes this layout's copy (for tests/bench)."""
        if _cpu is None:
            return {}
        run, runs, nd, indexed = _cpu.plan_info(
            self.layer_ptrs, self._geom, self._paged, self._store
        )
        return {"run_bytes": run, "runs_per_block": runs, "outer_dims": nd, "layer_indexed": indexed}


def gather(
    kv_caches: Any, layout: KVLayout, block_ids: Sequence[int], dst: Any, *,
    num_threads: int | None = None, mode: str = "auto", stream: Any = None,
    nt: bool | None = None,
) -> CopyEvent | None:  # fmt: skip
    """Copy cache blocks ``block_ids`` (every layer, K and V) into store blocks ``dst``.

    ``dst`` is a 2-D uint8 ``[n, layout.block_bytes]`` array/tensor or a list of n
    1-D uint8 buffers.  On the CPU the copy is done when this returns (None); for
    a CUDA cache it is enqueued on ``stream`` (an int cudaStream_t, a
    torch.cuda.Stream, or None for torch's current stream) and a
    :class:`CopyEvent` is returned.
    """
    return KVCopier(kv_caches, layout).gather(
        block_ids, dst, num_threads=num_threads, mode=mode, stream=stream, nt=nt
    )


def scatter(
    src: Any, layout: KVLayout, block_ids: Sequence[int], kv_caches: Any, *,
    num_threads: int | None = None, mode: str = "auto", stream: Any = None,
    nt: bool | None = None,
) -> CopyEvent | None:  # fmt: skip
    """Copy store blocks ``src`` into cache blocks ``block_ids`` (every layer, K and V).

    Duplicate ids are rejected (two sources for one block).  See :func:`gather`.
    """
    return KVCopier(kv_caches, layout).scatter(
        src, block_ids, num_threads=num_threads, mode=mode, stream=stream, nt=nt
    )


def set_num_threads(n: int) -> None:
    """Threads per CPU copy (<= 0 restores the default, min(cores, 4))."""
    if _cpu is not None:
        _cpu.set_num_threads(int(n))


def get_num_threads() -> int:
    return _cpu.get_num_threads() if _cpu is not None else 1
