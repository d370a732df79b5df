"""The iteration model on the runtime's plan and policies: golden timelines, monotonicity, speed."""

from __future__ import annotations

import json
import math
import time

import pytest

from scaleout.scheduler.config import SchedulerConfig
from scaleout.sim.chrome import chrome_trace
from scaleout.sim.config import CodecModel, IterationConfig
from scaleout.sim.iteration import simulate
from scaleout.sim.models import DEVICES, MODELS, model, model_workload
from scaleout.sim.network import parse_topology, preset
from scaleout.sim.scaling import sweep
from scaleout.sim.themis import pipelined_algorithm
from scaleout.sim.trace import read_trace, write_trace
from scaleout.sim.validation import Scenario, validate
from scaleout.sim.workload import Layer, Workload

MB = 1 << 20


def _two_layers() -> Workload:
    return Workload(
        name="toy",
        layers=(
            Layer(name="small", forward_s=0.5, backward_s=1.0, grad_bytes=1 * MB),
            Layer(name="big", forward_s=0.5, backward_s=1.0, grad_bytes=8 * MB),
        ),
    )


def _link() -> object:
    # 2 ranks, 1 MB/s, no latency: a ring all-reduce of n bytes takes n / (1 MB/s)
    return parse_topology("2", bandwidths=[float(MB)], latencies=[0.0], kinds=["ring"])


def _comm(result, iteration: int = 0) -> list[tuple[str, float, float]]:
    return [
        (s.name, s.start, s.end)
        for s in result.spans
        if s.lane == "comm" and s.iteration == iteration
    ]


def test_priority_preempts_a_big_bucket_at_chunk_boundaries() -> None:
    sched = SchedulerConfig(
        policy="priority",
        bucket_bytes=8 * MB,
        first_bucket_bytes=8 * MB,
        partition_bytes=2 * MB,
        credit_bytes=2 * MB,
        urgent_bytes=1 * MB,
    )
    r = simulate(
        _two_layers(), _link(), IterationConfig(scheduler=sched, mode="overlap", trace=True)
    )
    # forward 0..1, backward big 1..2 -> 4 bulk chunks of 2 MB (2 s each), one in flight (credit);
    # backward small 2..3 -> the urgent 1 MB bucket goes right after the chunk in flight
    assert _comm(r) == [
        ("bucket0", 2.0, 4.0),
        ("bucket1", 4.0, 5.0),
        ("bucket0", 5.0, 7.0),
        ("bucket0", 7.0, 9.0),
        ("bucket0", 9.0, 11.0),
    ]
    # cross-iteration overlap: the next forward of 'small' waits only for its own bucket (t=5)
    nxt = [s for s in r.spans if s.iteration == 1 and s.name == "forward small"]
    assert nxt[0].start == pytest.approx(5.0)
    waits = [(s.start, s.end) for s in r.spans if s.lane == "wait" and s.iteration == 1]
    assert waits[0] == (3.0, 5.0)


def test_a_buckets_front_chunk_leaves_while_backward_produces_its_back() -> None:
    work = Workload(name="toy", layers=(
        Layer(name="a", forward_s=0.5, backward_s=1.0, grad_bytes=2 * MB),
        Layer(name="b", forward_s=0.5, backward_s=1.0, grad_bytes=2 * MB),
    ))
    sched = SchedulerConfig(policy="priority", bucket_bytes=8 * MB, first_bucket_bytes=8 * MB,
                            partition_bytes=2 * MB, credit_bytes=4 * MB, urgent_bytes=0)
    r = simulate(work, _link(), IterationConfig(scheduler=sched, mode="overlap", trace=True))
    # one bucket (b, a) in two 2 MB chunks; backward b 1..2 fills the front chunk, which is
    # on the wire 2..4 while backward a (2..3) fills the back one, sent next (4..6); a bucket
    # sent whole would have left at 3 and arrived at 7
    assert r.buckets == 1 and _comm(r) == [("bucket0", 2.0, 4.0), ("bucket0", 4.0, 6.0)]
    waits = [(s.start, s.end) for s in r.spans if s.lane == "wait" and s.iteration == 1]
    assert waits[0] == (3.0, 6.0)


