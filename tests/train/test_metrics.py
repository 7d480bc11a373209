"""metrics.jsonl, and TensorBoard event files read back by TensorBoard's own reader."""

from __future__ import annotations

import json
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from copejax.runtime.metrics import MetricsWriter, read_jsonl, truncate_after


def tensorboard_scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag's (step, value) pairs as TensorBoard shows them (purges applied)."""
    accumulator = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def test_writer_jsonl_and_tensorboard_scalars(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path)
    writer.write(5, {"train/loss": 1.25, "eval/test/error": 0.5})
    writer.write(10, {"train/loss": float("nan")})
    writer.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [
        {"step": 5, "train/loss": 1.25, "eval/test/error": 0.5},
        {"step": 10, "train/loss": None},
    ]
    # NaN is left out of TensorBoard.
    assert tensorboard_scalars(tmp_path / "tb") == {
        "train/loss": [(5, 1.25)],
        "eval/test/error": [(5, 0.5)],
    }


def test_resumed_writer_hides_the_redone_steps(tmp_path: Path) -> None:
    first = MetricsWriter(tmp_path)
    for step in (1, 2, 3, 4):
        first.write(step, {"train/loss": float(step)})
    first.close()  # as if killed after step 4, checkpoint at step 2
    truncate_after(tmp_path / "metrics.jsonl", 2)
    resumed = MetricsWriter(tmp_path, resumed_from=2)
    for step in (3, 4, 5):
        resumed.write(step, {"train/loss": 10.0 + step})
    resumed.close()
    assert tensorboard_scalars(tmp_path / "tb") == {
        "train/loss": [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0)]
    }
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]


def test_a_disabled_writer_writes_nothing(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path / "run", enabled=False)
    writer.write(1, {"train/loss": 1.0})
    writer.close()
    assert not (tmp_path / "run").exists()


def test_torn_last_line_and_truncation(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "x": s / 2}) for s in (1, 2, 3)]
    path.write_text("\n".join(lines) + '\n{"step": 4, "x"')
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]
    truncate_after(path, 2)
    assert read_jsonl(path) == [{"step": 1, "x": 0.5}, {"step": 2, "x": 1.0}]
