"""Element types, named the way the IRs print them.

One table maps each name to torch, NumPy (through ml_dtypes for bf16) and CUDA C++,
so that no other module spells a dtype conversion of its own.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

FLOATS = ("bf16", "f16", "f32", "f64")
INTS = ("i8", "i32", "i64", "u8")
ALL = FLOATS + INTS + ("bool",)

_NUMPY = {
    "bf16": np.dtype(ml_dtypes.bfloat16), "f16": np.dtype(np.float16),
    "f32": np.dtype(np.float32), "f64": np.dtype(np.float64),
    "i8": np.dtype(np.int8), "u8": np.dtype(np.uint8), "i32": np.dtype(np.int32),
    "i64": np.dtype(np.int64), "bool": np.dtype(np.bool_),
}
_CUDA = {
    "bf16": "__nv_bfloat16", "f16": "__half", "f32": "float", "f64": "double",
    "i8": "signed char", "u8": "unsigned char", "i32": "int", "i64": "long long", "bool": "bool",
}
_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "i8": 1, "u8": 1, "i32": 4, "i64": 8, "bool": 1}
_TORCH_NAMES = {
    "bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64", "i8": "int8",
    "u8": "uint8", "i32": "int32", "i64": "int64", "bool": "bool",
}


def check(name: str) -> str:
    if name not in _NUMPY:
        raise ValueError(f"unknown dtype {name!r}; tilefuse knows {', '.join(ALL)}")
    return name


def is_float(name: str) -> bool:
    return name in FLOATS


def itemsize(name: str) -> int:
    return _BYTES[check(name)]


def to_numpy(name: str) -> np.dtype:
    return _NUMPY[check(name)]


def to_cuda(name: str) -> str:
    return _CUDA[check(name)]


def to_torch(name: str):
    import torch

    return getattr(torch, _TORCH_NAMES[check(name)])


def from_torch(dtype) -> str:
    text = str(dtype).removeprefix("torch.")
    for name, tname in _TORCH_NAMES.items():
        if tname == text:
            return name
    raise ValueError(f"tilefuse does not support the dtype {dtype}")


def from_numpy(dtype) -> str:
    dtype = np.dtype(dtype)
    for name, np_dtype in _NUMPY.items():
        if np_dtype == dtype:
            return name
    raise ValueError(f"tilefuse does not support the NumPy dtype {dtype}")


def compute_type(name: str) -> str:
    """Type a fused kernel computes a value of `name` in: low-precision floats widen to f32."""
    return "f32" if name in ("bf16", "f16") else name
