"""Values read from the log of a `pretrain_gpt.py` run (megatron/training/log.py writes them `%.6E`)."""
from __future__ import annotations

import logging
import re

LOSS = re.compile(r"\| lm loss: (\S+) \|")  # the training loss of a log iteration's line
VALID_LOSS = re.compile(r"lm loss value: (\S+) \|")  # the loss of a validation (or test) line


def printed_losses(log: str) -> list[str]:
    """The training losses of a log as printed (for digit-for-digit comparisons), in order."""
    return LOSS.findall(log)


def losses(log: str) -> list[float]:
    """The training losses of a log, in order."""
    return [float(m) for m in LOSS.findall(log)]


def values(log: str) -> list[float]:
    """Training losses, then validation (and test) losses, in log order."""
    return losses(log) + [float(v) for v in VALID_LOSS.findall(log)]


class LogLines(logging.Handler):
    """The megatron logger's messages from INFO up while attached (`with LogLines() as handler:`), whatever level
    an earlier test left the logger at."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        self._level = logging.NOTSET

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> "LogLines":
        logger = logging.getLogger("megatron")
        self._level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logger = logging.getLogger("megatron")
        logger.removeHandler(self)
        logger.setLevel(self._level)
