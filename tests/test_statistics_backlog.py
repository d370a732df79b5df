"""Statistics (stop 52): an unknown operation is an error, not a row of zeros, and each row's
per-iteration figure is over the iterations that operation reported in."""

from __future__ import annotations

import pytest

from scaleout.session.statistics import Statistics


def _row(table: str, name: str) -> list[str]:
    return next(line.split() for line in table.splitlines() if line.split()[:1] == [name])


def test_an_unknown_operation_is_a_key_error_naming_the_known_ones() -> None:
    stats = Statistics()
    stats.add("conv1", compute_s=0.5)
    with pytest.raises(KeyError, match=r"no operation 'cnov1'.*known: 'conv1'"):
        stats.operation("cnov1")  # it returned a zero row, and the table grew a "cnov1" line
    assert "cnov1" not in stats and "cnov1" not in stats.table()
    assert stats.operation("conv1").compute_s == 0.5 and "conv1" in stats
    with pytest.raises(KeyError, match="none yet"):
        Statistics().operation("conv1")


def test_each_row_is_per_iteration_that_operation_reported_in() -> None:
    stats = Statistics()
    for it in range(4):
        stats.add("always", compute_s=0.010, bytes=1_000_000)
        if it in (1, 3):  # skipped in iterations 0 and 2
            stats.add("sometimes", compute_s=0.004, bytes=2_000_000)
        if it == 3:  # added in the last iteration
            stats.add("late", comm_s=0.006)
        stats.end_iteration()
    assert [stats.operation(n).iterations for n in ("always", "sometimes", "late")] == [4, 2, 1]
    table = stats.table()
    # compute ms, comm ms, exposed ms, MB, compression, iterations
    assert _row(table, "always")[1:] == ["10.0", "0.0", "0.0", "1.00", "-", "4"]
    # 8 ms over its 2 iterations: 4.0 ms (it read 2.0, over the run's 4), 2 MB (was 1.00)
    assert _row(table, "sometimes")[1:] == ["4.0", "0.0", "0.0", "2.00", "-", "2"]
    assert _row(table, "late")[1:3] == ["0.0", "6.0"]  # (was 1.5)
    # the total stays per iteration of the run: (40 + 8) ms / 4, (4 + 4) MB / 4
    assert _row(table, "total")[1:] == ["12.0", "1.5", "0.0", "2.00", "-", "4"]
    assert _row(stats.table(per_iteration=False), "sometimes")[1] == "8.0"


def test_a_figure_of_an_unfinished_iteration_is_not_divided_by_zero() -> None:
    stats = Statistics()
    stats.add("a", compute_s=0.002)
    stats.end_iteration()
    stats.add("b", comm_s=0.003)  # (its iteration has not ended)
    assert _row(stats.table(), "b")[1:3] == ["0.0", "3.0"]
    stats.reset()
    assert stats.iterations == 0 and "a" not in stats
    stats.add("a", compute_s=0.001)
    stats.end_iteration()
    assert stats.operation("a").iterations == 1  # (a report before reset() does not count)
