"""The independent float64 FP8 reference of the FP8 tests (tests/support/fp8_reference.py) against known facts of
the formats."""
import torch

from tests.support.fp8_reference import fp8_grid


def test_reference_grid_matches_known_format_facts() -> None:
    e4m3, e5m2 = fp8_grid("e4m3"), fp8_grid("e5m2")
    assert e4m3[-1] == 448 and e4m3[1] == 2.0**-9 and len(e4m3) == 127
    assert e5m2[-1] == 57344 and e5m2[1] == 2.0**-16 and len(e5m2) == 124
    assert torch.all(e4m3[1:] > e4m3[:-1]) and torch.all(e5m2[1:] > e5m2[:-1])
