"""Stick-breaking in the fused kernels (arXiv 2410.17980) against the dense reference.

Values against NumPy in float64, gradients of q, k, v and a term's parameters and per-token
values against ``jax.grad`` of the dense float32 maths; with and without the query's own key,
grouped KV heads, packed segments, a window with sinks and several tiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.ops.kernels.gpu_lowering import lower_for_gpu
from copejax.ops.kernels.terms import KernelTerm
from copejax.ops.kernels.triton_params import (
    approx_log1p,
    approx_log1p_for_tracing,
    gpu_scan,
    scan_for_tracing,
)
from tests.ops.kernels.full_pairs import full_and_masked
from tests.ops.kernels.reference import mask_BTS, stick_attention
from tests.ops.kernels.test_fused_attention import (
    RANK_BT,
    SEGMENTS_BT,
    B,
    G,
    H,
    N,
    T,
    _bias_BNTS,
    _decay,
    _inputs,
    _slope,
    _table,
    on_layout,
)
from tests.ops.kernels.tolerances import assert_close


def _allowed(window: int | None, sinks: int, include_self: bool) -> np.ndarray:
    allowed = mask_BTS(SEGMENTS_BT, window, sinks, RANK_BT)
    if not include_self:
        allowed = allowed & ~np.eye(T, dtype=bool)[None]
    return allowed


def _kernel(x: dict, *, window: int | None, sinks: int, include_self: bool) -> jax.Array:
    terms = [
        KernelTerm("slope", _slope, params_NP=x["slopes"]),
        KernelTerm("table", _table, params_NP=x["table"]),
        KernelTerm("decay", _decay, q_values_BTN=x["c"], k_values_BSN=x["c"]),
    ]
    return on_layout(
        x,
        terms=terms,
        window=window,
        sink_tokens=sinks,
        k_rank_BT=jnp.asarray(RANK_BT),
        block_q=32,
        block_k=16,
        normalizer="stickbreaking",
        include_self=include_self,
    )


@pytest.mark.parametrize(
    ("window", "sinks", "include_self"),
    [
        pytest.param(None, 0, False, marks=pytest.mark.slow),
        pytest.param(20, 3, True, marks=pytest.mark.slow),
    ],
)
def test_values_equal_numpy(window: int | None, sinks: int, include_self: bool) -> None:
    x = _inputs(jnp.float32)
    y = jax.jit(lambda x: _kernel(x, window=window, sinks=sinks, include_self=include_self))(x)
    x64 = {key: np.asarray(value, np.float64) for key, value in x.items()}
    allowed = _allowed(window, sinks, include_self)
    expected = stick_attention(x64["q"], x64["k"], x64["v"], _bias_BNTS(x64, np), allowed, xp=np)
    assert_close(y, expected, dtype="float32", summands=T, roundings=0)


@pytest.mark.parametrize(
    ("dtype", "window", "sinks", "include_self"),
    [
        ("float32", 20, 3, False),
        pytest.param("float32", None, 0, True, marks=pytest.mark.slow),
        pytest.param("bfloat16", None, 0, False, marks=pytest.mark.slow),
    ],
)
def test_gradients_equal_dense(dtype: str, window: int | None, sinks: int, include_self: bool):
    x = _inputs(jnp.dtype(dtype))
    allowed = jnp.asarray(_allowed(window, sinks, include_self))
    cot = jnp.asarray(np.random.default_rng(5).normal(size=(B, T, N, H)), jnp.float32)

    def kernel(x):
        y = _kernel(x, window=window, sinks=sinks, include_self=include_self)
        return y.astype(jnp.float32)

    def dense(x):  # the same inputs in float32: only the kernel's roundings differ
        x32 = {key: value.astype(jnp.float32) for key, value in x.items()}
        y = stick_attention(x32["q"], x32["k"], x32["v"], _bias_BNTS(x32), allowed)
        return y

    y, pull = jax.vjp(jax.jit(kernel), x)
    y_ref, pull_ref = jax.vjp(dense, x)
    (grads,), (grads_ref,) = jax.jit(pull)(cot), pull_ref(cot)
    assert_close(y, y_ref, dtype=dtype, summands=T, roundings=2)
    pairs = B * T * T // 2
    for key, summands in [("q", T), ("k", T), ("v", T), ("c", T)]:
        assert_close(grads[key], grads_ref[key], dtype=dtype, summands=summands, roundings=4)
    for key in ("slopes", "table"):
        assert_close(grads[key], grads_ref[key], dtype=dtype, summands=pairs, roundings=4)
    assert G < N  # grouped heads are exercised


@pytest.mark.slow
def test_gradients_with_matmul_sums_equal_dense() -> None:
    """The GPU kernels' within-tile sums as tensor-core matmuls (the benchmark's lever,
    ``scan_for_tracing(False)``) instead of prefix sums: the same gradients."""
    with scan_for_tracing(False):
        assert not gpu_scan()
        test_gradients_equal_dense("float32", 20, 3, False)
    assert gpu_scan()


def test_gradients_with_the_approximate_log1p_equal_dense() -> None:
    """The benchmark's lever ``approx_log1p_for_tracing(True)``: log1p as log2(1 + u) ln 2
    (on a GPU ``lg2.approx``; here an exact log2, with the rounding of 1 + u), within the same
    bounds of the dense float32 maths."""
    with approx_log1p_for_tracing(True):
        assert approx_log1p()
        test_gradients_equal_dense("float32", 20, 3, False)
    assert not approx_log1p()


def test_full_pairs_run_without_the_mask_in_the_forward_and_dq_kernels() -> None:
    """Stick-breaking's forward and dq kernels run a full pair (keys before its first query,
    one segment: row 0's older tiles) in a second body without the mask (twice their
    matmuls); its dk / dv kernel keeps one (a second spilled more on the H100 target).
    Masking every pair (the benchmark's lever) gives the same values and gradients."""
    x = _inputs(jnp.float32)
    cot = jnp.asarray(np.random.default_rng(6).normal(size=(B, T, N, H)), jnp.float32)

    def run(x):
        return _kernel(x, window=None, sinks=0, include_self=False)

    full, masked = full_and_masked(run, x, cot)
    for name in ("copejax_attention_forward", "copejax_attention_dq"):
        assert sum(full[name]) == 2 * sum(masked[name]) > 0, name
    assert full["copejax_attention_dkdv"] == masked["copejax_attention_dkdv"]


@pytest.mark.parametrize("approx", [False, True])
def test_lowers_to_triton(approx: bool) -> None:
    """The stick-breaking forward and backward kernels lower to Triton (from the CPU), with
    libdevice's log1p or the lever's ``lg2.approx`` (inline PTX in all three kernels)."""
    x = _inputs(jnp.bfloat16)

    def loss(x):
        y = on_layout(
            x,
            terms=[KernelTerm("decay", _decay, q_values_BTN=x["c"], k_values_BSN=x["c"])],
            normalizer="stickbreaking",
            include_self=False,
            interpret=False,
        )
        return jnp.sum(y.astype(jnp.float32))

    with approx_log1p_for_tracing(approx):
        text = lower_for_gpu(jax.jit(jax.grad(loss)), x).as_text()
    for name in ("copejax_attention_forward", "copejax_attention_dq", "copejax_attention_dkdv"):
        assert name in text
    assert ("lg2.approx.f32" in text) == approx