def test_fifo_sends_buckets_whole_in_backward_order() -> None:
    sched = SchedulerConfig(policy="fifo", bucket_bytes=8 * MB, first_bucket_bytes=8 * MB)
    r = simulate(_two_layers(), _link(), IterationConfig(scheduler=sched, mode="sync", trace=True))
    assert _comm(r) == [("bucket0", 2.0, 10.0), ("bucket1", 10.0, 11.0)]
    assert r.iteration_s == pytest.approx(11.0)  # sync: the next forward starts at 11
    assert r.compute_s == pytest.approx(3.0) and r.exposed_s == pytest.approx(8.0)
    assert r.efficiency == pytest.approx(3.0 / 11.0)
    assert r.utilisation[0] == pytest.approx(9.0 / 11.0)


def test_codec_shrinks_bytes_and_costs_compute() -> None:
    codec = CodecModel(name="q8", ratio=0.25, seconds_per_byte=0.1 / MB)
    sched = SchedulerConfig(policy="fifo", bucket_bytes=16 * MB, first_bucket_bytes=16 * MB)
    r = simulate(_two_layers(), _link(), IterationConfig(scheduler=sched, mode="sync", codec=codec))
    # one bucket of 9 MB -> 2.25 MB on the wire (2.25 s) + 0.9 s of codec after backward at t=3
    assert r.iteration_s == pytest.approx(3.0 + 2.25 + 0.9)
    with pytest.raises(ValueError, match="ratio"):
        CodecModel(name="x", ratio=2.0)


@pytest.mark.parametrize(
    "policy,mode", [("fifo", "sync"), ("priority", "overlap"), ("fifo", "overlap")]
)
def test_more_bandwidth_never_slower_more_latency_never_faster(policy: str, mode: str) -> None:
    work = model_workload("resnet50", device=DEVICES["p100"], batch_size=32)
    cfg = IterationConfig(scheduler=SchedulerConfig(policy=policy), mode=mode)

    def t(bw: float, lat: str) -> float:
        topo = parse_topology(
            "8x16", bandwidths=[bw * 8, bw], latencies=[lat, lat], kinds=["ring", "switch"]
        )
        return simulate(work, topo, cfg).iteration_s

    times = [t(bw, "5us") for bw in (1e8, 1e9, 1e10, 1e11)]
    assert times == sorted(times, reverse=True)
    assert t(1e9, "5us") <= t(1e9, "50us") <= t(1e9, "500us")
    assert min(times) >= work.compute_s - 1e-12


def test_model_table_matches_published_sizes() -> None:
    assert set(MODELS) >= {
        "resnet50",
        "resnet152",
        "bert_large",
        "gpt",
        "dlrm",
        "vgg16",
        "resnet101",
        "inception_v3",
    }
    assert model("resnet50").params == pytest.approx(25.6e6, rel=0.01)
    assert model("vgg16").params == pytest.approx(138.4e6, rel=0.01)
    assert model("bert_large").params == pytest.approx(335e6, rel=0.02)
    assert model("resnet50").flops / 2 == pytest.approx(4.1e9, rel=0.02)
    assert len(model("gpt:96").layers) == 2 * 96 + 2
    with pytest.raises(ValueError, match="unknown model"):
        model("alexnet")


def test_trace_workload_round_trip_and_rescaling(tmp_path) -> None:
    work = _two_layers()
    path = tmp_path / "rank0.json"
    write_trace(path, work, device="cpu", command="test")
    back = read_trace(path)
    assert back == work
    faster = back.scaled(batch_size=2, speed=4.0)
    assert (
        faster.compute_s == pytest.approx(work.compute_s * 2 / 4)
        and faster.grad_bytes == work.grad_bytes
    )
    path.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not a scaleout trace"):
        read_trace(path)


def test_chrome_trace_has_a_track_per_rank_and_three_lanes() -> None:
    r = simulate(_two_layers(), _link(), IterationConfig(trace=True))
    doc = chrome_trace(r.spans, ranks=3)
    names = {
        (e["pid"], e["args"]["name"]) for e in doc["traceEvents"] if e["name"] == "thread_name"
    }
    assert names == {(p, lane) for p in range(3) for lane in ("compute", "comm", "wait")}
    assert {e["cat"] for e in doc["traceEvents"] if e["ph"] == "X"} == {"compute", "comm", "wait"}


