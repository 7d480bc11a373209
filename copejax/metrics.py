"""Metrics sinks: ``<workdir>/metrics.jsonl`` and TensorBoard event files, without TensorFlow.

TensorBoard reads TFRecord files of ``Event`` protocol buffers. Scalars need only a handful of
fields, so they are encoded here by hand (protobuf wire format, CRC-32C framing) instead of
pulling TensorFlow or tensorboardX into the dependencies: ``tensorboard --logdir <workdir>``
shows them. A resumed run re-does the steps after its checkpoint, so both sinks are cut back to
that step first (:func:`truncate_after`, :func:`truncate_events_after`): no step is logged twice.
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
        self.workdir = Path(workdir)

    def _open(self) -> None:
        """Opens both sinks at the first write, so that a run with nothing to log (a rerun of
        a finished workdir) leaves no new empty event file."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.path, "a", encoding="utf-8")
        tb_dir = self.workdir / "tb"
        tb_dir.mkdir(exist_ok=True)
        now = time.time()
        name = f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}"
        self._events = open(tb_dir / name, "ab")
        self._events.write(tfrecord(encode_file_version(now)))
        self._events.flush()

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        if self._jsonl is None:
            self._open()
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


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            return value, at


def event_step(data: bytes) -> int:
    """The ``step`` field (2) of an encoded ``Event`` message; 0 when absent."""
    at = 0
    while at < len(data):
        key, at = _read_varint(data, at)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _read_varint(data, at)
            if field == 2:
                return value
        elif wire == 1:
            at += 8
        elif wire == 2:
            length, at = _read_varint(data, at)
            at += length
        elif wire == 5:
            at += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire} in an event record")
    return 0


def read_records(path: str | os.PathLike) -> list[bytes]:
    """The payloads of a TFRecord file, up to the first torn or corrupt record."""
    blob = Path(path).read_bytes()
    records, at = [], 0
    while at + 12 <= len(blob):
        length_bytes = blob[at : at + 8]
        (length,) = struct.unpack("<Q", length_bytes)
        (length_crc,) = struct.unpack("<I", blob[at + 8 : at + 12])
        end = at + 12 + length + 4
        if length_crc != masked_crc32c(length_bytes) or end > len(blob):
            break
        data = blob[at + 12 : at + 12 + length]
        if struct.unpack("<I", blob[end - 4 : end])[0] != masked_crc32c(data):
            break
        records.append(data)
        at = end
    return records


def truncate_events_after(tb_dir: str | os.PathLike, step: int) -> None:
    """Drops TensorBoard events of steps after ``step`` (and torn records) from every event
    file in ``tb_dir``, rewriting each changed file atomically."""
    tb_dir = Path(tb_dir)
    if not tb_dir.is_dir():
        return
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        records = read_records(path)
        kept = [r for r in records if event_step(r) <= step]
        if len(kept) == len(records) and sum(len(r) + 16 for r in records) == path.stat().st_size:
            continue
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(b"".join(tfrecord(r) for r in kept))
        os.replace(tmp, path)
