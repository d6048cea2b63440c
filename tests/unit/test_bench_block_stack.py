"""bench/bench_block_stack.py at tiny shapes on the CPU, so that the GPU's decisive benchmark cannot rot: every
variant builds through the CLI's path and steps, the rows and the JSON agree, and the kernel classes of the
profile table are the ones a GPU trace names."""
from __future__ import annotations

import json
import logging

import pytest

from tests.support.config import load_bench

bench = load_bench("bench_block_stack")


@pytest.mark.parametrize("name, kind", [
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "GEMM"),  # cuBLASLt on Hopper
    ("sm90_xmma_gemm_e4m3e4m3_bf16f32_f32_tn_n_tilesize128x128x128", "GEMM"),
    ("aten::_scaled_mm", "GEMM"),
    ("aten::mm", "GEMM"),
    ("flash_fwd_kernel", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("triton_red_fused_abs_amax_0", "quantization"),
    ("triton_poi_fused__to_copy_clamp_mul_1", "quantization"),
    ("triton_poi_fused_add_mul_rsqrt_2", "other"),
])
def test_kernel_classes(name, kind):
    assert bench.kernel_class(name) == kind


def test_tiny_run_steps_every_variant(tmp_path):
    out = tmp_path / "stack.json"
    level = logging.getLogger("megatron").level
    rows = bench.main(["--device", "cpu", "--shape", "tiny", "--layers", "2", "--compile", "off", "--iters", "2",
                       "--warmup", "1", "--profile", "--json", str(out)])
    assert [r["variant"] for r in rows] == list(bench.VARIANTS)
    ran = [r for r in rows if "skipped" not in r]
    assert {r["variant"] for r in ran} >= {"bf16", "fp8-delayed", "fp8-tensorwise"}
    assert ran[0]["vs_bf16"] == 1.0
    for r in ran:
        assert len(r["steps_s"]) == 2 and r["median_step_s"] > 0
        assert r["vs_bf16"] == pytest.approx(r["median_step_s"] / ran[0]["median_step_s"])
        assert set(r["profile_ms"]) == {"GEMM", "quantization", "attention", "other", "idle"}
        assert r["profile_ms"]["GEMM"] > 0 and r["profile_ms"]["attention"] > 0
    fp8 = next(r for r in ran if r["variant"] == "fp8-delayed")
    assert fp8["profile_ms"]["quantization"] > 0  # the FP8 casts are seen as such
    assert json.loads(out.read_text())["rows"] == rows
    assert logging.getLogger("megatron").level == level  # quiet while it builds, as it was afterwards