def test_validation_fails_above_its_bound() -> None:
    good = Scenario(
        name="a",
        group="published",
        measured=90.0,
        unit="%",
        bound=3.0,
        source="s",
        assumptions="none",
        predict=lambda: 92.0,
    )
    bad = Scenario(
        name="b",
        group="testbed",
        measured=100.0,
        unit="ms",
        bound=0.15,
        source="s",
        assumptions="none",
        predict=lambda: 120.0,
    )
    assert validate([good]).ok
    report = validate([good, bad])
    assert not report.ok and [o.ok for o in report.outcomes] == [True, False]
    assert report.outcomes[1].error == pytest.approx(0.2)


def test_speed_resnet50_on_1024_nodes_and_a_4096_node_transformer_sweep() -> None:
    # CPU time of this process: the bounds are about the simulator, not the machine's load
    topo = preset("dgx-ethernet").topology
    work = model_workload("resnet50", device=DEVICES["a100"], batch_size=32)
    started = time.process_time()
    simulate(work, topo.with_npus(1024))
    assert time.process_time() - started < 1.0
    gpt = model_workload("gpt:96", device=DEVICES["h100"], batch_size=8)
    started = time.process_time()
    points = sweep(gpt, topo, [8 << k for k in range(10)])
    assert time.process_time() - started < 30.0
    assert points[-1].npus == 4096
    effs = [p.efficiency for p in points]
    assert effs == sorted(effs, reverse=True)


def test_measured_codec_models() -> None:
    from scaleout.sim.config import CODECS, codec_model

    assert codec_model("none") == CodecModel()
    assert codec_model("sign").summable is False and codec_model("blockquant").summable
    assert all(0 < c.ratio < 1 for c in CODECS.values())
    with pytest.raises(ValueError, match="known: none"):
        codec_model("zip")
    # a gathered codec's bytes grow with the ranks, a summed one's do not
    work = _two_layers()
    wide = parse_topology("64", bandwidths=[float(MB)], latencies=[0.0], kinds=["ring"])
    sched = SchedulerConfig(policy="fifo", bucket_bytes=16 * MB, first_bucket_bytes=16 * MB)
    sign = simulate(work, wide, IterationConfig(scheduler=sched, codec=codec_model("sign")))
    fp16 = simulate(work, wide, IterationConfig(scheduler=sched, codec=codec_model("cast:fp16")))
    assert sign.comm_s > fp16.comm_s


def test_pipelined_and_themis_allreduce_inside_an_iteration() -> None:
    # fast inner dimension, slow outer one: the fixed order leaves the outer links idle
    topo = parse_topology("8x8", bandwidths=["50GB/s", "200GB/s"], latencies="1us", kinds="ring")
    work = model_workload("resnet50", device=DEVICES["v100"], batch_size=8)
    sched = SchedulerConfig(policy="fifo", bucket_bytes=25 * MB, first_bucket_bytes=1 * MB)

    def t(pipeline: str | None) -> float:
        cfg = IterationConfig(scheduler=sched, mode="sync", pipeline=pipeline, pipeline_chunks=16)
        return simulate(work, topo, cfg).comm_s

    plain, base, themis = t(None), t("baseline"), t("themis")
    # the slow inner dimension bounds both fixed orders; Themis sends chunks up the fast one first
    assert themis < min(base, plain)
    with pytest.raises(ValueError, match="pipeline"):
        IterationConfig(pipeline="random")


def _host_case(host: float, codec: CodecModel | None = None) -> float:
    # backward runs b (1 s, 8 B of gradients) then a (20 s, none): b's all-reduce (2 ranks,
    # 1 B/s: 8 s on the wire) runs entirely under a's backward
    work = Workload(
        name="host",
        layers=(
            Layer(name="a", forward_s=0.0, backward_s=20.0, grad_bytes=0),
            Layer(name="b", forward_s=1.0, backward_s=1.0, grad_bytes=8),
        ),
    )
    topo = parse_topology("2", bandwidths=[1.0], latencies=[0.0], kinds=["ring"])
    cfg = IterationConfig(
        scheduler=SchedulerConfig(policy="fifo"), mode="sync", host_s_per_byte=host,
        codec=codec or CodecModel(),
    )
    return simulate(work, topo, cfg).iteration_s


