"""Each forward's lookup ids say which rows the row-sparse exchange flags
(``scaleout.pytorch.lookup_ids``): training still equals the single-process reference, the
gradients are no longer searched for their rows, and every case where the ids could miss a row
falls back to the search and stays exact.

Float64 against ``test_lookup_rows``' reference: a row the ids missed would leave its
gradient out of the sum, far above float reordering.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import scaleout
from harness import run_ranks
from scaleout.compression import CodecState, CompressionConfig, RowsCodec, compressed_allreduce
from scaleout.compression import rows as rows_module
from scaleout.compression.rows import ROWS_SEARCH, ROWS_TOUCHED
from scaleout.core.grid import GroupType
from scaleout.pytorch import DataParallel, DistributedOptimizer
from test_lookup_rows import PER_RANK, STEPS, Lookups, batch, reference

DENSE = 1e-3  # what the hook case adds to every row of emb.weight's gradient


def _counting_scans() -> list[int]:
    """Record the rows of every matrix the exchange searches for touched rows in this rank."""
    searched: list[int] = []
    search = rows_module._touched

    def counted(matrix: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        searched.append(matrix.shape[0])
        return search(matrix, *args, **kwargs)

    rows_module._touched = counted
    return searched


def body(mode: str, case: str, device: str = "cpu") -> list[int]:
    scans = _counting_scans()
    env = scaleout.init(timeout=60, **({"backend": "gloo"} if device == "cuda" else {}))
    world = env.world_size
    torch.manual_seed(0 if env.rank == 0 else 7)  # DataParallel broadcasts rank 0's weights
    net = Lookups().double().to(device)
    if case == "hook":  # a dense term on every row: the ids would miss it
        net.emb.weight.register_hook(lambda grad: grad + DENSE)
    compression = {  # the user's codec on the tables alone, or on every layer
        "explicit codec": CompressionConfig(layers={"emb.weight": "rows", "bag.weight": "rows"},
                                            min_numel=0),
        "rows everywhere": CompressionConfig(codec="rows", min_numel=0)}.get(case)
    model = DataParallel(net, env.create_distribution(), compression=compression)
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.3, momentum=0.9),
                               model, mode=mode)
    mine = slice(env.rank * PER_RANK, (env.rank + 1) * PER_RANK)
    for step in range(STEPS):
        ids, targets = (t.to(device) for t in batch(step, world))
        if case == "extra forward":  # a forward whose graph is never backpropagated
            model(batch(step + 100, world)[0][mine].to(device))
        if case == "micro-batches":  # two samples, then the rest (an even split keeps the
            with model.no_sync():  # positions of the whole batch), the first under no_sync()
                (F.mse_loss(model(ids[mine][:2]), targets[mine][:2]) * 2 / PER_RANK).backward()
            (F.mse_loss(model(ids[mine][2:]), targets[mine][2:]) * (PER_RANK - 2)
             / PER_RANK).backward()
        else:
            F.mse_loss(model(ids[mine]), targets[mine]).backward()
        opt.step()
        opt.zero_grad(set_to_none=case != "kept gradients")
    model.synchronize()
    expected = reference(world, DENSE if case == "hook" else 0.0)
    for name, param in net.named_parameters():
        torch.testing.assert_close(param.detach().cpu(), expected[name], rtol=1e-9, atol=1e-11,
                                   msg=lambda m, n=name: f"rank {env.rank} {case} {n}: {m}")
    model.close()
    env.finalize()
    return scans


@pytest.mark.parametrize("world,mode", [(2, "overlap"), (3, "sync")])
def test_the_ids_replace_the_search_and_training_matches_single_process(
        world: int, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCALEOUT_LOOKUP_ROWS", "1")  # (the ranks are on one machine here)
    assert run_ranks(world, body, mode, "plain") == [[]] * world


@pytest.mark.parametrize("case,searched", [
    ("hook", True),  # a tensor hook may write any row
    ("kept gradients", True),  # zero_grad(set_to_none=False): .grad exists at the forward
    ("micro-batches", True),  # no_sync(): the first half's rows are in .grad
    ("extra forward", False),  # its rows join the next exchange's: more, none missed
])
def test_where_the_ids_could_miss_a_row_the_exchange_searches_and_stays_exact(
        case: str, searched: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCALEOUT_LOOKUP_ROWS", "1")
    scans = run_ranks(2, body, "overlap", case)
    assert all(scans) if searched else scans == [[], []], (case, scans)


def test_a_rows_codec_the_user_names_gets_the_ids_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tables given the ``rows`` codec by the user, with the runtime's own row-sparse
    lookups off (``SCALEOUT_LOOKUP_ROWS=0``, as on one machine): their exchanges take the
    forward's ids as well, and training still equals the single-process reference (before,
    only the tables the runtime sent row-sparse itself got them, and these searched)."""
    monkeypatch.setenv("SCALEOUT_LOOKUP_ROWS", "0")
    assert run_ranks(2, body, "overlap", "explicit codec") == [[], []]


