"""Fixtures and hooks of the whole suite (tests/unit: in-process, tests/e2e: launches processes); the helpers they
use live in tests/support."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# The emulated FP8 GEMMs round once (FP32 GEMMs) on every CPU the suite runs on: the BF16-GEMM mode that CPUs with
# AMX-BF16 (and AMD CPUs with AVX512-BF16) default to (megatron/fp8/cpu_gemm.py) has its own tests, which set it
# themselves. Set before any test imports megatron (the mode is decided at import) and inherited by the processes
# tests launch.
os.environ.setdefault("MEGATRON_CPU_FP8_GEMM", "exact")

# The repository root on sys.path: `tests.support`, `megatron` and `pretrain_gpt` importable from every test module.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


@pytest.fixture(autouse=True)
def _seeded_generators():
    """Every test starts from the same state of torch's, Python's and numpy's global generators: a test that draws
    unseeded data gets the same data whichever tests ran before it in its worker (pytest-xdist spreads them
    differently from run to run)."""
    import random

    import numpy as np
    import torch

    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    yield


@pytest.fixture(autouse=True)
def _single_process_env(monkeypatch):
    """Tests run as one process unless they spawn workers themselves."""
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    yield


@pytest.fixture(scope="session")
def torch_reference_save(tmp_path_factory) -> Path:
    """The checkpoint folder of `torch_reference` (iteration 4); read it, never write into it."""
    from tests.support.launch import run

    save = tmp_path_factory.mktemp("torch_reference")
    (save / "log.txt").write_text(run(1, save=save))
    return save


@pytest.fixture(scope="session")
def torch_reference(torch_reference_save) -> tuple[list[float], dict]:
    """`pretrain_gpt.py` on the torch engine, one process, tests/support/launch.py's BASE (4 micro-batches of 2 per
    step): its training losses and final weights. The reference of the DDP, DeepSpeed ZeRO 0-2 and ZeRO-3
    comparisons."""
    from megatron.checkpoint import store as ckpt
    from tests.support.logs import losses

    log = (torch_reference_save / "log.txt").read_text()
    return losses(log), ckpt.load_checkpoint_files(torch_reference_save)["payload"]["model"]


@pytest.fixture(scope="session")
def torch_control(tmp_path_factory) -> tuple[list[float], dict]:
    """`torch_reference`'s noise (tests/support/run_noise.py): the same run with micro-batches of 1 and 8
    accumulation steps, the same math in another summation order."""
    from megatron.checkpoint import store as ckpt
    from tests.support.launch import run
    from tests.support.logs import losses

    save = tmp_path_factory.mktemp("torch_control")
    return losses(run(1, save=save, micro_batch_size=1)), ckpt.load_checkpoint_files(save)["payload"]["model"]


@pytest.fixture(scope="session")
def deepspeed_zero1(tmp_path_factory) -> tuple[str, Path]:
    """DeepSpeed ZeRO-1, 2 processes under torchrun, tests/support/launch.py's BASE (2 micro-batches of 2 per rank
    per step): its log and save folder. Compared with the torch engine (test_deepspeed_launch) and with the same
    run started by the deepspeed launcher (test_launchers)."""
    pytest.importorskip("deepspeed")
    from tests.support.launch import run

    save = tmp_path_factory.mktemp("deepspeed_zero1")
    return run(2, "--deepspeed", "--zero-stage", "1", save=save), save


@pytest.fixture(scope="session")
def pp2_fp32_log():
    """log(stage): the log of `pretrain_gpt.py` at PP = 2 under DeepSpeed ZeRO `stage` ("0" or "1"), FP32, tests/
    support/launch.py's BASE with validation at 2 and 4 and clipping at 0.05 (active); one run per stage per
    session. test_pipeline_launch compares it with PP = 1, test_upstream_scripts_launch with the same run under
    full recompute."""
    pytest.importorskip("deepspeed")
    from tests.support.launch import run

    logs = {}

    def log(stage: str) -> str:
        if stage not in logs:
            logs[stage] = run(2, "--deepspeed", "--zero-stage", stage, "--pipeline-model-parallel-size", "2",
                              eval_interval=2, clip_grad=0.05)
        return logs[stage]
    return log


@pytest.fixture
def venv_python() -> str:
    return sys.executable


def pytest_configure(config):
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    # torch.compile's on-disk cache does not tell kernels built under ATEN_CPU_CAPABILITY=avx2 from native ones:
    # a cache filled by one setting and read by the other gave NaNs (compiled Fp8AdamW) or a segfault. CI runs
    # the suite under both settings (scripts/test.sh), so each setting gets its own cache folder.
    isa = os.environ.get("ATEN_CPU_CAPABILITY", "native")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                          str(Path(os.environ.get("TMPDIR", "/tmp")) / f"torchinductor-megatron-{isa}"))
    from tests.support import collective_guard  # every collective of megatron/ must go through megatron.comm

    collective_guard.enable()


def pytest_collection_modifyitems(config, items):
    """`slow` tests (long experiments) are skipped unless MEGATRON_SLOW_TESTS=1 (pytest.ini's marker)."""
    if os.environ.get("MEGATRON_SLOW_TESTS", "") not in ("", "0"):
        return
    skip = pytest.mark.skip(reason="slow: set MEGATRON_SLOW_TESTS=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# scripts/test.sh runs pytest-xdist with `--dist loadfile`: a test file runs whole in one worker, so a module's
# fixtures are made once. Files whose tests share a session fixture (one run that several files compare
# against) also run in one worker, so that run is made once per session, not once per worker.
_SHARED_RUNS = {
    "torch-reference": ("test_deepspeed_launch.py", "test_deepspeed_zero3.py", "test_ddp.py", "test_launchers.py"),
    "pp2-fp32": ("test_pipeline_launch.py", "test_upstream_scripts_launch.py"),
}
_GROUP_OF_FILE = {name: group for group, names in _SHARED_RUNS.items() for name in names}
_WORKER_LAUNCHES: list[dict] = []


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hooks: defined only when it is installed
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedRunsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return _GROUP_OF_FILE.get(Path(path).name, path)

    return SharedRunsTogether(config, log)


def _launch_counts() -> dict:
    forkserver = sys.modules.get("tests.support.forkserver")
    return dict(forkserver.COUNTS) if forkserver is not None else {}


def pytest_sessionfinish(session):
    """An xdist worker hands its launch counts to the controller (pytest_testnodedown)."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["launches"] = _launch_counts()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _WORKER_LAUNCHES.append(getattr(node, "workeroutput", {}).get("launches", {}))


def pytest_terminal_summary(terminalreporter):
    """How the session's launches went (tests/support/forkserver.py): forked, or real processes."""
    counts = [c for c in [_launch_counts(), *_WORKER_LAUNCHES] if c]
    if counts:
        total = {key: sum(c.get(key, 0) for c in counts) for key in ("forked", "servers", "real")}
        terminalreporter.write_line(f"launches: {total['forked']} forked from {total['servers']} preloaded "
                                    f"server(s), {total['real']} real processes (an import-time variable differed)")


def pytest_unconfigure(config):
    """The fork server of the session's launches (tests/support/forkserver.py) stops with the session."""
    forkserver = sys.modules.get("tests.support.forkserver")
    if forkserver is not None:
        forkserver.shutdown()
