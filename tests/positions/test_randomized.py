"""Randomized positional encodings (Ruoss et al. 2023, arXiv 2305.16843)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model.transformer import Transformer
from copejax.positions import registry
from copejax.positions.base import Dims
from copejax.positions.randomized import relabel_positions, sample_ordered_positions
from tests.conftest import tiny_config
from tests.positions.test_sinusoidal import reference_pe

DIMS = Dims(d_model=8, num_heads=2, head_dim=4, num_layers=1, max_len=6)


def embed(options: dict, x: np.ndarray, pos: np.ndarray, deterministic: bool, seed: int = 0):
    module = registry.make_scheme("randomized", options).embed_module(DIMS)
    rngs = {"params": jax.random.key(0), "positions": jax.random.key(seed)}
    params = module.init(rngs, jnp.asarray(x), jnp.asarray(pos), deterministic)
    out = module.apply(
        params,
        jnp.asarray(x),
        jnp.asarray(pos),
        deterministic,
        rngs={"positions": rngs["positions"]},
    )
    return out, params


def test_samples_are_sorted_distinct_and_in_range() -> None:
    sample = np.asarray(sample_ordered_positions(jax.random.key(3), 64, 10, 25))
    assert sample.shape == (64, 10) and sample.dtype == np.int32
    assert np.all(np.diff(sample, axis=1) > 0)  # strictly increasing: sorted and distinct
    assert sample.min() >= 0 and sample.max() < 25
    assert len({tuple(row) for row in sample}) > 1  # rows drawn independently
    assert set(np.unique(sample)) == set(range(25))  # the whole range is reachable


def test_samples_differ_between_keys_and_repeat_for_the_same_key() -> None:
    a = np.asarray(sample_ordered_positions(jax.random.key(0), 2, 8, 100))
    b = np.asarray(sample_ordered_positions(jax.random.key(1), 2, 8, 100))
    c = np.asarray(sample_ordered_positions(jax.random.key(0), 2, 8, 100))
    assert not np.array_equal(a, b)
    np.testing.assert_array_equal(a, c)


def test_sample_equal_to_range_is_the_identity() -> None:
    sample = sample_ordered_positions(jax.random.key(0), 3, 7, 7)
    np.testing.assert_array_equal(np.asarray(sample), np.tile(np.arange(7), (3, 1)))


def test_training_replaces_positions_and_encodes_them(rng: np.random.Generator) -> None:
    x = rng.normal(size=(3, 6, 8)).astype(np.float32)
    pos = np.tile(np.arange(6), (3, 1))
    out, _ = embed({}, x, pos, deterministic=False)
    new = np.asarray(out.positions_BT)
    assert np.all(np.diff(new, axis=1) > 0) and new.min() >= 0 and new.max() < 4 * 6
    assert not np.array_equal(new, pos)
    np.testing.assert_allclose(np.asarray(out.x_BTD), x + reference_pe(new, 8), atol=2e-5)
    other, _ = embed({}, x, pos, deterministic=False, seed=1)
    assert not np.array_equal(np.asarray(other.positions_BT), new)


def test_evaluation_leaves_positions_unchanged(rng: np.random.Generator) -> None:
    x = rng.normal(size=(2, 6, 8)).astype(np.float32)
    pos = np.tile(np.arange(6), (2, 1))
    out, _ = embed({}, x, pos, deterministic=True)
    np.testing.assert_array_equal(np.asarray(out.positions_BT), pos)
    np.testing.assert_allclose(np.asarray(out.x_BTD), x + reference_pe(pos, 8), atol=2e-5)


def test_sample_at_eval_follows_the_paper(rng: np.random.Generator) -> None:
    x = rng.normal(size=(2, 6, 8)).astype(np.float32)
    pos = np.tile(np.arange(6), (2, 1))
    out, _ = embed({"sample_at_eval": True, "max_position": 50}, x, pos, deterministic=True)
    new = np.asarray(out.positions_BT)
    assert np.all(np.diff(new, axis=1) > 0) and new.max() < 50 and not np.array_equal(new, pos)


def test_packed_positions_relabel_each_document_with_an_increasing_prefix() -> None:
    sample = jnp.asarray([[2, 5, 9, 11, 20]])
    got = relabel_positions(jnp.asarray([[0, 1, 2, 0, 1]]), sample)
    np.testing.assert_array_equal(np.asarray(got), [[2, 5, 9, 2, 5]])
    with pytest.raises(ValueError, match=r"allowed: positions in \[0, T=5\)"):
        relabel_positions(jnp.asarray([[0, 1, 2, 3, 5]]), sample)


def test_learned_encoding_has_a_table_of_max_position_rows(rng: np.random.Generator) -> None:
    x = rng.normal(size=(1, 6, 8)).astype(np.float32)
    pos = np.arange(6)[None]
    out, params = embed({"encoding": "learned"}, x, pos, deterministic=False)
    table = np.asarray(params["params"]["learned"]["table"].unbox())
    assert table.shape == (4 * 6, 8)
    new = np.asarray(out.positions_BT)[0]
    np.testing.assert_allclose(np.asarray(out.x_BTD)[0], x[0] + table[new], rtol=1e-6)


def test_none_encoding_only_relabels(rng: np.random.Generator) -> None:
    x = rng.normal(size=(1, 6, 8)).astype(np.float32)
    out, _ = embed({"encoding": "none"}, x, np.arange(6)[None], deterministic=False)
    np.testing.assert_array_equal(np.asarray(out.x_BTD), x)
    assert registry.make_scheme("randomized", {"encoding": "none"}).attention_module(DIMS) is None


def test_rope_encoding_passes_random_positions_to_rope_in_the_model() -> None:
    cfg = tiny_config("randomized", position_options={"encoding": "rope", "max_position": 1000})
    model = Transformer(cfg)
    tokens = jnp.ones((2, 8), jnp.int32)
    positions = jnp.tile(jnp.arange(8), (2, 1))
    rngs = {"params": jax.random.key(0), "positions": jax.random.key(5)}
    emb, params = model.init_with_output(rngs, tokens, positions, False, method=Transformer.embed)
    assert "randomized" not in params["params"]  # rope encoding: no parameters
    new = np.asarray(emb.positions_BT)  # what forward_embedded hands to the rope site
    assert np.all(np.diff(new, axis=1) > 0) and new.max() < 1000
    np.testing.assert_array_equal(
        np.asarray(emb.x_BTD),
        np.asarray(params["params"]["token_embed"]["embedding"].unbox()[1]) * np.ones((2, 8, 1)),
    )  # rope does not touch the embeddings
    site = registry.make_scheme("randomized", {"encoding": "rope"}).attention_module(DIMS)
    assert type(site).__name__ == "_RoPESite"


def test_sequence_longer_than_max_position_raises() -> None:
    with pytest.raises(ValueError, match=r"T=9 exceeds max_position=8"):
        sample_ordered_positions(jax.random.key(0), 1, 9, 8)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"encoding": "alibi"}, "encoding must be one of"),
        ({"max_position": 10}, "max_position must be an integer >= max_len=16"),
        ({"max_position": 20.5}, "max_position must be an integer"),
    ],
)
def test_bad_options_are_rejected(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tiny_config("randomized", position_options=options)


def test_randomized_plus_rope_routes_each_option_to_its_part() -> None:
    """``encoding`` belongs to randomized and ``base`` (the frequency base) to rope."""
    scheme = registry.make_scheme(
        "randomized+rope", {"encoding": "none", "base": 500.0, "max_position": 64}
    )
    randomized, rope = scheme.parts
    assert (randomized.encoding, randomized.max_position) == ("none", 64)
    assert rope.base == 500.0
    tiny_config("randomized+rope", position_options={"encoding": "none", "base": 500.0})
