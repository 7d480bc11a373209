"""The console progress line: step, loss, steps/s, tokens/s and the estimated time left."""

from __future__ import annotations

import time
from collections.abc import Mapping


def format_duration(seconds: float) -> str:
    """``3725`` -> ``"1h02m05s"``; ``65`` -> ``"1m05s"``; ``9.2`` -> ``"9s"``."""
    seconds = max(round(seconds), 0)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


class Progress:
    """Measures speed between calls of :meth:`update` and prints one line per log step.

    The first interval after a (re)start includes compilation, so its speed is low; the ETA
    uses the latest interval's speed.
    """

    def __init__(self, total_steps: int, start_step: int, tokens_per_step: int) -> None:
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self._step = start_step
        self._time = time.perf_counter()
        self._steps_per_sec = 0.0

    def update(self, step: int) -> dict[str, float]:
        """Speeds since the previous call: ``train/steps_per_sec``, ``train/tokens_per_sec``."""
        now = time.perf_counter()
        elapsed = max(now - self._time, 1e-9)
        self._steps_per_sec = (step - self._step) / elapsed
        self._step, self._time = step, now
        return {
            "train/steps_per_sec": self._steps_per_sec,
            "train/tokens_per_sec": self._steps_per_sec * self.tokens_per_step,
        }

    def eta_seconds(self, step: int) -> float:
        return (self.total_steps - step) / max(self._steps_per_sec, 1e-9)

    def print(self, step: int, record: Mapping[str, float]) -> None:
        width = len(str(self.total_steps))
        print(
            f"step {step:{width}d}/{self.total_steps} | loss {record['train/loss']:.4f} | "
            f"{record['train/steps_per_sec']:.2f} steps/s | "
            f"{record['train/tokens_per_sec']:,.0f} tokens/s | "
            f"ETA {format_duration(self.eta_seconds(step))}",
            flush=True,
        )

    def print_eval(self, step: int, record: Mapping[str, float]) -> None:
        """Prints ``eval/<split>/<name>`` scalars; breakdowns (``<name>/<bucket>``) are counted.

        Breakdowns such as addition's 2,500 ``accuracy/<la>x<lb>`` stay in metrics.jsonl only.
        """
        names = [k.removeprefix("eval/") for k in record if k.startswith("eval/")]
        shown = [name for name in names if name.count("/") <= 1]
        parts = [f"{name} {record['eval/' + name]:.4f}" for name in shown]
        if len(shown) < len(names):
            parts.append(f"+{len(names) - len(shown)} breakdown values in metrics.jsonl")
        print(f"eval at step {step}: " + " | ".join(parts), flush=True)
