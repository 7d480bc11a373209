"""One run per workdir at a time: an exclusive ``flock`` on ``<workdir>/.lock``.

The kernel drops the lock when its process ends, however it ends (SIGKILL included), so a
lock left by a dead process never blocks the next run: the file stays, the lock does not. The
file holds the holder's pid, host and start time, for the message a second run gets. flock
needs a local or flock-aware filesystem (NFSv4 and most cluster filesystems are).
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path
from typing import IO

LOCK_FILE = ".lock"


class WorkdirBusyError(ValueError):
    """Another live process holds the workdir's lock."""


class WorkdirUnusableError(ValueError):
    """The workdir cannot be created or written (a file, a read-only directory...)."""


def prepare(root: Path) -> None:
    """Creates ``root`` if needed; a ValueError in one line when it is not a usable directory."""
    if root.exists() and not root.is_dir():
        raise WorkdirUnusableError(f"--workdir {root} is a file, not a directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise WorkdirUnusableError(f"cannot create --workdir {root}: {error.strerror}") from None


class WorkdirLock:
    """Holds ``<root>/.lock`` from :meth:`acquire` to :meth:`release`."""

    def __init__(self, root: Path) -> None:
        self.path = root / LOCK_FILE
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        """Takes the lock or raises WorkdirBusyError naming the holder.

        Raises:
          WorkdirBusyError: a live process holds it.
          WorkdirUnusableError: the lock file cannot be written (a read-only workdir).
        """
        try:
            handle = open(self.path, "a+", encoding="utf-8")
        except OSError as error:
            raise WorkdirUnusableError(
                f"--workdir {self.path.parent} is not writable ({error.strerror}); a run writes "
                "its checkpoints and metrics there: use a writable --workdir"
            ) from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown process"
            handle.close()
            raise WorkdirBusyError(
                f"--workdir {self.path.parent} is in use by another run ({holder}); wait for it "
                "to end, or use another --workdir"
            ) from None
        try:
            handle.seek(0)
            handle.truncate()
            started = time.strftime("%Y-%m-%d %H:%M:%S")
            handle.write(f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n")
            handle.flush()
        except OSError as error:
            handle.close()
            raise WorkdirUnusableError(
                f"--workdir {self.path.parent} is not writable ({error.strerror})"
            ) from None
        self._file = handle

    def release(self) -> None:
        """Drops the lock (the file stays: removing it could let two runs lock two files)."""
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
