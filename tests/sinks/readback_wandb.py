"""Read a W&B offline run file (``run-<id>.wandb``) back, record by record.

The file is a LevelDB-style log: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then
32 KiB blocks of chunks. Each chunk has a 7-byte header (crc32 u32, length u16, type u8 with
FULL=1, FIRST=2, MIDDLE=3, LAST=4); a block tail shorter than a header is padding. Records are
``wandb.proto.wandb_internal_pb2.Record`` messages.
"""

from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError
from wandb.proto import wandb_internal_pb2

__all__ = ["WandbRun", "find_run_file", "read_run"]

_BLOCK = 32 * 1024
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


@dataclass
class WandbRun:
    """The records of one offline run, decoded."""

    history: list[dict[str, Any]] = field(default_factory=list)  # one dict per log() call; media
    # and histograms are dicts ({"_type": "histogram", "values": [...], "bins": [...]})
    metrics: list[Any] = field(default_factory=list)  # MetricRecord protos (define_metric)
    config: dict[str, Any] = field(default_factory=dict)
    run: Any = None  # the RunRecord (name, tags, project)
    exit_code: int | None = None
    alerts: list[Any] = field(default_factory=list)  # AlertRecord protos (run.alert: title, text, level)

    def column(self, key: str) -> list[tuple[Any, Any]]:
        """``(tmetrics/step, value)`` for every history row that has ``key``."""
        return [(row.get("tmetrics/step"), row[key]) for row in self.history if key in row]


def _records(data: bytes) -> list[bytes]:
    magic, version = data[:4], data[4:7]
    if magic != b":W&B" or struct.unpack("<HB", version) != (0xBEE1, 0):
        raise ValueError(f"not a W&B run file: header {data[:7]!r}")
    out: list[bytes] = []
    pending = b""
    pos = _HEADER
    while pos + _HEADER <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < _HEADER:  # block trailer padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        payload = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind == _FULL:
            out.append(payload)
        elif kind == _FIRST:
            pending = payload
        elif kind == _MIDDLE:
            pending += payload
        elif kind == _LAST:
            out.append(pending + payload)
            pending = b""
        elif kind == 0 and length == 0:
            break
        else:
            raise ValueError(f"bad chunk type {kind} at byte {pos}")
    return out


def _put(target: dict[str, Any], item: Any, value: Any) -> None:
    """A flat ``key`` or a ``nested_key`` path (media and histograms: ``["h", "_type"]``)."""
    if item.key:
        target[item.key] = value
        return
    *parents, last = item.nested_key
    for name in parents:
        target = target.setdefault(name, {})
    target[last] = value


def find_run_file(wandb_dir: str | Path) -> Path:
    """The single ``run-*.wandb`` file under ``wandb_dir`` (searched recursively)."""
    files = sorted(Path(wandb_dir).rglob("run-*.wandb"))
    if len(files) != 1:
        raise AssertionError(f"expected one W&B run file under {wandb_dir}; found {files}")
    return files[0]


def read_run(path: str | Path, *, timeout: float = 30.0) -> WandbRun:
    """The decoded run, once W&B has written its ``exit`` record (the last one).

    ``finish()`` can return before W&B's service process has written the tail of the file
    (seen on a loaded machine), so this polls until the exit record is there or ``timeout``
    seconds pass (then it returns what is there; a test's assertions then show what is missing).
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            run = _decode(Path(path).read_bytes())
        except (ValueError, DecodeError):  # a chunk still being written
            run = WandbRun()
        if run.exit_code is not None or time.monotonic() > deadline:
            return run
        time.sleep(0.1)


def _decode(data: bytes) -> WandbRun:
    run = WandbRun()
    for raw in _records(data):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row: dict[str, Any] = {}
            for item in record.history.item:
                _put(row, item, json.loads(item.value_json))
            run.history.append(row)
        elif kind == "metric":
            run.metrics.append(record.metric)
        elif kind == "config":
            for item in record.config.update:
                _put(run.config, item, json.loads(item.value_json))
        elif kind == "run":
            run.run = record.run
            for item in record.run.config.update:
                _put(run.config, item, json.loads(item.value_json))
        elif kind == "alert":
            run.alerts.append(record.alert)
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    return run
