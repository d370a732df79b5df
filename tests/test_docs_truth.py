"""The docs are true: README.md and docs/*.md checked against the code (stop 52).

Each test reads what a page states (a command line, a default, a signature, an example's
output, a refusal) and checks it against the code, so that the page and the code cannot part
silently. Snippets run at world sizes 1 and 2 in forked ranks (a few seconds in all).
"""

from __future__ import annotations

import argparse
import dataclasses
import doctest
import inspect
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from harness import run_ranks

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *(f"docs/{name}.md" for name in (
    "workloads", "benchmarks", "scheduling", "compression", "codecs", "tuning", "hybrid"))]
MB = 1 << 20


def _page(name: str) -> str:
    return (ROOT / name).read_text()


# -- command lines -------------------------------------------------------------------------

def _commands() -> list[tuple[str, str]]:
    """(page, command) for every ``scaleout ...`` command line the pages show: inline code and
    lines of fenced blocks."""
    found = []
    for name in PAGES:
        text = _page(name)
        spans = re.findall(r"`(scaleout (?:run|bench|tune|testbed|sim)\b[^`]*)`", text)
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
            joined = block.replace("\\\n", " ")
            spans += [line.strip() for line in joined.splitlines()
                      if line.strip().startswith("scaleout ")]
        found += [(name, span) for span in spans]
    return found


def _subparser(parser: argparse.ArgumentParser, words: list[str]) -> tuple[argparse.ArgumentParser, int]:
    """The deepest subcommand parser ``words`` name, and how many words named it."""
    used = 0
    while used < len(words):
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions or words[used] not in actions[0].choices:
            break
        parser = actions[0].choices[words[used]]
        used += 1
    return parser, used


def test_every_documented_command_line_uses_flags_the_parser_has() -> None:
    from scaleout.cli.main import build_parser

    parser = build_parser(None)
    commands = _commands()
    assert len(commands) > 20, commands  # the pages do show many
    unknown = []
    for page, command in commands:
        words = command.split()[1:]
        sub, used = _subparser(parser, words)
        assert used, f"{page}: {command!r} names no subcommand"
        options = set(sub._option_string_actions)
        for word in words[used:]:
            if words[0] == "run" and word.endswith(".py"):
                break  # the rest are the script's own arguments
            flag = word.strip("[]()|,").split("=")[0]
            if re.fullmatch(r"--?[a-z][a-z0-9-]*", flag) and flag not in options:
                unknown.append(f"{page}: {flag} in {command!r}")
    assert not unknown, "\n".join(unknown)


# -- defaults ------------------------------------------------------------------------------

def test_scheduler_defaults_are_the_documented_ones() -> None:
    from scaleout import SchedulerConfig

    table = dict(re.findall(r"^\| `(\w+_bytes)` \| (\d+) MB \|", _page("docs/scheduling.md"),
                            flags=re.M))
    assert set(table) == {"bucket_bytes", "first_bucket_bytes", "partition_bytes",
                          "credit_bytes", "urgent_bytes"}, table
    config = SchedulerConfig()
    for name, megabytes in table.items():
        assert getattr(config, name) == int(megabytes) * MB, name
    assert config.policy is None and config.channels is None


def test_tune_config_defaults_are_the_documented_ones() -> None:
    from scaleout.pytorch.tuning import TuneConfig

    text = _page("docs/tuning.md")
    config = TuneConfig()
    codecs = re.search(r"\(`codecs`, default ((?:`[^`]+`(?:,\s*)?)+)", text).group(1)
    assert config.codecs == tuple(re.findall(r"`([^`]+)`", codecs))
    for name in ("skip", "measure", "min_gain_exact", "min_gain_lossy"):
        stated = re.search(rf"`{name}=([\d.]+)`", text).group(1)
        assert getattr(config, name) == type(getattr(config, name))(stated), name
    assert config.verify == int(re.search(r"`TuneConfig.verify` iterations \(default (\d+)\)",
                                          text).group(1))
    within = re.search(r"`TuneConfig.runner_up_within` \(default (\d+)%\)", text).group(1)
    assert config.runner_up_within == pytest.approx(int(within) / 100)
    # "Tuning therefore takes `skip + measure + 1 + verify` iterations, 6 with the defaults"
    assert config.skip + config.measure + 1 + config.verify == 6


