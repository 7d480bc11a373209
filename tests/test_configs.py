"""Every configs/*.py: get_config for each variant, its command in the docstring, and (for the
synthetic tasks) a config that the trainer's validation accepts, with every eval split fitting
the model's max_len."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from copejax.config.base import base_config
from copejax.data.base import make_task
from copejax.training.train import validate

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
CONFIGS = sorted(p.stem for p in CONFIG_DIR.glob("*.py") if not p.stem.startswith("_"))
SYNTHETIC = ("addition", "counting", "flipflop", "passkey", "selective_copy")
VARIANTS = ("smoke", "cpu", "paper")


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"configs_{name}", CONFIG_DIR / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flatten(config: object, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in config.items():
        if hasattr(value, "items") and key not in ("options", "position_options"):
            keys |= flatten(value, f"{prefix}{key}.")
        else:
            keys.add(prefix + key)
    return keys


def test_every_synthetic_task_has_a_config() -> None:
    assert set(SYNTHETIC) <= set(CONFIGS)


@pytest.mark.parametrize("name", CONFIGS)
def test_docstring_holds_the_command(name: str) -> None:
    doc = load(name).__doc__ or ""
    assert f"python -m copejax.main --config=configs/{name}.py:smoke" in doc


@pytest.mark.parametrize("variant", [*VARIANTS, None])
@pytest.mark.parametrize("name", CONFIGS)
def test_get_config_variants(name: str, variant: str | None) -> None:
    config = load(name).get_config(variant)
    assert flatten(config) == flatten(base_config())  # the schema's keys, no more, no fewer
    assert config.train.steps > 0 and config.train.batch_size > 0


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", SYNTHETIC)
def test_synthetic_configs_validate(name: str, variant: str) -> None:
    config = load(name).get_config(variant)
    assert config.task.name == name
    plan = validate(config, device_count=1)
    task = make_task(name, config.task.options.to_dict())
    max_len = plan.model_config.max_len
    for split in plan.eval_splits:
        length = task.split_len(split) if hasattr(task, "split_len") else task.seq_len
        assert length <= max_len, (split, length, max_len)


@pytest.mark.parametrize("name", SYNTHETIC)
def test_smoke_is_smaller_than_cpu_is_smaller_than_paper(name: str) -> None:
    module = load(name)
    tasks = [make_task(name, module.get_config(v).task.options.to_dict()) for v in VARIANTS]
    steps = [module.get_config(v).train.steps for v in VARIANTS]
    assert tasks[0].seq_len <= tasks[1].seq_len <= tasks[2].seq_len
    assert steps[0] < steps[1] < steps[2]


@pytest.mark.parametrize("name", SYNTHETIC)
def test_shortcuts_and_bad_arguments(name: str) -> None:
    module = load(name)
    config = module.get_config("smoke,position=cope,seed=3")
    assert config.model.position == "cope" and config.seed == 3
    with pytest.raises(ValueError, match="nonsense"):
        module.get_config("smoke,nonsense=1")
    with pytest.raises(ValueError, match="at most one"):
        module.get_config("smoke,paper")


@pytest.mark.parametrize("name", ["addition", "passkey"])
def test_paper_tape_uses_the_appendix_sizes(name: str) -> None:
    """TAPE's appendix: L = D = 2, B' = 48, psi on each head's B = 64 features."""
    from copejax.positions.tape import PAPER_OPTIONS

    config = load(name).get_config("paper,position=tape")
    plan = validate(config, device_count=1)
    scheme = plan.model_config.scheme
    assert {key: getattr(scheme, key) for key in PAPER_OPTIONS} == PAPER_OPTIONS
    assert plan.model_config.resolved_head_dim == 64  # B = 64
    assert scheme.hidden == 48 and scheme.psi_input == "head"
    assert not load(name).get_config("cpu,position=tape").model.position_options


LG_TASKS = load("length_generalization").TASKS


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("task_name", LG_TASKS)
def test_length_generalization_configs_validate(task_name: str, variant: str) -> None:
    """Every suite task at every size: a valid plan, the protocol's training lengths (1 to 40
    outside smoke) and every eval split fitting ``model.max_len``."""
    config = load("length_generalization").get_config(f"{task_name},{variant}")
    assert config.task.name == task_name
    plan = validate(config, device_count=1)
    task = make_task(task_name, config.task.options.to_dict())
    assert plan.eval_splits == ("test", "long")
    assert max(task.split_length(s) for s in plan.eval_splits) == plan.model_config.max_len
    if variant != "smoke":
        assert task.lengths("train") == tuple(range(1, 41))
        assert task.lengths("long")[0] == 41


def test_length_generalization_task_word_and_shortcuts() -> None:
    module = load("length_generalization")
    assert module.get_config(None).task.name == "reverse_string"
    arg = "parity_check,smoke,position=cope,train_max=5,test_max=9,test_step=1"
    config = module.get_config(arg)
    assert config.task.name == "parity_check" and config.model.position == "cope"
    assert config.task.options.max_train_length == 5 and config.model.max_len == 9 + 1
    for variant in VARIANTS:  # Ruoss et al.'s initialisation at every size (haiku's default)
        assert module.get_config(variant).model.dense_init == "fan_in"
    assert module.get_config("cpu,dense_init=normal").model.dense_init == "normal"
    with pytest.raises(ValueError, match="at most one task"):
        module.get_config("parity_check,bucket_sort")
    with pytest.raises(ValueError, match="nonsense"):
        module.get_config("smoke,nonsense=1")


@pytest.mark.slow  # about 13 s; the config's smoke arms train in tests/test_experiments.py
def test_length_generalization_smoke_trains(tmp_path: Path) -> None:
    """End to end: a few steps of the smoke config train, evaluate both splits per length;
    with the randomized arm sampling positions at evaluation too, as Ruoss et al. do (the
    evaluation step passes a positions rng)."""
    from copejax.training import train

    arg = "binary_addition,smoke,steps=3,position=randomized,sample_at_eval=True"
    config = load("length_generalization").get_config(arg)
    config.train.update(eval_every=3, checkpoint_every=3, log_every=1)
    metrics = train.run(config, tmp_path / "run")
    for split in ("test", "long"):
        assert 0.0 <= metrics[f"eval/{split}/accuracy"] <= 1.0
    assert {f"eval/long/accuracy/{n}" for n in (9, 13, 17)} <= set(metrics)
