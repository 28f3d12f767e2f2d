"""The one codec between numpy arrays and message fields.

Arrays travel as raw bytes with their dtype and shape: never as lists of Python floats,
never pickled. Every process that puts an array on a socket goes through `pack` (or
`pack_list`, `pack_each`) / `unpack`.
"""

from __future__ import annotations

import math
import sys
from array import array as _array
from collections.abc import Iterable
from typing import Any

import msgspec
import numpy as np

# NOTE: a closed set of dtypes keeps a malformed frame from naming an object dtype.
_DTYPES = frozenset(
    {"bool", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "uint8"}
)
# NOTE: looked up, not rebuilt per call: a step packs a few arrays per request.
_LITTLE = {name: np.dtype(name).newbyteorder("<") for name in _DTYPES}
_NAME_OF = {dtype: name for name, dtype in _LITTLE.items()}
# NOTE: memoryview's format codes of the dtypes it can read natively (not float16).
_FORMATS = {
    "bool": "?",
    "int8": "b",
    "int16": "h",
    "uint8": "B",
    "int32": "i",
    "int64": "q",
    "float32": "f",
    "float64": "d",
}
_NATIVE_IS_LITTLE = sys.byteorder == "little"
# NOTE: the array module's codes whose C type has the dtype's width here (checked, not
# assumed: C's int is not 4 bytes everywhere).
_LIST_CODES = {
    name: code
    for name, code in (("int32", "i"), ("int64", "q"), ("float32", "f"), ("float64", "d"))
    if _array(code).itemsize == np.dtype(name).itemsize
}


class Array(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A numpy array as bytes: C order, little-endian, dtype from a closed set. Not tracked by
    the cyclic collector (a few per request per step; see protocol/outputs.py)."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


def pack(array: np.ndarray) -> Array:
    array = np.asarray(array)
    name = _NAME_OF.get(array.dtype)  # a little-endian dtype of the set
    if name is None:
        if array.dtype.name not in _DTYPES:
            raise TypeError(f"dtype {array.dtype} cannot travel in a message")
        name = array.dtype.name
        array = array.astype(_LITTLE[name])
    # NOTE: tobytes writes C order whatever the strides (and keeps 0-d arrays 0-d).
    return Array(name, array.shape, array.tobytes(order="C"))


def pack_list(values: Iterable[Any], dtype: str, shape: tuple[int, ...] | None = None) -> Array:
    """pack(np.asarray(list(values), dtype).reshape(shape)) of a flat list of Python numbers
    (shape None: 1-D), the same bytes (the same C conversions and overflow errors) without
    numpy: the controller packs ~20 short lists a step, where numpy's per-call cost was most
    of the time."""
    code = _LIST_CODES.get(dtype)
    if dtype == "bool":
        data = bytes(bool(v) for v in values)
    elif code is None or not _NATIVE_IS_LITTLE:
        data = np.asarray(list(values), dtype=_LITTLE[dtype]).tobytes()
    else:
        data = _array(code, values).tobytes()
    count = len(data) // _LITTLE[dtype].itemsize
    if shape is not None and math.prod(shape) != count:
        raise ValueError(f"{count} values do not fill shape {shape}")
    return Array(dtype, (count,) if shape is None else shape, data)


def pack_each(array: np.ndarray, axis: int) -> list[Array]:
    """pack(array.take(i, axis)) for every i, in one conversion and one copy: for a step's
    [N, B, ...] arrays, where each request takes its row b (B packs a step otherwise)."""
    array = np.asarray(array)
    # NOTE: moving axis 1 to the front is swapping it with 0, one C call (moveaxis is ~10
    # Python-level calls, paid per field per step).
    rows = array.swapaxes(0, axis) if axis <= 1 else np.moveaxis(array, axis, 0)
    name = _NAME_OF.get(rows.dtype) or rows.dtype.name
    if name not in _DTYPES:
        raise TypeError(f"dtype {rows.dtype} cannot travel in a message")
    data = np.ascontiguousarray(rows, dtype=_LITTLE[name]).tobytes()
    shape, size = rows.shape[1:], math.prod(rows.shape[1:]) * _LITTLE[name].itemsize
    return [Array(name, shape, data[i * size : (i + 1) * size]) for i in range(len(rows))]


def unpack(message: Array) -> np.ndarray:
    """A read-only view of the message's bytes (no copy)."""
    dtype = _LITTLE.get(message.dtype)
    if dtype is None:
        raise ValueError(f"dtype {message.dtype!r} is not allowed in a message")
    count = math.prod(message.shape)
    if count < 0 or count * dtype.itemsize != len(message.data):
        raise ValueError(f"{len(message.data)} bytes do not fill shape {message.shape} of {dtype}")
    return np.frombuffer(message.data, dtype=dtype, count=count).reshape(message.shape)


def unpack_list(message: Array) -> Any:
    """unpack(message).tolist(), the same Python values, read without building an array: for
    the handful of values of one request's step output, where numpy's per-call cost is most
    of the time."""
    fmt = _FORMATS.get(message.dtype)
    count = math.prod(message.shape)
    if fmt is None or count <= 0 or not _NATIVE_IS_LITTLE:
        return unpack(message).tolist()
    if count * _LITTLE[message.dtype].itemsize != len(message.data):
        raise ValueError(f"{len(message.data)} bytes do not fill shape {message.shape}")
    view: Any = memoryview(message.data)  # NOTE: typeshed's cast takes literal formats only
    return view.cast(fmt, message.shape).tolist()


def empty(dtype: str, *shape: int) -> Array:
    return pack(np.zeros(shape, dtype=dtype))
