"""Gaudi checks (an HPU with habana_frameworks): skipped with the reason elsewhere; `scripts/gaudi_check.sh` runs them.

They probe the ops this project relies on there and compare the HPU path with the emulated one on the same
numbers: the E4M3 cast at Gaudi2's limit, the power-of-two scales' int32 bit ops, Fp8AdamW's stochastic-rounding noise
(int32) against the CPU's, 64-bit integer arithmetic (the FP8 statistics' counters), the FP8 GEMM with 0-d scale
inverses in both backward format pairs, one FP8 layer's three GEMMs and one Fp8AdamW step."""
import importlib.util

import pytest
import torch

from megatron.fp8 import Fp8Linear, Fp8Recipe
from megatron.fp8.recipe import Fp8Backend
from megatron.fp8.stats import sqnr_db


def _has_gaudi() -> bool:
    if importlib.util.find_spec("habana_frameworks") is None:
        return False
    from megatron.accelerator import prepare_habana_environment

    prepare_habana_environment()
    try:
        import habana_frameworks.torch.core  # noqa: F401
        import habana_frameworks.torch.hpu as hthpu

        return bool(hthpu.is_available())
    except Exception:  # noqa: BLE001 - a broken install is no Gaudi
        return False


HAS_GAUDI = _has_gaudi()
pytestmark = [pytest.mark.hpu, pytest.mark.skipif(not HAS_GAUDI, reason="needs a Gaudi (habana_frameworks, hpu)")]


def test_e4m3_cast_saturates_at_gaudi2s_limit():
    x = torch.tensor([300.0, -300.0, 240.0, 1.0], device="hpu")
    q, _ = torch.ops.hpu.cast_to_fp8_v2(x, None, False, False, torch.float8_e4m3fn)
    values = q.float().cpu().tolist()
    assert values[2:] == [240.0, 1.0], values
    print(f"cast of +-300 to E4M3 gives {values[:2]}")  # saturation (240) or inf: the layers clamp first either way


def test_power_of_two_bit_ops_equal_the_cpus():
    """The power-of-two scales' int32 bit ops (megatron/dtypes.py: fp32 -> int32 views, shifts, masks) on the HPU."""
    from megatron.dtypes import exp2_int, frexp_fp32, ldexp_fp32

    a = torch.tensor([3e-30, 0.7, 448.0, 6.0e4, 1.0, 1e-40, 0.0], device="hpu")
    k = torch.tensor([-130, -20, 0, 5, 127, 100, 3], device="hpu")
    for hpu, cpu in ((frexp_fp32(a), frexp_fp32(a.cpu())), ((exp2_int(k),), (exp2_int(k.cpu()),)),
                     ((ldexp_fp32(a, -k.clamp(-126, 126)),), (ldexp_fp32(a.cpu(), -k.cpu().clamp(-126, 126)),))):
        for x, y in zip(hpu, cpu):
            assert torch.equal(x.cpu(), y)


def test_stochastic_rounding_noise_equals_the_cpus():
    """Fp8AdamW's noise, int32 arithmetic (tests/unit/test_fp8_adam_noise.py): the same bits on the HPU."""
    from megatron.optimizer.fp8_state_quant import counter_uniform, u32_halves

    def noise(device: str) -> torch.Tensor:
        start, key = u32_halves(2**32 - 50000, device), u32_halves(4000000000, device)
        return counter_uniform(100000, start, key, torch.device(device)).cpu()

    assert torch.equal(noise("hpu"), noise("cpu"))


def test_int64_arithmetic_passes_2_to_the_31():
    """The FP8 statistics' element counters are int64 and pass 2**31 on large layers; the HPU path sets
    PT_ENABLE_INT64_SUPPORT=1 so that the bridge keeps them in 64 bits."""
    counts = torch.full((4,), 2**31 - 10, dtype=torch.int64, device="hpu")
    counts += torch.full((4,), 100, dtype=torch.int64, device="hpu")
    assert counts.sum().item() == 4 * (2**31 + 90)


@pytest.mark.parametrize("a_dtype,b_dtype", [(torch.float8_e4m3fn, torch.float8_e4m3fn),
                                             (torch.float8_e5m2, torch.float8_e4m3fn),
                                             (torch.float8_e5m2, torch.float8_e5m2)])
def test_fp8_gemm_with_0d_scale_inverses(a_dtype, b_dtype):
    torch.manual_seed(0)
    a, b = torch.randn(64, 128) * 4, torch.randn(32, 128) * 4
    qa, qb = a.to(a_dtype), b.to(b_dtype)
    sa, sb = torch.tensor(0.5), torch.tensor(0.25)
    want = (qa.float() * sa) @ (qb.float() * sb).t()
    got = torch.ops.hpu.fp8_gemm_v2(qa.to("hpu"), False, qb.to("hpu"), True, None, torch.float32, sa.to("hpu"),
                                    sb.to("hpu"), None, False).cpu()
    assert sqnr_db(got, want) > 100  # exact products, fp32 sums in another order


def test_fp8_layer_on_gaudi_is_as_accurate_as_the_emulation():
    """Against FP32: the HPU layer's y, dx, dW within 1 dB of the emulated layer's accuracy (E4M3 at 240 there, at
    448 here: the same number of mantissa bits, so the same noise), i.e. no layout or scale convention error."""
    torch.manual_seed(0)
    weight = torch.randn(256, 512) * 0.02
    x = torch.randn(4, 64, 512)
    xr = x.clone().requires_grad_(True)
    wr = weight.clone().requires_grad_(True)
    yr = xr @ wr.t()
    yr.pow(2).sum().backward()
    reference = [yr.detach(), xr.grad, wr.grad]
    from megatron.fp8.backends import HpuBackend, select_backend

    assert isinstance(select_backend("auto", torch.device("hpu")), HpuBackend)
    accuracy = {}
    for backend, device in ((Fp8Backend.HPU, "hpu"), (Fp8Backend.EMULATED, "cpu")):
        layer = Fp8Linear(512, 256, bias=False, recipe=Fp8Recipe(backend=backend), device=device)
        with torch.no_grad():
            layer.weight.copy_(weight)
        xi = x.to(device).requires_grad_(True)
        y = layer(xi)
        y.float().pow(2).sum().backward()
        got = [t.float().cpu() for t in (y, xi.grad, layer.weight.grad)]
        accuracy[backend] = [sqnr_db(g, r) for g, r in zip(got, reference)]
    print(f"SQNR vs FP32 (y, dx, dW): HPU {accuracy[Fp8Backend.HPU]}, emulated {accuracy[Fp8Backend.EMULATED]}")
    for hpu, emulated in zip(accuracy[Fp8Backend.HPU], accuracy[Fp8Backend.EMULATED]):
        assert hpu > emulated - 1.0


def test_fp8_adam_step_on_gaudi_matches_the_cpu():
    from megatron.optimizer.fp8_adam import Fp8AdamW

    torch.manual_seed(0)
    w, g = torch.randn(256, 256), torch.randn(256, 256)
    results = []
    for device, backend in (("hpu", None), ("cpu", "hpu")):  # the CPU computes with Gaudi's limits too
        p = torch.nn.Parameter(w.clone().to(device))
        opt = Fp8AdamW([p], lr=1e-3, block_size=128, format_backend=backend, compile=True)
        # On the HPU the limits come from the parameters' device (E4M3 240), and inductor is not used.
        assert opt.format_backend == "hpu" and opt.m_format.max == 240.0 and opt.runs_eager
        for _ in range(3):
            p.grad = g.to(device)
            opt.step()
        results.append(p.detach().cpu())
    assert sqnr_db(results[0], results[1]) > 60
