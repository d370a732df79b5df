"""The comparisons of compression/masks.py: numpy's (on the CPU) give what torch's give, NaN,
-0.0, infinities and odd dtypes and layouts included."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scaleout.compression.masks import negative_into, not_below

SPECIAL = [0.0, -0.0, float("nan"), float("inf"), float("-inf"), 1e-45, -1e-45]
values = st.lists(st.one_of(st.floats(width=32), st.sampled_from(SPECIAL)), max_size=300)


@settings(max_examples=200, deadline=None)
@given(values, st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]))
def test_negative_into_is_torch_lt_zero(xs: list[float], dtype: torch.dtype) -> None:
    x = torch.tensor(xs, dtype=dtype)
    out = torch.ones(len(xs), dtype=torch.bool)
    assert negative_into(x, out) is out
    assert torch.equal(out, x < 0)


@settings(max_examples=200, deadline=None)
@given(values, st.one_of(st.floats(width=32), st.sampled_from(SPECIAL)),
       st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_not_below_is_the_indices_of_not_lt(xs: list[float], t: float, dtype: torch.dtype) -> None:
    x = torch.tensor(xs, dtype=dtype)
    threshold = torch.tensor(t, dtype=dtype)
    got = not_below(x, threshold)
    assert got.dtype == torch.int64
    assert torch.equal(got, torch.lt(x, threshold).logical_not_().nonzero().view(-1))


@pytest.mark.parametrize("layout", ["strided", "2-D"])
def test_layouts_numpy_does_not_take_go_to_torch(layout: str) -> None:
    x = torch.tensor([[-1.0, 2.0, float("nan")], [0.5, -0.0, -3.0]])
    if layout == "strided":
        x = x.t()  # not contiguous
    out = torch.empty(x.shape, dtype=torch.bool)
    assert torch.equal(negative_into(x, out), x < 0)
    assert torch.equal(not_below(x, torch.tensor(0.5)),
                       torch.lt(x.reshape(-1), 0.5).logical_not_().nonzero().view(-1))
