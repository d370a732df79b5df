"""Front ends given no Distribution (``DataParallel(model)``, ``EmbeddingCollection(...)``,
``hvd.init()`` after ``scaleout.init``) join the job through ``attach()``: they keep the
timeout given to ``scaleout.init`` (before: always 300 s, so a rank that stopped communicating
held the others for 300 s after ``init(timeout=3)``)."""

from __future__ import annotations

import time

import torch
from torch import nn

from harness import others_done, run_ranks


def body_data_parallel_without_a_distribution() -> tuple[str, float, str]:
    import scaleout
    from scaleout.pytorch import DataParallel

    env = scaleout.init(timeout=2)
    torch.manual_seed(0)
    model = DataParallel(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        if env.rank == 1 and step == 2:
            others_done()  # busy outside communication, heartbeat going, till rank 0 is done
            return "", 0.0, ""
        started = time.monotonic()
        try:
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        except scaleout.CommunicationError as err:
            return type(err).__name__, time.monotonic() - started, str(err)
    return "no error", 0.0, ""


def test_data_parallel_keeps_the_init_timeout() -> None:
    kind, seconds, message = run_ranks(2, body_data_parallel_without_a_distribution,
                                       timeout=40)[0]
    assert kind == "CommunicationTimeout", (kind, message)
    assert "within 2 s" in message and "rank 1 is alive but not at this call" in message, message
    assert seconds < 6, message


def body_attach() -> tuple[float, str, float, str]:
    import scaleout
    from scaleout.core.env import attach

    scaleout.init(timeout=7, check_consistency="full")
    env = attach(check_consistency=None)
    plain = attach()
    return env.timeout, env.check_consistency, plain.timeout, plain.check_consistency


def test_attach_takes_the_timeout_and_checks_of_init() -> None:
    assert run_ranks(1, body_attach, timeout=30) == [(7.0, "full", 7.0, "off")]


def body_horovod_after_init() -> tuple[str, float, str]:
    import scaleout
    import scaleout.horovod as hvd

    env = scaleout.init(timeout=2)
    hvd.init()  # joins the job, with its timeout (before: 300 s)
    hvd.allreduce(torch.ones(2))
    if env.rank == 1:
        others_done()  # (alive, heartbeat going, till rank 0's wait has timed out)
        return "", 0.0, ""
    started = time.monotonic()
    try:
        hvd.allreduce(torch.ones(2), name="late")
    except Exception as err:  # noqa: BLE001 - reported to the test
        return type(err).__name__, time.monotonic() - started, str(err)
    return "no error", 0.0, ""


def test_horovod_after_init_keeps_its_timeout() -> None:
    kind, seconds, message = run_ranks(2, body_horovod_after_init, timeout=40)[0]
    assert "within 2 s" in message and "rank 1 is alive but not at this call" in message, \
        (kind, message)
    assert seconds < 6, message
