"""`pretrain_gpt.py` with faults injected from a plan, for the soak test (tests/e2e/test_fault_soak.py):
`fault_plan.py PLAN.json -- <flags>`.

PLAN.json: {"dir": folder for markers, "faults": [{"kind", "rank", "iteration"}, ...]}. Fault k fires once, the first
time rank `rank` of any torchrun attempt starts the iteration after `iteration` (a marker file records that it
fired, so a restarted attempt that passes the same iteration again runs on):
  kill      SIGKILL: a dead rank
  stop      SIGSTOP: a hung rank (the other's collective times out; torchrun kills the stopped one)
  stall     the main thread sleeps: a rank stuck outside the collectives (--exit-on-stall-seconds ends it)
  bitflip   one bit of the newest checkpoint's model file flipped, then SIGKILL: a bad disk, then a crash
  truncate  the newest checkpoint's model file cut to half, then SIGKILL: a node lost mid-write
  enospc    this rank's next checkpoint file hits a full disk halfway: a failed save the run goes on after
"""
from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time
from pathlib import Path


def _newest_model_file(save: Path) -> Path:
    from megatron.checkpoint import store

    return store.model_file(store.iteration_dir(save, store.read_tracker(save)))


def install(plan: dict, save: Path) -> None:
    from megatron.checkpoint import manifest
    from megatron.training.loop import Trainer

    markers = Path(plan["dir"])
    rank = int(os.environ.get("RANK", "0"))
    full_disk = {"armed": False}
    write = manifest.ChecksumFile.write

    def checksum_write(self, data):
        if full_disk["armed"] and self.bytes > 0:
            full_disk["armed"] = False
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, data)

    manifest.ChecksumFile.write = checksum_write
    step = Trainer.train_step

    def train_step(self, *args, **kwargs):
        for k, fault in enumerate(plan["faults"]):
            marker = markers / f"fault_{k:02d}_{fault['kind']}"
            if fault["rank"] != rank or fault["iteration"] != self.state.iteration or marker.exists():
                continue
            marker.write_text(f"attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT')}")
            print(f"fault {k}: {fault['kind']} on rank {rank} after iteration {self.state.iteration}", flush=True)
            kind = fault["kind"]
            if kind in ("bitflip", "truncate"):
                target = _newest_model_file(save)
                data = bytearray(target.read_bytes())
                if kind == "bitflip":
                    data[len(data) // 2] ^= 0x04
                else:
                    data = data[:len(data) // 2]
                target.write_bytes(bytes(data))
            if kind in ("kill", "bitflip", "truncate"):
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif kind == "stall":
                time.sleep(3600)
            elif kind == "enospc":
                full_disk["armed"] = True
        return step(self, *args, **kwargs)

    Trainer.train_step = train_step


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.support import pretrain_main

    argv = sys.argv[sys.argv.index("--") + 1:]
    install(json.loads(Path(sys.argv[1]).read_text()), Path(argv[argv.index("--save") + 1]))
    pretrain_main.run(argv)
