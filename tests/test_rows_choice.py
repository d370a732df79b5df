"""The row-sparse exchange's local steps, on one process: which rows a block sends, and the
row flags as bits (numpy's packing on the CPU, the tensor arithmetic elsewhere), against plain
reference rules on random layouts."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scaleout.compression import bits
from scaleout.compression import rows as R

SETTINGS = settings(max_examples=200, deadline=None)


def _reference(union: torch.Tensor, per_matrix: list[int], dense_above: float) -> torch.Tensor:
    """Matrix by matrix: every row where more than ``dense_above`` of them were touched, else
    the touched ones; in order."""
    sent, start = [], 0
    for rows in per_matrix:
        flags = union[start:start + rows]
        if int(flags.sum()) > dense_above * rows:
            sent.append(torch.arange(start, start + rows))
        else:
            sent.append(flags.nonzero().view(-1) + start)
        start += rows
    return torch.cat(sent)


@st.composite
def _blocks(draw: st.DrawFn) -> tuple[list[tuple[list[int], list[bool]]], float]:
    blocks = []
    for _ in range(draw(st.integers(1, 3))):
        per_matrix = draw(st.lists(st.integers(2, 40), min_size=1, max_size=6))
        kind = draw(st.sampled_from(["none", "some", "all"]))
        flag = {"none": st.just(False), "some": st.booleans(), "all": st.just(True)}[kind]
        flags = draw(st.lists(flag, min_size=sum(per_matrix), max_size=sum(per_matrix)))
        blocks.append((per_matrix, flags))
    return blocks, draw(st.sampled_from([0.0, 0.3, 0.5, 0.9, 1.0]))


@SETTINGS
@given(_blocks())
def test_each_block_sends_its_touched_rows_and_its_dense_matrices_whole(case) -> None:
    blocks, dense_above = case
    codec = R.RowsCodec(dense_above=dense_above)
    width, offset, matrices, unions = 4, 0, [], []
    for per_matrix, flags in blocks:
        rows = sum(per_matrix)
        matrices.append((offset, rows * width, width, per_matrix))
        unions.append(torch.tensor(flags, dtype=torch.bool))
        offset += rows * width
    chosen = codec._rows_to_send(torch.cat(unions), matrices)
    for (o, n, _, per_matrix), union in zip(matrices, unions):
        want = _reference(union, per_matrix, dense_above)
        if want.numel() == n // width:
            assert o not in chosen, "a block whose every row goes is sent whole"
        else:
            assert torch.equal(chosen[o], want)


@SETTINGS
@given(st.lists(st.booleans(), min_size=1, max_size=100), st.integers(1, 4))
def test_row_flags_as_bits_are_lsb_first_on_every_path_and_or_on_arrival(flags, ranks) -> None:
    mine = torch.tensor(flags, dtype=torch.bool)
    others = [mine.roll(r) for r in range(ranks)]
    packed = [R._packed(f) for f in others]
    want = [sum(int(b) << k for k, b in enumerate(flags[j:j + 8])) for j in range(0, len(flags), 8)]
    assert packed[0].dtype == torch.uint8 and packed[0].tolist() == want, \
        "flag 8j+k in bit k of byte j"
    padded = torch.zeros(len(want) * 8, dtype=torch.bool)
    padded[:len(flags)] = mine
    assert bits._gathered(padded).tolist() == want, "the tensor path (CUDA) packs the same"
    assert torch.equal(bits._looked_up(packed[0]), padded), "and unpacks the same"
    union = R._unpacked(torch.stack(packed), mine.numel())
    assert union.dtype == torch.bool
    assert torch.equal(union, torch.stack(others).any(dim=0))
