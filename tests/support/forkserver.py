"""Launching a script in N processes by forking a preloaded interpreter: the processes a launcher would start,
without each paying the interpreter's start and the imports of torch, megatron and DeepSpeed (~4-6 s of CPU per
process on the 2-core test machines, most of a tiny run's cost).

One server per test session (`python -m tests.support.forkserver`, started on first use) imports those modules
and runs nothing else: no torch op, no thread, no process group. For each request it forks `nproc` children; each
sets the environment torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...; one
OpenMP thread per rank, torchrun's default), changes to the repository folder, sends stdout and stderr to files
shared by the ranks (as torchrun's workers share its streams) and runs the script as `__main__`, then exits
through its atexit handlers.
Rank 0 creates the rendezvous store itself (env:// without an agent). A rank that fails makes the others be
terminated, as torchrun does; the request's exit code is then 1 (torchrun's), or the child's own in one process.

What stays a real launch: the launchers themselves (torchrun, the DeepSpeed launcher, hostfiles:
tests/e2e/test_launchers.py and the tests that name them), and any run whose environment differs from the
session's in a variable read at import time: `launch` compares the environment it is given with this process's,
and outside RUNTIME_VARIABLES any difference makes it start a real process instead (same result, full cost). When
the session's own environment changes (an in-process test sets a variable for good), the next launch starts a
new server with it. MEGATRON_TEST_FORKSERVER=0 makes every launch a real process.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.support.config import REPO


# Variables the server sets per rank, and ones our code reads at run time only (never at import), so a request
# may change them without a real process.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                  "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID")
RUNTIME_VARIABLES = frozenset(RANK_VARIABLES + ("MEGATRON_TRACEBACK", "PYTEST_CURRENT_TEST", "OMP_NUM_THREADS"))
# torch fixes its thread count when it is imported (the server's OMP_NUM_THREADS): a child whose OMP_NUM_THREADS
# differs sets it as a fresh process would have found it (torch.set_num_threads: OpenMP, MKL and oneDNN).

# A rank that failed: the others get SIGTERM, then SIGKILL after this many seconds (torchrun waits 30).
TERMINATE_GRACE_S = 10.0


# ----------------------------------------------------------------------------------------------------- server
def _preload() -> None:
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    sys.path.insert(0, str(REPO))
    import pretrain_gpt  # noqa: F401  (megatron's arguments, config, loop, engines, FP8 layers)
    import megatron.training.deepspeed_engine  # noqa: F401
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        pass
    sys.path.remove(str(REPO))
    if threading.active_count() != 1:
        raise RuntimeError(f"preloading started threads ({threading.enumerate()}); forking would be unsafe")


def _child(request: dict, rank: int, protocol_fd: int) -> None:
    """In a forked child: become rank `rank` of the request and run its script; never returns."""
    code = 1
    try:
        os.close(protocol_fd)
        os.setpgid(0, 0)
        os.chdir(request["cwd"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            target = os.open(request[name], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(target, fd)
            os.close(target)
        env = dict(request["env"])
        if request.get("distributed", request["nproc"] > 1):
            n = request["nproc"]
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                       GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(n),
                       ROLE_NAME="default", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(request["port"]),
                       TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none")
        if request["nproc"] > 1:
            # One thread per rank, as torchrun sets it when OMP_NUM_THREADS is unset (the session sets 2 for its
            # in-process tests): 2 to 4 ranks of 2 threads each on the 2-core machines doubled a run's time.
            env["OMP_NUM_THREADS"] = "1"
        threads = env.get("OMP_NUM_THREADS")
        if threads != os.environ.get("OMP_NUM_THREADS") and threads:
            import torch

            torch.set_num_threads(int(threads))
        os.environ.clear()
        os.environ.update(env)
        try:
            import runpy

            if "call" in request:
                _call(request["call"], rank)
            elif request["script"].startswith("-m "):  # python -m NAME argv
                module = request["script"][3:]
                sys.argv = [module, *request["argv"]]
                sys.path[0] = request["cwd"]
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                script = os.path.abspath(request["script"])
                if not os.path.isfile(script):  # as the interpreter says it
                    print(f"{sys.executable}: can't open file {script!r}: [Errno 2] No such file or directory",
                          file=sys.stderr)
                    raise SystemExit(2)
                sys.argv = [request["script"], *request["argv"]]
                sys.path[0] = os.path.dirname(script)
                runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001  (as the interpreter would: the traceback, exit code 1)
            import traceback

            traceback.print_exc()
            code = 1
        import atexit

        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _call(call: dict, rank: int) -> None:
    """`module.name(rank, *args)` as a spawned worker runs it: the module imported from its file under its name
    (with its folder and the repository on sys.path, as the test session has them), the arguments unpickled."""
    import importlib.util
    import pickle

    sys.path[:0] = [os.path.dirname(call["file"]), str(REPO)]
    spec = importlib.util.spec_from_file_location(call["module"], call["file"])
    module = importlib.util.module_from_spec(spec)
    sys.modules[call["module"]] = module
    spec.loader.exec_module(module)
    target = module
    for part in call["name"].split("."):
        target = getattr(target, part)
    with open(call["args"], "rb") as f:
        args = pickle.load(f)
    target(rank, *args)


def _terminate(alive: set[int], codes: dict) -> None:
    """SIGTERM to the ranks still running (and what they started), SIGKILL after the grace; all reaped."""
    for pid in alive:
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + TERMINATE_GRACE_S
    while alive and time.monotonic() < deadline:
        _reap(alive, codes)
        time.sleep(0.05)
    for pid in alive:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    while alive:
        _wait_any(alive, codes)


def _reap(alive: set[int], codes: dict) -> None:
    """Record the exit codes of the ranks in `alive` that have exited, without waiting."""
    for pid in list(alive):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            alive.discard(pid)
            codes[pid] = os.waitstatus_to_exitcode(status)


def _wait_any(alive: set[int], codes: dict) -> int:
    """Wait until one of the ranks in `alive` exits; record its exit code; its pid."""
    while True:
        pid, status = os.wait()
        if pid in alive:
            alive.discard(pid)
            codes[pid] = os.waitstatus_to_exitcode(status)
            return pid


def _serve_one(request: dict, out) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(request["nproc"]):
        pid = os.fork()
        if pid == 0:
            _child(request, rank, out.fileno())
        pids.append(pid)
    out.write(json.dumps({"pids": pids}) + "\n")
    out.flush()
    alive, codes = set(pids), {}
    while alive:
        pid = _wait_any(alive, codes)
        if codes[pid] != 0 and alive:
            _terminate(alive, codes)
    ordered = [codes[pid] for pid in pids]
    failed = [c for c in ordered if c != 0]
    rc = 0 if not failed else (failed[0] if len(pids) == 1 else 1)
    out.write(json.dumps({"returncode": rc, "codes": ordered}) + "\n")
    out.flush()


def serve() -> None:
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the server and its imports print stays off the protocol stream
    _preload()
    out.write(json.dumps({"ready": os.getpid()}) + "\n")
    out.flush()
    for line in sys.stdin:
        if line.strip():
            _serve_one(json.loads(line), out)


# ----------------------------------------------------------------------------------------------------- client
class _Server:
    def __init__(self) -> None:
        self.env = dict(os.environ)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.forkserver"], cwd=REPO, env=self.env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self._read(300)
        if "ready" not in ready:
            raise RuntimeError(f"fork server did not start: {ready}")
        self.lock = threading.Lock()

    def _read(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"fork server exited ({self.proc.poll()})")
        return json.loads(line)

    def run(self, request: dict, timeout: float) -> int:
        with self.lock:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pids = self._read(60)["pids"]
            try:
                return self._read(timeout)["returncode"]
            except BaseException:  # a timeout here, or pytest-timeout's or Ctrl-C's exception in this thread
                for pid in pids:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                try:
                    self._read(60)  # the request's result line: the next request starts in step
                except BaseException:
                    self.proc.kill()  # out of step: the next launch starts a new server
                    self.proc.wait()
                raise

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


_server: _Server | None = None
# What this pytest process's launches were: forked, real processes (an import-time variable differed), servers started.
COUNTS = {"forked": 0, "real": 0, "servers": 0}


def _get_server() -> _Server | None:
    """The server for this process's environment as it is now: a new one where the session's environment has
    changed since the last one started (an in-process test set a variable for good); None where forking is off."""
    global _server
    if not available():
        return None
    if _server is not None and (_server.proc.poll() is not None or _differs(dict(os.environ), _server.env)):
        shutdown()
    if _server is None:
        _server = _Server()
        COUNTS["servers"] += 1
    return _server


def shutdown() -> None:
    """Stop the session's server (tests/conftest.py calls it at the session's end)."""
    global _server
    if _server is not None:
        _server.close()
        _server = None


def _differs(env: dict, base: dict) -> set[str]:
    keys = set(env) | set(base)
    return {k for k in keys if env.get(k) != base.get(k) and k not in RUNTIME_VARIABLES}


def available() -> bool:
    return hasattr(os, "fork") and os.environ.get("MEGATRON_TEST_FORKSERVER", "1") != "0"


def _run_forked(server: _Server, request: dict, timeout: float, args: tuple | None = None
                ) -> subprocess.CompletedProcess:
    """`request` through `server`, its ranks' stdout and stderr in files of a temporary folder (with `args`
    pickled there for a `call`); the exit code and both streams. TimeoutExpired past `timeout`."""
    import pickle
    import tempfile

    COUNTS["forked"] += 1
    what = [request.get("script") or request["call"]["name"], *request.get("argv", ())]
    with tempfile.TemporaryDirectory(prefix="forkserver_") as folder:
        paths = {name: os.path.join(folder, name) for name in ("stdout", "stderr")}
        if args is not None:
            with open(os.path.join(folder, "args.pkl"), "wb") as f:
                pickle.dump(args, f)
            request = {**request, "call": {**request["call"], "args": os.path.join(folder, "args.pkl")}}

        def streams() -> tuple[str, str]:
            return tuple(Path(paths[name]).read_text(errors="replace") for name in ("stdout", "stderr"))

        try:
            rc = server.run({**request, **paths}, timeout)
        except TimeoutError:
            raise subprocess.TimeoutExpired(what, timeout, *streams()) from None
        return subprocess.CompletedProcess(what, rc, *streams())


def launch(nproc: int, script: str, argv: list[str], *, port: int, env: dict | None = None,
           timeout: float = 300) -> subprocess.CompletedProcess:
    """`script argv` in `nproc` processes (ranks of one gloo world on `port` when nproc > 1), forked from the
    session's server; a real `python script` / torchrun process when the environment differs in a variable read
    at import time. Its stdout and stderr (all ranks, as under torchrun) and exit code. `script` "-m NAME" runs the
    module NAME (python -m)."""
    from tests.support.launch import pretrain_command

    wanted = dict(os.environ if env is None else env)
    server = None if _differs(wanted, dict(os.environ)) else _get_server()
    if server is None:
        COUNTS["real"] += 1
        cmd = pretrain_command(nproc, argv, script, port=port)
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=wanted)
    request = {"script": script, "argv": list(argv), "nproc": nproc, "port": port, "cwd": str(REPO), "env": wanted}
    return _run_forked(server, request, timeout)


def spawn(fn, args: tuple = (), nprocs: int = 2, *, timeout: float = 300) -> None:
    """`torch.multiprocessing.spawn(fn, args, nprocs)` for a module-level `fn(rank, *args)` of a test or support
    module, forked from the session's server (the spawn itself where the environment differs, as `launch`). A
    worker that fails fails the call with its output."""
    import inspect

    server = _get_server()
    if server is None:
        COUNTS["real"] += 1
        import torch.multiprocessing as mp

        mp.spawn(fn, args=args, nprocs=nprocs, join=True)
        return
    call = {"file": os.path.abspath(inspect.getfile(fn)), "module": fn.__module__, "name": fn.__qualname__}
    request = {"call": call, "nproc": nprocs, "port": 0, "distributed": False, "cwd": os.getcwd(),
               "env": dict(os.environ)}
    out = _run_forked(server, request, timeout, tuple(args))
    if out.returncode != 0:
        raise AssertionError(f"a worker of {fn.__qualname__} failed ({out.returncode}):\n"
                             + out.stdout[-2000:] + out.stderr[-6000:])


if __name__ == "__main__":
    serve()
