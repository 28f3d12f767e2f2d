"""The one codec between numpy arrays and message fields.

Arrays travel as raw bytes with their dtype and shape: never as lists of Python floats,
never pickled. Every process that puts an array on a socket goes through `pack` / `unpack`.
"""

from __future__ import annotations

import msgspec
import numpy as np

# NOTE: a closed set of dtypes keeps a malformed frame from naming an object dtype.
_DTYPES = frozenset({"bool", "int8", "int32", "int64", "float16", "float32", "float64", "uint8"})


class Array(msgspec.Struct, frozen=True, array_like=True):
    """A numpy array as bytes: C order, little-endian, dtype from a closed set."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


def pack(array: np.ndarray) -> Array:
    array = np.asarray(array)
    if array.dtype.name not in _DTYPES:
        raise TypeError(f"dtype {array.dtype} cannot travel in a message")
    # NOTE: asarray, not ascontiguousarray (which makes 0-d arrays 1-d); little-endian bytes.
    array = np.asarray(array, dtype=array.dtype.newbyteorder("<"), order="C")
    return Array(array.dtype.name, tuple(int(n) for n in array.shape), array.tobytes())


def unpack(message: Array) -> np.ndarray:
    """A read-only view of the message's bytes (no copy)."""
    if message.dtype not in _DTYPES:
        raise ValueError(f"dtype {message.dtype!r} is not allowed in a message")
    dtype = np.dtype(message.dtype).newbyteorder("<")
    count = int(np.prod(message.shape, dtype=np.int64))
    if count * dtype.itemsize != len(message.data):
        raise ValueError(f"{len(message.data)} bytes do not fill shape {message.shape} of {dtype}")
    return np.frombuffer(message.data, dtype=dtype, count=count).reshape(message.shape)


def empty(dtype: str, *shape: int) -> Array:
    return pack(np.zeros(shape, dtype=dtype))
