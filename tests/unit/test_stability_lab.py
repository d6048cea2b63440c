"""The stability lab (tools/stability_lab.py) in this process: the BF16 verdict, bad input refused before any run,
chains of runs under --jobs, reports merged from several summaries, which finished runs a rerun reuses."""
from __future__ import annotations

import json

import pytest
import torch

from megatron.stability import presets
from tests.support.config import load_tool

stability_lab = load_tool("stability_lab")


def test_bf16_verdict_uses_the_seed_spread():
    control = [5.00, 5.02, 4.98]  # sample std 0.02
    assert presets.bf16_holds(control, [5.03, 5.05, 5.01])["holds"] is True  # +0.03 <= 2 x 0.02
    assert presets.bf16_holds(control, [5.10, 5.12, 5.08])["holds"] is False  # +0.10 > 0.04
    assert presets.bf16_holds(control, [5.01, None, 4.99])["holds"] is None  # a died run: not all pairs
    assert presets.bf16_holds([5.0], [5.5])["holds"] is None  # one seed: no spread, no verdict
    assert presets.bf16_holds([5.0, 5.1], [None, None])["holds"] is False


@pytest.mark.parametrize("argv, needle", [
    (["--variants", "fp9"], "--variants"),
    (["--seeds", ""], "--seeds"),
    (["--inject-c", "0"], "--inject-c"),
    (["--quick", "--preset", "natural"], "--quick"),
])
def test_bad_input_is_one_clear_line(argv, needle, tmp_path, capsys):
    assert stability_lab.main([*argv, "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err
    assert not list(tmp_path.iterdir())  # rejected before any run


def test_jobs_run_every_chain_in_order_and_reraise():
    seen: list[str] = []
    chains = [lambda k=k: [seen.append(f"{k}{i}") for i in range(3)] for k in "abcd"]
    presets.run_chains(chains, jobs=2)
    assert sorted(seen) == sorted(f"{k}{i}" for k in "abcd" for i in range(3))
    for k in "abcd":  # each chain's runs stay in order (a resume needs its base run)
        assert [x for x in seen if x[0] == k] == [f"{k}0", f"{k}1", f"{k}2"]

    def boom() -> None:
        raise RuntimeError("chain failed")
    with pytest.raises(RuntimeError, match="chain failed"):
        presets.run_chains([chains[0], boom], jobs=2)


def _fake_demo_summary(losses: dict[tuple[str, int], tuple[float, float]], iters: int = 200) -> dict:
    runs = {f"{c}_s{s}": {"config": c, "seed": s, "summary": {"final_valid_loss": v, "test_loss": t}}
            for (c, s), (v, t) in losses.items()}
    return {"preset": "ablation", "iters": iters, "runs": runs, "table": presets.simple_table(runs)}


def test_report_merges_split_invocations_and_pairs_by_seed(tmp_path, capsys):
    a = _fake_demo_summary({("bf16", 1): (5.0, 5.5), ("bf16", 2): (5.2, 5.6), ("fp8", 1): (5.1, 5.4),
                            ("fp8", 2): (5.25, 5.7)})
    b = _fake_demo_summary({("bf16", 3): (4.9, 5.3), ("fp8", 3): (4.85, 5.35)})
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, summary in zip(paths, (a, b)):
        path.write_text(json.dumps(summary))
    assert stability_lab.main(["--report", *map(str, paths)]) == 0
    text = capsys.readouterr().out
    bf16 = torch.tensor([5.0, 5.2, 4.9], dtype=torch.float64)
    fp8 = torch.tensor([5.1, 5.25, 4.85], dtype=torch.float64)
    diff = fp8 - bf16  # +0.1, +0.05, -0.05: paired by seed (same initialisation and tokens)
    assert f"| bf16 | {bf16.mean():.4f} +- {bf16.std():.4f} (n=3) |" in text
    assert f"{diff.mean():.4f} +- {diff.std():.4f} (n=3)" in text
    test_diff = torch.tensor([5.4 - 5.5, 5.7 - 5.6, 5.35 - 5.3], dtype=torch.float64)
    assert f"{test_diff.mean():.4f} +- {test_diff.std():.4f} (n=3) |" in text
    # The same run in two summaries, or summaries of different lengths, do not merge: one line each.
    for other in (a, _fake_demo_summary({("bf16", 3): (4.9, 5.3)}, iters=400)):
        paths[1].write_text(json.dumps(other))
        assert stability_lab.main(["--report", *map(str, paths)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "--report" in err and "Traceback" not in err


def test_a_rerun_reuses_only_runs_finished_with_the_same_command(tmp_path):
    from megatron.stability.runs import command_text
    from megatron.checkpoint.store import TRACKER_FILE

    run = tmp_path / "bf16_s1"
    flags = ["--train-iters", "20", "--test-data-path", "x", "--save", str(run / "ckpt")]
    assert not presets.completed_run(run, flags, 1)  # nothing there
    (run / "ckpt").mkdir(parents=True)
    (run / "command.txt").write_text(command_text(flags, 1) + "\n")
    (run / "ckpt" / TRACKER_FILE).write_text("20")
    (run / "train.log").write_text("saved checkpoint at iteration 20\n")
    assert not presets.completed_run(run, flags, 1)  # killed between the last save and the test evaluation
    (run / "train.log").write_text("saved ...\n test loss at iteration 20 | lm loss value: 5.0 |\n")
    assert presets.completed_run(run, flags, 1)
    assert not presets.completed_run(run, flags, 2)  # another thread count is another command
    assert not presets.completed_run(run, ["--train-iters", "40", *flags[2:]], 1)
    (run / "ckpt" / TRACKER_FILE).write_text("10")
    assert not presets.completed_run(run, flags, 1)  # stopped early
