"""The console progress line: step, loss, steps/s, tokens/s and the estimated time left."""

from __future__ import annotations

import collections
import contextlib
import math
import time
from collections.abc import Iterator, Mapping


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

    Time spent inside :meth:`paused` (evaluation, checkpoint saves) is not training time and is
    left out of every speed. The ETA uses the speed over the last ``window`` logging intervals,
    leaving out the first interval after a (re)start, which includes compilation, as soon as
    there is another one.
    """

    def __init__(
        self, total_steps: int, start_step: int, tokens_per_step: int, window: int = 10
    ) -> None:
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self._step = start_step
        self._time = time.perf_counter()
        self._paused = 0.0
        self._steps_per_sec = 0.0
        self._first: tuple[int, float] | None = None
        self._recent: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time inside this block does not count as training time."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self._paused += time.perf_counter() - began

    def update(self, step: int) -> dict[str, float]:
        """Speeds since the previous call: ``train/steps_per_sec``, ``train/tokens_per_sec``."""
        now = time.perf_counter()
        elapsed = max(now - self._time - self._paused, 1e-9)
        interval = (step - self._step, elapsed)
        if self._first is None:
            self._first = interval
        else:
            self._recent.append(interval)
        self._steps_per_sec = interval[0] / elapsed
        self._step, self._time, self._paused = step, now, 0.0
        return {
            "train/steps_per_sec": self._steps_per_sec,
            "train/tokens_per_sec": self._steps_per_sec * self.tokens_per_step,
        }

    def eta_seconds(self, step: int) -> float:
        intervals = list(self._recent) or ([self._first] if self._first else [])
        steps = sum(s for s, _ in intervals)
        seconds = sum(t for _, t in intervals)
        rate = steps / seconds if seconds > 0 else 0.0
        return (self.total_steps - step) / max(rate, 1e-9)

    def print(self, step: int, record: Mapping[str, float], skipped: int = 0) -> None:
        """The step line; ``skipped`` counts this window's non-finite steps (loss n/a if all)."""
        width = len(str(self.total_steps))
        loss = record["train/loss"]
        shown = f"loss {loss:.4f}" if math.isfinite(loss) else "loss n/a"
        if skipped:
            shown += f" ({skipped} skipped)"
        print(
            f"step {step:{width}d}/{self.total_steps} | {shown} | "
            f"{record['train/steps_per_sec']:.2f} steps/s | "
            f"{record['train/tokens_per_sec']:,.0f} tokens/s | "
            f"ETA {format_duration(self.eta_seconds(step))}",
            flush=True,
        )

    def print_eval(self, step: int, record: Mapping[str, float]) -> None:
        """Prints ``eval/<split>/<name>`` scalars, one line per split; breakdowns
        (``<name>/<bucket>``, such as addition's 2,500 ``accuracy/<la>x<lb>``) are only counted:
        they stay in metrics.jsonl."""
        splits: dict[str, list[str]] = {}
        hidden: dict[str, int] = {}
        for key, value in record.items():
            if not key.startswith("eval/"):
                continue
            split, _, name = key.removeprefix("eval/").partition("/")
            splits.setdefault(split, [])
            if "/" in name:
                hidden[split] = hidden.get(split, 0) + 1
            else:
                splits[split].append(f"{name} {value:.4f}")
        for split, parts in splits.items():
            count = hidden.get(split)
            more = [f"+{count} breakdown values in metrics.jsonl"] if count else []
            print(f"eval step {step} | {split}: {', '.join(parts + more)}", flush=True)
