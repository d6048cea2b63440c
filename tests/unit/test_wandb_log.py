"""--wandb-project / --wandb-exp-name / --wandb-save-dir: rank 0 logs the TensorBoard scalars by iteration under
Megatron's tags; without credentials the run is offline, and its files hold the logged values."""
import importlib.util

import pytest

from megatron.arguments import parse_config
from megatron.training import wandb_log
from megatron.training.loop import pretrain
from tests.support.config import tiny_argv

wandb = pytest.importorskip("wandb")


@pytest.fixture
def no_credentials(tmp_path, monkeypatch):
    for var in ("WANDB_API_KEY", "WANDB_MODE", "NETRC"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_an_offline_run_holds_the_logged_losses(tmp_path, no_credentials):
    from tests.support.wandb_files import history

    assert wandb_log.wandb_mode() == "offline"
    argv = tiny_argv("--wandb-project", "fp8", "--wandb-exp-name", "tiny", "--wandb-save-dir", str(tmp_path / "wb"),
                     train_iters=10, log_interval=5, eval_interval=10)
    result = pretrain(parse_config(argv))
    rows = history(tmp_path / "wb")
    train = {row["_step"]: row["lm-loss-training/lm loss"] for row in rows if "lm-loss-training/lm loss" in row}
    # The interval's mean, added as the log line adds it: the same floats in the same order.
    assert train == {5: sum(result.losses[:5]) / 5, 10: sum(result.losses[5:]) / 5}
    valid = [row for row in rows if "lm-loss-validation/lm loss validation" in row]
    assert [(r["_step"], r["lm-loss-validation/lm loss validation"]) for r in valid] == result.valid
    assert any("learning-rate/learning-rate" in row and "grad-norm/grad-norm" in row for row in rows)


def test_credentials_make_it_online_and_wandb_mode_decides(monkeypatch, no_credentials):
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_log.wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_log.wandb_mode() == "disabled"


def test_without_wandb_installed_the_flag_is_one_clear_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match=r"--wandb-project needs the wandb package, which is not installed: pip "
                                         r"install wandb"):
        parse_config(tiny_argv("--wandb-project", "fp8"))


@pytest.mark.parametrize("flag", ["--wandb-exp-name", "--wandb-save-dir"])
def test_a_wandb_flag_without_the_project_is_refused(flag, tmp_path):
    with pytest.raises(ValueError, match=f"{flag} is given without --wandb-project"):
        parse_config(tiny_argv(flag, str(tmp_path / "x")))
