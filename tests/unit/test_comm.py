"""`megatron.comm`: every collective of megatron/ goes through it, on the backend's device, never in FP8.

Three checks that a CPU/gloo suite can make although only NCCL/HCCL would fail:
- a static scan of megatron/ for collectives called (or imported) anywhere but megatron/comm.py;
- the run-time guard (installed for the whole suite by conftest.py) that refuses such calls;
- a one-process run of the loop with the collective path forced on, over groups that claim the "nccl"
  backend, whose device lookup answers a stand-in device (`meta`): the fakes record which device each
  tensor was put on, and every reduction of the loop, evaluation, FP8 amax sync, Smooth-SwiGLU scales,
  gradient clipping, tensor-parallel regions and the pipeline guard must have used it.
"""
from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron import comm
from tests.support.config import REPO, tiny_argv
from tests.support.processes import one_rank_world

COMM_FILE = REPO / "megatron" / "comm.py"
DIST_MODULES = {"torch.distributed", "torch.distributed.distributed_c10d", "deepspeed.comm"}


# ------------------------------------------------------------------------------------------- static scan
def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def collective_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for every collective of torch.distributed / deepspeed.comm named in `source`, however
    imported: `import torch.distributed as X`, `from torch import distributed`, `from torch.distributed
    import all_reduce as Y`, the full `torch.distributed.all_reduce` path."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}  # local name -> the distributed module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in DIST_MODULES and a.asname:
                    aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                if f"{node.module}.{a.name}" in DIST_MODULES:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                elif node.module in DIST_MODULES and a.name in comm.COLLECTIVES:
                    found.append((node.lineno, f"from {node.module} import {a.name}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in comm.COLLECTIVES:
            base = _dotted(node.value)
            if base is None:
                continue
            head, _, rest = base.partition(".")
            module = aliases[head] + (f".{rest}" if rest else "") if head in aliases else base
            if module in DIST_MODULES:
                found.append((node.lineno, f"{base}.{node.attr}"))
    return sorted(found)


def test_no_collective_outside_comm():
    offenders = []
    for path in sorted((REPO / "megatron").rglob("*.py")):
        if path == COMM_FILE:
            continue
        for line, what in collective_uses(path.read_text()):
            offenders.append(f"{path.relative_to(REPO)}:{line}: {what}")
    assert not offenders, "collectives outside megatron/comm.py:\n" + "\n".join(offenders)
    assert collective_uses(COMM_FILE.read_text())  # the scan sees comm's own calls (it is not blind)


def test_scan_finds_every_spelling():
    source = """
import torch
import torch.distributed as d
import torch.distributed
from torch import distributed as td
from torch.distributed import all_reduce as ar, get_rank
from torch.distributed import distributed_c10d
import deepspeed.comm as dscomm

def f(x):
    d.all_reduce(x)
    torch.distributed.broadcast(x, 0)
    td.barrier()
    ar(x)
    distributed_c10d.all_gather_into_tensor(x, x)
    dscomm.reduce_scatter_tensor(x, x)
    get_rank()
    fn = d.send
"""
    found = [what for _, what in collective_uses(source)]
    assert found == ["from torch.distributed import all_reduce", "d.all_reduce", "torch.distributed.broadcast",
                     "td.barrier", "distributed_c10d.all_gather_into_tensor", "dscomm.reduce_scatter_tensor",
                     "d.send"]


# ------------------------------------------------------------------------------------------- run-time guard
@pytest.fixture
def one_rank_group():
    """A real one-process gloo world (no port: a HashStore), torn down afterwards."""
    with one_rank_world() as world:
        yield world


def test_guard_refuses_collectives_from_megatron_but_not_through_comm(one_rank_group, monkeypatch):
    monkeypatch.setenv(comm.FORCE_ENV, "1")
    assert getattr(dist.all_reduce, "megatron_collective_guard", False)  # installed by conftest.py
    bypass = compile("dist.all_reduce(x)", str(REPO / "megatron" / "training" / "somewhere.py"), "exec")
    with pytest.raises(RuntimeError, match="must go through megatron.comm"):
        exec(bypass, {"dist": dist, "x": torch.ones(2)})
    x = torch.tensor([1.0, float("nan")])
    comm.all_reduce(x, one_rank_group, comm.ReduceOp.MAX)
    assert x[0] == 1.0 and x[1] == float("inf")  # the NaN rule of MAX reductions
    with pytest.raises(TypeError, match="FP8"):
        comm.all_reduce(torch.zeros(2, dtype=torch.float8_e4m3fn), one_rank_group, comm.ReduceOp.MAX)
    monkeypatch.delenv(comm.FORCE_ENV)
    y = torch.tensor([float("nan")])
    comm.all_reduce(y, one_rank_group, comm.ReduceOp.MAX)  # one rank, not forced: nothing communicated
    assert torch.isnan(y).all()


# torch.distributed's collectives, written out here rather than read from comm.COLLECTIVES: a name dropped from
# that tuple would otherwise drop out of this check too.
GUARDED_COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor", "broadcast", "broadcast_object_list",
    "barrier", "monitored_barrier", "reduce", "gather", "gather_object", "scatter", "scatter_object_list",
    "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "all_gather_single", "reduce_scatter_single", "send_object_list", "recv_object_list")


def test_guard_claims_every_collective():
    assert set(GUARDED_COLLECTIVES) <= set(comm.COLLECTIVES)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch deprecates some of them when called
@pytest.mark.parametrize("name", GUARDED_COLLECTIVES)
def test_guard_refuses_every_collective_called_from_megatron(name):
    """Each collective, not only all_reduce and barrier: a guard that wraps (or checks) some of them would let
    megatron/ call the others directly. The call has no arguments: the guard refuses it before torch sees it,
    and a caller outside megatron/ gets torch's own answer (a TypeError, or no default group), not the guard's."""
    fn = getattr(dist, name, None)
    if fn is None:
        pytest.skip(f"torch {torch.__version__} has no torch.distributed.{name}")
    assert not dist.is_initialized()  # nothing can communicate or block if the guard lets a call through
    assert getattr(fn, "megatron_collective_guard", False), f"torch.distributed.{name} is not guarded"
    inside = compile(f"dist.{name}()", str(REPO / "megatron" / "training" / "somewhere.py"), "exec")
    with pytest.raises(RuntimeError, match=f"torch.distributed.{name} called from .*must go through megatron.comm"):
        exec(inside, {"dist": dist})
    outside = compile(f"dist.{name}()", str(REPO / "tools" / "somewhere.py"), "exec")
    with pytest.raises(Exception) as err:
        exec(outside, {"dist": dist})
    assert "must go through megatron.comm" not in str(err.value)


def test_float64_over_hccl_travels_as_a_float32_pair(one_rank_group, monkeypatch):
    """Gaudi has no float64: the evaluation's float64 sums go as (hi, lo) float32 pairs over HCCL (faked here by
    the backend name, the wire staying on the CPU), and come back to within a few float64 ulps."""
    monkeypatch.setenv(comm.FORCE_ENV, "1")
    monkeypatch.setattr(comm.dist, "get_backend", lambda group=None: "hccl")
    monkeypatch.setattr(comm, "_accelerator_device", lambda kind: torch.device("cpu"))
    dtypes = []
    real = dist.all_reduce
    monkeypatch.setattr(comm.dist, "all_reduce", lambda t, *a, **k: (dtypes.append(t.dtype), real(t, *a, **k))[1])
    x = torch.tensor([123456.78901234567, 4096.0], dtype=torch.float64)
    want = x.clone()
    comm.all_reduce(x, one_rank_group)
    assert dtypes == [torch.float32]  # one float32 all-reduce of the stacked pair, nothing float64 on the wire
    # |x - hi| <= 2^-24 |x| and lo rounds that to fp32 (another 2^-24), plus the final float64 addition.
    assert x.dtype == torch.float64 and torch.allclose(x, want, rtol=2.0**-48 + 2.0**-53, atol=0)
    with pytest.raises(TypeError, match="no float64"):
        comm.all_reduce(x, one_rank_group, comm.ReduceOp.MAX)


def test_device_follows_the_backend(monkeypatch):
    monkeypatch.setattr(comm, "_accelerator_device", lambda kind: torch.device(kind, 3))
    assert comm.device_for_backend("gloo") == torch.device("cpu")
    assert comm.device_for_backend("nccl") == torch.device("cuda", 3)
    assert comm.device_for_backend("cpu:gloo,cuda:nccl") == torch.device("cuda", 3)  # the hot path
    assert comm.device_for_backend("hccl") == torch.device("hpu", 3)


# ---------------------------------------------------------------------------------- the stand-in device
class _Wire:
    """Fakes of torch.distributed's collectives: record (op, group backend, device, dtype, call chain); a
    tensor on the stand-in device (meta, no data) is not communicated, a CPU one goes to real gloo."""

    def __init__(self, monkeypatch, gloo_groups: list) -> None:
        self.calls: list[dict] = []
        self.gloo_groups = gloo_groups
        for name in ("all_reduce", "all_gather", "reduce_scatter", "barrier"):
            monkeypatch.setattr(dist, name, self._fake(name, getattr(dist, name)))

    def backend(self, group=None) -> str:
        return "gloo" if any(group is g for g in self.gloo_groups) else "nccl"

    def _fake(self, name, real):
        def call(*args, **kwargs):
            frame = sys._getframe(1)
            chain = []
            while frame is not None and len(chain) < 6:
                chain.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}")
                frame = frame.f_back
            tensors = [a for a in args if isinstance(a, torch.Tensor)] + \
                [t for a in args if isinstance(a, list) for t in a]
            group = kwargs.get("group")
            self.calls.append({"op": name, "backend": self.backend(group), "chain": chain,
                               "devices": {t.device.type for t in tensors}, "dtypes": {t.dtype for t in tensors}})
            if any(t.device.type == "meta" for t in tensors):
                return None
            return real(*args, **kwargs)

        return call

    def sites(self) -> set[str]:
        return {site for c in self.calls for site in c["chain"]}


def test_every_reduction_goes_through_comm_on_the_communication_device(monkeypatch):
    from megatron.arguments import parse_config
    from megatron.model.smooth_swiglu import SmoothSwiGLU
    from megatron.parallel import tensor_parallel as tp
    from megatron.training.loop import Trainer
    from megatron.training.pipeline_engine import _guard_non_finite_steps

    monkeypatch.setenv(comm.FORCE_ENV, "1")  # one process, yet every collective goes to the backend
    gloo_groups: list = []
    real_new_group = dist.new_group

    def new_group(*args, **kwargs):
        group = real_new_group(*args, **kwargs)
        if kwargs.get("backend") == "gloo":
            gloo_groups.append(group)
        return group

    wire = _Wire(monkeypatch, gloo_groups)
    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "get_backend", wire.backend)  # every group but the host group claims "nccl"
    monkeypatch.setattr(comm, "_accelerator_device", lambda kind: torch.device("meta"))
    config = parse_config(tiny_argv("--fp8-format", "hybrid", "--smooth-swiglu", "--device", "cpu",
                                    train_iters=2, eval_interval=2, eval_iters=1, log_interval=1,
                                    clip_grad=1.0, exit_duration_in_mins=1000))
    try:
        trainer = Trainer(config)
        parallel = trainer.parallel
        assert parallel.world_size == 1 and parallel.host_group is gloo_groups[0]
        one_rank = parallel.data_parallel_group
        # TP = 1 has no TP group; give the clipping and the Smooth-SwiGLU scales a one-rank "nccl" one.
        trainer.engine.parallel = dataclasses.replace(parallel, tensor_parallel_group=one_rank)
        smooth = [m for m in trainer.model.modules() if isinstance(m, SmoothSwiGLU)]
        assert smooth
        for m in smooth:
            m.tp_group = one_rank
        result = trainer.train()
        assert all(torch.isfinite(torch.tensor(result.losses))) and len(result.losses) == 2

        x = torch.randn(2, 4, 6, requires_grad=True)  # tensor-parallel regions, forward and backward
        y = tp.gather_from_sequence_parallel_region(tp.reduce_from_tensor_parallel_region(x, one_rank), one_rank)
        z = tp.reduce_scatter_to_sequence_parallel_region(tp.gather_from_tensor_parallel_region(y, one_rank),
                                                          one_rank)
        assert torch.equal(z, x)  # one rank: every region is the identity
        z.sum().backward()

        w = torch.nn.Parameter(torch.ones(3))  # the ZeRO-0 pipeline guard's gradient-norm reduction
        opt = torch.optim.SGD([w], lr=0.1)
        _guard_non_finite_steps(opt, 1.0, 1)
        w.grad = torch.ones(3)
        opt.step()
        assert not opt.overflow
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

    for c in wire.calls:
        assert c["chain"][0] == "comm.py:" + {"all_reduce": "all_reduce", "all_gather": "all_gather",
                                              "reduce_scatter": "reduce_scatter", "barrier": "barrier"}[c["op"]], c
        assert not c["dtypes"] & comm._FP8_DTYPES, c
        expected = {"cpu"} if c["backend"] == "gloo" else {"meta"}
        assert c["op"] == "barrier" or c["devices"] == expected, c  # no CPU tensor reached an "nccl" group
    sites = wire.sites()
    for site in ("engine.py:train_batch", "engine.py:evaluate", "loop.py:_any_rank", "step.py:fp8_optimizer_step",
                 "smooth_swiglu.py:channel_split_scales", "layer_state.py:quantized_scaled_weight",
                 "grads.py:clip_grad_norm", "tensor_parallel.py:_all_gather", "tensor_parallel.py:_reduce_scatter",
                 "tensor_parallel.py:_all_reduce", "pipeline_engine.py:step"):
        assert site in sites, (site, sorted(sites))
    host = [c for c in wire.calls if c["backend"] == "gloo"]
    assert host and all("loop.py:_any_rank" in c["chain"] for c in host)  # only the exit flags use the host