def test_a_rows_codec_on_every_layer_gives_the_tables_the_ids_and_searches_the_rest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``rows`` named for every layer: one bucket holds the tables and the other weights. The
    tables' flags come from the forward's ids; only ``pos`` is searched (2 rows; every batch
    reads both, so it is not counted as lookup-only), once per exchange, and training
    matches the reference. Before, a matrix no lookup reads turned the bucket's ids off, and
    every exchange searched 64 + 48 + 2 rows."""
    monkeypatch.setenv("SCALEOUT_LOOKUP_ROWS", "0")
    assert run_ranks(2, body, "overlap", "rows everywhere") == [[2] * STEPS] * 2


@pytest.mark.gpu
@pytest.mark.parametrize("case,searched",
                         [("explicit codec", []), ("rows everywhere", [2] * STEPS)])
def test_a_rows_codec_the_user_names_gets_the_ids_on_cuda(
        case: str, searched: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The same on CUDA tensors, two ranks sharing one GPU over gloo: the flags are set on the
    device from the lookups' saved indices, and with ``rows`` on every layer the other
    matrices' rows are searched into them (the reference still runs on the CPU)."""
    monkeypatch.setenv("SCALEOUT_LOOKUP_ROWS", "0")
    assert run_ranks(2, body, "overlap", case, "cuda", timeout=120) == [searched] * 2


def _hinted_exchange(hint: Callable[[torch.Tensor], Any]) -> list[torch.Tensor]:
    """One bucket (two tables, a bias) exchanged with its rows searched for, then with
    ``hint(touched rows)`` handed in (a ``(flags, ROWS_SEARCH ranges)`` pair: both): both
    sums."""
    env = scaleout.init(timeout=30)
    comm = env.create_distribution().communicator(GroupType.DATA)
    shapes = [(6, 3), (4, 3), (5,)]
    g = torch.Generator().manual_seed(env.rank)
    grad = torch.zeros(6 * 3 + 4 * 3 + 5, dtype=torch.float64)
    touched = torch.zeros(10, dtype=torch.bool)
    touched[[env.rank, 7 + env.rank]] = True
    grad[:30].view(10, 3)[touched] = torch.randn(2, 3, generator=g, dtype=torch.float64)
    grad[30:] = torch.randn(5, generator=g, dtype=torch.float64)
    codec, out = RowsCodec(), []
    for handed in (None, hint(touched)):
        state = CodecState()
        if isinstance(handed, tuple):
            handed, state.scratch[ROWS_SEARCH] = handed
        if handed is not None:
            state.scratch[ROWS_TOUCHED] = handed
        bucket = grad.clone()
        try:
            compressed_allreduce(codec, bucket, state, comm, shapes=shapes).wait(timeout=30)
        except ValueError as err:
            out.append(str(err))
            continue
        assert not {ROWS_TOUCHED, ROWS_SEARCH} & set(state.scratch)  # (one exchange each)
        out.append(bucket)
    env.finalize()
    return out


def _with_extra_rows(touched: torch.Tensor) -> torch.Tensor:
    return touched | (torch.arange(10) % 4 == 0)  # more rows than touched: still the sum


def _too_short(touched: torch.Tensor) -> torch.Tensor:
    return touched[:9]


def _second_table_searched(touched: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The first table's flags known, the second's (rows 6..9) left to the search."""
    flags = touched.clone()
    flags[6:] = False
    return flags, ((6, 4),)


def _search_past_the_rows(touched: torch.Tensor) -> tuple[torch.Tensor, Any]:
    return touched, ((8, 3),)


def test_a_hint_gives_the_searched_sum_and_a_malformed_one_is_named() -> None:
    for searched, hinted in run_ranks(2, _hinted_exchange, _with_extra_rows):
        torch.testing.assert_close(hinted, searched, rtol=0, atol=0)
    for _, error in run_ranks(2, _hinted_exchange, _too_short):
        assert "hint must be one bool per flagged row (10), got 9 values" in error, error
    for searched, partly in run_ranks(2, _hinted_exchange, _second_table_searched):
        torch.testing.assert_close(partly, searched, rtol=0, atol=0)
    for _, error in run_ranks(2, _hinted_exchange, _search_past_the_rows):
        assert "'rows_search' entry must be (first row, rows) within one block" in error, error
    assert RowsCodec.row_counts([(6, 3), (4, 3), (5,), (1, 3), (0, 3)]) == [6, 4, 0, 0, 0]
