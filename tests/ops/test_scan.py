"""copejax.ops.scan's float32 cumulative sums against NumPy loops, both directions and impls."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.ops.scan import blockwise_cumsum, cumsum, exclusive_cumsum

IMPLS = ("associative_scan", "cumsum", "auto")


def loop_cumsum(x: np.ndarray, axis: int, reverse: bool) -> np.ndarray:
    """y[i] = sum_{j <= i} x[j] (or sum_{j >= i} x[j]) along ``axis``, float64 loops."""
    x = np.moveaxis(np.asarray(x, np.float64), axis, -1)
    y = np.zeros_like(x)
    length = x.shape[-1]
    for i in range(length):
        span = range(i, length) if reverse else range(i + 1)
        for j in span:
            y[..., i] += x[..., j]
    return np.moveaxis(y, -1, axis)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("axis", [-1, 1, 0])
def test_cumsum_matches_numpy_loops(impl: str, reverse: bool, axis: int) -> None:
    x = np.random.default_rng(0).normal(size=(3, 5, 7)).astype(np.float32)
    y = cumsum(jnp.asarray(x), axis=axis, reverse=reverse, impl=impl)
    assert y.dtype == jnp.float32 and y.shape == x.shape
    np.testing.assert_allclose(np.asarray(y), loop_cumsum(x, axis, reverse), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reverse", [False, True])
def test_exclusive_cumsum_excludes_the_element(impl: str, reverse: bool) -> None:
    x = np.random.default_rng(1).normal(size=(2, 9)).astype(np.float32)
    y = exclusive_cumsum(jnp.asarray(x), reverse=reverse, impl=impl)
    want = loop_cumsum(x, -1, reverse) - x
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["associative_scan", "cumsum"])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize(("axis", "block"), [(-1, 4), (-1, 1), (-1, 12), (1, 3)])
def test_blockwise_equals_full(impl: str, reverse: bool, axis: int, block: int) -> None:
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 6, 12)), jnp.float32)
    full = cumsum(x, axis=axis, reverse=reverse, impl=impl)
    blocked = blockwise_cumsum(x, block, axis=axis, reverse=reverse, impl=impl)
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(full), rtol=1e-5, atol=1e-5)


def test_blockwise_rejects_a_length_that_is_not_a_multiple() -> None:
    with pytest.raises(ValueError, match="multiple of block"):
        blockwise_cumsum(jnp.ones((2, 10)), 4)


def test_unknown_impl_raises() -> None:
    with pytest.raises(ValueError, match="scan impl"):
        cumsum(jnp.ones(3), impl="loop")


@pytest.mark.parametrize("impl", ["associative_scan", "cumsum"])
def test_masked_before_scan_future_entries_contribute_exactly_zero(impl: str) -> None:
    """Suffix sums over keys, masked first: huge, inf or NaN future values change nothing."""
    rng = np.random.default_rng(3)
    length = 7
    causal_TS = np.tril(np.ones((length, length), bool))
    x = rng.uniform(size=(2, length, length)).astype(np.float32)
    x_bad = np.where(causal_TS, x, np.float32(np.nan))
    x_bad[0, 0, -1] = np.inf

    def positions(x_TS: jax.Array) -> jax.Array:
        return cumsum(jnp.where(causal_TS, x_TS, 0.0), axis=-1, reverse=True, impl=impl)

    clean = np.asarray(positions(jnp.asarray(x)))
    dirty = np.asarray(positions(jnp.asarray(x_bad)))
    np.testing.assert_array_equal(clean, dirty)
    want = loop_cumsum(np.where(causal_TS, x, 0.0), -1, True)
    np.testing.assert_allclose(clean, want, rtol=1e-6, atol=1e-6)
    assert np.all(clean[:, ~causal_TS] == 0.0)
    grad = jax.grad(lambda v: positions(v).sum())(jnp.asarray(x_bad))
    assert np.all(np.asarray(grad)[:, ~causal_TS] == 0.0)
    assert np.all(np.isfinite(np.asarray(grad)))


@pytest.mark.parametrize("impl", ["associative_scan", "cumsum"])
@pytest.mark.parametrize("reverse", [False, True])
def test_float32_accumulation_from_bfloat16_input(impl: str, reverse: bool) -> None:
    # 300 ones: a bfloat16 accumulator would stop at 256 (257 is not representable).
    x = jnp.ones((2, 300), jnp.bfloat16)
    y = cumsum(x, reverse=reverse, impl=impl)
    assert y.dtype == jnp.float32
    counts = np.arange(1, 301, dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(y[0]), counts[::-1] if reverse else counts)
    blocked = blockwise_cumsum(x, 60, reverse=reverse, impl=impl)
    assert blocked.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(blocked[1]), counts[::-1] if reverse else counts)


@pytest.mark.parametrize("reverse", [False, True])
def test_gradients_of_both_impls_agree(reverse: bool) -> None:
    x = jnp.asarray(np.random.default_rng(4).normal(size=(3, 8)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(5).normal(size=(3, 8)), jnp.float32)

    def loss(x: jax.Array, impl: str) -> jax.Array:
        return jnp.sum(w * cumsum(x, reverse=reverse, impl=impl))

    g_scan = jax.grad(loss)(x, "associative_scan")
    g_cumsum = jax.grad(loss)(x, "cumsum")
    # d/dx_j sum_i w_i y_i = sum over the i whose sum contains j of w_i: the opposite scan.
    want = loop_cumsum(np.asarray(w), -1, not reverse)
    np.testing.assert_allclose(np.asarray(g_scan), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(g_cumsum), want, rtol=1e-5, atol=1e-5)
