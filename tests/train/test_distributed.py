"""Sharded and multi-process training give the losses of one device.

Each configuration runs in a subprocess, because the number of (simulated) devices is fixed
when JAX starts: ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` gives 8 CPU devices.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import portpicker
import pytest

from copejax.positions import registry
from copejax.runtime.metrics import read_jsonl
from tests.conftest import host_devices_env

ROOT = Path(__file__).resolve().parents[2]
SCHEMES = ("nope", "rope", "alibi", "cope")
STEPS = 5


def _run(workdirs: list[Path], spec: dict, devices: int = 1) -> subprocess.Popen:
    env = host_devices_env(devices)
    command = [sys.executable, "-m", "tests.train.run_tiny", ",".join(map(str, workdirs))]
    return subprocess.Popen(
        [*command, json.dumps(spec)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait(process: subprocess.Popen) -> None:
    output, _ = process.communicate(timeout=900)
    assert process.returncode == 0, output[-3000:]


def _losses(workdir: Path) -> list[float]:
    return [r["train/loss"] for r in read_jsonl(workdir / "metrics.jsonl")]


def _spec(position: str, **extra: object) -> dict:
    train = {"steps": STEPS, "log_every": 1, "eval_every": 0, "checkpoint_every": 0}
    return {"position": position, "train": train, "eval": {"splits": ["test"]}, **extra}


# The blockwise engine under the meshes too (blocks of 4: several per sequence).
BLOCKWISE = {"attention_impl": "blockwise", "attention_block": 4}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("position", "model"),
    [(name, {}) for name in SCHEMES] + [("alibi", BLOCKWISE), ("cope", BLOCKWISE)],
    ids=lambda v: v if isinstance(v, str) else ("blockwise" if v else "default"),
)
def test_meshes_match_one_device(position: str, model: dict, tmp_path: Path) -> None:
    if position not in registry.names():
        pytest.fail(f"scheme {position!r} is not registered; known: {registry.names()}")
    one = tmp_path / "one"
    _wait(_run([one], _spec(position, model=model)))
    meshes = {"data4_tensor2": {"data": 4, "tensor": 2}, "fsdp8": {"data": 1, "fsdp": 8}}
    for name, mesh in meshes.items():
        _wait(_run([tmp_path / name], _spec(position, mesh=mesh, model=model), devices=8))
    reference = _losses(one)
    assert len(reference) == STEPS
    for name in meshes:
        assert _losses(tmp_path / name) == pytest.approx(reference, abs=1e-5), name


@pytest.mark.slow
def test_two_processes_match_one(tmp_path: Path) -> None:
    one = tmp_path / "one"
    single = _run([one], _spec("rope"))
    address = f"127.0.0.1:{portpicker.pick_unused_port()}"
    shared = tmp_path / "two"
    processes = [
        _run([shared], _spec("rope", distributed=[address, 2, i]), devices=4) for i in range(2)
    ]
    for process in [single, *processes]:
        _wait(process)
    assert _losses(shared) == pytest.approx(_losses(one), abs=1e-5)
    assert len(_losses(one)) == STEPS
