"""The stability lab (tools/stability_lab.py) end to end: `--quick`, the injection, the reports of its summary,
and the dry runs (which prepare the demo corpus with tools/prepare_demo_data.py where it is missing).

`--quick` runs four ordinary `pretrain_gpt.py` runs of the tiny model (BF16 and FP8, each a base run and a
resume from a checkpoint injected with w1 = +-64 w2 in two channels per layer), once for the module.
"""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.stability.inject import channel_cosines
from tests.support.config import REPO, load_tool

stability_lab = load_tool("stability_lab")
VOCAB = 4096  # the demo tokenizer's size (tools/prepare_demo_data.py)


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("lab")
    proc = subprocess.run([sys.executable, "tools/stability_lab.py", "--quick", "--output-dir", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads((out / "summary.json").read_text())


def test_quick_writes_summary_and_plots(quick):
    out, summary = quick
    assert summary["c_star"] == 64 and summary["c_star_unjudged"] is True  # one seed: no spread, no verdict
    assert set(summary["runs"]) == {"bf16_c64_s1", "fp8_c64_s1"}
    assert all(e["returncode"] == 0 for e in summary["runs"].values())
    assert len(summary["plots"]) >= 3
    for plot in summary["plots"]:
        data = Path(plot).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000, plot
        assert Path(plot).parent == out


def test_every_run_is_a_recorded_cli_run_with_the_guard_off(quick):
    out, summary = quick
    assert len(summary["commands"]) == 4  # two bases, two resumes
    for rec in summary["commands"]:
        assert "pretrain_gpt.py" in rec["command"] and "--no-divergence-guard" in rec["command"]
        assert (Path(rec["run_dir"]) / "command.txt").read_text().strip() == rec["command"]
    for name in summary["runs"]:  # the resolved config each run saved says the guard was off
        ckpt = out / "runs" / name / "ckpt"
        configs = list(ckpt.glob("iter_*/config.json"))
        assert configs and all(json.loads(c.read_text())["divergence"]["enabled"] is False for c in configs)


def test_injection_set_the_chosen_channels_to_plus_minus_one(quick):
    out, summary = quick
    for name, entry in summary["runs"].items():
        inj = entry["injection"]
        assert inj["iteration"] == summary["base_iters"]
        for layer, rec in inj["layers"].items():
            assert len(rec["channels"]) == summary["channels"] == 2
            assert rec["signs"] == [1.0, -1.0]
            # c = 64 is a power of two: up = +-64 gate is exact in fp32, so the cosine is +-1 to float64 rounding.
            for sign, before, after in zip(rec["signs"], rec["cos_before"], rec["cos_after"]):
                assert after == pytest.approx(sign, abs=1e-12)
                assert abs(before) < 0.999  # the edit changed something
            # The chosen channels were the most aligned ones before the edit (checked against the base run).
            base = out / "base" / name.replace("_c64", "") / "ckpt"
            state = torch.load(next(base.glob("iter_*/mp_rank_00/model_optim_rng.pt")), weights_only=True)
            cos = channel_cosines(state["model"][f"decoder.layers.{layer}.mlp.linear_fc1.weight"]).abs()
            assert sorted(rec["channels"]) == sorted(torch.topk(cos, 2).indices.tolist())
        # The resumed run starts from the edited weights: its first top-k point holds the two +-1 channels.
        first = entry["topk_alignment"][str(summary["base_iters"])]
        assert all(layer[:2] == pytest.approx([1.0, 1.0], abs=1e-12) for layer in first)
        # ...and the run's own diagnostics saw it: the logged align_max right after the injection is near 1.
        for layer in entry["per_layer"].values():
            after = [a for s, a in zip(layer["steps"], layer["align_max"]) if s > summary["base_iters"]]
            assert after[0] > 0.9


def test_numbers_are_sane_and_bf16_and_fp8_differ(quick):
    _, summary = quick
    bf16, fp8 = summary["runs"]["bf16_c64_s1"], summary["runs"]["fp8_c64_s1"]
    for entry in (bf16, fp8):
        steps, loss = entry["loss"]
        assert steps == sorted(steps) and steps[-1] == summary["base_iters"] + summary["resume_iters"]
        assert all(math.isfinite(x) and 0 < x < math.log(VOCAB) + 2 for x in loss)
        assert loss[-1] < loss[0]  # it learns
        s = entry["summary"]
        assert s["final_valid_loss"] is not None and math.isfinite(s["final_valid_loss"])
    assert bf16["summary"]["max_fp8_clipped_frac"] is None  # no FP8 statistics in a BF16 run
    clip = fp8["summary"]["max_fp8_clipped_frac"]
    assert clip is not None and 0 <= clip <= 1
    assert any("mlp.linear_fc2/input" in k for k in fp8["summary"]["fp8_tensors"])
    assert "fc2_input_fp8_amax" in fp8["per_layer"]["0"] and "fc2_input_fp8_amax" not in bf16["per_layer"]["0"]
    # Same seed, same tokens, different arithmetic: the loss curves must not be identical.
    assert bf16["loss"][0] == fp8["loss"][0] and bf16["loss"][1] != fp8["loss"][1]


def test_report_prints_the_markdown_tables(quick, capsys):
    out, summary = quick
    assert stability_lab.main(["--report", str(out / "summary.json")]) == 0
    text = capsys.readouterr().out
    assert "c* = 64 (not judged: one seed)" in text
    bf16 = summary["table"]["bf16/c64"]["final_valid_loss"]["mean"]
    assert f"| bf16/c64 | {bf16:.4f} (n=1) |" in text and "| fp8/c64 |" in text
    assert stability_lab.main(["--report", str(out / "missing.json")]) == 2


def test_reanalyze_reproduces_the_summary_from_the_run_folders(quick, tmp_path):
    out, summary = quick
    copy = tmp_path / "lab"
    shutil.copytree(out, copy)
    # Run folders are recorded with absolute paths; point them at the copy.
    text = (copy / "summary.json").read_text().replace(str(out), str(copy))
    (copy / "summary.json").write_text(text)
    assert stability_lab.main(["--reanalyze", "--output-dir", str(copy)]) == 0
    again = json.loads((copy / "summary.json").read_text())
    assert again["table"] == summary["table"] and again["wall_s"] == summary["wall_s"]
    assert "reanalyzed" in again


@pytest.mark.parametrize("controls, expected", [(True, 6), (False, 5)])
def test_dry_run_prints_every_command_and_fp8_controls_flag_works(controls, expected, tmp_path, capsys):
    flag = "--fp8-controls" if controls else "--no-fp8-controls"
    assert stability_lab.main(["--dry-run", "--seeds", "1", "--inject-c", "8", "--variants", "bf16,fp8", flag,
                               "--output-dir", str(tmp_path)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[lab] ") and "pretrain_gpt.py" in ln]
    assert len(lines) == expected  # base bf16, bf16 control, bf16 c8, base fp8, (fp8 control,) fp8 c8
    assert all("--no-divergence-guard" in ln for ln in lines)
    assert sum("--fp8-format hybrid" in ln for ln in lines) == expected - 3


def test_recipes_dry_run_uses_the_demo_run_and_no_bf16_skips_bf16(tmp_path, capsys):
    argv = ["--preset", "recipes", "--recipes", "blockwise,mxfp8", "--iters", "60", "--seeds", "1,2",
            "--recipe-seeds", "1", "--dry-run", "--output-dir", str(tmp_path)]
    assert stability_lab.main(argv) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "pretrain_gpt.py" in ln]
    assert len(lines) == 4  # BF16 seeds 1 and 2, each recipe seed 1
    assert sum("--fp8-recipe blockwise" in ln for ln in lines) == 1 and "--hidden-size 256" in lines[0]
    assert stability_lab.main(argv + ["--no-bf16"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "pretrain_gpt.py" in ln]
    assert len(lines) == 2 and all("--fp8-recipe" in ln for ln in lines)


@pytest.mark.parametrize("preset", ["inject", "ablation"])
def test_jobs_and_torch_compile_change_no_command(preset, tmp_path, capsys):
    """--jobs runs the same commands (recorded in the same order); --torch-compile reaches every run."""
    argv = ["--preset", preset, "--seeds", "1,2", "--inject-c", "8,64", "--iters", "20", "--dry-run"]
    recorded = []
    for jobs in (1, 2):
        out = tmp_path / f"j{jobs}"
        assert stability_lab.main([*argv, "--jobs", str(jobs), "--output-dir", str(out)]) == 0
        summary = json.loads((out / "summary.json").read_text())
        recorded.append([c["command"].replace(str(out), "OUT") for c in summary["commands"]])
    assert recorded[0] == recorded[1] and len(recorded[0]) >= 10
    assert all("--torch-compile auto" in c for c in recorded[0])  # the CLI's default, stated in every command
    capsys.readouterr()
    assert stability_lab.main([*argv, "--torch-compile", "on", "--output-dir", str(tmp_path / "on")]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "pretrain_gpt.py" in ln]
    assert lines and all("--torch-compile on" in ln for ln in lines)
    assert stability_lab.main([*argv, "--jobs", "0", "--output-dir", str(tmp_path / "bad")]) == 2
    assert "--jobs must be >= 1" in capsys.readouterr().err


def test_diagnostics_warn_at_the_first_log_point_after_the_injection(quick):
    """The SwiGLU jump history travels in the checkpoint: the resumed run judges its first log point (base 8,
    log interval 2: iteration 10) against the base run's series, so the injected outlier is warned at once."""
    _, summary = quick
    for row in ("bf16/c64", "fp8/c64"):
        assert summary["table"][row]["first_warning"] == [10], row
