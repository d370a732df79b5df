"""The spans in which this process did not run (core/stalls.py): noted once, counted once."""

from __future__ import annotations

import time

import pytest

from scaleout.core import stalls


@pytest.fixture(autouse=True)
def _no_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stalls, "_spans", type(stalls._spans)(maxlen=stalls._spans.maxlen))


def test_a_look_a_little_late_notes_nothing() -> None:
    assert stalls.note_late(100.0, 100.0 + stalls.LATE_S) == 0.0
    assert stalls.stopped_within(0.0, 1e9) == 0.0


def test_one_stop_noted_by_several_threads_counts_once() -> None:
    assert stalls.note_late(100.0, 106.0) == 6.0  # the waiter's slice
    stalls.note_late(99.5, 106.1)  # the watchdog's round
    stalls.note_late(100.2, 105.9)  # the progress thread's idle poll
    assert stalls.stopped_within(0.0, 200.0) == pytest.approx(6.6)
    assert stalls.stopped_within(102.0, 104.0) == pytest.approx(2.0)  # clipped to the window
    assert stalls.stopped_within(107.0, 200.0) == 0.0


def test_separate_stops_add_up() -> None:
    stalls.note_late(10.0, 12.0)
    stalls.note_late(20.0, 23.0)
    assert stalls.stopped_within(0.0, 100.0) == pytest.approx(5.0)
    assert stalls.stopped_within(11.0, 21.0) == pytest.approx(2.0)


def test_a_timeout_names_a_stop_only_when_it_is_a_real_part_of_the_wait() -> None:
    now = time.monotonic()
    assert stalls.why_timed_out(now - 300.0, 300.0) is None  # no stop at all
    stalls.note_late(now - 20.0, now - 19.0)  # 1 s of a 300 s wait: not the cause
    assert stalls.why_timed_out(now - 300.0, 300.0) is None
    stalls.note_late(now - 10.0, now - 1.0)
    why = stalls.why_timed_out(now - 12.0, 3.0)
    assert why is not None and "did not run for 9.0 s" in why and "timeout" in why
