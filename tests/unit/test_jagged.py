"""tq_redis.meta.jagged reads a jagged tensor's parts as torch's public methods report them, and the
codec's fast paths over it store exactly what the public methods' path stores."""

from __future__ import annotations

import pytest
import torch

from tq_redis.codec import tensors as codec
from tq_redis.errors import BatchSizeMismatch, UnsupportedValue
from tq_redis.meta import jagged, schemas


def _rows(*lengths: int, width: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    shape = (lambda k: (k, width)) if width else (lambda k: (k,))
    parts = [(torch.arange(k * max(width, 1)) + 100 * i).to(dtype).reshape(shape(k)) for i, k in enumerate(lengths)]
    return torch.nested.nested_tensor(parts, layout=torch.jagged)


CASES = {
    "1-d rows": _rows(3, 0, 5),
    "2-d rows": _rows(2, 4, width=3),
    "bfloat16": _rows(1, 2, dtype=torch.bfloat16),
    "needs grad": _rows(4, 1).requires_grad_(),
}


@pytest.mark.parametrize("name", CASES)
def test_parts_are_what_the_public_methods_give(name):
    t = CASES[name]
    parts = jagged.jagged_parts(t)
    assert parts is not None
    assert torch.equal(parts.values.detach(), t.values().detach())
    assert torch.equal(parts.offsets, t.offsets())
    assert parts.lengths is None and t.lengths() is None
    assert (parts.ragged_idx, parts.rows) == (t._ragged_idx, t.size(0))


def test_rows_with_holes_report_their_lengths():
    starts, lengths = torch.tensor([0, 1, 0, 2]), torch.tensor([2, 3, 5, 1])
    t = torch.nested.narrow(torch.arange(20.0).reshape(4, 5), 1, starts, lengths, layout=torch.jagged)
    parts = jagged.jagged_parts(t)
    assert parts is not None and parts.lengths is not None
    assert parts.lengths.tolist() == t.lengths().tolist() == [2, 3, 5, 1]


STRIDED_NESTED = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])


@pytest.mark.parametrize("value", [torch.zeros(3, 2), STRIDED_NESTED, [1, 2]])
def test_anything_else_has_no_parts(value):
    assert jagged.jagged_parts(value) is None


def _stored(name: str, value: torch.Tensor) -> tuple[dict, list[bytes]]:
    schema, per_sample = codec.encode_field(name, value, value.size(0))
    return schema, [b"".join(bytes(seg) for seg in sample) for sample in per_sample]


@pytest.mark.parametrize("name", CASES)
def test_the_fast_path_stores_what_the_public_methods_path_stores(name, monkeypatch):
    t = CASES[name]
    fast = _stored(name, t)
    monkeypatch.setattr(jagged, "jagged_parts", lambda _t: None)  # parts_of falls back to the public methods
    monkeypatch.setattr(schemas, "jagged_parts", lambda _t: None)
    assert _stored(name, t) == fast
    back = codec.decode_field(name, fast[1], nested_output=True)
    assert [r.tolist() for r in back.unbind()] == [r.tolist() for r in t.detach().unbind()]


def test_the_fast_path_refuses_what_the_public_path_refuses():
    with pytest.raises(BatchSizeMismatch, match="3 samples"):
        codec.encode_field("x", _rows(1, 2, 3), 2)
    on_meta = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged, device="meta")
    with pytest.raises(UnsupportedValue, match="meta device"):
        codec.encode_field("x", on_meta, 2)


def test_rows_with_holes_are_stored_row_by_row_through_the_public_path():
    starts, lengths = torch.tensor([0, 1, 0]), torch.tensor([2, 3, 5])
    t = torch.nested.narrow(torch.arange(15.0).reshape(3, 5), 1, starts, lengths, layout=torch.jagged)
    schema, stored = _stored("h", t)
    assert schema["kind"] == "jagged"
    back = codec.decode_field("h", stored, nested_output=True)
    assert [r.tolist() for r in back.unbind()] == [[0.0, 1.0], [6.0, 7.0, 8.0], [10.0, 11.0, 12.0, 13.0, 14.0]]


@pytest.mark.parametrize("lengths", [(3, 0, 5), (1,), (0, 0), (7, 2)])
@pytest.mark.parametrize("width", [0, 3])
@pytest.mark.parametrize("dtype", [torch.int64, torch.bfloat16])
def test_jagged_from_rows_builds_what_the_public_constructor_builds(lengths, width, dtype):
    rows = list(_rows(*lengths, width=width, dtype=dtype).unbind())
    built, public = jagged.jagged_from_rows(rows), torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    assert type(built) is type(public) and built.layout == torch.jagged and built.dtype == dtype
    assert torch.equal(built.offsets(), public.offsets())
    assert [r.tolist() for r in built.unbind()] == [r.tolist() for r in rows]
    assert built.to_padded_tensor(0).shape == public.to_padded_tensor(0).shape  # the bounds are the rows' own
    before = [r.clone() for r in rows]
    jagged.parts_of(built).values.zero_()  # a copy: the caller's rows are untouched
    assert all(torch.equal(r, b) for r, b in zip(rows, before))


def test_jagged_from_rows_refuses_what_cannot_be_one_tensor():
    with pytest.raises(ValueError, match="at least one row"):
        jagged.jagged_from_rows([])
    with pytest.raises(RuntimeError):
        jagged.jagged_from_rows([torch.ones(2, 3), torch.ones(2, 4)])


@pytest.mark.parametrize("name", CASES)
def test_row_views_are_the_rows_unbind_gives(name):
    t = CASES[name]
    assert [r.tolist() for r in jagged.row_views(t)] == [r.tolist() for r in t.unbind()]


def test_row_views_of_rows_with_holes_fall_back_to_unbind():
    t = torch.nested.nested_tensor_from_jagged(
        torch.arange(10.0), torch.tensor([0, 4, 7, 10]), lengths=torch.tensor([2, 1, 3])
    )
    assert [r.tolist() for r in jagged.row_views(t)] == [[0.0, 1.0], [4.0], [7.0, 8.0, 9.0]]
