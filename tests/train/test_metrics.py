"""metrics.jsonl and TensorBoard event files, decoded here by an independent reader."""

from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path

from copejax.metrics import MetricsWriter, crc32c, masked_crc32c, read_jsonl, truncate_after


def _crc32c_bitwise(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 * (crc & 1))
    return crc ^ 0xFFFFFFFF


def test_crc32c_check_value_and_bitwise_reference() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C standard check value
    data = bytes(range(256)) * 3
    assert crc32c(data) == _crc32c_bitwise(data)


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        i += 1
        shift += 7
        if not byte & 0x80:
            return value, i


def _fields(buf: bytes) -> list[tuple[int, object]]:
    """(field number, value) of a protobuf message; length-delimited values as bytes."""
    out, i = [], 0
    while i < len(buf):
        key, i = _varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = struct.unpack("<d", buf[i : i + 8])[0], i + 8
        elif wire == 5:
            value, i = struct.unpack("<f", buf[i : i + 4])[0], i + 4
        else:
            size, i = _varint(buf, i)
            value, i = buf[i : i + size], i + size
        out.append((field, value))
    return out


def _records(path: Path) -> list[bytes]:
    buf, i, records = path.read_bytes(), 0, []
    while i < len(buf):
        header = buf[i : i + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", buf[i + 8 : i + 12])[0] == masked_crc32c(header)
        data = buf[i + 12 : i + 12 + length]
        assert struct.unpack("<I", buf[i + 12 + length : i + 16 + length])[0] == masked_crc32c(data)
        records.append(data)
        i += 16 + length
    return records


def test_writer_jsonl_and_tensorboard_scalars(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path)
    writer.write(5, {"train/loss": 1.25, "eval/test/error": 0.5})
    writer.write(10, {"train/loss": float("nan")})
    writer.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [
        {"step": 5, "train/loss": 1.25, "eval/test/error": 0.5},
        {"step": 10, "train/loss": None},
    ]
    (events,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    first, second, third = (dict(_fields(r)) | {"all": _fields(r)} for r in _records(events))
    assert first[3] == b"brain.Event:2"
    assert second[2] == 5 and math.isclose(second[1], time.time(), abs_tol=60)
    values = [dict(_fields(v)) for field, v in _fields(second[5]) if field == 1]
    assert {v[1].decode(): v[2] for v in values} == {"train/loss": 1.25, "eval/test/error": 0.5}
    assert third[2] == 10 and _fields(third[5]) == []  # NaN left out of TensorBoard


def test_torn_last_line_and_truncation(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "x": s / 2}) for s in (1, 2, 3)]
    path.write_text("\n".join(lines) + '\n{"step": 4, "x"')
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]
    truncate_after(path, 2)
    assert read_jsonl(path) == [{"step": 1, "x": 0.5}, {"step": 2, "x": 1.0}]