def test_compression_defaults_and_specs_are_the_documented_ones() -> None:
    from scaleout.compression import CompressionConfig, codec_spec, make_codec

    text = _page("docs/compression.md")
    assert CompressionConfig().min_numel == int(re.search(r"default (\d+)\)", text).group(1))
    listed = re.search(r"from spec strings by `make_codec`: (.*?)\. A\n", text, flags=re.S).group(1)
    specs = [s for s in re.findall(r'`"([^"`]+)"`', listed) if not s.startswith("…")]
    assert len(specs) >= 9, specs
    for spec in specs:  # each parses, and its spec string parses back to the same codec
        assert make_codec(codec_spec(make_codec(spec))) == make_codec(spec), spec
    for short, long in (("cast:bf16", "cast:dtype=bf16"), ("topk:0.01", "topk:ratio=0.01"),
                        ("powersgd:4", "powersgd:rank=4")):  # "A bare first value sets ..."
        assert make_codec(short) == make_codec(long)
    quant = make_codec("blockquant")
    assert (quant.block_size, quant.min_levels) == (256, 15)  # "the `min_levels` option (default 15)"
    assert 127 // 8 >= quant.min_levels > 127 // 9  # int8 up to 8 ranks, then int16
    with pytest.raises(ValueError, match="valid codecs: none, cast, blockquant"):
        make_codec("nope")


def test_codec_contract_signatures_are_the_documented_ones() -> None:
    """docs/compression.md, "The contract": the parameter lists it shows are the code's.
    (Until stop 52 it showed ``exchange(tensor, state, comm, group)`` and
    ``exchange_bucket(flat, shapes, state, comm, group)``: no ``group`` is passed.)"""
    from scaleout.compression import Codec, CodecState, compressed_allreduce

    text = _page("docs/compression.md")
    shown = {name: args for name, args in re.findall(
        r"^\| `((?:Codec\.\w+|compressed_allreduce))\(([^)]*)\)", text, flags=re.M)}
    code = {"Codec.encode": Codec.encode, "Codec.decode": Codec.decode,
            "Codec.exchange": Codec.exchange, "Codec.exchange_bucket": Codec.exchange_bucket,
            "compressed_allreduce": compressed_allreduce}
    assert set(shown) == set(code), shown
    for name, args in shown.items():
        params = [p for p in inspect.signature(code[name]).parameters if p != "self"]
        assert [a.strip().split("=")[0] for a in args.split(",") if a.strip() != "*"] \
            == params, name
    assert inspect.signature(CodecState.work_buffer).parameters["device"].default \
        is inspect.Parameter.empty  # "the device is required"


# -- pure docstring examples ---------------------------------------------------------------

def test_pure_docstring_examples_hold() -> None:
    from scaleout.core import grid
    from scaleout.pytorch import TableSpec, plan_tables
    from scaleout.scheduler import SchedulerConfig, plan

    checked = 0
    for fn in (grid.grid_groups, grid.Grid, plan.chunk_needs, plan.chunks_ready,
               plan.build_plan, plan.plan_and_policy, plan_tables):
        globs = {**vars(plan), **vars(grid), "SchedulerConfig": SchedulerConfig,
                 "TableSpec": TableSpec, "plan_tables": plan_tables}
        finder = doctest.DocTestFinder(recurse=False)
        for test in finder.find(fn, fn.__name__, globs=globs):
            result = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS).run(test)
            assert result.failed == 0, fn.__name__
            checked += result.attempted
    assert checked >= 8


# -- workloads -----------------------------------------------------------------------------

def test_workload_table_holds_for_the_small_workloads() -> None:
    from scaleout.workloads import get_workload, layer_sizes, workload_names

    rows = {m.group(1): m.groups() for m in re.finditer(
        r"^\| `([\w-]+)` \|[^|]*\|[^|]*\| (\d+)(?: sequences)? \| ([\d,]+) \| [\d.]+ MB \| (\d+) \|",
        _page("docs/workloads.md"), flags=re.M)}
    assert tuple(rows) == workload_names()
    for name in ("transformer", "dlrm", "digits-mlp", "digits-cnn"):  # seconds, not minutes
        _, batch, params, layers = rows[name]
        workload = get_workload(name)
        model = workload.build_model(seed=0)
        assert workload.default_batch_size == int(batch), name
        assert sum(p.numel() for p in model.parameters()) == int(params.replace(",", "")), name
        assert len(layer_sizes(model)) == int(layers), name
    with pytest.raises(ValueError, match="valid names: resnet18"):
        get_workload("nope")


