"""Stopping on SIGTERM (preemption) or Ctrl-C: save at the current step, then exit cleanly.

Cloud and TPU schedulers preempt with SIGTERM and a grace period. A single process catches
SIGTERM and SIGINT here and the training loop, asking :meth:`StopSignal.reached` after every
step, saves a checkpoint at that step and raises :class:`Preempted`. Several processes must
save the same step together: there JAX's preemption service (on by default,
``jax_enable_preemption_service``, started by ``jax.distributed.initialize``) catches SIGTERM
on any process and agrees on a step that every process reaches; orbax's
``CheckpointManager.reached_preemption(step)`` asks it. Ctrl-C on one of several processes is
turned into a SIGTERM to itself, so it takes the same road.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

import jax

EXIT_CODES = {signal.SIGTERM: 128 + signal.SIGTERM, signal.SIGINT: 128 + signal.SIGINT}


class Preempted(Exception):
    """Training stopped at a signal after saving; ``exit_code`` is 128 + the signal number."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class StopSignal:
    """Catches SIGTERM and SIGINT while installed (a context manager).

    Args:
      manager: the orbax CheckpointManager (asked about the multi-process sync point).
    """

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.received: int | None = None
        self._multi = jax.process_count() > 1
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:  # a second Ctrl-C or SIGTERM: stop now, without saving
            raise KeyboardInterrupt
        self.received = signum
        if self._multi and signum == signal.SIGINT:
            os.kill(os.getpid(), signal.SIGTERM)  # JAX's preemption notifier takes it from here

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set from the main thread
        wanted = [signal.SIGINT] if self._multi else [signal.SIGTERM, signal.SIGINT]
        for signum in wanted:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def reached(self, step: int) -> bool:
        """True when the run should save at ``step`` and stop (every process gets the same)."""
        if self._multi:
            if self.manager.reached_preemption(step):
                self.received = self.received or signal.SIGTERM
                return True
            return False
        return self.received is not None

    def exit_code(self) -> int:
        return EXIT_CODES.get(self.received or signal.SIGTERM, 143)

    def name(self) -> str:
        return signal.Signals(self.received or signal.SIGTERM).name
