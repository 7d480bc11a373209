"""Every registered scheme's parameters name each logical axis at most once (flax refuses a
repeated name when it maps names to a mesh, so such a scheme cannot train at all)."""

from __future__ import annotations

import flax.linen as nn
import jax
import pytest

from copejax.model.transformer import Transformer
from copejax.positions import registry
from copejax.runtime import sharding
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


def test_key_and_value_kernels_use_the_kv_heads_axis() -> None:
    """Grouped-query attention: K key/value heads under their own logical name, which the
    default rules shard like the query heads."""
    model = Transformer(
        tiny_config("fox", num_heads=4, num_kv_heads=2, position_options={"qk_norm": True})
    )
    tokens_BT, positions_BT = tokens_and_positions()
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens_BT, positions_BT))
    attention = abstract["params"]["block_0"]["attention"]
    for name in ("key", "value"):
        box = attention[name]["kernel"]
        assert box.names == (sharding.EMBED, sharding.KV_HEADS, sharding.HEAD_DIM)
        assert box.value.shape == (32, 2, 8)
    assert attention["query"]["kernel"].names[1] == sharding.HEADS
    assert attention["fox"]["k_norm_scale"].names[0] == sharding.KV_HEADS
    assert (
        dict(sharding.DEFAULT_RULES)[sharding.KV_HEADS]
        == dict(sharding.DEFAULT_RULES)[sharding.HEADS]
    )
