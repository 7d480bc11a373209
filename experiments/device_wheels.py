"""The wheels a GPU machine without copejax's data and logging packages needs, ready to carry.

    python -m experiments.device_wheels          # here: downloads them into .whl/ (git-ignored)

The accelerator image this project is lent (Python 3.12, jax 0.11.2, flax, optax, orbax and
their needs, no network) lacks a few of copejax's runtime packages: grain (and array_record,
which it reads), ml_collections, tensorboardX, portpicker, importlib_resources and tzdata, and
its flax needs a newer release than ours (``DEVICE_VERSIONS``). This
downloads those at the versions ``constraints.txt`` pins, as CPython 3.12 manylinux wheels
without their dependencies (the image has the rest), and prints the line that installs them
there at the start of the device call, e.g. before
``JAX_PLATFORMS=cuda python -m experiments.bench_kernels_gpu`` (issue 45's measurement).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The runtime packages (and their needs) missing from the device image's package list.
MISSING_ON_DEVICE = (
    "array_record",
    "grain",
    "importlib_resources",
    "ml_collections",
    "portpicker",
    "tensorboardX",
    "tzdata",
)
# Carried at another version than constraints.txt's: flax 0.12.8 imports
# jax.experimental.hijax.HiPrimitive, which the device's jax 0.11.2 lacks; 0.12.10 ran the
# whole test suite on jax 0.11.2 and the first H100 measurement (2026-11-27).
DEVICE_VERSIONS = {"flax": "0.12.10"}
PYTHON_VERSION = "3.12"
PLATFORMS = (  # pip matches a wheel's manylinux tag exactly: the ones these wheels carry
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
INSTALL = (
    "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
    "--target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit;"
)


def normal_name(name: str) -> str:
    """A package name as pip compares them: lower case, runs of -_. as one dash."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(
    constraints: Path = ROOT / "constraints.txt", names: tuple[str, ...] = MISSING_ON_DEVICE
) -> list[str]:
    """``name==version`` of every package in ``names`` (default ``MISSING_ON_DEVICE``), as
    constraints.txt pins it, then ``DEVICE_VERSIONS``; a package it does not pin is a
    ValueError naming it."""
    pinned = {}
    for line in constraints.read_text().splitlines():
        name, sep, version = line.strip().partition("==")
        if sep:
            pinned[normal_name(name)] = f"{name}=={version}"
    absent = [name for name in names if normal_name(name) not in pinned]
    if absent:
        raise ValueError(f"constraints.txt pins no version of {absent}: pin them first")
    device = [f"{name}=={version}" for name, version in DEVICE_VERSIONS.items()]
    return [pinned[normal_name(name)] for name in names] + device


def download_command(out: Path) -> list[str]:
    """The pip command that fetches the pinned wheels for the device's Python into ``out``."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
    command += ["--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation"]
    command += ["cp", *[arg for p in PLATFORMS for arg in ("--platform", p)], "-d", str(out)]
    return command + pins()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.device_wheels")
    parser.add_argument("--out", default=str(ROOT / ".whl"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run(download_command(out), check=True)
    wheels = sorted(p.name for p in out.glob("*.whl"))
    size = sum(p.stat().st_size for p in out.glob("*.whl")) / 2**20
    print(f"{len(wheels)} wheels, {size:.1f} MiB in {out}: {', '.join(wheels)}")
    print("Carry '.whl' with the device call and start its command with:")
    print(INSTALL)


if __name__ == "__main__":
    main()
