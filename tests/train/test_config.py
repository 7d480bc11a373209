"""The config schema, big_vision-style arguments, config files and command-line overrides."""

from __future__ import annotations

import pytest
from absl import flags
from ml_collections import config_flags

from copejax.config.base import base_config, parse_arg
from copejax.runtime.sharding import DEFAULT_RULES

SCHEMA = {
    "seed", "task.name", "task.options", "model.position", "model.position_options",
    "train.steps", "train.batch_size", "train.learning_rate", "train.warmup_steps",
    "train.schedule", "train.end_learning_rate_fraction", "train.weight_decay", "train.b1",
    "train.b2", "train.eps", "train.grad_clip", "train.log_every", "train.eval_every",
    "train.checkpoint_every", "train.keep_checkpoints", "train.nonfinite", "eval.splits",
    "eval.batch_size", "eval.max_examples", "data.worker_count", "data.shuffle", "mesh.data",
    "mesh.fsdp", "mesh.tensor", "axis_rules",
}  # fmt: skip


def test_base_config_has_every_schema_key() -> None:
    config = base_config()
    for key in SCHEMA:
        node = config
        for part in key.split("."):
            node = node[part]
    assert config.axis_rules == DEFAULT_RULES
    assert config.mesh.data == -1


@pytest.mark.parametrize(
    ("arg", "expected"),
    [
        (None, {}),
        ("", {}),
        ("cpu,position=cope,seed=1", {"cpu": True, "position": "cope", "seed": 1}),
        ("lr=3e-4, smoke", {"lr": 3e-4, "smoke": True}),
        ("flag=false,name=a_b,x=1.5", {"flag": False, "name": "a_b", "x": 1.5}),
    ],
)
def test_parse_arg(arg: str | None, expected: dict) -> None:
    assert parse_arg(arg) == expected
    assert {k: type(v) for k, v in parse_arg(arg).items()} == {
        k: type(v) for k, v in expected.items()
    }


@pytest.mark.parametrize("arg", ["a,,b", "=1", "x=", "1a=2", "a=1,a=2", "a b"])
def test_parse_arg_rejects_malformed(arg: str) -> None:
    with pytest.raises(ValueError, match="config argument"):
        parse_arg(arg)


def _parse(*argv: str) -> flags.FlagValues:
    values = flags.FlagValues()
    argv_list = ["prog", *argv]
    config_flags.DEFINE_config_file(
        "config", None, "config", flag_values=values, sys_argv=argv_list
    )
    values(argv_list)
    return values


def test_config_file_variants_shortcuts_and_overrides() -> None:
    values = _parse(
        "--config=configs/flipflop.py:smoke,position=nope,seed=3",
        "--config.train.steps=7",
        "--config.eval.max_examples=5",
    )
    config = values.config
    assert (config.model.position, config.seed) == ("nope", 3)
    assert (config.train.steps, config.eval.max_examples) == (7, 5)
    assert config.task.options.num_instructions == 16  # the smoke variant
    with pytest.raises(AttributeError):
        config.train.stepz = 1  # locked: a typo cannot add a key


def test_override_of_unknown_key_is_an_error() -> None:
    with pytest.raises((flags.Error, KeyError, AttributeError), match="stepz"):
        _parse("--config=configs/flipflop.py:smoke", "--config.train.stepz=7")


def test_unknown_config_argument_lists_the_known_ones() -> None:
    with pytest.raises(flags.Error, match=r"unknown config argument 'nosuch'.*position"):
        _parse("--config=configs/flipflop.py:nosuch=1")
