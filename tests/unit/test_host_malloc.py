"""megatron.host_malloc: the CPU run's glibc malloc settings, chosen once, a user's own settings left alone."""
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from megatron import host_malloc
from megatron.accelerator import Accelerator

MODULE = Path(host_malloc.__file__)

# Loads host_malloc.py alone (no torch) in a fresh process; counts the mmapped chunks glibc adds for a 64 MiB
# block, first with glibc's defaults, then after configure(). A 64 MiB block is above the largest mmap threshold
# glibc's defaults ever reach (32 MiB), so the first count is 1 on any glibc.
_PROBE = r"""
import ctypes, importlib.util, sys
spec = importlib.util.spec_from_file_location("host_malloc", sys.argv[1])
hm = importlib.util.module_from_spec(spec); spec.loader.exec_module(hm)
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def mapped_while_held():
    base = libc.mallinfo2().hblks
    block = libc.malloc(64 << 20)
    count = libc.mallinfo2().hblks - base
    libc.free(block)
    return count
before = mapped_while_held()
print(before, hm.configure(), mapped_while_held())
"""


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(host_malloc, "_applied", None)
    calls = []
    monkeypatch.setattr(host_malloc, "_mallopt", lambda settings: calls.append(settings) or True)
    monkeypatch.setattr(host_malloc, "glibc_version", lambda: "2.36")
    return calls


def test_the_choice_defaults_to_keep_and_a_value_we_do_not_know_names_the_variable():
    assert host_malloc.requested({}) == "keep"
    assert host_malloc.requested({"MEGATRON_CPU_MALLOC": " System "}) == "system"
    with pytest.raises(host_malloc.CpuMallocConfigError, match="MEGATRON_CPU_MALLOC='jemalloc' is not one of keep"):
        host_malloc.requested({"MEGATRON_CPU_MALLOC": "jemalloc"})


@pytest.mark.parametrize("environ, said", [
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "jemalloc is preloaded (LD_PRELOAD)"),
    ({"LD_PRELOAD": "libtcmalloc_minimal.so.4"}, "tcmalloc is preloaded (LD_PRELOAD)"),
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1:glibc.malloc.trim_threshold=0"},
     "GLIBC_TUNABLES sets glibc.malloc.trim_threshold"),
    ({"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TOP_PAD_": "0"}, "MALLOC_TOP_PAD_, MALLOC_MMAP_THRESHOLD_ set"),
])
def test_a_users_own_malloc_setting_is_found(environ, said):
    assert host_malloc.user_setting(environ) == said


def test_settings_that_touch_other_parameters_are_not_the_users_malloc_choice():
    assert host_malloc.user_setting({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1", "LD_PRELOAD": "libfoo.so"}) is None


def test_keep_sets_the_three_parameters_once_and_says_so(fresh, caplog):
    with caplog.at_level(logging.INFO, logger="megatron"):
        assert host_malloc.configure({}) == "keep"
        assert host_malloc.configure({"MEGATRON_CPU_MALLOC": "system"}) == "keep"  # decided once per process
    assert fresh == [host_malloc.KEEP_SETTINGS]
    assert dict(host_malloc.KEEP_SETTINGS) == {host_malloc.M_MMAP_MAX: 0, host_malloc.M_TRIM_THRESHOLD: 2**31 - 1,
                                               host_malloc.M_TOP_PAD: 256 << 20}
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU malloc:")]
    assert lines == ["CPU malloc: glibc 2.36 keeps freed memory for reuse (no mmap per large tensor, no trimming "
                     "below 2 GiB; MEGATRON_CPU_MALLOC=system keeps glibc's defaults)"]


@pytest.mark.parametrize("environ, version, result, said", [
    ({"MEGATRON_CPU_MALLOC": "system"}, "2.36", "system", "glibc's default malloc settings"),
    ({"LD_PRELOAD": "libtcmalloc.so"}, "2.36", "user", "left as set: tcmalloc is preloaded"),
    ({}, None, "absent", "not glibc"),
])
def test_other_answers_leave_malloc_alone_and_say_why(fresh, monkeypatch, caplog, environ, version, result, said):
    monkeypatch.setattr(host_malloc, "glibc_version", lambda: version)
    with caplog.at_level(logging.INFO, logger="megatron"):
        assert host_malloc.configure(environ) == result
    assert fresh == []
    assert said in caplog.text


def test_a_refused_mallopt_is_said(fresh, monkeypatch, caplog):
    monkeypatch.setattr(host_malloc, "_mallopt", lambda settings: False)
    with caplog.at_level(logging.INFO, logger="megatron"):
        assert host_malloc.configure({}) == "refused"
    assert "refused mallopt" in caplog.text


def test_only_the_cpu_device_configures_host_malloc(monkeypatch):
    seen = []
    monkeypatch.setattr(host_malloc, "configure", lambda: seen.append(True))
    for device_type in ("cuda", "hpu", "cpu"):
        Accelerator(device_type).prepare_host_memory()
    assert seen == [True]


@pytest.mark.skipif(host_malloc.glibc_version() is None, reason="glibc's malloc is what is configured")
def test_after_keep_a_large_block_comes_from_the_heap_instead_of_its_own_mapping():
    env = {"PATH": "/usr/bin:/bin"}  # a fresh process with none of the user's malloc settings
    out = subprocess.run([sys.executable, "-c", _PROBE, str(MODULE)], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["1", "keep", "0"]
