"""Metrics sinks: ``<workdir>/metrics.jsonl`` and TensorBoard event files (``tensorboardX``).

``tensorboard --logdir <workdir>`` shows the scalars; tensorboardX writes the event files
without TensorFlow. A resumed run re-does the steps after its checkpoint, so neither sink may
show a step twice: metrics.jsonl is cut back to the checkpoint's step (:func:`truncate_after`),
and the new event file starts with TensorBoard's purge marker for the next step
(``SummaryWriter(purge_step=...)``: a ``SessionLog.START`` event), after which TensorBoard's
readers drop the earlier files' events from that step on.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path

from tensorboardX import SummaryWriter


class MetricsWriter:
    """Appends one JSON line per ``write`` (flushed) and TensorBoard scalars.

    ``write(step, {"train/loss": 0.5, ...})`` writes ``{"step": step, "train/loss": 0.5}`` to
    metrics.jsonl and the scalars to ``<workdir>/tb/events.out.tfevents.*``. Non-finite values
    are written as JSON null (JSON has no NaN) and left out of TensorBoard.

    Args:
      workdir: the run's directory.
      enabled: False on every process but the main one.
      resumed_from: the checkpoint step a resumed run starts after (None for a new run):
        TensorBoard then hides the earlier files' events of later steps.
    """

    def __init__(
        self, workdir: str | os.PathLike, enabled: bool = True, resumed_from: int | None = None
    ) -> None:
        self.enabled = enabled
        self.workdir = Path(workdir)
        self.path = self.workdir / "metrics.jsonl"
        self.resumed_from = resumed_from
        self._jsonl = None
        self._events: SummaryWriter | None = None

    def _open(self) -> None:
        """Opens both sinks at the first write, so that a run with nothing to log (a rerun of
        a finished workdir) leaves no new empty event file."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.path, "a", encoding="utf-8")
        purge = None if self.resumed_from is None else self.resumed_from + 1
        # tensorboardX names the file by the second and the host and truncates an existing
        # one: a resumed run within the same second would erase the first file's events. The
        # suffix keeps names unique, in creation order (TensorBoard reads files sorted by name).
        suffix = f".{time.time_ns()}.{os.getpid()}"
        self._events = SummaryWriter(
            str(self.workdir / "tb"), purge_step=purge, filename_suffix=suffix
        )

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        if self._jsonl is None:
            self._open()
        clean = {k: (float(v) if math.isfinite(float(v)) else None) for k, v in scalars.items()}
        assert self._jsonl is not None and self._events is not None
        self._jsonl.write(json.dumps({"step": int(step), **clean}) + "\n")
        self._jsonl.flush()
        for tag, value in clean.items():
            if value is not None:
                self._events.add_scalar(tag, value, int(step))
        self._events.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._events is not None:
            self._events.close()
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