# -- snippets in ranks ---------------------------------------------------------------------

def _snippets() -> dict:
    """README's "Using it" and core snippets, and the public docstrings' examples (2 ranks)."""
    import scaleout
    from scaleout import GroupType, ParameterSetSpec, Phase, ReduceOp, Session
    from scaleout.compression import CodecState, compressed_allreduce, make_codec
    from scaleout.pytorch import (ColumnParallelLinear, DataParallel, DistributedOptimizer,
                                  EmbeddingCollection, TableSpec, tensor_parallel)

    out = {}
    env = scaleout.init(timeout=30)
    out["rank"] = (env.rank, env.world_size)
    d = env.create_distribution(2, 1)  # Distribution's example
    out["allreduce"] = d.allreduce(torch.full((2,), float(env.rank)), group=GroupType.DATA).wait()
    d = env.create_distribution(data_parts=2, model_parts=1)  # README's core snippet
    out["sum"] = d.allreduce(torch.ones(2), ReduceOp.SUM, group=GroupType.DATA).wait()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))  # README's "Using it"
    model = DataParallel(net, env.create_distribution())
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), model)
    for step in range(3):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * step + env.rank))
        nn.functional.cross_entropy(model(x), torch.zeros(5, dtype=torch.long)).backward()
        opt.step()
        opt.zero_grad()
    model.synchronize()
    out["weight"] = net[0].weight.detach().clone()
    model.close()
    grid = env.create_distribution(1, 2)  # the tensor-parallel and embedding examples
    out["column"] = tuple(ColumnParallelLinear(16, 8, distribution=grid)(torch.randn(5, 16)).shape)
    out["tp"] = tuple(tensor_parallel(nn.Sequential(nn.Linear(8, 32), nn.ReLU(),
                                                    nn.Linear(32, 8)), grid)[0].weight.shape)
    tables = EmbeddingCollection([TableSpec(rows=r, dim=8) for r in (9, 5, 4, 2)], grid)
    out["tables"] = tuple(tables(torch.zeros(6, 4, dtype=torch.long)).shape)
    session = Session(env, Phase.TRAIN)  # Session's example
    session.set_global_minibatch_size(64)
    op = session.add_operation("fc1", d, parameter_sets=[ParameterSetSpec(count=4096)])
    session.commit()
    ps = op.parameter_sets[0]
    ps.start_gradient_comm(torch.full((4096,), float(env.rank)))
    out["average"] = ps.wait_gradient_comm()[:2].clone()
    session.statistics.end_iteration()
    session.close()
    # docs/compression.md: integer tensors go with `none` only, every other codec refuses
    refused = {}
    for spec in ("cast:fp16", "blockquant", "sign", "topk", "powersgd", "rows"):
        try:
            compressed_allreduce(make_codec(spec), torch.ones(20, 30, dtype=torch.int64),
                                 CodecState(), d, group=GroupType.DATA, average=False).wait(10)
        except TypeError:
            refused[spec] = True
    out["int_refused"] = refused
    out["int_none"] = compressed_allreduce(make_codec("none"), torch.ones(3, dtype=torch.int64),
                                           CodecState(), d, group=GroupType.DATA,
                                           average=False).wait(10)
    # docs/scheduling.md: max_norm and scale_grad_by_freq are refused across 2 ranks
    for option in ({"max_norm": 1.0}, {"scale_grad_by_freq": True}):
        try:
            DataParallel(nn.Sequential(nn.Embedding(10, 4, **option), nn.Linear(4, 2))).close()
            out[next(iter(option))] = "accepted"
        except ValueError:
            out[next(iter(option))] = "ValueError"
    env.finalize()
    return out


