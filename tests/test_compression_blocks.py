"""compression/blocks.py: a flat tensor as its whole blocks and its short last one."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scaleout.compression.blocks import block_rows


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 70), size=st.integers(1, 16))
def test_the_rows_are_views_that_cover_the_tensor_block_by_block(n: int, size: int) -> None:
    flat = torch.arange(n, dtype=torch.float32)
    parts = block_rows(flat, size)
    assert all(rows.numel() for rows, _ in parts)  # no empty part
    assert torch.equal(torch.cat([rows.reshape(-1) for rows, _ in parts] or [flat]), flat)
    padded = torch.nn.functional.pad(flat, (0, -n % size)).view(-1, size)  # [blocks, size]
    for rows, blocks in parts:
        assert rows.data_ptr() == flat[blocks.start * size:].data_ptr()  # in place, no copy
        assert torch.equal(padded[blocks, :rows.shape[1]], rows)
    assert sum(b.stop - b.start for _, b in parts) == -(-n // size)
    assert [rows.shape[1] for rows, _ in parts][-1:] in ([], [size], [n % size])


def test_a_block_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="block size"):
        block_rows(torch.zeros(4), 0)
