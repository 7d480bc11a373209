"""Training runs side by side on a CPU: each its own ``python -m copejax.main`` process on one
CPU, its output labelled (the demo, and the studies' ``--jobs N``).

Each run is the command a results page lists (``python -m copejax.main --config=...
--workdir=...``), started with

- ``XLA_FLAGS`` plus :data:`SINGLE_THREAD_FLAGS` (Eigen's matrix products on the calling
  thread), and
- its CPU affinity set to one CPU before it imports anything (``os.sched_setaffinity``, on
  systems that have it), which XLA's own thread pool follows.

Until 2026-12-08 the studies' workers had only the first, with an
``intra_op_parallelism_threads=1`` that XLA_FLAGS skips without a word (a word after a
``--`` flag that is not one), so each computed on every core.

Why pin: a run's numbers then do not depend on the machine's core count. On this project's
2-core machine, Flip-Flop ``configs/flipflop.py:cpu,position=cope`` (600 steps, seed 0) ended
at 15.2 % test error (35.7 % at 4x the length, sparse) with XLA's defaults, at 0.0 % (4.6 %)
with Eigen on one thread and XLA on both cores, and at 0.0 % (0.33 %) on one CPU, the same
whether ``taskset -c 0`` or this module pinned it. Flip-Flop's training has a plateau, and
whether one seed leaves it in time hangs on the order of float sums, which the thread count
sets. Small runs lose little speed: the demo's three runs took 5 min 46 s here, two at a time
on one CPU each, against 5 min 43 s one after another on both cores.

Each output line comes out as ``[label] line``. SIGINT (Ctrl-C) or SIGTERM reaches this
process alone (the runs have their own sessions) and is passed on to every run, which saves at
its current step and stops (``copejax.main``); no new run starts, and the caller learns the
signal from :class:`Outcome` (running the same command again resumes). A second Ctrl-C is
passed on too, and stops the runs without saving.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import IO

SINGLE_THREAD_FLAGS = "--xla_cpu_multi_thread_eigen=false"
# The child's first lines: its affinity, set before the module it runs imports JAX.
_PINNED = (
    "import os, runpy, sys\n"
    "if hasattr(os, 'sched_setaffinity'): os.sched_setaffinity(0, {int(sys.argv[1])})\n"
    "sys.argv = sys.argv[2:]\n"
    "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n"
)
_STOPPING = (signal.SIGINT, signal.SIGTERM)


@dataclasses.dataclass(frozen=True)
class Job:
    """One run: a ``label`` for its output lines and the module it runs with its arguments,
    e.g. ``("copejax.main", "--config=configs/flipflop.py:cpu", "--workdir=...")``."""

    label: str
    argv: tuple[str, ...]

    @classmethod
    def training(cls, label: str, config_file: str | os.PathLike, arg: str, workdir: Path) -> Job:
        """``python -m copejax.main --config=<config_file>:<arg> --workdir=<workdir>``, the
        paths absolute (so the run does not depend on where it is started)."""
        config = Path(config_file).resolve()
        return cls(
            label,
            ("copejax.main", f"--config={config}:{arg}", f"--workdir={Path(workdir).resolve()}"),
        )

    def command(self) -> str:
        """The command line that runs this job alone."""
        return " ".join(("python -m", *self.argv))


@dataclasses.dataclass(frozen=True)
class Outcome:
    """Exit status per job label (jobs that never started have none) and the signal that
    stopped the batch (None when every job ran)."""

    codes: dict[str, int]
    stopped_by: int | None = None

    def failed(self) -> list[str]:
        return [label for label, code in self.codes.items() if code != 0]


def usable_cpus() -> list[int]:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _relay(stream: IO[str], prefix: str) -> None:
    """Copies a run's output lines to this process's stdout, each after ``prefix``; reads to
    the end whatever this stdout can print, so that the run never blocks on a full pipe."""
    for line in stream:
        try:
            sys.stdout.write(prefix + line)
        except UnicodeEncodeError:
            sys.stdout.write((prefix + line).encode("ascii", "replace").decode("ascii"))
        sys.stdout.flush()


def run_pinned(jobs: Sequence[Job], processes: int) -> Outcome:
    """Runs ``jobs`` in order, at most ``processes`` at once, each on one CPU of
    :func:`usable_cpus` (round robin when there are more processes than CPUs). Returns when
    every started job has exited."""
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    flags = f"{os.environ.get('XLA_FLAGS', '')} {SINGLE_THREAD_FLAGS}".strip()
    env = dict(os.environ, XLA_FLAGS=flags, PYTHONUNBUFFERED="1", PYTHONIOENCODING="utf-8")
    cpus = usable_cpus()
    pending = list(jobs)
    running: dict[subprocess.Popen, tuple[Job, int, threading.Thread]] = {}
    codes: dict[str, int] = {}
    stopped: list[int] = []

    def stop(signum: int, frame: FrameType | None) -> None:
        stopped.append(signum)
        for child in running:
            child.send_signal(signum)

    previous = {s: signal.signal(s, stop) for s in _STOPPING}
    try:
        while running or (pending and not stopped):
            while pending and not stopped and len(running) < processes:
                job = pending.pop(0)
                busy = [cpu for _, cpu, _ in running.values()]
                cpu = min(cpus, key=busy.count)  # the first of the least busy
                child = subprocess.Popen(
                    [sys.executable, "-c", _PINNED, str(cpu), *job.argv],
                    env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    text=True, encoding="utf-8", errors="replace", start_new_session=True,
                )  # fmt: skip
                relay = threading.Thread(target=_relay, args=(child.stdout, f"[{job.label}] "))
                relay.start()
                running[child] = (job, cpu, relay)
            for child in [c for c in running if c.poll() is not None]:
                job, _, relay = running.pop(child)
                relay.join()
                codes[job.label] = child.returncode
            time.sleep(0.1)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for child in running:  # only after an error here: the runs are not left behind
            child.kill()
    return Outcome(codes, stopped[0] if stopped else None)
