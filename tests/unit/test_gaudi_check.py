"""scripts/gaudi_check.py on a machine without a Gaudi, in this process: the plan fits the deadline, its probes are the
hpu-marked tests (which exist and are skipped here with their reason), its training run parses, --dry-run prints the
plan, and the check says in one line that there is nothing to check."""
from __future__ import annotations

import sys

from megatron.arguments import parse_config
from tests.support.config import REPO

sys.path.insert(0, str(REPO / "scripts"))
import gaudi_check  # noqa: E402


def test_the_plan_fits_its_deadline_and_its_commands_hold():
    stages = gaudi_check.plan()
    assert sum(s["limit"] for s in stages) <= gaudi_check.DEADLINE_S - 10 and gaudi_check.DEADLINE_S < 300
    probes, train = stages
    assert probes["cmd"][-1].endswith("tests/unit/test_gaudi.py") and "hpu" in probes["cmd"]
    argv = train["cmd"][train["cmd"].index(str(REPO / "pretrain_gpt.py")) + 1:]
    i = argv.index("--device")
    assert argv[i + 1] == "hpu"
    config = parse_config(argv[:i] + argv[i + 2:], world_size=1, env={})  # no hpu device here to resolve
    assert config.fp8 is not None and config.fp8.backend.value == "hpu" and config.optimizer.optimizer == "fp8adam"


def test_dry_run_and_no_gaudi(capsys):
    assert gaudi_check.main(["--dry-run"]) == 0
    plan = capsys.readouterr().out
    assert "probes: limit" in plan and "train_1: limit" in plan
    assert gaudi_check.main([]) == 2
    assert capsys.readouterr().out.strip() == ("gaudi_check: no Gaudi here (habana_frameworks and an hpu device); "
                                               "nothing to check")
