"""Values and comparisons shared by the tests of the tensor codec and the safe object encoding."""

from __future__ import annotations

import collections
import math
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor, in C order."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(a: Any, b: Any) -> None:
    """Deep equality that checks exact types and treats NaN as equal to NaN."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.layout == b.layout and a.is_nested == b.is_nested
        if a.is_nested:
            ua, ub = a.unbind(), b.unbind()
            assert len(ua) == len(ub)
            for x, y in zip(ua, ub):
                assert_same(x, y)
        else:
            assert a.shape == b.shape
            assert tensor_bytes(a) == tensor_bytes(b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        if a.dtype.kind == "O":
            for x, y in zip(a.reshape(-1), b.reshape(-1)):
                assert_same(x, y)
        else:
            assert a.tobytes() == b.tobytes()
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or a == b
    elif isinstance(a, complex):
        assert_same(a.real, b.real)
        assert_same(a.imag, b.imag)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs, infs, denormals included) of any dtype."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    itemsize = dtype.itemsize
    raw = torch.randint(0, 256, (math.prod(shape) * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


class Opaque:
    """A user class msgpack cannot represent; module level so pickle can find it."""

    def __init__(self, x: int):
        self.x = x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.x == self.x


Point = collections.namedtuple("Point", "x y")


_scalars = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=8) | st.binary(max_size=8) | st.complex_numbers(allow_nan=True)
)
python_objects = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.lists(inner, max_size=4).map(tuple)
    | st.dictionaries(st.text(max_size=5) | st.integers(-5, 5), inner, max_size=4),
    max_leaves=20,
)
"""Plain Python values (scalars, lists, tuples, dicts) that the safe object encoding holds."""
