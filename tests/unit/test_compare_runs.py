"""tools/compare_runs.py on two tiny runs: an FP32 baseline and an FP8 run with statistics."""
from __future__ import annotations

import json

import numpy as np
import pytest

from megatron.arguments import parse_config
from megatron.evaluation.run_compare import compare, relative_gap
from megatron.training.loop import pretrain
from tests.support.config import load_tool, tiny_argv

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _tool():
    return load_tool("compare_runs").main


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    common = dict(train_iters=10, log_interval=2, eval_interval=5, eval_iters=1)
    base = pretrain(parse_config(tiny_argv(tensorboard_dir=str(root / "baseline"), **common)))
    fp8 = pretrain(parse_config(tiny_argv("--fp8-format", "hybrid", "--fp8-backend", "emulated", "--log-fp8-stats",
                                          tensorboard_dir=str(root / "fp8"), **common)))
    return root, base, fp8


def test_table_json_and_plots(two_runs, tmp_path, capsys):
    root, base, fp8 = two_runs
    out_dir = tmp_path / "plots"
    runs = _tool()([str(root / "baseline"), str(root / "fp8"), "--output-dir", str(out_dir),
                    "--json", str(tmp_path / "summary.json")])
    printed = capsys.readouterr().out
    assert "baseline" in printed and "fp8" in printed and "final valid" in printed
    by_name = {r.name: r for r in runs}
    assert by_name["baseline"].final_valid == pytest.approx(base.valid[-1][1], rel=1e-6)
    assert by_name["baseline"].best_valid == pytest.approx(min(v for _, v in base.valid), rel=1e-6)
    # TensorBoard stores scalars in float32: each loss read back carries a relative rounding of up to 2^-24, so
    # the gap (a ratio of two of them, minus 1) is exact to (1 + gap) * 2^-23, whatever its own size.
    gap = (fp8.valid[-1][1] - base.valid[-1][1]) / base.valid[-1][1]
    assert by_name["fp8"].valid_gap == pytest.approx(gap, rel=0, abs=(1 + abs(gap)) * 2.0**-23)
    assert by_name["baseline"].tokens == 10 * 8 * 32 and by_name["baseline"].skipped == 0
    assert by_name["baseline"].worst_fp8_clip is None
    assert by_name["fp8"].worst_fp8_clip is not None and 0.0 <= by_name["fp8"].worst_fp8_clip[1] <= 1.0
    assert by_name["baseline"].peak_memory_mib > 0 and by_name["baseline"].tokens_per_sec > 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [row["run"] for row in summary] == ["baseline", "fp8"] and summary[0]["valid_gap_vs_first"] == 0.0
    for name in ("loss_vs_tokens.png", "relative_gap_vs_tokens.png", "fp8_clipping.png", "fp8_amax.png"):
        data = (out_dir / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 1000, name


def test_relative_gap_interpolates_inside_the_overlap():
    ref = (np.array([0, 100, 200]), np.array([4.0, 3.0, 2.0]))
    run = (np.array([50, 150, 250]), np.array([3.5 * 1.1, 2.5 * 0.9, 1.0]))
    x, gap = relative_gap(run, ref)
    assert x.tolist() == [50, 150]  # 250 lies outside the reference's tokens
    assert gap == pytest.approx([0.1, -0.1])


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="--tensorboard-dir"):
        compare([str(tmp_path / "missing")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no TensorBoard scalars"):
        compare([str(tmp_path / "empty")])


def test_a_folder_several_runs_wrote_is_warned_about_and_a_resumed_run_is_not(tmp_path, caplog):
    import logging

    from torch.utils.tensorboard import SummaryWriter

    from megatron.evaluation.run_compare import read_scalars

    def write(folder, steps, suffix):
        w = SummaryWriter(str(folder), filename_suffix=suffix)
        for step in steps:
            w.add_scalar("lm-loss-training/lm loss vs tokens", 1.0 / step, step)
        w.close()

    write(tmp_path / "resumed", range(1, 11), ".a")
    write(tmp_path / "resumed", range(9, 21), ".b")  # from the checkpoint at step 8
    write(tmp_path / "two", range(1, 11), ".a")
    write(tmp_path / "two", range(1, 11), ".b")  # a second run from scratch
    with caplog.at_level(logging.WARNING):
        read_scalars(str(tmp_path / "resumed"))
        assert not caplog.records
        read_scalars(str(tmp_path / "two"))
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / 'two'}: 2 event files each start at step 1, so more than one run wrote this folder and their "
        "scalars are merged (a later file's value wins at each step): give each run its own --tensorboard-dir"]
