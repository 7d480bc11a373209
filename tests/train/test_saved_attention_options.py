"""Configs saved before the attention options moved to model level still load.

Earlier runs stored ``model.attention_kernel`` and, in cope / fox / stickbreaking,
``position_options.attention_impl``, ``block_size``, ``blockwise_min_len`` and ``scan_impl``.
"""

from __future__ import annotations

import ml_collections
import pytest

from copejax.config.base import base_config
from copejax.data.base import make_task
from copejax.model import checks
from copejax.model.saved_configs import upgrade_attention_options
from copejax.training.plan import model_config


def _saved_config(
    position: str, options: dict, kernel: str = "einsum"
) -> ml_collections.ConfigDict:
    """The model block as a run before the change wrote it."""
    config = base_config()
    config.model.position = position
    del config.model["attention_impl"]
    del config.model["attention_block"]
    del config.model["attention_backward"]
    del config.model["scan_impl"]
    config.model.attention_kernel = kernel
    config.model.position_options = ml_collections.ConfigDict(options)
    return config


def test_a_cope_run_saved_with_per_scheme_options_loads_with_model_level_ones() -> None:
    options = {"p_max": 8, "attention_impl": "blockwise", "block_size": 64, "scan_impl": "cumsum"}
    options["blockwise_min_len"] = 512
    config = _saved_config("cope", options)
    task = make_task(config.task.name, config.task.options.to_dict())
    cfg = checks.validate(model_config(config, task))
    assert (cfg.attention_impl, cfg.attention_block, cfg.scan_impl) == ("blockwise", 64, "cumsum")
    assert dict(cfg.position_options) == {"p_max": 8}


def test_a_saved_dot_product_attention_kernel_becomes_the_attention_impl() -> None:
    config = _saved_config("rope", {}, kernel="dot_product_attention")
    task = make_task(config.task.name, config.task.options.to_dict())
    cfg = checks.validate(model_config(config, task))
    assert cfg.attention_impl == "dot_product_attention"


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ({"attention_kernel": "einsum", "position_options": {"attention_impl": "auto"}}, {}),
        ({"attention_impl": "naive", "position_options": {}}, {"attention_impl": "naive"}),
        (
            {"attention_impl": "naive", "position_options": {"attention_impl": "blockwise"}},
            {"attention_impl": "naive"},
        ),
    ],
)
def test_upgrade_keeps_model_level_keys_and_drops_defaults(model: dict, expected: dict) -> None:
    upgraded, options = upgrade_attention_options(model)
    assert upgraded == expected
    assert options == {}


def test_a_saved_config_with_zero_for_unset_sizes_loads_and_resumes() -> None:
    """Configs saved before ModelConfig.from_config wrote 0 for an unset head_dim, mlp_dim
    and max_len: they load as None / the task's length, and compare equal to today's."""
    from copejax.model.config import ModelConfig
    from copejax.runtime import workdir

    old = {"d_model": 32, "num_heads": 2, "head_dim": 0, "mlp_dim": 0, "max_len": 0}
    cfg = ModelConfig.from_config(old, vocab_size=7, default_max_len=24)
    assert (cfg.head_dim, cfg.mlp_dim, cfg.max_len) == (None, None, 24)
    assert cfg.resolved_head_dim == 16
    new = {"model": {**old, "head_dim": None, "mlp_dim": None, "max_len": None}}
    assert workdir.config_differences({"model": old}, new) == []
    assert workdir.config_differences({"model": {**old, "max_len": 8}}, new) == [
        "model.max_len: 8 -> None"
    ]


def test_a_saved_config_without_keys_added_later_resumes() -> None:
    """Configs saved before the keys of workdir.ADDED_KEYS existed (model.norm_eps,
    train.init_from, model.window_decode_cache) equal today's at the values that reproduce
    them, and differ at any other value."""
    from copejax.config.base import base_config
    from copejax.runtime import workdir

    new = workdir.config_to_dict(base_config())
    old = {**new, "model": dict(new["model"]), "train": dict(new["train"])}
    for dotted in workdir.ADDED_KEYS:
        section, key = dotted.split(".")
        del old[section][key]
    assert workdir.same_run(old, new)
    new["model"]["norm_eps"] = 1e-5
    assert workdir.config_differences(old, new) == ["model.norm_eps: 1e-06 -> 1e-05"]
    new["model"]["norm_eps"] = 1e-6
    new["model"]["window_decode_cache"] = "full"
    assert workdir.config_differences(old, new) == ["model.window_decode_cache: 'ring' -> 'full'"]


def test_unknown_model_keys_are_refused_by_name() -> None:
    from copejax.model.config import ModelConfig

    with pytest.raises(ValueError, match=r"unknown model keys \['num_head'\]; allowed: \["):
        ModelConfig.from_config({"num_head": 2}, vocab_size=7, default_max_len=8)


def test_the_scheme_is_resolved_once_and_rebuilt_by_replace() -> None:
    import dataclasses

    from copejax.model.config import ModelConfig
    from copejax.positions.cope import CoPE

    cfg = ModelConfig(vocab_size=7, position="cope", position_options={"p_max": 8})
    assert isinstance(cfg.scheme, CoPE) and cfg.scheme.p_max == 8
    assert cfg.scheme is cfg.scheme  # built in __post_init__, not per access
    other = dataclasses.replace(cfg, position_options={"p_max": 4})
    assert other.scheme.p_max == 4 and other != cfg
    assert hash(cfg) == hash(
        ModelConfig(vocab_size=7, position="cope", position_options={"p_max": 8})
    )
