"""Selective attention's penalties on the TPU kernels (arXiv 2410.02703), from the CPU.

In TPU interpret mode, values against NumPy in float64 (``F_ij = sum_{k < i} S_kj`` from the
paper's equations, :func:`tests.ops.kernels.test_selective_kernel.penalty_BTS`) and the
gradients of q, k, v and the other terms' arrays against ``jax.vjp`` of the dense float32
maths; grouped KV heads, packed segments, a window with and without sinks, relu and sigmoid,
float32 and bfloat16, and lengths of several query and key tiles (200 tokens: 4 query tiles
of 64 and 2 key tiles of 128, padded to 256). The Mosaic export of the four kernels, and the
model on the TPU kernels against its naive path. TPU interpret mode costs seconds per call:
the default set keeps one short case (4 query tiles of 16, one key tile: a TPU key tile
holds 128 keys or the whole padded sequence), the export and the refusals.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model.kernel_terms import kernel_refusal, tpu_kernel_refusal
from copejax.ops.kernels import selective_attention
from copejax.ops.kernels.attention import fused_attention
from copejax.ops.kernels.selective import SelectiveTerm
from copejax.ops.kernels.terms import KernelTerm
from copejax.ops.kernels.tpu_selective import tpu_selective_forward_call
from copejax.positions import registry
from tests.ops.kernels.every_term import every_term
from tests.ops.kernels.reference import attention_jnp, attention_numpy, mask_BTS
from tests.ops.kernels.test_fused_attention import _decay, _slope
from tests.ops.kernels.test_selective_kernel import (
    HEAD,
    B,
    H,
    _inputs,
    _layout,
    _terms_BNTS,
    penalty_BTS,
)
from tests.ops.kernels.test_tpu_kernels import _on_tpu_kernels
from tests.ops.kernels.tolerances import assert_close

SLOW = pytest.mark.slow
SMALL = {"T": 40, "N": 2, "G": 1, "block_q": 16, "block_k": 16, "segments": (17, 15, 8)}
LARGE = {"T": 200, "N": 4, "G": 2, "block_q": 64, "block_k": 128, "segments": (90, 70, 40)}


def _kernel(x: dict, shape: dict, window, sinks: int, *, nonlinearity="relu", interpret=None):
    ids, rank = _layout(shape)
    positions = jnp.asarray(rank)
    terms = []
    if "slopes" in x:
        terms = [
            KernelTerm("slope", _slope, params_NP=x["slopes"]),
            KernelTerm("decay", _decay, q_values_BTN=x["c"], k_values_BSN=x["c"]),
        ]
    return fused_attention(
        x["q"],
        x["k"],
        x["v"],
        q_positions_BT=positions,
        k_positions_BT=positions,
        segment_ids_BT=jnp.asarray(ids),
        window=window,
        sink_tokens=sinks,
        k_rank_BT=positions,
        block_q=shape["block_q"],
        block_k=shape["block_k"],
        interpret=interpret,
        terms=terms,
        selective=SelectiveTerm(HEAD, nonlinearity),
        backend="tpu",
    )


def _check(shape: dict, dtype: str, window, sinks: int, *, nonlinearity: str, terms: bool) -> None:
    """Values (float32 inputs: against NumPy float64), and the gradients of q, k, v and the
    other terms' arrays against the dense float32 maths."""
    x = _inputs(shape, jnp.dtype(dtype), terms=terms)
    ids, rank = _layout(shape)
    allowed = mask_BTS(ids, window, sinks, rank)
    length = shape["T"]
    cot = jnp.asarray(np.random.default_rng(5).normal(size=(B, length, shape["N"], H)))
    cot = cot.astype(jnp.float32)

    def kernel(x):
        return _kernel(x, shape, window, sinks, nonlinearity=nonlinearity).astype(jnp.float32)

    def dense(x, frozen: bool = False):  # the same inputs in float32: only roundings differ
        x32 = {key: value.astype(jnp.float32) for key, value in x.items()}
        f = penalty_BTS(x32["q"], x32["k"], ids, nonlinearity)
        f = jax.lax.stop_gradient(f) if frozen else f
        bias = _terms_BNTS(x32, rank) - f[:, None]
        return attention_jnp(x32["q"], x32["k"], x32["v"], bias, jnp.asarray(allowed))

    def with_grads(function, x, cot):  # one compilation of the kernels, forward and backward
        y, pull = jax.vjp(function, x)
        return y, pull(cot)[0]

    y, grads = jax.jit(functools.partial(with_grads, kernel))(x, cot)
    y_ref, grads_ref = jax.jit(functools.partial(with_grads, dense))(x, cot)
    if dtype == "float32":
        x64 = {key: np.asarray(value, np.float64) for key, value in x.items()}
        f64 = penalty_BTS(x64["q"], x64["k"], ids, nonlinearity, xp=np)
        bias = _terms_BNTS(x64, rank, np) - f64[:, None]
        expected = attention_numpy(x64["q"], x64["k"], x64["v"], bias, allowed)
        assert_close(y, expected, dtype=dtype, summands=length, roundings=0)
        assert float(np.max(np.where(allowed, f64, 0))) > 1.0  # the penalties are live
    assert_close(y, y_ref, dtype=dtype, summands=length, roundings=2)
    pairs = B * length * length // 2  # what a parameter's gradient sums over
    for key in x:
        assert grads[key].dtype == x[key].dtype
        summands = pairs if key == "slopes" else 2 * length
        assert_close(grads[key], grads_ref[key], dtype=dtype, summands=summands, roundings=4)
    # The selecting head's q and k get the selection's gradient, not a constant F's.
    frozen = jax.jit(functools.partial(with_grads, functools.partial(dense, frozen=True)))
    frozen_grads = frozen(x, cot)[1]
    for key, head in (("q", HEAD), ("k", HEAD // (shape["N"] // shape["G"]))):
        gap = np.abs(np.asarray(grads_ref[key] - frozen_grads[key], np.float32)[:, :, head])
        assert gap.max() > 0.05 * np.abs(np.asarray(grads_ref[key], np.float32)).max()


def test_small_float32_window_sinks_gqa_packed_terms() -> None:
    _check(SMALL, "float32", 12, 2, nonlinearity="relu", terms=True)


@SLOW
@pytest.mark.parametrize(
    ("dtype", "window", "sinks", "nonlinearity", "terms"),
    [
        ("float32", None, 0, "relu", False),
        ("float32", 100, 3, "relu", True),
        ("float32", 100, 0, "sigmoid", True),
        ("bfloat16", None, 0, "relu", True),
        ("bfloat16", 100, 3, "sigmoid", False),
    ],
)
def test_several_tiles(dtype: str, window, sinks: int, nonlinearity: str, terms: bool) -> None:
    _check(LARGE, dtype, window, sinks, nonlinearity=nonlinearity, terms=terms)


def test_lowers_to_mosaic_tpu() -> None:
    """The prefix, forward and both backward kernels, with every scheme's term beside the
    penalties, GQA and a window with sinks, pass Pallas's Mosaic TPU lowering (exported from
    the CPU; Mosaic's layout passes run only on a TPU)."""
    heads, length = 4, 256  # two key tiles, four query tiles
    terms = every_term(heads, length)
    q_BTNH = jnp.ones((1, length, heads, 16), jnp.bfloat16)
    positions_BT = jnp.arange(length)[None]

    def loss(q_BTNH: jax.Array) -> jax.Array:
        y = fused_attention(
            q_BTNH,
            q_BTNH[:, :, :2],
            q_BTNH[:, :, :2],
            q_positions_BT=positions_BT,
            k_positions_BT=positions_BT,
            segment_ids_BT=jnp.zeros((1, length), jnp.int32),
            terms=terms,
            window=100,
            sink_tokens=2,
            k_rank_BT=positions_BT,
            block_q=64,
            block_k=128,
            interpret=False,
            backend="tpu",
            selective=SelectiveTerm(3, "sigmoid"),
        )
        return jnp.sum(y.astype(jnp.float32))

    text = jax.export.export(jax.jit(jax.grad(loss)), platforms=["tpu"])(q_BTNH).mlir_module()
    assert text.count("tpu_custom_call") == 4
    for name in ("prefix", "forward", "dq", "dkdv"):
        assert f"copejax_selective_{name}_tpu" in text


@pytest.mark.parametrize(
    ("position", "options"),
    [
        ("selective", {}),
        ("selective+rope", {}),
        ("selective+fox+alibi", {}),
        ("selective", {"nonlinearity": "sigmoid"}),
    ],
)
def test_tpu_runs_what_the_kernels_run(position: str, options: dict) -> None:
    scheme = registry.make_scheme(position, options)
    assert tpu_kernel_refusal(scheme) is None


@pytest.mark.parametrize(
    ("options", "named"),
    [({"prune_threshold": 2.0}, "prune_threshold=2.0"), ({"prune_budget": 4}, "prune_budget=4")],
)
def test_tpu_refuses_pruning_by_name(options: dict, named: str) -> None:
    scheme = registry.make_scheme("selective", options)
    refusal = tpu_kernel_refusal(scheme)
    assert refusal is not None and named in refusal
    assert refusal == kernel_refusal(scheme)


@SLOW
@pytest.mark.parametrize(
    ("position", "dtype", "window", "sinks"),
    [
        ("selective", "float32", 12, 2),
        ("selective+fox", "float32", None, 0),
        ("selective+rope", "bfloat16", 12, 2),
    ],
)
def test_model_on_tpu_kernels_equals_naive(
    position: str, dtype: str, window, sinks: int, monkeypatch
) -> None:
    """The whole model on the TPU kernels equals the naive path (values and every
    parameter's gradient), GQA, packed segments."""
    from tests.ops.kernels import test_kernel_registry

    _on_tpu_kernels(monkeypatch)
    traced = []

    def forward_call(*args, **kwargs):
        traced.append(True)
        return tpu_selective_forward_call(*args, **kwargs)

    monkeypatch.setattr(selective_attention, "tpu_selective_forward_call", forward_call)
    test_kernel_registry._compare(position, dtype, window=window, sinks=sinks)
    assert traced
