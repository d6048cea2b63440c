"""The soak: one 2-rank FP8 run under `torchrun --max-restarts` meets 10 faults of every kind at seeded random
iterations (a dead rank, a hung rank, a rank stuck outside the collectives, a bit flipped in and a truncation of the
newest checkpoint followed by a crash, a full disk during a save). It finishes, and its final checkpoint (weights,
Fp8AdamW's FP8 moments, FP8 scaling and RNG state) is bitwise that of the same run without faults. Slow (about 3-4
minutes on 2 cores): `MEGATRON_SLOW_TESTS=1 python -m pytest tests/e2e/test_fault_soak.py` (docs/reliability.md);
MEGATRON_SOAK_SEED picks another plan."""
from __future__ import annotations

import json
import os
import random
import re
import subprocess

import pytest

from tests.support.config import REPO, tiny_argv
from tests.support.launch import launch_checked, torchrun_command
from tests.support.training import bitwise_differences, checkpoint_tensors

pytestmark = pytest.mark.slow

KINDS = ("kill", "stop", "stall", "bitflip", "truncate", "enospc")
FAULTS = 10
ITERS = 3 * FAULTS + 4
RUN = dict(save_interval=2, train_iters=ITERS, micro_batch_size=2, global_batch_size=8, eval_iters=0,
           eval_interval=1000, log_interval=1, distributed_timeout_minutes=0.15)
SWITCHES = ("--fp8-format", "hybrid", "--optimizer", "fp8adam", "--no-fp8-optimizer-compile",
            "--exit-on-stall-seconds", "4", "--keep-last-n-checkpoints", "3")
RESTARTS = {"kill", "stop", "stall", "bitflip", "truncate"}  # the faults that end the attempt
# what the log shows for each kind of fault
EVIDENCE = {"kill": "stopped answering", "stop": "stopped answering", "stall": "no iteration finished for",
            "bitflip": "fails its checksum", "truncate": "is truncated or overwritten",
            "enospc": "checkpoint not saved"}


def plan(seed: int) -> list[dict]:
    rng = random.Random(seed)
    kinds = list(KINDS) + [rng.choice(KINDS) for _ in range(FAULTS - len(KINDS))]
    rng.shuffle(kinds)
    # a full disk on rank 0, which writes the torch engine's checkpoint file; the rest on either rank
    return [{"kind": kind, "rank": 0 if kind == "enospc" else rng.randrange(2), "iteration": 3 + 3 * k}
            for k, kind in enumerate(kinds)]


def test_ten_random_faults_in_one_run_cost_nothing_in_the_end(tmp_path):
    seed = int(os.environ.get("MEGATRON_SOAK_SEED", "2026"))
    faults = plan(seed)
    markers = tmp_path / "markers"
    markers.mkdir()
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps({"dir": str(markers), "faults": faults}))
    soak, clean = tmp_path / "soak", tmp_path / "clean"
    argv = tiny_argv(*SWITCHES, **RUN)
    cmd = torchrun_command(2, "--max-restarts", str(FAULTS + 2), "tests/support/fault_plan.py", str(plan_file), "--",
                           *argv, "--save", str(soak), "--load", str(soak))
    out = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    log = out.stdout
    assert out.returncode == 0, f"seed {seed}, plan {faults}\n{log[-5000:]}"
    fired = sorted(p.name for p in markers.iterdir())
    assert len(fired) == FAULTS, (fired, faults)
    for kind in {f["kind"] for f in faults}:
        assert EVIDENCE[kind] in log, (kind, log[-5000:])
    # What each fault cost: a dead, hung or stuck rank resumes from the newest checkpoint saved before it; a damaged
    # newest checkpoint from the one saved before that (a save lost to the full disk leaves a longer gap).
    events = re.findall(r"fault \d+: (\w+) on rank (\d) after iteration (\d+)|loaded checkpoint \S+ at iteration "
                        r"(\d+)|saved checkpoint at iteration (\d+)", log)
    saved: list[int] = []
    costs = []
    for i, (kind, rank, after, _, save) in enumerate(events):
        if save:
            saved = sorted({*(x for x in saved if x < int(save)), int(save)})  # a re-save replaces the later ones
        elif kind in RESTARTS:
            resumed = next(int(e[3]) for e in events[i + 1:] if e[3])
            before = [x for x in saved if x <= int(after)]
            expected = before[-2] if kind in ("bitflip", "truncate") else before[-1]
            costs.append((kind, int(rank), int(after), resumed, expected))
    print("\n".join(f"{kind:8s} rank {rank} after iteration {after:2d}: resumed from {resumed} "
                     f"({after - resumed} iterations redone)" for kind, rank, after, resumed, _ in costs))
    assert len(costs) == sum(f["kind"] in RESTARTS for f in faults)
    assert all(resumed == expected for *_, resumed, expected in costs), costs
    launch_checked(2, [*argv, "--save", str(clean), "--load", str(clean)], stdout_tail=0, stderr_tail=3000)
    different = bitwise_differences(checkpoint_tensors(soak, ITERS), checkpoint_tensors(clean, ITERS))
    assert not different, (seed, different[:10])
