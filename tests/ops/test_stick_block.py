"""The stick-breaking key-block update's hand-written backward (copejax.ops.engine_blocks)
against a NumPy reference of arXiv 2410.17980's weights and finite differences of it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from copejax.ops.engine_blocks import stickbreaking_update

B, N, Q, K, W = 1, 2, 3, 4, 2


def _reference_loss(z: np.ndarray, remainder: np.ndarray, v: np.ndarray, allowed: np.ndarray):
    """float64 loops: A_ij = sigmoid(z_ij) prod_{k > j, allowed} (1 - sigmoid(z_ik)) times
    exp(-r_i); the loss mixes the block's output and its new remainder r_i + sum softplus."""
    out = np.zeros((B, Q, N, W))
    new_r = remainder.astype(np.float64).copy()
    for b in range(B):
        for n in range(N):
            for i in range(Q):
                for j in range(K):
                    if not allowed[b, i, j]:
                        continue
                    beta = 1 / (1 + np.exp(-z[b, n, i, j]))
                    keep = np.prod(
                        [
                            1 / (1 + np.exp(z[b, n, i, k]))
                            for k in range(j + 1, K)
                            if allowed[b, i, k]
                        ]
                    )
                    out[b, i, n] += beta * keep * np.exp(-remainder[b, n, i]) * v[b, j, n]
                    new_r[b, n, i] += np.log1p(np.exp(z[b, n, i, j]))
    return np.sum(out * np.arange(1, W + 1)) + np.sum(np.cos(new_r))


def test_values_and_gradients_match_the_reference() -> None:
    rng = np.random.default_rng(0)
    z = rng.normal(scale=2.0, size=(B, N, Q, K))
    remainder = rng.uniform(0, 1, size=(B, N, Q))
    v = rng.normal(size=(B, K, N, W))
    allowed = rng.uniform(size=(B, Q, K)) < 0.7
    acc = rng.normal(size=(B, Q, N, W))

    def loss(z, remainder, v):
        state = {"acc_BQNW": jnp.asarray(acc, jnp.float32), "remainder_BNQ": remainder}
        new = stickbreaking_update(state, z, jnp.asarray(allowed), v, "auto")
        out = new["acc_BQNW"] - jnp.asarray(acc, jnp.float32)
        return jnp.sum(out * jnp.arange(1, W + 1)) + jnp.sum(jnp.cos(new["remainder_BNQ"]))

    args = [jnp.asarray(a, jnp.float32) for a in (z, remainder, v)]
    value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(*args)
    np.testing.assert_allclose(value, _reference_loss(z, remainder, v, allowed), rtol=1e-5)
    eps = 1e-6
    for arg_index, grad in enumerate(grads):
        base = [z, remainder, v]
        expected = np.zeros(base[arg_index].shape)
        for idx in np.ndindex(*base[arg_index].shape):
            plus = [a.copy() for a in base]
            minus = [a.copy() for a in base]
            plus[arg_index][idx] += eps
            minus[arg_index][idx] -= eps
            diff = _reference_loss(*plus, allowed) - _reference_loss(*minus, allowed)
            expected[idx] = diff / (2 * eps)
        np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-5)
    assert np.all(np.asarray(grads[0])[np.broadcast_to(~allowed[:, None], z.shape)] == 0.0)
