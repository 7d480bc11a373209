"""PaTH's level calls (later queries against earlier keys) on the Mosaic TPU kernels (arXiv
2505.16381), in TPU interpret mode on the CPU, and their Mosaic lowering exported from the
CPU.

The TPU's key tiles are at least 128 keys: queries from token 128 (tiles of 64, the last one
padded) against the keys of tokens 0..199 (two tiles of 128, the last one padded), packed
segments, a window and a per-token term. Values and log-sum-exps against NumPy (float64),
gradients (the log-sum-exp's cotangent included) against ``jax.grad`` of the dense float32
maths, both from :mod:`tests.ops.kernels.test_path_kernel`; PaTH's whole path (chunk
products, XLA within chunks) against the Triton kernels. TPU interpret mode costs seconds
per kernel call, so the gradients and the model run slow.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model.kernel_path import path_attention
from copejax.model.kernel_terms import kernel_refusal
from copejax.ops.engine_blocks import BlockTerm
from copejax.ops.kernels.tiles import MASKED_LOGIT
from copejax.positions.registry import make_scheme
from tests.ops.kernels.test_path_kernel import _offset, _offset_dense
from tests.ops.kernels.tolerances import assert_close

B, T, N, G, H, CHUNK = 1, 300, 2, 1, 16, 128  # three chunks, the last one padded
OFFSET, KEYS = 128, 200
SEGMENTS_BT = np.array([[0] * 150 + [1] * 100 + [2] * 50], np.int32)
POSITIONS_BT = np.array([np.r_[np.arange(150), np.arange(100), np.arange(50)]])
WINDOW = 200
SLOW = pytest.mark.slow


def _inputs(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    c = jnp.asarray(np.cumsum(-rng.uniform(0, 0.1, (B, T, N)), axis=1), jnp.float32)
    return {"q": normal(B, T, N, H), "k": normal(B, T, G, H), "v": normal(B, T, G, H), "c": c}


def _tpu_offset(x: dict, *, interpret: bool | None = None):
    return _offset(
        x,
        offset=OFFSET,
        length_k=KEYS,
        window=WINDOW,
        tokens=(POSITIONS_BT, SEGMENTS_BT),
        blocks=(64, 128),
        interpret=interpret,
        backend="tpu",
    )


def _dense(x: dict, xp=jnp):
    return _offset_dense(
        x, offset=OFFSET, length_k=KEYS, window=WINDOW, segments_BT=SEGMENTS_BT, xp=xp
    )


def test_tpu_offset_attention_equals_numpy() -> None:
    x = _inputs()
    out, lse = jax.jit(_tpu_offset)(x)
    x64 = {key: np.asarray(value, np.float64) for key, value in x.items()}
    want_out, want_lse = _dense(x64, xp=np)
    assert_close(out, want_out, dtype="float32", summands=T, roundings=0)
    seen = want_lse > MASKED_LOGIT / 2
    assert seen.any() and (~seen).any()  # segment 2's queries see no key before token 200
    np.testing.assert_array_equal(np.asarray(lse) > MASKED_LOGIT / 2, seen)
    assert_close(lse[seen], want_lse[seen], dtype="float32", summands=T, roundings=0)


@SLOW
def test_tpu_offset_attention_gradients_with_the_lse_cotangent() -> None:
    x = _inputs()
    rng = np.random.default_rng(7)
    cot_out = jnp.asarray(rng.normal(size=(B, T - OFFSET, N, H)), jnp.float32)
    cot_lse = jnp.asarray(rng.normal(size=(B, T - OFFSET, N)), jnp.float32)

    def loss(run):
        def value(x):
            out, lse = run(x)
            seen = lse > MASKED_LOGIT / 2
            return jnp.sum(out * cot_out) + jnp.sum(jnp.where(seen, lse, 0.0) * cot_lse)

        return jax.grad(value)

    dx, dx_ref = jax.jit(loss(_tpu_offset))(x), loss(_dense)(x)
    for key in ("q", "k", "v", "c"):
        assert_close(dx[key], dx_ref[key], dtype="float32", summands=T, roundings=0)


def test_tpu_offset_attention_lowers_to_mosaic() -> None:
    """The forward and both backward kernels with a query offset pass Pallas's Mosaic TPU
    lowering (exported from the CPU; Mosaic's layout passes run only on a TPU)."""
    x = {key: value.astype(jnp.bfloat16) for key, value in _inputs().items()}
    x["c"] = x["c"].astype(jnp.float32)

    def loss(q_BTNH: jax.Array, k_BTGH: jax.Array) -> jax.Array:
        out, lse = _tpu_offset({**x, "q": q_BTNH, "k": k_BTGH}, interpret=False)
        return jnp.sum(out) + jnp.sum(jnp.where(lse > MASKED_LOGIT / 2, lse, 0.0))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    exported = jax.export.export(grad, platforms=["tpu"])(x["q"], x["k"])
    text = exported.mlir_module()
    assert text.count("tpu_custom_call") == 3
    for name in ("forward", "dq", "dkdv"):
        assert f"copejax_attention_{name}_tpu" in text


@SLOW
def test_tpu_path_attention_equals_the_triton_kernels() -> None:
    """PaTH's whole chunked path on the TPU kernels (chunks of 128) equals it on the Triton
    kernels (checked against the Householder products in test_path_kernel), values and the
    gradients of q, k, v, w and beta."""
    rng = np.random.default_rng(3)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    w = normal(B, T, G, H)
    inputs = {
        "q": normal(B, T, N, H),
        "k": normal(B, T, G, H),
        "v": normal(B, T, G, H),
        "w": w / jnp.linalg.norm(w, axis=-1, keepdims=True),
        "beta": jnp.asarray(rng.uniform(0.0, 2.0, (B, T, G)), jnp.float32),
    }

    def run(x: dict, backend: str) -> jax.Array:
        term = BlockTerm(
            None,
            k_arrays={key: jnp.repeat(x[key], N // G, axis=2) for key in ("w", "beta")},
        )
        y = path_attention(
            term,
            x["q"],
            x["k"],
            x["v"],
            q_positions_BT=jnp.asarray(POSITIONS_BT),
            k_positions_BT=jnp.asarray(POSITIONS_BT),
            segment_ids_BT=jnp.asarray(SEGMENTS_BT),
            window=WINDOW,
            block=64,
            chunk=CHUNK,
            backend=backend,
        )
        return jnp.sum(jnp.sin(y))

    grads = [
        jax.jit(jax.value_and_grad(functools.partial(run, backend=b)))(inputs)
        for b in ("tpu", "triton")
    ]
    (value_tpu, grad_tpu), (value_gpu, grad_gpu) = grads
    assert_close(value_tpu, value_gpu, dtype="float32", summands=T * T, roundings=0)
    for key, g in grad_gpu.items():
        assert_close(grad_tpu[key], g, dtype="float32", summands=2 * T, roundings=0)


def test_path_runs_on_the_kernels() -> None:
    assert kernel_refusal(make_scheme("path")) is None
    assert kernel_refusal(make_scheme("path+fox")) is None