def test_host_cpu_per_byte_charges_compute_only_while_it_overlaps() -> None:
    assert _host_case(0.0) == pytest.approx(22.0)  # 1 + 1 + 20, the 8 s transfer hidden
    # 0.5 s/B: 4 s of CPU done while computing lengthens the next compute span by 4 s
    assert _host_case(0.5) == pytest.approx(26.0)
    # exposed traffic: CPU done while waiting costs nothing; a transfer lasts >= its CPU
    one = Workload(name="one", layers=(Layer(name="a", forward_s=1.0, backward_s=1.0,
                                              grad_bytes=8),))
    topo = parse_topology("2", bandwidths=[1.0], latencies=[0.0], kinds=["ring"])
    sync = SchedulerConfig(policy="fifo")
    for host, expected in ((0.5, 10.0), (2.0, 18.0)):  # max(8 s wire, 8 x host) after 2 s
        cfg = IterationConfig(scheduler=sync, mode="sync", host_s_per_byte=host)
        assert simulate(one, topo, cfg).iteration_s == pytest.approx(expected)
    with pytest.raises(ValueError, match="host_s_per_byte"):
        IterationConfig(host_s_per_byte=-1.0)


def test_a_codec_on_the_host_shares_the_compute_cores() -> None:
    half = CodecModel(name="half", ratio=0.5, seconds_per_byte=0.25)  # 8 B in: 2 s of codec
    # no host: the codec's 2 s lengthen the transfer (4 s on the wire), all hidden under a
    assert _host_case(0.0, half) == pytest.approx(22.0)
    # host 0.5 s/B: 4 wire B cost 2 s of CPU, the codec 2 s more, all while a computes
    assert _host_case(0.5, half) == pytest.approx(26.0)


def test_host_cpu_per_message_is_charged_per_chunk_like_the_bytes() -> None:
    # _host_case's transfer as one message: 3 s of CPU per collective, done while a computes
    work = Workload(name="host", layers=(
        Layer(name="a", forward_s=0.0, backward_s=20.0, grad_bytes=0),
        Layer(name="b", forward_s=1.0, backward_s=1.0, grad_bytes=8)))
    topo = parse_topology("2", bandwidths=[1.0], latencies=[0.0], kinds=["ring"])

    def run(per_message: float, partition: int) -> float:
        sched = SchedulerConfig(policy="priority", partition_bytes=partition,
                                credit_bytes=8, urgent_bytes=0)
        cfg = IterationConfig(scheduler=sched, mode="sync", host_s_per_message=per_message)
        return simulate(work, topo, cfg).iteration_s

    assert run(0.0, 8) == pytest.approx(22.0)
    assert run(3.0, 8) == pytest.approx(25.0)  # one message: its 3 s lengthen a's compute
    assert run(0.0, 4) == pytest.approx(22.0)  # two chunks cost nothing more on the wire...
    assert run(3.0, 4) == pytest.approx(28.0)  # ...but twice the CPU: more, smaller chunks pay
    with pytest.raises(ValueError, match="host_s_per_message"):
        IterationConfig(host_s_per_message=-1.0)


def test_a_cycled_loop_starts_collectives_only_at_its_cycles() -> None:
    # Horovod's background loop (cycle_s): a gradient ready at t=2 waits for the cycle at t=5
    one = Workload(name="one", layers=(Layer(name="a", forward_s=1.0, backward_s=1.0,
                                              grad_bytes=8),))
    topo = parse_topology("2", bandwidths=[1.0], latencies=[0.0], kinds=["ring"])
    fifo = SchedulerConfig(policy="fifo")

    def run(cycle: float) -> object:
        cfg = IterationConfig(scheduler=fifo, mode="sync", cycle_s=cycle, trace=True)
        return simulate(one, topo, cfg)

    assert run(0.0).iteration_s == pytest.approx(10.0)  # backward 2 s, 8 s on the wire
    cycled = run(5.0)
    assert _comm(cycled, 0) == [("bucket0", 5.0, 13.0)]
    # the loop ticks 5 s after its last cycle or when that cycle's work ended (t=13), then
    # every 5 s while idle: the next gradient (t=15) waits for t=18
    assert _comm(cycled, 1) == [("bucket0", 18.0, 26.0)]
    assert cycled.iteration_s == pytest.approx(13.0)
    # a busy loop does not sleep: what arrived during a cycle's work goes right after it
    sched = SchedulerConfig(policy="fifo", bucket_bytes=1 * MB, first_bucket_bytes=1 * MB)
    r = simulate(_two_layers(), _link(),
                 IterationConfig(scheduler=sched, mode="sync", cycle_s=1.0, trace=True))
    assert _comm(r) == [("bucket0", 2.0, 10.0), ("bucket1", 10.0, 11.0)]
    with pytest.raises(ValueError, match="cycle_s"):
        IterationConfig(cycle_s=-1.0)


