from __future__ import annotations

import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane.codec import (
    column_from_arrow,
    column_to_arrow,
    materialize,
    nested_from_arrow,
    nested_from_values,
    nested_to_arrow,
    pad_nested,
    to_nested_by_length,
)

DTYPES = [torch.bfloat16, torch.float32, torch.int64, torch.bool]


def _rows(lengths, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        if dtype == torch.bool:
            rows.append(torch.rand(n, generator=g) > 0.5)
        elif dtype == torch.int64:
            rows.append(torch.randint(-(2**40), 2**40, (n,), generator=g))
        else:
            rows.append(torch.randn(n, generator=g).to(dtype))
    return rows


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=12),
    dtype=st.sampled_from(DTYPES),
    pad=st.sampled_from([0, 1, -1, 7]),
)
def test_roundtrip_jagged_and_padded(lengths, dtype, pad):
    rows = _rows(lengths, dtype)
    lens = torch.tensor(lengths, dtype=torch.int64)
    nt = nested_from_values(torch.cat(rows) if rows else torch.zeros(0, dtype=dtype), lens)
    field, arr = column_to_arrow("x", nt)
    back = column_from_arrow(field, arr)
    assert back.dtype == dtype
    assert torch.equal(back.offsets(), nt.offsets())
    assert torch.equal(back.values(), nt.values())
    width = max(lengths) + 3
    dense = materialize({"x": back}, pad_value_dict={"x": pad}, pad_to_seqlen=width)["x"]
    assert dense.shape == (len(lengths), width)
    for i, row in enumerate(rows):
        assert torch.equal(dense[i, : len(row)], row)
        assert bool((dense[i, len(row) :] == torch.tensor(pad).to(dtype)).all())


def test_numeric_encode_is_zero_copy():
    nt = nested_from_values(torch.arange(10, dtype=torch.float32), torch.tensor([3, 0, 7]))
    arr = nested_to_arrow(nt)
    # the Arrow values buffer points at the tensor's memory
    assert arr.values.buffers()[1].address == nt.values().data_ptr()
    back = nested_from_arrow(arr, torch.float32)
    assert back.values().data_ptr() == arr.values.buffers()[1].address


def test_to_nested_by_length():
    padded = torch.tensor([[1, 2, 3, 0, 0], [4, 0, 0, 0, 0]])
    nt = to_nested_by_length(padded, [3, 1])
    assert nt.values().tolist() == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="lengths must lie"):
        to_nested_by_length(padded, [6, 1])


def test_pad_to_seqlen_shorter_than_rows_refused():
    nt = nested_from_values(torch.zeros(5), torch.tensor([5]))
    with pytest.raises(ValueError, match="shorter than the longest row"):
        pad_nested(nt, 0, pad_to_seqlen=3)


def test_text_and_struct_columns():
    f, arr = column_to_arrow("t", ["a", "", "ü"])
    assert arr.type == pa.large_string()
    assert column_from_arrow(f, arr) == ["a", "", "ü"]
    f, arr = column_to_arrow("s", [{"a": 1, "b": "x"}, {"a": 2, "b": "y"}])
    assert pa.types.is_struct(arr.type)
    assert column_from_arrow(f, arr) == [{"a": 1, "b": "x"}, {"a": 2, "b": "y"}]


def test_unsupported_column_types_raise():
    with pytest.raises(TypeError, match="2-D dense tensor"):
        column_to_arrow("x", torch.zeros(2, 3))
    with pytest.raises(TypeError, match="list\\[str\\]"):
        column_to_arrow("x", {"a": 1})
