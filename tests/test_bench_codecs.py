"""``scaleout bench codecs``: a smoke run at small sizes on the CPU, and its helpers."""

from __future__ import annotations

import json

import pytest

from scaleout.bench.codecs import CodecBenchConfig, matrix_shape
from scaleout.cli.bench_codecs import split_codecs
from scaleout.cli.main import main


def test_bench_codecs_smoke(tmp_path, capsys) -> None:
    out = tmp_path / "codecs.json"
    code = main(["bench", "codecs", "--device", "cpu", "--sizes", "4K,6000", "--repeats", "2",
                 "--warmup", "1", "--json", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    assert "fp16_compress_hook" in table and "powerSGD_hook(rank=4)" in table
    report = json.loads(out.read_text())
    rows = report["results"]
    assert {r["codec"] for r in rows} >= {"cast:fp16", "powersgd:rank=4", "topk:ratio=0.01", "rows"}
    assert [r["numel"] for r in rows[:1]] == [4096] and rows[-1]["shape"] == [75, 80]
    for row in rows:
        assert "error" not in row, row
        assert row["encode_decode_s"] > 0 and row["exchange_s"] > 0 and row["copy_s"] > 0
        assert row["encode_decode_x_copy"] == pytest.approx(row["encode_decode_s"] / row["copy_s"])
    powersgd = next(r for r in rows if r["codec"] == "powersgd:rank=4")
    assert powersgd["ours_over_torch"] == pytest.approx(powersgd["exchange_s"] / powersgd["torch_s"])
    # the exchange ran on two ranks (a peer process): bytes went over the wire
    assert report["exchange_ranks"] == 2 and report["exchange_alone"] is None
    assert "exchanges on 2 ranks (gloo)" in table
    cast = next(r for r in rows if r["codec"] == "cast:fp16" and r["numel"] == 4096)
    assert cast["dense_bytes"] == 4 * 4096 and cast["payload_bytes"] == 2 * 4096
    assert cast["wire_ratio"] == pytest.approx(2.0)
    assert next(r for r in rows if r["codec"] == "none")["wire_ratio"] == pytest.approx(1.0)
    # what reproducing it takes
    assert report["date"] and report["machine"]["cpus"] >= 1 and "cpu_model" in report["machine"]
    assert report["source"]["path"].endswith("scaleout") and report["scaleout_env"] == {}


def test_bench_codecs_alone_says_so(tmp_path, capsys) -> None:
    """At world size 1 nothing moves and scaleout's cast codec returns before casting: the
    figure is labelled, and it has no wire ratio."""
    out = tmp_path / "codecs.json"
    assert main(["bench", "codecs", "--sizes", "4K", "--codecs", "cast:fp16", "--repeats", "1",
                 "--warmup", "0", "--ranks", "1", "--json", str(out)]) == 0
    assert "exchanges at WORLD SIZE 1 (asked)" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["exchange_ranks"] == 1 and report["exchange_alone"] == "asked"
    (row,) = report["results"]
    assert row["wire_ratio"] is None and row["wire_bytes"] == 0


def test_split_codecs_keeps_options_with_their_codec() -> None:
    assert split_codecs("cast:fp16,topk:ratio=0.01,momentum=0.9,sign") == (
        "cast:fp16", "topk:ratio=0.01,momentum=0.9", "sign")
    assert split_codecs("powersgd:rank=2; rows") == ("powersgd:rank=2", "rows")


def test_matrix_shape_and_config_validation() -> None:
    assert matrix_shape(26214400) == (5120, 5120) and matrix_shape(7) == (1, 7)
    with pytest.raises(ValueError, match="device"):
        CodecBenchConfig(device="tpu")
    with pytest.raises(ValueError, match="unknown codec"):
        CodecBenchConfig(codecs=("zip",))
    with pytest.raises(ValueError, match="sizes"):
        CodecBenchConfig(sizes=(0,))
    with pytest.raises(ValueError, match="ranks: expected 1 or 2"):
        CodecBenchConfig(ranks=3)


def test_bench_codecs_rejects_bad_input(capsys) -> None:
    assert main(["bench", "codecs", "--sizes", "lots"]) == 2
    assert "error" in capsys.readouterr().err