def test_each_round_of_a_codec_costs_a_collective_latency_and_its_call() -> None:
    # the codec of test_codec_shrinks_bytes_and_costs_compute on a link with 0.5 s of latency
    topo = parse_topology("2", bandwidths=[float(MB)], latencies=[0.5], kinds=["ring"])
    sched = SchedulerConfig(policy="fifo", bucket_bytes=16 * MB, first_bucket_bytes=16 * MB)

    def run(rounds: int, per_message: float = 0.0) -> float:
        codec = CodecModel(name="q8", ratio=0.25, seconds_per_byte=0.1 / MB,
                           multi_round=rounds > 1, rounds=rounds)
        cfg = IterationConfig(scheduler=sched, mode="sync", codec=codec,
                              host_s_per_message=per_message)
        return simulate(_two_layers(), topo, cfg).iteration_s

    one_byte = simulate(  # what a 1-byte all-reduce takes on this link: the round's latency
        Workload(name="b", layers=(Layer(name="x", forward_s=0.0, backward_s=0.0, grad_bytes=1),)),
        topo, IterationConfig(scheduler=sched, mode="sync")).iteration_s
    assert one_byte == pytest.approx(1.0, abs=1e-5)  # 2 steps x 0.5 s
    assert run(2) - run(1) == pytest.approx(one_byte)
    # a host that pays 10 s per collective: the exchange lasts its CPU, 10 s per round
    assert run(2, 10.0) - run(1, 10.0) == pytest.approx(10.0)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="rounds"):
            CodecModel(name="x", ratio=0.5, multi_round=True, rounds=bad)
    with pytest.raises(ValueError, match="rounds"):
        CodecModel(name="x", ratio=0.5, rounds=2)  # several rounds: multi_round


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_non_finite_costs_rates_and_times_are_refused(bad: float) -> None:
    # each priced an iteration as nan or inf (and sim run wrote NaN into its JSON)
    with pytest.raises(ValueError, match="seconds_per_byte must be a finite number >= 0"):
        CodecModel(name="x", ratio=0.5, seconds_per_byte=bad)
    for name in ("host_s_per_byte", "host_s_per_message", "cycle_s"):
        with pytest.raises(ValueError, match=f"{name} must be a finite number >= 0"):
            IterationConfig(**{name: bad})
    for name in ("forward_s", "backward_s", "update_s"):
        times = {"forward_s": 0.0, "backward_s": 0.0, name: bad}
        with pytest.raises(ValueError, match=f"Layer.{name} must be a finite number >= 0"):
            Layer(name="a", grad_bytes=0, **times)
    with pytest.raises(ValueError, match="device rate must be a finite number > 0"):
        model_workload("resnet50", device=bad, batch_size=1)
    with pytest.raises(ValueError, match="speed must be a finite number > 0"):
        _two_layers().scaled(speed=bad)


def test_gradient_bytes_stop_at_64_bits() -> None:
    assert Layer(name="a", forward_s=0.0, backward_s=0.0, grad_bytes=2**63 - 1).grad_bytes
    with pytest.raises(ValueError, match=r"grad_bytes must be an int from 0 to 2\*\*63 - 1"):
        Layer(name="a", forward_s=0.0, backward_s=0.0, grad_bytes=10**400)


def test_a_pipelined_all_reduce_takes_one_algorithm_and_no_flat_ring() -> None:
    assert pipelined_algorithm("direct") == pipelined_algorithm(["direct"] * 3) == "direct"
    for algorithm, flat in ((("ring", "direct"), False), ("ring", True)):
        with pytest.raises(ValueError, match="one algorithm and no flat ring"):
            pipelined_algorithm(algorithm, flat)
        with pytest.raises(ValueError, match="one algorithm and no flat ring"):
            IterationConfig(pipeline="themis", algorithm=algorithm, flat=flat)
