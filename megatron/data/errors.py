"""Errors of the data pipeline that the user fixes (a file or a flag), not bugs.

`DataError` is a `ValueError`, so entry points print it as one line without a traceback
(`megatron.errors.run_cli` for pretrain_gpt.py and the tools; tools/preprocess_data.py's own `main`), and
callers that already catch `ValueError` keep working. Its message names the file and says what to do.
"""
from __future__ import annotations


class DataError(ValueError):
    """A data file or data flag the user must fix; the message names the file and the fix."""


class DatasetNotFoundError(DataError, FileNotFoundError):
    """A `.bin` or `.idx` file that is not there (still a `FileNotFoundError` for callers testing that)."""


class CorruptIndexedDatasetError(DataError):
    """A `.bin/.idx` pair whose contents contradict the format, each other or their manifest."""


class TokenIdOutOfRangeError(DataError):
    """Token ids that the tokenizer (and so the embedding table) does not have."""
