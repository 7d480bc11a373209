"""End to end: train, evaluate, checkpoint, resume; golden first-step loss; workdir safety."""

from __future__ import annotations

import math
import shutil

import pytest

from copejax.model.transformer import Transformer
from copejax.runtime import sharding, workdir
from copejax.runtime.checkpoint import Checkpointer, CheckpointMismatchError
from copejax.runtime.metrics import read_jsonl
from copejax.training import train
from copejax.training.plan import validate
from copejax.training.train_step import make_steps
from tests.train.tiny_task import tiny_config

# Timing-dependent keys differ between runs; everything else must match exactly.
TIMING = ("train/steps_per_sec", "train/tokens_per_sec")

# The first-step training loss of tiny_config("rope") (seed 0). If a deliberate change to the
# model's initialisation, the tiny task, the rng derivation or the loss moves it, check that the
# new value is still near ln(8) (a uniform prediction over the 8 tokens) and update it here,
# saying why in the commit; an unexplained change means training is no longer reproducible.
GOLDEN_FIRST_LOSS = 2.081632


def _deterministic(records: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    root = tmp_path_factory.mktemp("full")
    final = train.run(tiny_config(), root)
    return root, final, read_jsonl(root / "metrics.jsonl")


def test_trains_evaluates_and_checkpoints(uninterrupted: tuple) -> None:
    root, final, records = uninterrupted
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for step in (3, 6):
        record = records[step - 1]
        for split in ("test", "long"):  # "long" has longer sequences than training
            assert math.isfinite(record[f"eval/{split}/loss"])
            assert 0.0 <= record[f"eval/{split}/error"] <= 1.0
    assert "eval/test/loss" not in records[0]
    assert records[-1]["train/loss"] < records[0]["train/loss"]
    assert final["eval/test/loss"] == records[-1]["eval/test/loss"]
    assert Checkpointer(root / "checkpoints", keep=5).all_steps() == [3, 6]
    assert workdir.read_config(root) == workdir.config_to_dict(tiny_config())
    assert list((root / "tb").glob("events.out.tfevents.*"))


def test_golden_first_step_loss(uninterrupted: tuple) -> None:
    first = uninterrupted[2][0]["train/loss"]
    assert abs(first - math.log(8)) < 0.05, "an untrained model should predict about uniformly"
    assert first == pytest.approx(GOLDEN_FIRST_LOSS, abs=1e-4), (
        f"first-step loss {first:.6f} != golden {GOLDEN_FIRST_LOSS}: see the comment on "
        "GOLDEN_FIRST_LOSS for what to do"
    )


def test_resume_gives_identical_metrics(uninterrupted: tuple, tmp_path) -> None:
    root = tmp_path / "resumed"
    train.run(tiny_config(), root, stop_after=4)  # checkpoint 3 saved, step 4 logged
    assert [r["step"] for r in read_jsonl(root / "metrics.jsonl")] == [1, 2, 3, 4]
    train.run(tiny_config(), root)  # resumes from 3: step 4 is re-done, not duplicated
    assert _deterministic(read_jsonl(root / "metrics.jsonl")) == _deterministic(uninterrupted[2])


def test_evaluation_leaves_training_untouched(uninterrupted: tuple, tmp_path) -> None:
    """Evaluating at step 3 changes nothing that training or the last evaluation sees, so a
    study may evaluate less often without changing its numbers."""
    train.run(tiny_config(eval_every=6), tmp_path)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert "eval/test/loss" not in records[2]
    full = _deterministic(uninterrupted[2])
    without_mid_eval = [
        {k: v for k, v in r.items() if r["step"] == 6 or not k.startswith("eval/")} for r in full
    ]
    assert _deterministic(records) == without_mid_eval


def test_resume_may_change_how_often_it_evaluates(uninterrupted: tuple, tmp_path) -> None:
    train.run(tiny_config(), tmp_path, stop_after=4)  # evaluated at 3, checkpoint 3
    train.run(tiny_config(eval_every=0), tmp_path)  # only the final evaluation from here
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert _deterministic(records) == _deterministic(uninterrupted[2])
    assert workdir.read_config(tmp_path)["train"]["eval_every"] == 0


def test_different_config_is_refused_unless_restart(uninterrupted: tuple, tmp_path) -> None:
    root = tmp_path / "copy"
    shutil.copytree(uninterrupted[0], root)
    with pytest.raises(workdir.WorkdirConflictError) as refused:
        train.run(tiny_config(learning_rate=2e-2), root)
    said = str(refused.value)
    assert "train.learning_rate: 0.01 -> 0.02" in said
    # It names what may change, and a way on that keeps the run before the one that deletes it.
    assert "may change only train.steps, mesh.data" in said
    assert said.index("--config.train.init_from=") < said.index("--restart")
    train.run(tiny_config(steps=7), root, restart=True, stop_after=1)
    assert [r["step"] for r in read_jsonl(root / "metrics.jsonl")] == [1]
    assert Checkpointer(root / "checkpoints", keep=5).all_steps() == []


def test_checkpoint_of_other_shapes_fails_clearly(uninterrupted: tuple) -> None:
    config = tiny_config()
    config.model.d_model = 32
    plan = validate(config)
    mesh = sharding.make_mesh()
    steps = make_steps(
        Transformer(plan.model_config), config.train, 0, (1, 11), mesh=mesh,
        rules=sharding.DEFAULT_RULES,
    )  # fmt: skip
    ckpt = Checkpointer(uninterrupted[0] / "checkpoints", keep=5)
    with pytest.raises(
        CheckpointMismatchError,
        match=r"different model.*\n  params/block_0/attention/key/kernel: "
        r"checkpoint \(16, 2, 8\), config \(32, 2, 16\)",
    ):
        ckpt.restore(6, steps.abstract_state, None)


def test_nonfinite_loss_stops_or_skips(tmp_path) -> None:
    config = tiny_config()
    config.task.options.poison_index = 3 * 8 + 5  # a row of step 4's batch (no shuffling)
    config.data.shuffle = False
    with pytest.raises(train.NonFiniteLossError, match=r"at step 4;.*checkpoint 3"):
        train.run(config, tmp_path / "stop")
    assert Checkpointer(tmp_path / "stop" / "checkpoints", keep=5).all_steps() == [3]
    config.train.nonfinite = "skip"
    final = train.run(config, tmp_path / "skip")
    assert final["train/nonfinite_steps"] == 1.0
    assert math.isfinite(final["train/loss"])


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("train.batch_size", 7, r"train\.batch_size=7 must be a positive multiple"),
        ("mesh.tensor", 3, r"mesh"),
        ("model.position", "nosuch", r"unknown position scheme 'nosuch'"),
        ("task.name", "nosuch", r"unknown task 'nosuch'"),
        ("train.schedule", "step", r"train\.schedule must be one of"),
        ("train.learning_rate", -1.0, r"train\.learning_rate must be"),
        ("eval.splits", ("nope",), r"eval\.splits \['nope'\] unknown"),
        ("train.nonfinite", "ignore", r"train\.nonfinite must be one of"),
    ],
)
def test_bad_configs_fail_before_compute(key: str, value: object, message: str) -> None:
    config = tiny_config()
    parent, leaf = key.split(".")
    with config.unlocked():
        config[parent][leaf] = value
    with pytest.raises(ValueError, match=message):
        validate(config, device_count=4)
