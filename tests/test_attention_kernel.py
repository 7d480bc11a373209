"""``model.attention_impl="dot_product_attention"`` equals the explicit naive path.

The kernel (``jax.nn.dot_product_attention``) replaces the content logits, mask and softmax of
``copejax.model.attention.Attention`` for schemes whose only sites are embed and qk; values,
gradients and incremental decoding must not change, and other schemes are refused by name.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model import checks, decode
from copejax.model.transformer import Transformer
from tests import sweeps
from tests.conftest import tiny_config

KERNEL_SCHEMES = [
    "nope",
    "learned",
    "sinusoidal",
    "rope",
    "xpos",
    "randomized",
    # position-only biases, passed to the kernel as bias=
    "alibi",
    "t5",
    "kerple",
    "fire",
    "alibi+rope",
]
SEGMENTS_BT = np.array([[1] * 8, [1, 1, 1, 2, 2, 3, 3, 3]], np.int32)
POSITIONS_BT = np.array([list(range(8)), [0, 1, 2, 0, 1, 0, 1, 2]], np.int32)
TOKENS_BT = np.random.default_rng(0).integers(0, 13, (2, 8)).astype(np.int32)


def _models(position: str) -> tuple[Transformer, Transformer, object]:
    einsum_cfg = tiny_config(position)
    kernel_cfg = dataclasses.replace(einsum_cfg, attention_impl="dot_product_attention")
    checks.validate(kernel_cfg)
    params = Transformer(einsum_cfg).init(
        jax.random.key(0), jnp.asarray(TOKENS_BT), jnp.asarray(POSITIONS_BT)
    )["params"]
    return Transformer(einsum_cfg), Transformer(kernel_cfg), params


@pytest.mark.parametrize("position", sweeps.schemes(KERNEL_SCHEMES, fast=("rope", "alibi")))
def test_kernel_equals_einsum_values_and_gradients(position: str) -> None:
    einsum_model, kernel_model, params = _models(position)
    args = (jnp.asarray(TOKENS_BT), jnp.asarray(POSITIONS_BT), jnp.asarray(SEGMENTS_BT))

    def loss(model: Transformer, p: object) -> jax.Array:
        return jnp.sum(jnp.sin(model.apply({"params": p}, *args)))

    value_e, grads_e = jax.jit(jax.value_and_grad(lambda p: loss(einsum_model, p)))(params)
    value_k, grads_k = jax.jit(jax.value_and_grad(lambda p: loss(kernel_model, p)))(params)
    np.testing.assert_allclose(value_k, value_e, rtol=1e-5, atol=1e-5)
    for g_k, g_e in zip(jax.tree.leaves(grads_k), jax.tree.leaves(grads_e), strict=True):
        np.testing.assert_allclose(g_k, g_e, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("position", ["nope", "rope", "alibi"])
def test_kernel_decoding_equals_full_pass(position: str) -> None:
    _, model, params = _models(position)
    full = model.apply(
        {"params": params},
        jnp.asarray(TOKENS_BT),
        jnp.asarray(POSITIONS_BT),
        jnp.asarray(SEGMENTS_BT),
    )
    cache = decode.init_cache(model.cfg, 2, 8)
    outputs = []
    for start, end in [(0, 4), (4, 5), (5, 6), (6, 7), (7, 8)]:
        logits, variables = model.apply(
            {"params": params, "cache": cache},
            jnp.asarray(TOKENS_BT[:, start:end]),
            jnp.asarray(POSITIONS_BT[:, start:end]),
            jnp.asarray(SEGMENTS_BT[:, start:end]),
            decode=True,
            mutable=["cache"],
        )
        cache = variables["cache"]
        outputs.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), full, rtol=1e-5, atol=1e-5)


def test_kernel_keeps_float32_softmax_in_bfloat16() -> None:
    """bf16 model: the kernel's logits and softmax are float32, like the einsum path."""
    einsum_model, kernel_model, params = _models("rope")
    bf16 = {"dtype": "bfloat16"}
    einsum_model = Transformer(dataclasses.replace(einsum_model.cfg, **bf16))
    kernel_model = Transformer(dataclasses.replace(kernel_model.cfg, **bf16))
    args = (jnp.asarray(TOKENS_BT), jnp.asarray(POSITIONS_BT))
    a = np.asarray(einsum_model.apply({"params": params}, *args), np.float32)
    b = np.asarray(kernel_model.apply({"params": params}, *args), np.float32)
    np.testing.assert_allclose(b, a, rtol=0.05, atol=0.05)


@pytest.mark.parametrize(
    "position", ["relative", "transformer_xl", "cope", "fox", "stickbreaking", "tape"]
)
def test_kernel_refuses_schemes_with_other_sites(position: str) -> None:
    with pytest.raises(ValueError, match=rf"attention_impl.*'{position}' also uses"):
        tiny_config(position, attention_impl="dot_product_attention")


def test_unknown_kernel_is_refused() -> None:
    with pytest.raises(ValueError, match=r"attention_impl must be one of .*'flash'"):
        tiny_config("nope", attention_impl="flash")


@pytest.mark.parametrize("window", [None, 3])
def test_kernel_without_segment_ids_masks_by_index(
    window: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No segment ids: the kernel gets ``is_causal`` (and the window as
    ``local_window_size``) instead of a (B, 1, T, S) mask array, with the same values and
    gradients; given ids (even one document), it gets the mask."""
    einsum_cfg = tiny_config("alibi", window=window)
    kernel_cfg = dataclasses.replace(einsum_cfg, attention_impl="dot_product_attention")
    tokens_BT, positions_BT = jnp.asarray(TOKENS_BT), jnp.asarray(POSITIONS_BT)
    params = Transformer(einsum_cfg).init(jax.random.key(0), tokens_BT, positions_BT)["params"]
    calls = []
    kernel = jax.nn.dot_product_attention

    def recorded(*args: object, **kwargs: object) -> jax.Array:
        calls.append({k: kwargs[k] for k in ("mask", "is_causal", "local_window_size")})
        return kernel(*args, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", recorded)

    def loss(cfg: object, p: object, *ids: jax.Array) -> jax.Array:
        logits = Transformer(cfg).apply({"params": p}, tokens_BT, positions_BT, *ids)
        return jnp.sum(jnp.sin(logits))

    value_e, grads_e = jax.value_and_grad(lambda p: loss(einsum_cfg, p))(params)
    value_k, grads_k = jax.value_and_grad(lambda p: loss(kernel_cfg, p))(params)
    np.testing.assert_allclose(value_k, value_e, rtol=1e-5, atol=1e-5)
    for g_k, g_e in zip(jax.tree.leaves(grads_k), jax.tree.leaves(grads_e), strict=True):
        np.testing.assert_allclose(g_k, g_e, rtol=1e-4, atol=1e-6)
    assert calls and all(c["mask"] is None and c["is_causal"] for c in calls)
    expected = None if window is None else (window - 1, 0)
    assert all(c["local_window_size"] == expected for c in calls)
    calls.clear()
    one_document_BT = jnp.zeros_like(tokens_BT)
    Transformer(kernel_cfg).apply({"params": params}, tokens_BT, positions_BT, one_document_BT)
    assert calls and all(c["mask"] is not None and not c["is_causal"] for c in calls)
