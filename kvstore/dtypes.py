"""The one dtype table: element sizes by name, and the short names engines use.

Names are torch's (``"float16"``, ``"bfloat16"``, ``"float8_e4m3fn"``, ...) plus the spellings
vLLM's ``kv_cache_dtype`` and users write (``"half"``, ``"fp8"``, ``"fp8_e4m3"``, ...). The
copy module sizes elements from it (:func:`dtype_info`); the codecs
normalize names with :func:`normalize` and quantize the :data:`QUANTIZABLE` ones.
"""

from __future__ import annotations

import re
from typing import Any

SIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1,
    # vLLM's and users' spellings (kept as given in layouts and fingerprints)
    "half": 2, "float": 4, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
}  # fmt: skip

ALIASES: dict[str, str] = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32",
                           "fp32": "float32"}

QUANTIZABLE: tuple[str, ...] = ("float16", "bfloat16", "float32")  # what the int8/fp8 codecs read


def size_of(name: str) -> int | None:
    """Bytes per element of a dtype name (``torch.`` prefix allowed), None if unknown."""
    return SIZES.get(name.removeprefix("torch."))


def normalize(dtype: str | None) -> str:
    """``"torch.float16"`` / ``"half"`` / ``"fp16"`` -> ``"float16"``; None -> ``"uint8"`` (raw
    bytes); unknown names come back lower-cased."""
    if dtype is None:
        return "uint8"
    d = re.sub(r"^(torch|numpy|np)\.", "", str(dtype).strip().lower())
    return ALIASES.get(d, d)


def dtype_info(dtype: Any) -> tuple[int, str | None]:
    """(element size in bytes, dtype name or None) of a torch/numpy dtype, a name or a size."""
    if isinstance(dtype, bool):
        raise TypeError("dtype must be a dtype, a dtype name or an element size")
    if isinstance(dtype, int):
        if dtype not in (1, 2, 4, 8):
            raise ValueError(f"element size must be 1, 2, 4 or 8 bytes, got {dtype}")
        return dtype, None
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if (size := size_of(name)) is not None:
            return size, name
    itemsize = getattr(dtype, "itemsize", None)  # torch.dtype (>= 2.1) and numpy dtypes
    if isinstance(itemsize, int) and itemsize > 0:
        name = str(dtype).removeprefix("torch.")
        return itemsize, name
    try:
        import numpy as np

        dt = np.dtype(dtype)
        return dt.itemsize, dt.name
    except Exception:
        raise ValueError(f"unknown dtype {dtype!r}") from None
