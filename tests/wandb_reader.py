"""Read an offline W&B run back with wandb's own protobuf classes.

wandb 0.31 dropped its Python reader of the `.wandb` file. The file is a 7-byte W&B header
(":W&B", magic 0xBEE1, version) followed by a LevelDB-log stream: 32 KiB blocks of chunks, each with
a 7-byte header (crc32 of type + payload, little-endian length, type FULL/FIRST/MIDDLE/LAST).
A chunk never starts in the last 6 bytes of a block; those bytes are zero padding.
Each reassembled payload is one serialized `wandb_internal_pb2.Record`.
"""

import json
import struct
import zlib
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK_LEN = 32768
HEADER_LEN = 7
FILE_IDENT = b":W&B"
FILE_MAGIC = 0xBEE1
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_payloads(data: bytes) -> list[bytes]:
    ident, magic, _version = struct.unpack("<4sHB", data[:HEADER_LEN])
    assert ident == FILE_IDENT and magic == FILE_MAGIC, (ident, hex(magic))
    pos, parts, payloads = HEADER_LEN, [], []
    while pos + HEADER_LEN <= len(data):
        left = BLOCK_LEN - pos % BLOCK_LEN
        if left < HEADER_LEN:  # the block's zero trailer: the next chunk starts in the next block
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER_LEN])
        payload = data[pos + HEADER_LEN : pos + HEADER_LEN + length]
        if len(payload) < length:  # a chunk cut off by a writer that was still running
            break
        assert zlib.crc32(bytes([kind]) + payload) == crc, f"bad checksum at byte {pos}"
        pos += HEADER_LEN + length
        if kind == FULL:
            payloads.append(payload)
        elif kind == FIRST:
            parts = [payload]
        elif kind == MIDDLE:
            parts.append(payload)
        elif kind == LAST:
            payloads.append(b"".join([*parts, payload]))
            parts = []
        else:
            raise AssertionError(f"unknown chunk type {kind} at byte {pos}")
    return payloads


def read_records(path: Path) -> list[wandb_internal_pb2.Record]:
    return [wandb_internal_pb2.Record.FromString(p) for p in read_payloads(path.read_bytes())]


def item_key(item) -> str:
    return item.key or "/".join(item.nested_key)


def history(records) -> list[dict]:
    """One dict per logged history row, values decoded from their JSON."""
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            rows.append({item_key(i): json.loads(i.value_json) for i in r.history.item})
    return rows


def run_record(records):
    """The run's identity (id, group, display name, tags, config) as first written."""
    return next(r.run for r in records if r.WhichOneof("record_type") == "run")


def config_values(records) -> dict:
    """The run config: the run record's, then every later config update."""
    out = {item_key(i): json.loads(i.value_json) for i in run_record(records).config.update}
    for r in records:
        if r.WhichOneof("record_type") == "config":
            out |= {item_key(i): json.loads(i.value_json) for i in r.config.update}
    return out


def run_files(run_dir: Path) -> list[Path]:
    """Every `.wandb` file under a run dir (one per start of the run, resumes included)."""
    return sorted(run_dir.glob("wandb/*run-*/run-*.wandb"))
