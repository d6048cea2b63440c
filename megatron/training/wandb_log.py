"""Weights & Biases logging (`--wandb-project`, `--wandb-exp-name`, `--wandb-save-dir`, Megatron-LM's spellings).

Rank 0 logs every TensorBoard scalar by iteration under the same tag (`lm-loss-training/lm loss`,
`lm-loss-validation/lm loss validation`, ...), so dashboards built on Megatron's tags read both. The run is offline
(its files under the save folder, `wandb sync` uploads them later) unless credentials are there: WANDB_API_KEY, or
a `wandb login` in ~/.netrc; WANDB_MODE, when set, decides instead.
"""
from __future__ import annotations

import logging
import netrc
import os
from typing import Optional

logger = logging.getLogger(__name__)


def has_credentials() -> bool:
    """An API key in the environment, or a `wandb login` entry in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        hosts = netrc.netrc().hosts
    except (OSError, netrc.NetrcParseError):
        return False
    return any("wandb" in host for host in hosts)


def wandb_mode() -> str:
    return os.environ.get("WANDB_MODE") or ("online" if has_credentials() else "offline")


class WandbWriter:
    """`add_scalar(tag, value, step)` into a Weights & Biases run; `close()` finishes it."""

    def __init__(self, project: str, name: Optional[str], save_dir: Optional[str], config: dict) -> None:
        import wandb

        if save_dir:
            os.makedirs(save_dir, exist_ok=True)
        mode = wandb_mode()
        self.run = wandb.init(project=project, name=name, dir=save_dir, config=config, mode=mode)
        where = getattr(self.run, "dir", None) or save_dir or "./wandb"
        logger.info("wandb: project %s, run %s, %s%s", project, self.run.name, mode,
                    f" (files under {where}; `wandb sync` uploads them)" if mode == "offline" else "")

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.run.log({tag: value}, step=step)

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() can return before wandb's service has written the run's file; teardown waits for it
        wandb.teardown()


def build_wandb_writer(logging_config, save: Optional[str], config: dict) -> Optional[WandbWriter]:
    """The writer of a run with --wandb-project (its folder: --wandb-save-dir, else --save/wandb), else None."""
    if not logging_config.wandb_project:
        return None
    save_dir = logging_config.wandb_save_dir or (os.path.join(save, "wandb") if save else None)
    return WandbWriter(logging_config.wandb_project, logging_config.wandb_exp_name, save_dir, config)
