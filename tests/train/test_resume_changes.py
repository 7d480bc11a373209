"""Resuming with changed settings: a finished run extended, a run moved to another mesh and
device count, another number of data workers; every change named in the log.

The mesh move runs in subprocesses, because the number of (simulated) devices is fixed when JAX
starts (``XLA_FLAGS=--xla_force_host_platform_device_count=N``, as tests/train/
test_distributed.py does).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import ml_collections
import pytest

from copejax.runtime.checkpoint import Checkpointer
from copejax.runtime.metrics import read_jsonl
from copejax.training import optim, resume, train
from copejax.training.plan import validate
from tests.conftest import host_devices_env
from tests.float_tolerance import float32_sum_atol
from tests.train.tiny_task import tiny_config

ROOT = Path(__file__).resolve().parents[2]
TIMING = ("train/steps_per_sec", "train/tokens_per_sec")


def _losses(workdir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_jsonl(workdir / "metrics.jsonl")}


@pytest.mark.slow
def test_extend_a_finished_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run finished at step 4 goes on to step 6 when train.steps is raised: its first four
    steps stay as they were, and (constant schedule, so the learning rate of every step is the
    same in both) steps 5-6 are those of a run of 6 steps from the start."""
    short, full = tmp_path / "short", tmp_path / "full"

    def config(steps: int) -> ml_collections.ConfigDict:
        c = tiny_config(steps=steps, schedule="constant", eval_every=0)
        c.eval.splits = ("test",)
        return c

    train.run(config(6), full)
    train.run(config(4), short)
    first_part = read_jsonl(short / "metrics.jsonl")
    assert [r["step"] for r in first_part] == [1, 2, 3, 4]
    capsys.readouterr()

    train.run(config(6), short)
    said = capsys.readouterr().out
    assert "resumed from checkpoint 4" in said and "train.steps: 4 -> 6" in said
    records = read_jsonl(short / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[:4] == first_part
    assert _losses(short) == _losses(full)
    assert math.isfinite(records[-1]["eval/test/loss"])
    assert 6 in Checkpointer(short / "checkpoints", keep=5).all_steps()

    with pytest.raises(ValueError, match=r"train\.steps=5 is below checkpoint 6"):
        train.run(config(5), short)


def test_extending_names_the_schedule_change() -> None:
    """Under a decaying schedule the log gives the rate the next step trains at under the new
    step count and under the old one."""
    saved = tiny_config(steps=4)
    longer = tiny_config(steps=8)
    note = resume._schedule_note(saved.to_dict(), longer.train, 4)
    new_rate = float(optim.learning_rate_schedule(longer.train)(4))
    old_rate = float(optim.learning_rate_schedule(saved.train)(4))
    assert new_rate > old_rate
    assert f"step 5 trains at {new_rate:.4g}, where the saved run's schedule gave" in note
    assert note.endswith(f"gave {old_rate:.4g})")
    assert resume._schedule_note(saved.to_dict(), tiny_config(schedule="constant").train, 4) == ""


def _run(workdirs: list[Path], spec: dict, devices: int) -> str:
    env = host_devices_env(devices)
    command = [sys.executable, "-m", "tests.train.run_tiny", ",".join(map(str, workdirs))]
    done = subprocess.run(
        [*command, json.dumps(spec)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout


def test_extend_a_finished_run_on_fewer_devices_and_another_mesh(tmp_path: Path) -> None:
    """A run of 2 steps finished on 8 devices (data=4 x tensor=2) is extended to 4 steps on 4
    devices (fsdp=2 x tensor=2): its first steps stay as they were, and the losses are those
    of a run of 4 steps uninterrupted on 8 devices (constant schedule after warmup, so that
    every step's learning rate is the same in both).

    The two meshes sum in different orders. A step's loss is a float32 reduction over the
    batch's B*T tokens of terms that are themselves sums over at most the model's widest
    contraction (the MLP's hidden units), and each step after the resume starts from
    parameters whose gradients were summed in the other order too; so the tolerance is the
    reordering bound of float32_sum_atol for B*T*width terms, per step since the resume.
    """
    full, moved = tmp_path / "full", tmp_path / "moved"
    train_spec = {"steps": 4, "log_every": 1, "eval_every": 0, "checkpoint_every": 2}
    train_spec["schedule"] = "constant"
    spec = {"train": train_spec, "eval": {"splits": ["test"], "max_examples": 8}}
    first = {**spec, "mesh": {"data": 4, "tensor": 2}, "train_by_workdir": [{}, {"steps": 2}]}
    _run([full, moved], first, 8)
    first_part = read_jsonl(moved / "metrics.jsonl")
    assert [r["step"] for r in first_part] == [1, 2]
    said = _run([moved], {**spec, "mesh": {"data": 1, "fsdp": 2, "tensor": 2}}, 4)
    assert "resumed from checkpoint 2" in said and "train.steps: 2 -> 4" in said
    assert "mesh.data: 4 -> 1" in said and "mesh.fsdp: 1 -> 2" in said
    assert "mesh: data=4 x fsdp=1 x tensor=2 (8 devices) -> data=1 x fsdp=2 x tensor=2 (4 " in said

    assert read_jsonl(moved / "metrics.jsonl")[:2] == first_part
    reference, resumed = _losses(full), _losses(moved)
    assert sorted(resumed) == sorted(reference) == [1, 2, 3, 4]
    config = tiny_config(**train_spec)
    plan = validate(config, device_count=1)
    tokens = config.train.batch_size * plan.task.seq_len
    width = max(plan.model_config.d_model, plan.model_config.resolved_mlp_dim)
    for step in (1, 2):  # the same program on the same mesh
        atol = float32_sum_atol(reference[step], tokens)
        assert resumed[step] == pytest.approx(reference[step], abs=atol)
    for step in (3, 4):
        atol = (step - 2) * float32_sum_atol(reference[step], tokens * width)
        assert abs(resumed[step] - reference[step]) <= atol, (step, resumed, reference, atol)


@pytest.mark.slow
def test_resume_with_other_data_workers(tmp_path: Path) -> None:
    """Stopped at step 3 with no data workers, resumed with 2 to step 6 (their iterator state
    has another shape), then with 3: the batches, so the losses, are those of the
    uninterrupted run."""
    full, moved = tmp_path / "full", tmp_path / "moved"
    train_spec = {"steps": 8, "log_every": 1, "eval_every": 0, "checkpoint_every": 3}
    spec = {"train": train_spec, "eval": {"splits": ["test"]}}
    _run([full, moved], {**spec, "stop_after": [None, 3]}, 1)
    said = _run([moved], {**spec, "data": {"worker_count": 2}, "stop_after": [6]}, 1)
    assert "data.worker_count: 0 -> 2" in said and "starts at batch 3" in said
    said = _run([moved], {**spec, "data": {"worker_count": 3}}, 1)
    assert "data.worker_count: 2 -> 3" in said and "starts at batch 6" in said
    assert _losses(moved) == _losses(full)


def test_refusal_names_what_may_change() -> None:
    from copejax.runtime import workdir

    old = workdir.config_to_dict(tiny_config())
    new = workdir.config_to_dict(tiny_config(steps=9, learning_rate=0.5))
    new["mesh"]["tensor"] = 2
    assert workdir.resumable_changes(old, new) == ["mesh.tensor: 1 -> 2", "train.steps: 6 -> 9"]
    message = workdir.refusal("workdir w", old, new)
    assert "train.learning_rate: 0.01 -> 0.5" in message and "train.steps: 6" not in message
    for key in workdir.RESUMABLE:
        assert key in message
