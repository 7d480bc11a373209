"""Shaw et al. relative PE (CoPE paper eq. 1) and relative_capped (CoPE paper section 5.4)."""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model.transformer import Transformer
from copejax.positions import registry
from copejax.positions.base import AttentionContext, Dims
from copejax.positions.relative import relative_logits
from tests.conftest import tiny_config

HEADS, HEAD_DIM = 3, 4


def reference_logits(case: tuple, *, capped: bool) -> np.ndarray:
    """softmax argument of eq. 1: q_i . (k_j + e[i - j]) / sqrt(H), per head, by loops."""
    q, k, q_pos, mask, table = case
    k_pos = q_pos
    batch, length = q_pos.shape
    out = np.zeros((batch, HEADS, length, k_pos.shape[1]), np.float64)
    for b in range(batch):
        for h in range(HEADS):
            for i in range(length):
                for j in range(k_pos.shape[1]):
                    if not mask[b, i, j]:
                        continue
                    d = q_pos[b, i] - k_pos[b, j]
                    if d >= len(table) and not capped:
                        e = np.zeros(HEAD_DIM)
                    else:
                        e = table[min(d, len(table) - 1)]
                    out[b, h, i, j] = q[b, i, h] @ (k[b, j, h] + e) / np.sqrt(HEAD_DIM)
    return out


def run_site(name: str, max_distance: int, case: tuple) -> np.ndarray:
    """Content logits (as attention.py forms them) plus the site's bias, masked to zero."""
    q, k, q_pos, mask, table = case
    dims = Dims(d_model=12, num_heads=HEADS, head_dim=HEAD_DIM, num_layers=1, max_len=64)
    site = registry.make_scheme(name, {"max_distance": max_distance}).attention_module(dims)
    q, k = jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32)
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) / np.sqrt(HEAD_DIM)
    ctx = AttentionContext(
        x_BTD=jnp.zeros((*q.shape[:2], 12)),
        q_positions_BT=jnp.asarray(q_pos),
        k_positions_BS=jnp.asarray(q_pos),
        explicit_mask_BTS=jnp.asarray(mask),
    )
    params = flax.core.unfreeze(site.init(jax.random.key(0), q, k, k, logits, ctx, method="bias"))
    box = params["params"]["relative_embedding"]
    assert box.value.shape == table.shape and box.names == ("positions", "head_dim")
    params["params"]["relative_embedding"] = box.replace_boxed(jnp.asarray(table, jnp.float32))
    bias = site.apply(params, q, k, k, logits, ctx, method="bias")
    return np.where(mask[:, None], np.asarray(logits + bias), 0.0)


def random_case(seed: int, length: int, rows: int, max_pos: int):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(2, length, HEADS, HEAD_DIM)).astype(np.float32)
    k = rng.normal(size=(2, length, HEADS, HEAD_DIM)).astype(np.float32)
    q_pos = np.sort(rng.choice(max_pos, size=(2, length), replace=True), axis=1)
    mask = np.tril(np.ones((length, length), bool))[None] & (rng.random((2, length, length)) < 0.9)
    table = rng.normal(size=(rows, HEAD_DIM)).astype(np.float32)
    return q, k, q_pos, mask, table


@pytest.mark.parametrize("name", ["relative", "relative_capped"])
def test_logits_match_eq_1_within_the_table(name: str) -> None:
    case = random_case(0, length=7, rows=12, max_pos=12)
    got = run_site(name, 11, case)
    want = reference_logits(case, capped=name == "relative_capped")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["relative", "relative_capped"])
def test_distances_beyond_the_table_capped_vs_plain(name: str) -> None:
    # Positions up to 60 with a table for distances 0..5: many pairs are out of range. Plain
    # relative adds nothing for them (it cannot see this from the shapes); capped uses e[5].
    case = random_case(1, length=6, rows=6, max_pos=60)
    capped = name == "relative_capped"
    got = run_site(name, 5, case)
    want = reference_logits(case, capped=capped)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    other = reference_logits(case, capped=not capped)
    assert np.abs(got - other).max() > 1e-2  # the two variants really differ here


def _as_capped(variables: dict) -> dict:
    """A plain ``relative`` model's variables under the capped scheme's site name (the site
    module is named after its scheme; the parameters are the same)."""
    return _rename(variables, "relative", "relative_capped")


def _rename(tree: object, old: str, new: str) -> object:
    if not isinstance(tree, dict):
        return tree
    return {(new if key == old else key): _rename(value, old, new) for key, value in tree.items()}


def test_sequence_longer_than_the_table_plain_raises_capped_runs() -> None:
    tokens = jnp.zeros((1, 20), jnp.int32)
    positions = jnp.arange(20)[None]
    short = jnp.zeros((1, 8), jnp.int32), jnp.arange(8)[None]
    model = Transformer(tiny_config("relative", num_layers=1))  # max_len=16: distances 0..15
    params = model.init(jax.random.key(0), *short)
    with pytest.raises(ValueError, match=r"sequence length 20 .* max_distance=15"):
        model.apply(params, tokens, positions)
    capped = Transformer(tiny_config("relative_capped", num_layers=1))
    out = capped.apply(_as_capped(params), tokens, positions)  # the same table
    assert out.shape == (1, 20, 13) and np.all(np.isfinite(np.asarray(out)))


def test_capped_equals_plain_up_to_the_training_length() -> None:
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 13, (2, 16)))
    positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
    plain, capped = (
        Transformer(tiny_config(n, num_layers=1)) for n in ("relative", "relative_capped")
    )
    params = plain.init(jax.random.key(0), tokens, positions)
    np.testing.assert_allclose(
        capped.apply(_as_capped(params), tokens, positions),
        plain.apply(params, tokens, positions),
        atol=1e-6,
    )


def test_translation_invariance() -> None:
    rng = np.random.default_rng(4)
    q_BTNH = jnp.asarray(rng.normal(size=(2, 5, 2, 4)), jnp.float32)
    table = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)
    pos = jnp.asarray(np.sort(rng.integers(0, 20, (2, 5)), axis=1))
    for capped in (False, True):
        np.testing.assert_allclose(
            relative_logits(q_BTNH, pos + 77, pos + 77, table, capped),
            relative_logits(q_BTNH, pos, pos, table, capped),
            atol=1e-6,
        )
    model = Transformer(tiny_config("relative", num_layers=1))
    tokens = jnp.asarray(rng.integers(0, 13, (2, 8)))
    positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
    params = model.init(jax.random.key(0), tokens, positions)
    np.testing.assert_allclose(
        model.apply(params, tokens, positions + 300),
        model.apply(params, tokens, positions),
        atol=1e-5,
    )


def test_bad_max_distance_is_rejected() -> None:
    with pytest.raises(ValueError, match="max_distance must be an integer >= 0"):
        tiny_config("relative", position_options={"max_distance": -2})
