"""``copejax.terms``' public block terms through the engine equal the pure naive biases of
``copejax.functional`` (``softmax(q.k / sqrt(H) + bias) v``), with the engine's defaults:
no segment ids (one document per row) and positions of shape (T,)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax import functional, terms

B, T, N, H = 2, 7, 2, 8


def _naive(q: jax.Array, k: jax.Array, v: jax.Array, bias_BNTS: jax.Array) -> jax.Array:
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) / math.sqrt(H) + bias_BNTS
    mask = functional.cores.causal_mask(B, T)[:, None]
    weights = jax.nn.softmax(jnp.where(mask, logits, -1e30), axis=-1)
    return jnp.einsum("BNTS,BSNH->BTNH", weights, v)


@pytest.fixture
def qkv() -> tuple[jax.Array, ...]:
    return tuple(jax.random.normal(jax.random.key(i), (B, T, N, H)) for i in range(3))


def _engine(q: jax.Array, k: jax.Array, v: jax.Array, term: terms.BlockTerm) -> jax.Array:
    positions_T = jnp.arange(T)
    y, _ = terms.blockwise_attention(
        q, k, v, q_positions_BT=positions_T, k_positions_BS=positions_T, terms=[term], block=3
    )
    return y


def test_alibi(qkv: tuple) -> None:
    q, k, v = qkv
    bias = functional.alibi_bias(jnp.arange(T), num_heads=N)
    got = _engine(q, k, v, terms.alibi(num_heads=N))
    np.testing.assert_allclose(got, _naive(q, k, v, bias), rtol=1e-5, atol=1e-5)


def test_fox_naive_and_block_forms_take_the_same_gates(qkv: tuple) -> None:
    q, k, v = qkv
    x = jax.random.normal(jax.random.key(9), (B, T, 4))
    logf_BTN = functional.fox_log_forget_gates(x, jnp.ones((4, N)), jnp.zeros(N))
    got = _engine(q, k, v, terms.fox(logf_BTN))
    np.testing.assert_allclose(
        got, _naive(q, k, v, functional.fox_bias(logf_BTN)), rtol=1e-5, atol=1e-5
    )


def test_cope(qkv: tuple) -> None:
    q, k, v = qkv
    pos_emb = jax.random.normal(jax.random.key(7), (4, H))
    got = _engine(q, k, v, terms.cope(pos_emb))
    want = _naive(q, k, v, functional.cope_bias(q, k, pos_emb))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_rope_is_the_schemes_rotation(qkv: tuple) -> None:
    q, k, v = qkv
    params = functional.init("rope", jax.random.key(0), num_heads=N, head_dim=H)
    want = functional.attention(q, k, v, scheme="rope", params=params, impl="naive")
    positions = jnp.arange(T)
    got = _naive(functional.rope(q, positions), functional.rope(k, positions), v, 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
