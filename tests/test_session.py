"""MLSL's object model: sessions, parameter sets (plain and distributed update), activations."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import scaleout
from harness import others_done, run_ranks
from scaleout import ActivationSpec, Exchange, GroupType, ParameterSetSpec, Phase, SchedulerConfig, Session

POLICIES = [SchedulerConfig(policy="fifo"),
            SchedulerConfig(policy="priority", partition_bytes=256, credit_bytes=512,
                            bucket_bytes=1024, first_bucket_bytes=256, urgent_bytes=200)]
SIZES = [3, 700, 50, 1, 129, 400]  # elements per layer: fused, chunked, odd


def grad_of(rank: int, layer: int, it: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 10 * layer + it)
    return torch.randn(n, generator=g, dtype=torch.float64)


def body_gradients(policy_index: int, iterations: int) -> None:
    env = scaleout.init(timeout=30)
    dist = env.create_distribution()
    session = Session(env, Phase.TRAIN, scheduler=POLICIES[policy_index])
    session.set_global_minibatch_size(6 * env.world_size)
    ops = [session.add_operation(f"layer{i}", dist,
                                 parameter_sets=[ParameterSetSpec(count=n, dtype=torch.float64)])
           for i, n in enumerate(SIZES)]
    session.commit()
    assert ops[0].local_minibatch_size == 6 and ops[1].prev is ops[0]
    for it in range(iterations):
        for i in reversed(range(len(ops))):  # backward order
            ops[i].parameter_sets[0].start_gradient_comm(grad_of(env.rank, i, it, SIZES[i]))
        for i, op in enumerate(ops):  # next forward order, as the update needs them
            got = op.parameter_sets[0].wait_gradient_comm()
            want = sum(grad_of(r, i, it, SIZES[i]) for r in range(env.world_size)) / env.world_size
            torch.testing.assert_close(got, want)
    stats = session.statistics.as_dict()
    assert stats["total"]["bytes"] > 0 or env.world_size == 1
    assert "layer0" in session.statistics.table() or env.world_size == 1
    session.close()
    env.finalize()


@pytest.mark.parametrize("policy_index", [0, 1], ids=["fifo", "priority"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_gradient_comm_averages_over_data_group(world: int, policy_index: int) -> None:
    run_ranks(world, body_gradients, policy_index, 3, timeout=90)


def body_out_of_order_start() -> None:
    # ranks start their sets in different orders: the fixed lane order keeps collectives matched
    env = scaleout.init(timeout=30)
    dist = env.create_distribution()
    session = Session(env, scheduler=POLICIES[1])
    ops = [session.add_operation(f"l{i}", dist, parameter_sets=[ParameterSetSpec(count=n)])
           for i, n in enumerate(SIZES)]
    session.commit()
    order = list(range(len(ops)))
    np.random.default_rng(env.rank).shuffle(order)
    for i in order:
        ops[i].parameter_sets[0].start_gradient_comm(torch.full((SIZES[i],), float(env.rank + i)))
    for i, op in enumerate(ops):
        got = op.parameter_sets[0].wait_gradient_comm()
        assert torch.allclose(got, torch.full((SIZES[i],), (env.world_size - 1) / 2 + i))
    session.close()
    env.finalize()


def test_any_start_order_is_safe() -> None:
    run_ranks(3, body_out_of_order_start, timeout=60)


def body_front_chunk_leaves_early() -> None:
    # one bucket of two sets in two chunks: the set backward produces first fills the front
    # chunk, which is sent (and summed in place) before the other set exists
    env = scaleout.init(timeout=30)
    dist = env.create_distribution()
    session = Session(env, scheduler=SchedulerConfig(
        policy="priority", partition_bytes=512, credit_bytes=1024, bucket_bytes=1024,
        first_bucket_bytes=1024, urgent_bytes=0))
    second, first = (session.add_operation(f"l{i}", dist, parameter_sets=[
        ParameterSetSpec(count=64, dtype=torch.float64)]).parameter_sets[0] for i in range(2))
    session.commit()
    bucket = first.bucket
    assert bucket is second.bucket and bucket.span(first) == (0, 64)
    size = env.world_size
    for it in range(2):
        first.start_gradient_comm(torch.full((64,), float(env.rank + it), dtype=torch.float64))
        want = sum(r + it for r in range(size)) / size
        deadline = time.monotonic() + 20
        while not torch.all(bucket.buffer()[:64] == want):  # the front chunk's average
            assert time.monotonic() < deadline, "the front chunk was not sent on its own"
            time.sleep(0.01)
        assert not bucket.job.test()  # the bucket is not done: its back is not filled
        second.start_gradient_comm(torch.full((64,), float(2 * env.rank), dtype=torch.float64))
        assert torch.all(second.wait_gradient_comm() == size - 1)
        assert torch.all(first.wait_gradient_comm() == want)
    session.close()
    env.finalize()


@pytest.mark.parametrize("world", [2, 3])
def test_a_buckets_front_chunk_leaves_before_its_back_is_filled(world: int) -> None:
    run_ranks(world, body_front_chunk_leaves_early, timeout=60)


def body_distributed_update() -> list[float]:
    env = scaleout.init(timeout=30)
    dist = env.create_distribution()
    session = Session(env)
    n = 10  # not divisible by 3: the last rank's owned slice is short
    op = session.add_operation("fc", dist, parameter_sets=[
        ParameterSetSpec(count=n, dtype=torch.float64, distributed_update=True)])
    session.commit()
    ps = op.parameter_sets[0]
    size = env.world_size
    assert ps.owned_count == -(-n // size)
    assert ps.increment_comm is not None  # its own process group for the increments
    weights = torch.arange(n, dtype=torch.float64)
    for it in range(2):
        ps.start_gradient_comm(grad_of(env.rank, 0, it, n))
        owned = ps.wait_gradient_comm()
        assert owned.numel() == ps.owned_valid
        full = sum(grad_of(r, 0, it, n) for r in range(size)) / size
        torch.testing.assert_close(owned, full[ps.owned_offset: ps.owned_offset + ps.owned_valid])
        new_owned = weights[ps.owned_offset: ps.owned_offset + ps.owned_valid] - 0.1 * owned
        ps.start_increment_comm(new_owned)
        previous = weights
        weights = ps.wait_increment_comm().clone()
        # every rank's updated slice arrived: the whole tensor took the averaged step
        torch.testing.assert_close(weights, previous - 0.1 * full)
    session.close()
    env.finalize()
    return weights.tolist()


def test_distributed_update_matches_replicated_update() -> None:
    results = run_ranks(3, body_distributed_update, timeout=60)
    assert results[0] == results[1] == results[2]
    expected = torch.arange(10, dtype=torch.float64)
    for it in range(2):
        expected = expected - 0.1 * sum(grad_of(r, 0, it, 10) for r in range(3)) / 3
    np.testing.assert_allclose(results[0], expected.numpy(), rtol=1e-12)


def body_model_parallel_fc() -> None:
    # a fully-connected layer split over a 2-way model group: each rank holds half of the
    # input features; the output is reduce-scattered forward and all-gathered backward.
    env = scaleout.init(timeout=30)
    dist = env.create_distribution(env.world_size // 2, 2)
    session = Session(env)
    op = session.add_operation("fc", dist,
                               parameter_sets=[ParameterSetSpec(count=8 * 6)],
                               outputs=[ActivationSpec(exchange=Exchange.REDUCE_SCATTER)])
    session.commit()
    assert op.parameter_sets[0].local_count == 24
    torch.manual_seed(0)
    x, w = torch.randn(4, 8), torch.randn(8, 6)  # the same on every rank (seeded)
    m = dist.rank(GroupType.MODEL)
    partial = x[:, m * 4:(m + 1) * 4] @ w[m * 4:(m + 1) * 4]
    act = op.outputs[0]
    act.start_comm(partial)
    mine = act.wait_comm()
    torch.testing.assert_close(mine, (x @ w)[m * 2:(m + 1) * 2])
    act.start_grad_comm(torch.ones_like(mine) * (m + 1))
    full_grad = act.wait_grad_comm()
    torch.testing.assert_close(full_grad, torch.cat([torch.ones(2, 6), 2 * torch.ones(2, 6)]))
    session.close()
    env.finalize()


@pytest.mark.parametrize("world", [2, 4])
def test_activation_exchange_on_model_group(world: int) -> None:
    run_ranks(world, body_model_parallel_fc, timeout=60)


def body_misuse() -> None:
    env = scaleout.init(timeout=30)
    dist = env.create_distribution()
    session = Session(env)
    with pytest.raises(ValueError, match="count must be an int >= 1"):
        ParameterSetSpec(count=0)
    with pytest.raises(TypeError, match="parameter_sets must hold ParameterSetSpec"):
        session.add_operation("bad", dist, parameter_sets=[4])
    op = session.add_operation("fc", dist, parameter_sets=[ParameterSetSpec(count=4)])
    # two buckets of one name: one codec state was lost at save, the other loaded into both
    with pytest.raises(ValueError, match="operation 'twin': a parameter set named 'fc.0' is "
                                         "already registered"):
        session.add_operation("twin", dist, parameter_sets=[ParameterSetSpec(count=4,
                                                                             name="fc.0")])
    with pytest.raises(ValueError, match="named 'w' is already registered"):
        session.add_operation("pair", dist, parameter_sets=[ParameterSetSpec(count=2, name="w"),
                                                            ParameterSetSpec(count=2, name="w")])
    with pytest.raises(ValueError, match="must be divisible by the data-group size 2"):
        session.set_global_minibatch_size(5)
    session.set_global_minibatch_size(4)
    with pytest.raises(ValueError, match="can be set once"):
        session.set_global_minibatch_size(8)
    with pytest.raises(RuntimeError, match="commit"):
        op.parameter_sets[0].start_gradient_comm(torch.zeros(4))
    session.commit()
    ps = op.parameter_sets[0]
    with pytest.raises(ValueError, match="expected 4 elements, got 5"):
        ps.start_gradient_comm(torch.zeros(5))
    with pytest.raises(TypeError, match="expected dtype torch.float32"):
        ps.start_gradient_comm(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="not called this iteration"):
        ps.wait_gradient_comm()
    ps.start_gradient_comm(torch.ones(4))
    with pytest.raises(RuntimeError, match="already started"):
        ps.start_gradient_comm(torch.ones(4))
    assert torch.equal(ps.wait_gradient_comm(), torch.ones(4))
    with pytest.raises(RuntimeError, match="already committed"):
        session.add_operation("late", dist)
    session.close()
    env.finalize()


def test_misuse_is_reported() -> None:
    run_ranks(2, body_misuse, timeout=60)


def body_peer_never_starts() -> str:
    env = scaleout.init(timeout=30)
    dist = env.create_distribution()
    session = Session(env)
    op = session.add_operation("fc", dist, parameter_sets=[ParameterSetSpec(count=4)])
    session.commit()
    message = ""
    if env.rank == 0:
        op.parameter_sets[0].start_gradient_comm(torch.ones(4))
        with pytest.raises(scaleout.CommunicationTimeout) as info:
            op.parameter_sets[0].wait_gradient_comm(timeout=1.0)
        message = str(info.value)
    else:
        others_done()  # alive but never starts its gradient communication
    return message


def test_wait_times_out_when_a_peer_never_starts() -> None:
    message = run_ranks(2, body_peer_never_starts, timeout=60)[0]
    assert "rank 0: gradient communication of fc.0" in message
    assert "did not complete within 1 s" in message


CODECS = ["blockquant", "powersgd:rank=2", "topk:ratio=0.1", None, "sign", "cast:bf16"]


def body_compressed_lanes() -> None:
    # compressed sets (multi-round ones too) in both lanes, started in a different random order
    # on every rank: the engine must never block on one lane while a peer waits on another.
    env = scaleout.init(timeout=30)
    dist = env.create_distribution()
    session = Session(env, scheduler=POLICIES[1])
    shapes = [(16, 32), (64, 16), (40, 40), (8, 8), (32, 32), (30, 20)]
    ops = [session.add_operation(f"l{i}", dist, parameter_sets=[ParameterSetSpec(
        count=r * c, shape=(r, c), compression=CODECS[i], dtype=torch.float32)])
        for i, (r, c) in enumerate(shapes)]
    session.commit()
    rng = np.random.default_rng(env.rank)
    for _ in range(3):
        order = list(range(len(ops)))
        rng.shuffle(order)
        for i in order:
            ops[i].parameter_sets[0].start_gradient_comm(torch.ones(shapes[i]).reshape(-1))
        for i, op in enumerate(ops):  # equal inputs everywhere: every codec returns ~1
            got = op.parameter_sets[0].wait_gradient_comm(timeout=20)
            assert got.numel() == shapes[i][0] * shapes[i][1]
            if CODECS[i] and CODECS[i].startswith("topk"):
                # top-k sends its k largest (with error feedback: growing) entries only
                sent = got[got != 0]
                assert sent.numel() >= 0.1 * got.numel() and bool((sent >= 1 - 1e-3).all())
            else:
                torch.testing.assert_close(got, torch.ones_like(got), atol=1e-3, rtol=1e-3)
    session.close()
    env.finalize()


def test_compressed_sets_in_every_lane_never_deadlock() -> None:
    run_ranks(3, body_compressed_lanes, timeout=90)


def body_mismatched_plans() -> str:
    env = scaleout.init(timeout=20)
    dist = env.create_distribution()
    session = Session(env)
    count = 100 if env.rank == 0 else 120  # rank 1 registered a different model
    session.add_operation("fc", dist, parameter_sets=[ParameterSetSpec(count=count)])
    try:
        session.commit()
    except ValueError as err:
        message = str(err)
    else:
        message = ""
    session.close()
    env.finalize()
    return message


def test_ranks_with_different_bucket_plans_fail_at_commit() -> None:
    for message in run_ranks(2, body_mismatched_plans, timeout=60):
        assert "bucket plan" in message and "rank 0" in message and "rank 1" in message, message


@pytest.mark.parametrize("kwargs,error,fragment", [
    ({"count": 4, "name": 5}, TypeError, "ParameterSetSpec.name must be a str, got 5"),
    ({"count": 6, "shape": (-2, -3)}, ValueError, "positive dimensions, got (-2, -3)"),
    ({"count": 4, "shape": (2.0, 2.0)}, TypeError, "tuple of ints (a tensor's shape) or None, got (2.0, 2.0)"),
    ({"count": 4, "shape": "ab"}, TypeError, "tuple of ints (a tensor's shape) or None, got 'ab'"),
    ({"count": 4, "shape": 4}, TypeError, "tuple of ints (a tensor's shape) or None, got 4"),
    ({"count": 4, "shape": (True, 4)}, TypeError, "got (True, 4)"),
    ({"count": 4, "shape": (3,)}, ValueError, "shape (3,) has 3 elements, but count is 4"),
    # "false" is true: the set was sharded silently
    ({"count": 4, "distributed_update": "false"}, TypeError,
     "ParameterSetSpec.distributed_update must be a bool, got 'false'"),
    ({"count": 4, "model_split": "no"}, TypeError, "model_split must be a bool, got 'no'"),
    # accepted, then wait_gradient_comm failed on "the comm hook's result ... has 10 values"
    ({"count": 4, "distributed_update": True, "compression": "topk:ratio=0.5"}, ValueError,
     "compression with distributed_update=True is not supported"),
])
def test_parameter_set_spec_rejects_bad_name_and_shape(kwargs: dict, error: type,
                                                       fragment: str) -> None:
    with pytest.raises(error) as info:
        ParameterSetSpec(**kwargs)
    assert fragment in str(info.value)


def test_parameter_set_spec_shape_is_a_tuple() -> None:
    assert ParameterSetSpec(count=6, shape=[2, 3]).shape == (2, 3)
    assert ParameterSetSpec(count=6, shape=torch.Size([3, 2])).shape == (3, 2)
    assert ParameterSetSpec(count=1, shape=()).shape == ()  # a scalar parameter


def body_error_paths() -> None:
    env = scaleout.init(timeout=30)
    dist = env.create_distribution()
    with pytest.raises(TypeError, match=r"trace must be a scaleout TraceRecorder or None, "
                                        r"got 'dir'.*DataParallel\(trace=folder\)"):
        Session(env, trace="dir")
    # TEST phase: no gradients, and the message says so (not "commit first")
    test = Session(env, Phase.TEST)
    test_op = test.add_operation("t", dist, parameter_sets=[ParameterSetSpec(count=2)])
    with pytest.raises(RuntimeError, match="commit"):
        test_op.parameter_sets[0].start_gradient_comm(torch.ones(2))
    test.commit()
    with pytest.raises(RuntimeError, match="not exchanged in a TEST-phase session"):
        test_op.parameter_sets[0].start_gradient_comm(torch.ones(2))
    # a commit that fails (after building one distribution's plan) leaves nothing committed
    failing = Session(env)
    cpu = failing.add_operation("cpu", dist, parameter_sets=[ParameterSetSpec(count=2)])
    two_gpus = env.create_distribution()
    failing.add_operation("gpus", two_gpus, parameter_sets=[
        ParameterSetSpec(count=2, device="cuda:0"), ParameterSetSpec(count=2, device="cuda:1")])
    for _ in range(2):  # and a second try fails the same way, not "already committed"
        with pytest.raises(ValueError, match="must live on one GPU"):
            failing.commit()
        assert not failing.committed and failing.buckets == []
        assert cpu.parameter_sets[0].bucket is None
    with pytest.raises(RuntimeError, match="call session.commit"):
        cpu.parameter_sets[0].start_gradient_comm(torch.ones(2))
    # a start that fails (the engine is closed) leaves nothing started, and a set already in
    # the same bucket hears of the failure instead of waiting out its timeout
    session = Session(env, scheduler=SchedulerConfig(policy="fifo"))
    op = session.add_operation("fc", dist, parameter_sets=[ParameterSetSpec(count=2),
                                                            ParameterSetSpec(count=3)])
    session.commit()
    first, last = op.parameter_sets
    assert len(session.buckets) == 1 and {ps.name for ps in session.buckets[0].members} == {
        first.name, last.name}  # one bucket: the last of its sets to start sends it
    first.start_gradient_comm(torch.ones(2))
    last.start_gradient_comm(torch.ones(3))
    assert torch.equal(first.wait_gradient_comm(), torch.ones(2))
    assert torch.equal(last.wait_gradient_comm(), torch.ones(3))
    session.close()
    first.start_gradient_comm(torch.ones(2))
    with pytest.raises(scaleout.CommunicationError, match="progress engine is closed"):
        last.start_gradient_comm(torch.ones(3))
    assert not last.gradient_pending
    with pytest.raises(RuntimeError, match="not called this iteration"):
        last.wait_gradient_comm(timeout=5)
    began = time.perf_counter()
    with pytest.raises(scaleout.CommunicationError, match="progress engine is closed"):
        first.wait_gradient_comm(timeout=5)
    assert time.perf_counter() - began < 1
    env.finalize()


def test_bad_arguments_and_failed_steps_leave_a_consistent_session() -> None:
    run_ranks(2, body_error_paths, timeout=60)


def body_open_policy(rendezvous: str, local: int | None, testbed: bool) -> None:
    # the harness's ranks meet on 127.0.0.1, both local; another launch is faked on the
    # record the session reads (the process groups are already up on loopback)
    import dataclasses
    env = scaleout.init(timeout=30)
    env._info = dataclasses.replace(env.launch, master_addr=rendezvous, local_world_size=local,
                                    testbed_host=testbed)
    one_machine = rendezvous == "127.0.0.1" or (local == 2 and not testbed)
    assert env.launch.one_machine is one_machine
    dist = env.create_distribution()
    # a bulk bucket of several chunks behind a small urgent one: priority has work to do
    session = Session(env, scheduler=SchedulerConfig(
        partition_bytes=256, credit_bytes=512, bucket_bytes=4096, first_bucket_bytes=256,
        urgent_bytes=100))
    for i, n in enumerate([40, 900]):
        session.add_operation(f"l{i}", dist, parameter_sets=[ParameterSetSpec(count=n)])
    session.commit()
    lanes = {bucket.job.lane for bucket in session.buckets}
    assert lanes == ({0} if one_machine else {0, 1}), (rendezvous, local, lanes)
    # no sharded update, so no process group (and idle gloo thread) for increments
    assert all(ps.increment_comm is None for op in session.operations for ps in op.parameter_sets)
    session.close()
    env.finalize()


@pytest.mark.parametrize("rendezvous,local,testbed", [
    ("127.0.0.1", 2, False),  # loopback
    ("node0", 2, False),  # a single-node Slurm or MPI job meets on the node's name
    ("10.0.0.1", None, False),  # elsewhere, the launcher not saying
    ("10.0.0.1", 1, False),  # one rank per machine
    ("10.213.0.1", 2, True),  # testbed hosts, started as local ranks by scaleout run
])
def test_an_open_policy_is_fifo_for_ranks_on_one_machine(rendezvous: str, local: int | None,
                                                         testbed: bool) -> None:
    """Ranks all on one machine have no link to share: an open policy is fifo there (one
    lane), and priority where the plan has a bulk bucket to pre-empt elsewhere."""
    run_ranks(2, body_open_policy, rendezvous, local, testbed, timeout=60)


def test_one_machine_makes_fifo_of_host_copies_only() -> None:
    """On one machine CPU tensors only copy host memory (fifo); GPUs of one machine still
    share its links, so their open policy stays for the plan to decide (NCCL here: a
    communicator with no gloo group)."""
    from types import SimpleNamespace

    from scaleout.session.bucket import scheduler_as_run

    comm = SimpleNamespace(group=None, size=2)
    for device, one_machine, policy in (("cpu", True, "fifo"), ("cpu", False, None),
                                        ("cuda", True, None), ("cuda", False, None)):
        ran = scheduler_as_run(SchedulerConfig(), comm, torch.device(device), one_machine)
        assert ran.policy == policy, (device, one_machine, ran)
    assert scheduler_as_run(SchedulerConfig(policy="priority"), comm, torch.device("cpu"),
                            True).policy == "priority"
