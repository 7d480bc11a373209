"""Every scheme and the variants with extra modules initialise under the training program's
mesh (``jax.set_mesh`` + logical axis rules), where a parameter whose kernel is reshaped at
creation (Flax's DenseGeneral) fails its sharding annotation."""

from __future__ import annotations

import flax.linen as nn
import jax
import pytest

from copejax.model.transformer import Transformer
from copejax.positions import registry
from copejax.runtime import sharding
from tests.conftest import tiny_config, tokens_and_positions

VARIANTS = [(name, {}) for name in registry.names()] + [
    ("cope", {"gates": "sep_keys"}),
    ("cope", {"gates": "sep_keys", "share_layers": True}),
    ("cope", {"position_term": "mlp"}),
    ("cope", {"per_head_embeddings": True}),
    ("fox", {"output_gate": True, "qk_norm": True, "key_shift": True, "value_shift": True}),
    ("tape", {"contextualize": "mlp"}),
]


@pytest.mark.parametrize(("position", "options"), VARIANTS, ids=str)
def test_init_under_the_training_mesh(position: str, options: dict) -> None:
    model = Transformer(tiny_config(position, position_options=options))
    tokens_BT, positions_BT = tokens_and_positions()
    rngs = {"params": jax.random.key(0), "positions": jax.random.key(1)}
    mesh = sharding.make_mesh()
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
        params = jax.eval_shape(lambda: model.init(rngs, tokens_BT, positions_BT))["params"]
    assert jax.tree.leaves(params)