def test_readme_and_docstring_snippets_run_at_two_ranks() -> None:
    results = run_ranks(2, _snippets, timeout=90)
    for rank, out in enumerate(results):
        assert out["rank"] == (rank, 2)
        assert torch.equal(out["allreduce"], torch.tensor([1.0, 1.0]))
        assert torch.equal(out["sum"], torch.tensor([2.0, 2.0]))
        assert out["column"] == (5, 4) and out["tp"] == (16, 8) and out["tables"] == (6, 4, 8)
        assert torch.equal(out["average"], torch.tensor([0.5, 0.5]))
        assert out["int_refused"] == dict.fromkeys(
            ("cast:fp16", "blockquant", "sign", "topk", "powersgd", "rows"), True)
        assert torch.equal(out["int_none"], torch.full((3,), 2, dtype=torch.int64))
        assert out["max_norm"] == out["scale_grad_by_freq"] == "ValueError"
    assert torch.equal(results[0]["weight"], results[1]["weight"])  # replicas agree


def _refusals() -> dict:
    """What the pages say is refused, at one rank."""
    import os

    import scaleout
    from scaleout.pytorch import DataParallel, DistributedOptimizer

    def outcome(fn) -> str:
        try:
            fn()
        except (TypeError, ValueError, RuntimeError) as err:
            return type(err).__name__
        return "accepted"

    def lbfgs(**options) -> None:
        net = nn.Linear(4, 2)
        model = DataParallel(net, **options)
        try:
            DistributedOptimizer(torch.optim.LBFGS(net.parameters()), model)
        finally:
            model.close()

    def scaler() -> None:
        net = nn.Linear(4, 2)
        model = DataParallel(net)
        opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model)
        grad_scaler = torch.amp.GradScaler("cpu")
        grad_scaler.scale(model(torch.randn(3, 4)).sum()).backward()
        try:
            grad_scaler.step(opt)
        finally:
            model.close()

    def lookup_rows() -> None:
        os.environ["SCALEOUT_LOOKUP_ROWS"] = "2"
        model = DataParallel(nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2)))
        try:
            model(torch.tensor([1, 2])).sum().backward()
        finally:
            del os.environ["SCALEOUT_LOOKUP_ROWS"]
            model.close()

    env = scaleout.init(timeout=30)
    out = {
        "lbfgs overlap": outcome(lbfgs),
        "lbfgs sharded": outcome(lambda: lbfgs(distributed_update=True)),
        "GradScaler overlap": outcome(scaler),
        "sparse embedding": outcome(lambda: DataParallel(
            nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))).close()),
        "max_norm alone": outcome(lambda: DataParallel(
            nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Linear(4, 2))).close()),
        "lossy sharded": outcome(lambda: DataParallel(
            nn.Linear(64, 64), distributed_update=True, compression="blockquant").close()),
        "glob naming nothing": outcome(lambda: DataParallel(
            nn.Sequential(nn.Linear(64, 64)), compression={"encoder": "blockquant"}).close()),
        "tune with compression": outcome(lambda: DataParallel(
            nn.Linear(4, 4), tune=True, compression="blockquant").close()),
        "tune sharded": outcome(lambda: DataParallel(
            nn.Linear(4, 4), tune=True, distributed_update=True).close()),
        "SCALEOUT_LOOKUP_ROWS=2": outcome(lookup_rows),
    }
    env.finalize()
    return out


def test_documented_refusals_are_refused() -> None:
    assert run_ranks(1, _refusals, timeout=60)[0] == {
        "lbfgs overlap": "ValueError",           # docs/scheduling.md, "What overlap mode refuses"
        "lbfgs sharded": "ValueError",           # "LBFGS (a closure) is refused too"
        "GradScaler overlap": "ValueError",      # "a ValueError at scaler.step"
        "sparse embedding": "TypeError",         # "a TypeError at any rank count"
        "max_norm alone": "accepted",            # refused "across 2 or more" ranks only
        "lossy sharded": "ValueError",           # "a ValueError at DataParallel()"
        "glob naming nothing": "ValueError",     # docs/compression.md
        "tune with compression": "ValueError",   # docs/tuning.md, "Where it stops"
        "tune sharded": "ValueError",
        "SCALEOUT_LOOKUP_ROWS=2": "ValueError",  # "another value is a ValueError"
    }


def test_tuning_options_in_the_example_are_accepted() -> None:
    from scaleout.pytorch.tuning import TuneConfig

    assert dataclasses.is_dataclass(TuneConfig)
    with pytest.raises(ValueError, match="skip must be an int >= 1"):
        TuneConfig(skip=0)  # "at least 1: the first builds the plan"
