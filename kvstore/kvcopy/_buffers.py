"""Framework-agnostic access to tensors: torch tensors and numpy arrays directly
(cheap attribute reads), anything else through DLPack (``torch.from_dlpack`` or
``numpy.from_dlpack``).  Only metadata and data pointers are read here; the
native modules see raw addresses, so nothing links against libtorch."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Meta:
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    itemsize: int
    dtype_name: str
    device: str  # "cpu" or "cuda"
    device_index: int
    writeable: bool
    obj: Any  # the object to keep alive / hand to the reference path


def _torch():
    return sys.modules.get("torch")


def is_torch(x: Any) -> bool:
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


_dtype_names: dict = {}


def _dtype_name(dt) -> str:
    name = _dtype_names.get(dt)
    if name is None:
        name = _dtype_names[dt] = str(dt).removeprefix("torch.")
    return name


def tensor_meta(x: Any, what: str) -> Meta:
    t = _torch()
    if t is not None and isinstance(x, t.Tensor):
        if x.is_cuda:
            dev, idx = "cuda", x.get_device()
        elif x.is_cpu:
            dev, idx = "cpu", -1
        else:
            dev, idx = x.device.type, x.device.index or 0
        return Meta(
            ptr=x.data_ptr(),
            shape=tuple(x.shape),
            strides=x.stride(),
            itemsize=x.element_size(),
            dtype_name=_dtype_name(x.dtype),
            device=dev,
            device_index=idx,
            writeable=True,
            obj=x,
        )
    if isinstance(x, np.ndarray):
        st = x.strides
        isz = x.itemsize
        if any(s % isz for s in st):
            raise ValueError(f"{what}: strides {st} are not multiples of the item size")
        return Meta(
            ptr=x.__array_interface__["data"][0],
            shape=tuple(x.shape),
            strides=tuple(s // isz for s in st),
            itemsize=isz,
            dtype_name=x.dtype.name,
            device="cpu",
            device_index=-1,
            writeable=bool(x.flags.writeable),
            obj=x,
        )
    if hasattr(x, "__dlpack__"):
        if t is not None:
            return tensor_meta(t.from_dlpack(x), what)
        return tensor_meta(np.from_dlpack(x), what)
    raise TypeError(
        f"{what}: expected a torch tensor, a numpy array or a DLPack array, got {type(x).__name__}"
    )
