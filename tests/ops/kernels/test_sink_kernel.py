"""GPT-OSS's attention sink on the fused kernels (copejax.ops.kernels.sink), interpret mode.

The fold and the sink's gradient formula against ``jax.grad`` of dense attention with the sink
as an extra zero-value key; the kernels (values and gradients of q, k, v, a term's parameters
and the sink) against the same dense maths with grouped KV heads, packed segments, a window
with sink tokens, padding rows, in float32 and bfloat16; the model (``attention_sink=True``)
on the kernels against the naive path, for the softmax kernels of every kind.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.ops.kernels.attention import fused_attention
from copejax.ops.kernels.sink import fold_sink, sink_gradient
from copejax.ops.kernels.terms import KernelTerm
from tests.conftest import tiny_config
from tests.ops.kernels.reference import mask_BTS
from tests.ops.kernels.test_fused_attention import _slope
from tests.ops.kernels.tolerances import assert_close

B, T, N, G, H = 2, 40, 4, 2, 16  # three tiles of 16, the last padded: padding rows
SEGMENTS_BT = np.array([[0] * T, [0] * 17 + [1] * 15 + [2] * 8], np.int32)
POSITIONS_BT = np.array([np.arange(T), np.r_[np.arange(17), np.arange(15), np.arange(8)]])
WINDOW, SINKS = 12, 2
SINK_N = np.array([2.0, -1.0, 0.5, 3.0], np.float32)  # either sign, large enough to matter
SLOW = pytest.mark.slow
QUICK = {"xla_backend_optimization_level": 0}  # interpret mode: compile time dominates


def _inputs(dtype, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
    return {
        "q": normal(B, T, N, H),
        "k": normal(B, T, G, H),
        "v": normal(B, T, G, H),
        "slopes": jnp.asarray(rng.uniform(0.05, 0.5, (N, 1)), jnp.float32),
        "sink": jnp.asarray(SINK_N),
    }


def _dense(x: dict, allowed_BTS: jax.Array) -> jax.Array:
    """softmax over the allowed keys and the sink (a key of value 0), float32, dense."""
    f32 = {key: value.astype(jnp.float32) for key, value in x.items()}
    k = jnp.repeat(f32["k"], N // G, axis=2)
    v = jnp.repeat(f32["v"], N // G, axis=2)
    distance_BTS = jnp.asarray(POSITIONS_BT[:, :, None] - POSITIONS_BT[:, None, :], jnp.float32)
    s_BNTS = jnp.einsum("BTNH,BSNH->BNTS", f32["q"], k) / np.sqrt(H)
    s_BNTS = s_BNTS - f32["slopes"][None, :, :1, None] * distance_BTS[:, None]
    s_BNTS = jnp.where(allowed_BTS[:, None], s_BNTS, -1e30)
    sink_BNT1 = jnp.broadcast_to(f32["sink"][None, :, None, None], (*s_BNTS.shape[:3], 1))
    w_BNTS = jax.nn.softmax(jnp.concatenate([s_BNTS, sink_BNT1], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("BNTS,BSNH->BTNH", w_BNTS, v)


def _kernel(x: dict, *, window: int | None, sinks: int, block_k: int = 16, **kwargs) -> jax.Array:
    return fused_attention(
        x["q"],
        x["k"],
        x["v"],
        q_positions_BT=jnp.asarray(POSITIONS_BT),
        k_positions_BT=jnp.asarray(POSITIONS_BT),
        segment_ids_BT=jnp.asarray(SEGMENTS_BT),
        terms=[KernelTerm("slope", _slope, params_NP=x["slopes"])],
        window=window,
        sink_tokens=sinks,
        k_rank_BT=jnp.asarray(POSITIONS_BT, jnp.int32),
        block_q=16,
        block_k=block_k,
        sink_N=x["sink"],
        **kwargs,
    )


def test_fold_and_sink_gradient_equal_jax_grad_of_dense_attention() -> None:
    """``fold_sink`` of a sink-free softmax and ``sink_gradient`` from the folded
    log-sum-exp and ``D = dO . y`` equal the dense sink softmax and ``jax.grad`` of it;
    a row with no allowed key (padding) stays 0 and adds nothing to the gradient."""
    rng = np.random.default_rng(1)
    s_BNTS = jnp.asarray(rng.normal(size=(B, N, 6, 6)), jnp.float32)
    v_BSNW = jnp.asarray(rng.normal(size=(B, 6, N, 3)), jnp.float32)
    allowed_BTS = jnp.asarray(np.tril(np.ones((6, 6), bool))[None].repeat(B, 0))
    allowed_BTS = allowed_BTS.at[1, 5].set(False)  # an empty row, as a padding query's
    do_BTNW = jnp.asarray(rng.normal(size=(B, 6, N, 3)), jnp.float32)

    def dense(sink_N: jax.Array) -> jax.Array:
        s = jnp.where(allowed_BTS[:, None], s_BNTS, -jnp.inf)
        sink = jnp.broadcast_to(sink_N[None, :, None, None], (B, N, 6, 1))
        w = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
        return jnp.einsum("BNTS,BSNW->BTNW", w, v_BSNW)

    s_masked = jnp.where(allowed_BTS[:, None], s_BNTS, -jnp.inf)
    seen_BNT = jnp.any(allowed_BTS, axis=-1)[:, None]
    lse_BNT = jnp.where(seen_BNT, jax.nn.logsumexp(s_masked, axis=-1), 0.0)  # the kernels'
    w = jnp.where(allowed_BTS[:, None], jnp.exp(s_masked - lse_BNT[..., None]), 0.0)
    o_BTNW = jnp.einsum("BNTS,BSNW->BTNW", w, v_BSNW)
    sink_N = jnp.asarray(SINK_N)
    y_BTNW, lse_with_BNT = fold_sink(o_BTNW, lse_BNT, sink_N)
    y_ref, pull = jax.vjp(dense, sink_N)
    np.testing.assert_allclose(y_BTNW, y_ref, rtol=1e-5, atol=1e-6)
    assert not np.any(np.asarray(y_BTNW[1, 5]))
    delta_BNT = jnp.moveaxis(jnp.sum(do_BTNW * y_BTNW, axis=-1), 2, 1)
    (d_sink_ref,) = pull(do_BTNW)
    d_sink = sink_gradient(lse_with_BNT, delta_BNT, sink_N)
    np.testing.assert_allclose(d_sink, d_sink_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("dtype", "window", "sinks"),
    [
        ("float32", WINDOW, SINKS),
        pytest.param("bfloat16", WINDOW, SINKS, marks=SLOW),
        pytest.param("float32", None, 0, marks=SLOW),
        pytest.param("bfloat16", None, 0, marks=SLOW),
    ],
)
@pytest.mark.parametrize("backend", ["triton", pytest.param("tpu", marks=SLOW)])
def test_kernels_equal_dense_attention_with_a_sink(
    dtype: str, window: int | None, sinks: int, backend: str
) -> None:
    """Values and gradients (q, k, v, a term's parameters, the sink) equal the dense maths
    on the same inputs in float32: GQA, packed segments, a window with sink tokens."""
    x = _inputs(jnp.dtype(dtype))
    allowed = jnp.asarray(mask_BTS(SEGMENTS_BT, window, sinks, POSITIONS_BT))
    cot = jnp.asarray(np.random.default_rng(5).normal(size=(B, T, N, H)), jnp.float32)
    block_k = 128 if backend == "tpu" else 16  # the TPU kernels' smallest key tile
    kernel = functools.partial(
        _kernel, window=window, sinks=sinks, backend=backend, block_k=block_k
    )

    @functools.partial(jax.jit, compiler_options=QUICK)
    def values_and_grads(x: dict, cot: jax.Array) -> tuple:
        y, pull = jax.vjp(lambda x: kernel(x).astype(jnp.float32), x)
        return y, pull(cot)[0]

    y, grads = values_and_grads(x, cot)
    y_ref, pull_ref = jax.vjp(lambda x: _dense(x, allowed), x)
    (grads_ref,) = pull_ref(cot)
    assert_close(y, y_ref, dtype=dtype, summands=T, roundings=2)
    pairs = B * T * T // 2
    for key, summands in [("q", T), ("k", T), ("v", T), ("slopes", pairs), ("sink", B * T)]:
        assert grads[key].dtype == x[key].dtype
        assert_close(grads[key], grads_ref[key], dtype=dtype, summands=summands, roundings=4)
    assert float(jnp.max(jnp.abs(grads["sink"]))) > 1e-2  # the sink's gradient is live


def test_stick_breaking_has_no_denominator_for_the_sink() -> None:
    x = _inputs(jnp.float32)
    with pytest.raises(ValueError, match="sink joins a softmax denominator; 'stickbreaking'"):
        _kernel(x, window=None, sinks=0, normalizer="stickbreaking", include_self=False)
    with pytest.raises(ValueError, match="no denominator to join"):
        tiny_config("stickbreaking", attention_impl="kernel", attention_sink=True)


def _compare_with_sink(position: str, dtype: str, window: int | None, sinks: int) -> None:
    from tests.ops.kernels import test_kernel_registry

    test_kernel_registry._compare(position, dtype, window, sinks, attention_sink=True)


@pytest.mark.parametrize(
    "position",
    [
        pytest.param(p, marks=SLOW)
        for p in ["rope", "alibi+rope", "cope", "relative", "selective", "transformer_xl", "fox+t5"]
    ],
)
def test_model_with_a_sink_on_the_kernels_equals_naive(position: str) -> None:
    """``attention_sink=True``: the model on the kernels (the plain softmax kernels with and
    without terms, CoPE's, Shaw's, selective attention's, XL's widened q and k) equals the
    naive path, values and every gradient (the sink's too), float32, GQA, window with sink
    tokens, packed segments."""
    _compare_with_sink(position, "float32", WINDOW, SINKS)


@SLOW
@pytest.mark.parametrize("position", ["alibi", "cope"])
def test_model_with_a_sink_on_the_kernels_equals_naive_bfloat16(position: str) -> None:
    _compare_with_sink(position, "bfloat16", None, 0)


@SLOW
@pytest.mark.parametrize("position", ["alibi", "cope"])
def test_model_with_a_sink_on_the_tpu_kernels_equals_naive(position: str, monkeypatch) -> None:
    from tests.ops.kernels.test_tpu_kernels import _on_tpu_kernels

    traced = _on_tpu_kernels(monkeypatch)
    _compare_with_sink(position, "float32", WINDOW, SINKS)
    assert traced
