"""On a GPU: ``auto`` dispatches bf16 models to cuDNN's fused attention and the result equals
the explicit naive path; the blockwise engine equals the naive path on the GPU backend too.

Skipped unless JAX's default backend is a GPU (run with ``JAX_PLATFORMS=cuda``; the test
suite's conftest defaults to the CPU). The CPU-side equality of the same dispatch through
XLA's implementation is ``tests/test_attention_kernel.py``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model import attention_paths, decode
from copejax.model.transformer import Transformer
from tests.conftest import PACKED_POSITIONS_BT, PACKED_SEGMENTS_BT, perturbed, tiny_config

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="needs a GPU backend (JAX_PLATFORMS=cuda)"
)

# cuDNN's fused attention wants head dimensions that are multiples of 8: H = 64 here.
GPU_SIZES = {"d_model": 128, "num_heads": 2, "head_dim": 64, "max_len": 64}
FUSED_SCHEMES = ["nope", "rope", "alibi", "kerple", "alibi+rope"]
ENGINE_SCHEMES = ["nope", "rope", "alibi", "cope", "fox", "stickbreaking", "path"]


def _inputs(length: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(0)
    tokens_BT = jnp.asarray(rng.integers(0, 13, (2, length)), jnp.int32)
    repeats = length // PACKED_SEGMENTS_BT.shape[1]
    segments_BT = jnp.asarray(np.repeat(PACKED_SEGMENTS_BT, repeats, axis=1))
    positions_BT = jnp.asarray(np.repeat(PACKED_POSITIONS_BT, repeats, axis=1) * repeats)
    positions_BT = positions_BT + jnp.asarray(np.tile(np.arange(repeats), 8))[None]
    return tokens_BT, positions_BT, segments_BT


def _loss(model: Transformer, params: object, args: tuple) -> jax.Array:
    return jnp.mean(jnp.sin(model.apply({"params": params}, *args).astype(jnp.float32)))


@pytest.mark.parametrize("position", FUSED_SCHEMES)
def test_auto_takes_cudnn_in_bfloat16_and_equals_naive(position: str) -> None:
    cfg = tiny_config(position, dtype="bfloat16", **GPU_SIZES)
    assert attention_paths.choose_impl(cfg, 64, sowing=False) == "dot_product_attention"
    fused = Transformer(cfg)
    naive = Transformer(dataclasses.replace(cfg, attention_impl="naive"))
    reference = Transformer(dataclasses.replace(cfg, attention_impl="naive", dtype="float32"))
    args = _inputs(64)
    params = perturbed(fused.init(jax.random.key(0), *args[:2])["params"])
    hlo = jax.jit(lambda p: fused.apply({"params": p}, *args)).lower(params).compile().as_text()
    assert "cudnn" in hlo.lower(), "auto in bf16 on a GPU did not reach cuDNN's fused attention"
    out_f = np.asarray(fused.apply({"params": params}, *args), np.float32)
    out_n = np.asarray(naive.apply({"params": params}, *args), np.float32)
    out_r = np.asarray(reference.apply({"params": params}, *args), np.float32)
    # bf16 rounding of q, k, v and the output: both 16-bit paths sit as close to the f32
    # reference as each other.
    err_f, err_n = np.abs(out_f - out_r).max(), np.abs(out_n - out_r).max()
    assert err_f <= max(2.0 * err_n, 0.05), (err_f, err_n)
    grads_f = jax.grad(lambda p: _loss(fused, p, args))(params)
    grads_r = jax.grad(lambda p: _loss(reference, p, args))(params)
    for leaf_f, leaf_r in zip(jax.tree.leaves(grads_f), jax.tree.leaves(grads_r), strict=True):
        g_f, g_r = np.asarray(leaf_f, np.float32), np.asarray(leaf_r, np.float32)
        assert np.abs(g_f - g_r).max() <= 0.05 * (np.abs(g_r).max() + 1e-6)


def test_cudnn_decoding_equals_its_full_pass() -> None:
    cfg = tiny_config("rope", dtype="bfloat16", **GPU_SIZES)
    model = Transformer(cfg)
    args = _inputs(64)
    params = model.init(jax.random.key(0), *args[:2])["params"]
    full = np.asarray(model.apply({"params": params}, *args), np.float32)
    cache = decode.init_cache(cfg, 2, 64)
    outputs = []
    for start, end in [(0, 48), (48, 49), (49, 64)]:
        logits, variables = model.apply(
            {"params": params, "cache": cache},
            *(a[:, start:end] for a in args),
            decode=True,
            mutable=["cache"],
        )
        cache = variables["cache"]
        outputs.append(np.asarray(logits, np.float32))
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), full, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("position", ENGINE_SCHEMES)
def test_blockwise_engine_equals_naive_on_gpu(position: str) -> None:
    cfg = tiny_config(position, attention_impl="blockwise", attention_block=16, **GPU_SIZES)
    blockwise = Transformer(cfg)
    naive = Transformer(dataclasses.replace(cfg, attention_impl="naive"))
    args = _inputs(64)
    params = perturbed(blockwise.init(jax.random.key(0), *args[:2])["params"])
    value_b, grads_b = jax.value_and_grad(lambda p: _loss(blockwise, p, args))(params)
    value_n, grads_n = jax.value_and_grad(lambda p: _loss(naive, p, args))(params)
    np.testing.assert_allclose(value_b, value_n, rtol=1e-4, atol=1e-5)
    for g_b, g_n in zip(jax.tree.leaves(grads_b), jax.tree.leaves(grads_n), strict=True):
        np.testing.assert_allclose(g_b, g_n, rtol=1e-3, atol=1e-5)
