"""Every registered scheme's parameters name each logical axis at most once (flax refuses a
repeated name when it maps names to a mesh, so such a scheme cannot train at all)."""

from __future__ import annotations

import flax.linen as nn
import jax
import pytest

from copejax.model import Transformer
from copejax.positions import registry
from tests.conftest import tiny_config, tokens_and_positions


@pytest.mark.parametrize("scheme", registry.names())
def test_logical_axis_names_are_distinct_per_parameter(scheme: str) -> None:
    model = Transformer(tiny_config(scheme))
    tokens_BT, positions_BT = tokens_and_positions()
    rngs = {"params": jax.random.key(0), "positions": jax.random.key(1)}
    abstract = jax.eval_shape(lambda: model.init(rngs, tokens_BT, positions_BT))
    leaves = jax.tree_util.tree_leaves_with_path(
        abstract["params"], is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)
    )
    named = [(path, leaf.names) for path, leaf in leaves if isinstance(leaf, nn.Partitioned)]
    assert named, "parameters carry logical axis names"
    for path, names in named:
        strings = [n for n in names if isinstance(n, str)]
        assert len(strings) == len(set(strings)), f"{jax.tree_util.keystr(path)}: {names}"
