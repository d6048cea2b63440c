"""The history of an offline Weights & Biases run, read from its `run-*.wandb` file (a LevelDB-style log of
protobuf records: a 7-byte file header, then records of a 7-byte header (CRC32, length, kind) in 32 KiB blocks)."""
from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _records(data: bytes) -> list[bytes]:
    assert data[:4] == b":W&B", "not a .wandb file"
    out, chunks, pos = [], [], 7
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        chunks.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (FULL, LAST):
            out.append(b"".join(chunks))
            chunks = []
    return out


def history(folder: Path) -> list[dict]:
    """Each history row ({key: value, "_step": step}) of the one offline run under `folder`."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = sorted(Path(folder).glob("wandb/offline-run-*/run-*.wandb"))
    rows = []
    for raw in _records(path.read_bytes()):
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows
