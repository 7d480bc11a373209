"""Read-only directories that hold for root too: tests running as root (containers, CI) are not
stopped by ``chmod``, so their subprocesses drop to the unprivileged ``nobody`` user."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

NOBODY = 65534


def make_read_only(root: Path) -> None:
    """Removes write permission from ``root`` and everything in it (read and enter stay)."""
    for path in [root, *root.rglob("*")]:
        mode = path.stat().st_mode
        path.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH) | stat.S_IROTH
                   | (stat.S_IXOTH if path.is_dir() else 0))  # fmt: skip


def make_writable(root: Path) -> None:
    for path in [root, *root.rglob("*")]:
        path.chmod(path.stat().st_mode | stat.S_IWUSR)


def subprocess_kwargs(home: Path) -> dict[str, Any]:
    """subprocess.run arguments that make a read-only directory read-only for the child: as
    root, run it as ``nobody`` (with a writable HOME for its caches)."""
    if os.geteuid() != 0:
        return {}
    if not _others_may_run(Path(sys.executable).resolve()):
        pytest.skip(
            f"nobody may not run {sys.executable} (it or a directory above it is closed to others)"
        )
    home.mkdir(parents=True, exist_ok=True)
    os.chown(home, NOBODY, NOBODY)
    return {"user": NOBODY, "group": NOBODY, "extra_groups": []}


def _others_may_run(executable: Path) -> bool:
    """Whether a user outside the file's owner and group may run ``executable``: it and every
    directory above it open to others (a Python under root's home is not)."""
    return all(path.stat().st_mode & stat.S_IXOTH for path in [executable, *executable.parents])
