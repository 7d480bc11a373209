"""Metrics sinks: ``<workdir>/metrics.jsonl`` and TensorBoard event files, without TensorFlow.

TensorBoard reads TFRecord files of ``Event`` protocol buffers. Scalars need only a handful of
fields, so they are encoded here by hand (protobuf wire format, CRC-32C framing) instead of
pulling TensorFlow or tensorboardX into the dependencies: ``tensorboard --logdir <workdir>``
shows them.
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import time
from collections.abc import Mapping
from pathlib import Path

_CRC32C_POLY = 0x82F63B78  # Castagnoli, reflected


def _crc_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ _CRC32C_POLY if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``, as TFRecord framing uses."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _length_delimited(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def encode_event(wall_time: float, step: int, scalars: Mapping[str, float]) -> bytes:
    """An ``Event{wall_time, step, summary{value{tag, simple_value}...}}`` message."""
    values = b"".join(
        _length_delimited(
            1, _length_delimited(1, tag.encode()) + b"\x15" + struct.pack("<f", float(value))
        )
        for tag, value in scalars.items()
    )
    head = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step & (2**64 - 1))
    return head + _length_delimited(5, values)


def encode_file_version(wall_time: float) -> bytes:
    """The first record of every event file: ``Event{wall_time, file_version}``."""
    return b"\x09" + struct.pack("<d", wall_time) + _length_delimited(3, b"brain.Event:2")


def tfrecord(data: bytes) -> bytes:
    """TFRecord framing: length, masked CRC of the length, data, masked CRC of the data."""
    length = struct.pack("<Q", len(data))
    return (
        length
        + struct.pack("<I", masked_crc32c(length))
        + data
        + struct.pack("<I", masked_crc32c(data))
    )


class MetricsWriter:
    """Appends one JSON line per ``write`` (flushed) and TensorBoard scalars per split.

    ``write(step, {"train/loss": 0.5, ...})`` writes ``{"step": step, "train/loss": 0.5}`` to
    metrics.jsonl and the scalars to ``<workdir>/tb/events.out.tfevents.*``. Non-finite values
    are written as JSON null (JSON has no NaN) and left out of TensorBoard.
    """

    def __init__(self, workdir: str | os.PathLike, enabled: bool = True) -> None:
        self.enabled = enabled
        self.path = Path(workdir) / "metrics.jsonl"
        self._jsonl = None
        self._events = None
        if not enabled:
            return
        Path(workdir).mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.path, "a", encoding="utf-8")
        tb_dir = Path(workdir) / "tb"
        tb_dir.mkdir(exist_ok=True)
        now = time.time()
        name = f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}"
        self._events = open(tb_dir / name, "ab")
        self._events.write(tfrecord(encode_file_version(now)))
        self._events.flush()

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: (float(v) if math.isfinite(float(v)) else None) for k, v in scalars.items()}
        assert self._jsonl is not None and self._events is not None
        self._jsonl.write(json.dumps({"step": int(step), **clean}) + "\n")
        self._jsonl.flush()
        finite = {k: v for k, v in clean.items() if v is not None}
        self._events.write(tfrecord(encode_event(time.time(), int(step), finite)))
        self._events.flush()

    def close(self) -> None:
        for handle in (self._jsonl, self._events):
            if handle is not None:
                handle.close()
        self._jsonl = self._events = None


def read_jsonl(path: str | os.PathLike) -> list[dict[str, float]]:
    """The records of a metrics.jsonl file; a torn last line (killed mid-write) is skipped."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def truncate_after(path: str | os.PathLike, step: int) -> None:
    """Drops records of steps after ``step`` (a resumed run re-does them), atomically."""
    path = Path(path)
    if not path.exists():
        return
    kept = [r for r in read_jsonl(path) if r.get("step", 0) <= step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    os.replace(tmp, path)
