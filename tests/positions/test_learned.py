"""Learned absolute position embeddings (Vaswani et al. 2017, arXiv 1706.03762; GPT-2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model.transformer import Transformer
from copejax.positions import registry
from copejax.positions.base import Dims
from copejax.positions.learned import LearnedEmbed, lookup_rows_BTD
from tests.conftest import tiny_config

DIMS = Dims(d_model=6, num_heads=2, head_dim=3, num_layers=1, max_len=10)


def reference_add(x: np.ndarray, positions: np.ndarray, table: np.ndarray) -> np.ndarray:
    out = x.copy()
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            out[b, t] += table[positions[b, t]]
    return out


def test_embed_adds_the_table_row_of_each_position(rng: np.random.Generator) -> None:
    module = registry.make_scheme("learned", {"table_size": 12}).embed_module(DIMS)
    x = rng.normal(size=(3, 7, 6)).astype(np.float32)
    positions = rng.integers(0, 12, (3, 7)).astype(np.int32)  # packed-style, any order
    params = module.init(jax.random.key(0), jnp.asarray(x), jnp.asarray(positions))
    out = module.apply(params, jnp.asarray(x), jnp.asarray(positions))
    table = np.asarray(params["params"]["table"].unbox())
    assert table.shape == (12, 6)
    np.testing.assert_allclose(np.asarray(out.x_BTD), reference_add(x, positions, table), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out.positions_BT), positions)


def test_default_table_has_max_len_rows() -> None:
    module = registry.make_scheme("learned").embed_module(DIMS)
    assert isinstance(module, LearnedEmbed) and module.table_size == DIMS.max_len


def test_sequence_longer_than_the_table_raises_at_trace_time() -> None:
    module = registry.make_scheme("learned", {"table_size": 4}).embed_module(DIMS)
    x = jnp.zeros((1, 5, 6))
    positions = jnp.arange(5)[None]
    with pytest.raises(ValueError, match=r"T=5 exceeds table_size=4"):
        module.init(jax.random.key(0), x, positions)
    params = module.init(jax.random.key(0), x[:, :4], positions[:, :4])
    with pytest.raises(ValueError, match=r"T=5 exceeds table_size=4"):
        jax.jit(module.apply)(params, x, positions)  # traced positions: the length is checked


def test_concrete_position_beyond_the_table_raises() -> None:
    module = registry.make_scheme("learned", {"table_size": 4}).embed_module(DIMS)
    x = jnp.zeros((1, 2, 6))
    with pytest.raises(ValueError, match=r"\[1, 4\].*table_size=4"):
        module.init(jax.random.key(0), x, jnp.asarray([[1, 4]]))
    with pytest.raises(ValueError, match=r"\[-1, 0\]"):
        module.init(jax.random.key(0), x, jnp.asarray([[-1, 0]]))


def test_traced_out_of_range_positions_give_nan_not_a_clamped_row() -> None:
    table = jnp.arange(8.0).reshape(4, 2)
    rows = jax.jit(lookup_rows_BTD)(table, jnp.asarray([[0, 3, 4, -1]]))
    np.testing.assert_array_equal(np.asarray(rows[0, :2]), [[0.0, 1.0], [6.0, 7.0]])
    assert np.all(np.isnan(np.asarray(rows[0, 2:])))


def test_model_rejects_sequences_longer_than_max_len() -> None:
    model = Transformer(tiny_config("learned", max_len=6))
    tokens = jnp.zeros((1, 6), jnp.int32)
    params = model.init(jax.random.key(0), tokens, jnp.arange(6)[None])
    with pytest.raises(ValueError, match=r"T=7 exceeds table_size=6"):
        model.apply(params, jnp.zeros((1, 7), jnp.int32), jnp.arange(7)[None])


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"table_size": 0}, "table_size"),
        ({"table_size": -3}, "table_size"),
        ({"init_std": 0.0}, "init_std"),
    ],
)
def test_bad_options_are_rejected(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        registry.make_scheme("learned", options).validate(DIMS)
