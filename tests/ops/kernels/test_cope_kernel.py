"""CoPE's carried count in the fused kernels (arXiv 2405.18719) against a dense reference.

Values against NumPy in float64, gradients of q, k, v, the table and another term's
per-token values against ``jax.grad`` of the dense float32 maths; grouped KV heads, packed
segments, a window with sinks, and enough keys per query that positions reach the cap.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.ops.kernels.cope import CopeStatic, CopeTerm
from copejax.ops.kernels.gpu_lowering import lower_for_gpu
from copejax.ops.kernels.padding import full_tiles_for_tracing
from copejax.ops.kernels.terms import KernelTerm
from tests.ops.kernels.full_pairs import full_and_masked, kernel_jaxprs, matmuls
from tests.ops.kernels.reference import attention_jnp, attention_numpy, cope_term, mask_BTS
from tests.ops.kernels.test_fused_attention import (
    RANK_BT,
    SEGMENTS_BT,
    B,
    H,
    N,
    T,
    _decay,
    _inputs,
    on_layout,
)
from tests.ops.kernels.tolerances import assert_close

P_MAX = 8  # far below the longest segment (72 keys): the cap is reached


def _with_table(x: dict, seed: int = 3) -> dict:
    table = np.random.default_rng(seed).normal(size=(P_MAX, H))
    return {**x, "table": jnp.asarray(table, jnp.float32)}


def _kernel(x: dict, *, window: int | None, sinks: int) -> jax.Array:
    return on_layout(
        x,
        terms=[KernelTerm("decay", _decay, q_values_BTN=x["c"], k_values_BSN=x["c"])],
        window=window,
        sink_tokens=sinks,
        k_rank_BT=jnp.asarray(RANK_BT),
        block_q=32,
        block_k=16,
        cope=CopeTerm(x["table"], CopeStatic(P_MAX)),
    )


def _bias(x: dict, allowed, xp):
    c = xp.moveaxis(xp.asarray(x["c"]), 2, 1)
    decay = c[:, :, :, None] - c[:, :, None, :]
    return decay + cope_term(x["q"], x["k"], x["table"], allowed, P_MAX, xp=xp)


@pytest.mark.parametrize(
    ("window", "sinks"),
    [pytest.param(None, 0, marks=pytest.mark.slow), pytest.param(20, 3, marks=pytest.mark.slow)],
)
def test_values_equal_numpy(window: int | None, sinks: int) -> None:
    x = _with_table(_inputs(jnp.float32))
    y = jax.jit(lambda x: _kernel(x, window=window, sinks=sinks))(x)
    allowed = mask_BTS(SEGMENTS_BT, window, sinks, RANK_BT)
    x64 = {key: np.asarray(value, np.float64) for key, value in x.items()}
    expected = attention_numpy(x["q"], x["k"], x["v"], _bias(x64, allowed, np), allowed)
    assert_close(y, expected, dtype="float32", summands=T, roundings=0)


@pytest.mark.parametrize(
    ("dtype", "window", "sinks"),
    [("float32", 20, 3), pytest.param("bfloat16", None, 0, marks=pytest.mark.slow)],
)
def test_gradients_equal_dense(dtype: str, window: int | None, sinks: int) -> None:
    x = _with_table(_inputs(jnp.dtype(dtype)))
    allowed = jnp.asarray(mask_BTS(SEGMENTS_BT, window, sinks, RANK_BT))
    cot = jnp.asarray(np.random.default_rng(5).normal(size=(B, T, N, H)), jnp.float32)

    def kernel(x):
        return _kernel(x, window=window, sinks=sinks).astype(jnp.float32)

    def dense(x):
        x32 = {key: value.astype(jnp.float32) for key, value in x.items()}
        return attention_jnp(x32["q"], x32["k"], x32["v"], _bias(x32, allowed, jnp), allowed)

    y, pull = jax.vjp(jax.jit(kernel), x)
    y_ref, pull_ref = jax.vjp(dense, x)
    (grads,), (grads_ref,) = jax.jit(pull)(cot), pull_ref(cot)
    assert_close(y, y_ref, dtype=dtype, summands=T, roundings=2)
    for key in ("q", "k", "v", "c"):
        assert_close(grads[key], grads_ref[key], dtype=dtype, summands=T, roundings=4)
    assert_close(grads["table"], grads_ref["table"], dtype=dtype, summands=B * T * T, roundings=4)


def test_lowers_to_triton() -> None:
    x = _with_table(_inputs(jnp.bfloat16))

    def loss(x):
        y = on_layout(
            x,
            cope=CopeTerm(x["table"], CopeStatic(P_MAX)),
            interpret=False,
        )
        return jnp.sum(y.astype(jnp.float32))

    text = lower_for_gpu(jax.jit(jax.grad(loss)), x).as_text()
    for name in ("copejax_attention_forward", "copejax_attention_dq", "copejax_attention_dkdv"):
        assert name in text


def test_full_pairs_run_without_the_mask_in_the_forward_kernel() -> None:
    """CoPE's GPU forward runs a full pair (every gate and score allowed: row 0's older
    tiles) in a second body without the mask (twice its per-pair matmuls); its backward
    kernels keep one (they spill already). Masking every pair gives the same values and
    gradients."""
    x = _with_table(_inputs(jnp.float32))
    cot = jnp.asarray(np.random.default_rng(6).normal(size=x["q"].shape), jnp.float32)

    def run(x):
        return on_layout(x, block_q=16, block_k=16, cope=CopeTerm(x["table"], CopeStatic(P_MAX)))

    full, masked = full_and_masked(run, x, cot)
    forward = "copejax_attention_forward"
    assert full[forward][1] == 2 * masked[forward][1] > 0
    for name in ("copejax_attention_dq", "copejax_attention_dkdv"):
        assert full[name] == masked[name], name


def test_the_queries_table_is_taken_once_per_query_tile_on_a_gpu() -> None:
    """Per tile pair, CoPE adds no matmul to the GPU forward's walk and one (the gates' pull)
    to the dq kernel's: both take the table ``q e^T`` once (three bfloat16 pieces), and the dq
    kernel pulls its cotangent back once (nine). The dk / dv kernel adds the table's three
    per pair (its query tile changes) and no pull-back (the parameters are the dq kernel's).
    Counted in the kernels' jaxprs with every pair masked (by default full pairs take a
    second, mask-free body), against the nope kernels'."""
    x = _with_table(_inputs(jnp.bfloat16))

    def counts(**options) -> dict:
        def loss(x):
            y = on_layout(x, block_q=16, block_k=16, interpret=False, **options)
            return jnp.sum(y.astype(jnp.float32))

        jaxpr = jax.make_jaxpr(jax.grad(loss))(x).jaxpr
        return {name: matmuls(kernel) for name, kernel in kernel_jaxprs(jaxpr).items()}

    with full_tiles_for_tracing(False):  # one (masked) body per walk: full pairs take two
        nope = counts(backend="triton")
        cope = counts(backend="triton", cope=CopeTerm(x["table"], CopeStatic(P_MAX)))
    assert set(cope) == {f"copejax_attention_{k}" for k in ("forward", "dq", "dkdv")}
    added = {name: (cope[name][0], cope[name][1] - nope[name][1]) for name in cope}
    assert added == {
        "copejax_attention_forward": (3, 0),
        "copejax_attention_dq": (12, 1),
        "copejax_attention_dkdv": (0, 3),
    }
