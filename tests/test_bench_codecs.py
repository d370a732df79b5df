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


def test_bench_codecs_rejects_bad_input(capsys) -> None:
    assert main(["bench", "codecs", "--sizes", "lots"]) == 2
    assert "error" in capsys.readouterr().err
