"""Grouped KV heads, GPT-OSS's attention sink and length scaling of q against NumPy references.

The reference attention layer below is written from the definitions, in float64: query head n
reads key/value head n // (N / K) (Ainslie et al. 2023, arXiv 2305.13245); the sink adds
exp(sink_n) to every softmax denominator and mixes no value (GPT-OSS); SSMax multiplies the
logits by s log n with n the keys the query sees (arXiv 2501.19399); Llama 4 multiplies q by
log(floor((pos + 1) / floor_scale) + 1) * attn_scale + 1 (llama-models' reference code).
"""

from __future__ import annotations

import math
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model import checks, logit_scaling
from copejax.model.attention import Attention
from copejax.model.attention_paths import choose_impl
from copejax.model.config import ModelConfig
from copejax.model.transformer import Transformer
from copejax.ops import engine, engine_blocks
from copejax.positions.base import AttentionContext, masked_softmax_BNTS
from copejax.positions.fox import PRO_OPTIONS
from copejax.runtime import sharding
from tests.conftest import PACKED_POSITIONS_BT, PACKED_SEGMENTS_BT, perturbed, tiny_config

LENGTH = 8


# ----------------------------------------------------------------------------- references


def reference_attention_layer(
    x_BTD: np.ndarray,
    params: dict,
    segments_BT: np.ndarray,
    positions_BT: np.ndarray,
    *,
    sink: bool,
    scaling: str,
    ssmax_s_N: np.ndarray | None = None,
    floor_scale: float = 8192.0,
    attn_scale: float = 0.1,
) -> np.ndarray:
    """One nope attention layer, loop by loop, in float64."""
    x = x_BTD.astype(np.float64)
    wq, wk, wv = (np.asarray(params[n]["kernel"], np.float64) for n in ("query", "key", "value"))
    wo = np.asarray(params["out"]["kernel"], np.float64)
    sink_N = np.asarray(params["attention_sink"], np.float64) if sink else None
    batch, length, _ = x.shape
    heads, kv_heads, head_dim = wq.shape[1], wk.shape[1], wq.shape[2]
    group = heads // kv_heads
    y = np.zeros((batch, length, heads, head_dim))
    for b in range(batch):
        for n in range(heads):
            g = n // group
            for t in range(length):
                q = x[b, t] @ wq[:, n, :]
                seen = [s for s in range(t + 1) if segments_BT[b, s] == segments_BT[b, t]]
                factor = 1.0
                if scaling == "ssmax":
                    factor = ssmax_s_N[n] * math.log(len(seen))
                elif scaling == "llama4":
                    pos = positions_BT[b, t]
                    factor = math.log(math.floor((pos + 1) / floor_scale) + 1) * attn_scale + 1
                logits = [
                    factor * (q @ (x[b, s] @ wk[:, g, :])) / math.sqrt(head_dim) for s in seen
                ]
                exps = np.exp(np.array(logits))
                denom = exps.sum() + (math.exp(sink_N[n]) if sink else 0.0)
                for w, s in zip(exps / denom, seen, strict=True):
                    y[b, t, n] += w * (x[b, s] @ wv[:, g, :])
    return np.einsum("btnh,nhd->btd", y, wo)


CASES = [
    # (num_kv_heads, sink, scaling, ssmax_learned)
    (2, False, "none", True),
    (1, True, "none", True),
    (2, True, "ssmax", True),
    (4, False, "ssmax", False),
    (1, False, "llama4", True),
    (2, True, "llama4", True),
]


@pytest.mark.parametrize("impl", ["naive", "blockwise"])
@pytest.mark.parametrize(("kv_heads", "sink", "scaling", "learned"), CASES)
def test_attention_layer_matches_the_numpy_reference(
    kv_heads: int, sink: bool, scaling: str, learned: bool, impl: str
) -> None:
    cfg = tiny_config(
        "nope",
        num_heads=4,
        num_kv_heads=kv_heads,
        attention_sink=sink,
        logit_scaling=scaling,
        ssmax_learned=learned,
        ssmax_scale=0.7,
        llama4_floor_scale=2.0,
        llama4_attn_scale=0.5,
        attention_impl=impl,
        attention_block=3,
    )
    rng = np.random.default_rng(0)
    x_BTD = jnp.asarray(rng.normal(size=(2, LENGTH, cfg.d_model)), jnp.float32)
    ctx = AttentionContext.create(
        x_BTD, jnp.asarray(PACKED_POSITIONS_BT), jnp.asarray(PACKED_SEGMENTS_BT)
    )
    layer = Attention(cfg)
    params = nn.unbox(layer.init(jax.random.key(0), x_BTD, ctx))["params"]
    params = perturbed(params, scale=0.1)
    if sink:  # sinks of either sign, large enough to matter
        params["attention_sink"] = jnp.asarray([-1.0, 0.5, 2.0, 0.0], jnp.float32)
    assert params["key"]["kernel"].shape == (cfg.d_model, kv_heads, cfg.resolved_head_dim)
    y_BTD, _ = layer.apply({"params": params}, x_BTD, ctx)
    s_N = None
    if scaling == "ssmax":
        s_N = np.asarray(params["ssmax_scale"]) if learned else np.full(4, 0.7)
        assert ("ssmax_scale" in params) == learned
    want = reference_attention_layer(
        np.asarray(x_BTD),
        params,
        PACKED_SEGMENTS_BT,
        PACKED_POSITIONS_BT,
        sink=sink,
        scaling=scaling,
        ssmax_s_N=s_N,
        floor_scale=2.0,
        attn_scale=0.5,
    )
    np.testing.assert_allclose(np.asarray(y_BTD), want, rtol=1e-4, atol=1e-5)


def _repeat_kv_params(boxed: dict, group: int) -> dict:
    """Every parameter with a ``kv_heads`` axis repeated group-major along it."""

    def repeat(leaf: object) -> object:
        if not isinstance(leaf, nn.Partitioned):
            return leaf
        value = leaf.value
        if sharding.KV_HEADS in leaf.names:
            value = jnp.repeat(value, group, axis=leaf.names.index(sharding.KV_HEADS))
        return value

    return jax.tree.map(repeat, boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))


@pytest.mark.parametrize(
    ("position", "options"),
    [
        ("rope", {}),
        ("cope", {"gates": "sep_keys"}),
        ("fox", PRO_OPTIONS),
        pytest.param("tape", {}, marks=pytest.mark.slow),
        ("stickbreaking", {}),
        pytest.param("path", {}, marks=pytest.mark.slow),  # w, beta per key/value head (fla's)
        pytest.param("cope+rope", {}, marks=pytest.mark.slow),
        pytest.param("xpos", {}, marks=pytest.mark.slow),
        pytest.param("fox", {"key_shift": True, "value_shift": True}, marks=pytest.mark.slow),
        # FoX's per-KV-head shift gates and k norm repeated after TAPE's per-query-head keys.
        pytest.param("tape+fox", {"key_shift": True, "qk_norm": True}, marks=pytest.mark.slow),
    ],
    ids=str,
)
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_grouped_model_equals_full_heads_with_repeated_kv_weights(
    position: str, options: dict, kv_heads: int
) -> None:
    """A model with K key/value heads is the N-head model whose key/value weights (and
    key-side scheme weights) are the K heads' repeated: query head n reads head n // (N / K)."""
    overrides = dict(position_options=options, num_heads=4, num_layers=2)
    grouped = Transformer(tiny_config(position, num_kv_heads=kv_heads, **overrides))
    full = Transformer(tiny_config(position, **overrides))
    tokens_BT = jnp.asarray(np.random.default_rng(0).integers(0, 13, (2, LENGTH)), jnp.int32)
    positions_BT, segments_BT = jnp.asarray(PACKED_POSITIONS_BT), jnp.asarray(PACKED_SEGMENTS_BT)
    boxed = grouped.init(jax.random.key(0), tokens_BT, positions_BT)["params"]
    boxed = jax.tree.map(
        lambda leaf: (
            leaf.replace_boxed(perturbed(leaf.value))
            if isinstance(leaf, nn.Partitioned)
            else perturbed(leaf)
        ),
        boxed,
        is_leaf=lambda x: isinstance(x, nn.Partitioned),
    )
    grouped_params = nn.unbox(boxed)
    full_params = _repeat_kv_params(boxed, 4 // kv_heads)
    shapes = jax.tree.map(jnp.shape, full.init(jax.random.key(1), tokens_BT, positions_BT))
    assert jax.tree.map(jnp.shape, full_params) == nn.unbox(shapes)["params"]
    got = grouped.apply({"params": grouped_params}, tokens_BT, positions_BT, segments_BT)
    want = full.apply({"params": full_params}, tokens_BT, positions_BT, segments_BT)
    assert np.all(np.isfinite(np.asarray(want)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- pure pieces


def test_sink_softmax_matches_numpy(rng: np.random.Generator) -> None:
    logits = rng.normal(size=(2, 3, 4, 5)).astype(np.float32)
    mask = rng.random((2, 4, 5)) < 0.6
    mask[:, :, 0] = True
    mask[1, 2] = False  # a fully masked row: zeros, no NaN
    sink = rng.normal(size=3).astype(np.float32)
    got = np.asarray(masked_softmax_BNTS(jnp.asarray(logits), jnp.asarray(mask), jnp.asarray(sink)))
    exps = np.where(mask[:, None], np.exp(logits.astype(np.float64)), 0.0)
    want = exps / (exps.sum(-1, keepdims=True) + np.exp(sink)[None, :, None, None])
    want[1, :, 2] = 0.0
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert np.all(got.sum(-1) < 1.0)


@pytest.mark.parametrize("backward", ["flash", "remat"])
def test_engine_sink_values_and_gradients_match_the_naive_softmax(
    backward: str, rng: np.random.Generator
) -> None:
    """The sink seeds the online softmax; both backwards give the sink's gradient."""
    batch, length, heads, width = 2, 7, 3, 4
    q, k, v = (
        jnp.asarray(rng.normal(size=(batch, length, heads, width)), jnp.float32) for _ in "qkv"
    )
    sink_N = jnp.asarray(rng.normal(size=heads), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    ids = jnp.asarray([[0] * 7, [0, 0, 0, 1, 1, 1, 1]], jnp.int32)

    def blockwise(q: jax.Array, k: jax.Array, v: jax.Array, sink_N: jax.Array) -> jax.Array:
        y, _ = engine.blockwise_attention(
            q, k, v, q_positions_BT=positions, k_positions_BS=positions, q_segment_ids_BT=ids,
            k_segment_ids_BS=ids, block=3, backward=backward, sink_N=sink_N,
        )  # fmt: skip
        return y

    def naive(q: jax.Array, k: jax.Array, v: jax.Array, sink_N: jax.Array) -> jax.Array:
        mask = (ids[:, :, None] == ids[:, None, :]) & jnp.tril(jnp.ones((length, length), bool))
        logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) / math.sqrt(width)
        return jnp.einsum("BNTS,BSNH->BTNH", masked_softmax_BNTS(logits, mask, sink_N), v)

    np.testing.assert_allclose(blockwise(q, k, v, sink_N), naive(q, k, v, sink_N), atol=1e-6)
    cot = jnp.asarray(rng.normal(size=(batch, length, heads, width)), jnp.float32)
    grads_b = jax.grad(lambda *a: jnp.sum(blockwise(*a) * cot), argnums=(0, 1, 2, 3))(
        q, k, v, sink_N
    )
    grads_n = jax.grad(lambda *a: jnp.sum(naive(*a) * cot), argnums=(0, 1, 2, 3))(q, k, v, sink_N)
    for got, want in zip(grads_b, grads_n, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.all(np.abs(np.asarray(grads_b[3])) > 0)


def test_engine_refuses_a_sink_without_softmax() -> None:
    x = jnp.zeros((1, 2, 1, 2))
    pos = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ValueError, match="sink_N joins a softmax"):
        engine.blockwise_attention(
            x, x, x, q_positions_BT=pos, k_positions_BS=pos, q_segment_ids_BT=pos,
            k_segment_ids_BS=pos, normalizer=engine_blocks.Normalizer("stickbreaking"),
            sink_N=jnp.zeros(1),
        )  # fmt: skip


@pytest.mark.parametrize("offset", [0, 3])
def test_keys_seen_count_the_allowed_keys(offset: int, rng: np.random.Generator) -> None:
    k_ids = np.array([[0, 0, 1, 1, 1, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5, 5]], np.int32)
    length_q = 9 - offset
    q_ids = k_ids[:, offset:]
    got = np.asarray(logit_scaling.keys_seen_BT(jnp.asarray(q_ids), jnp.asarray(k_ids), offset))
    want = np.array(
        [
            [
                sum(k_ids[b, s] == q_ids[b, t] for s in range(offset + t + 1))
                for t in range(length_q)
            ]
            for b in range(2)
        ]
    )
    np.testing.assert_array_equal(got, want)


def test_llama4_scale_literal_values() -> None:
    """Llama 4's defaults (floor_scale 8192, attn_scale 0.1): 1 up to position 8190."""
    positions = jnp.asarray([[0, 8190, 8191, 3 * 8192 - 1]])
    got = np.asarray(logit_scaling.llama4_scale_BT(positions))
    want = [1.0, 1.0, 1.0 + 0.1 * math.log(2.0), 1.0 + 0.1 * math.log(4.0)]
    np.testing.assert_allclose(got[0], want, rtol=1e-6)


def test_ssmax_scale_is_s_log_n() -> None:
    got = logit_scaling.ssmax_scale_BTN(jnp.asarray([[1, 2, 10]]), jnp.asarray([0.5, 2.0]))
    want = np.log([1, 2, 10])[:, None] * np.array([0.5, 2.0])
    np.testing.assert_allclose(np.asarray(got)[0], want, rtol=1e-6)


def test_dot_product_attention_takes_grouped_heads_and_scaling() -> None:
    """jax.nn.dot_product_attention sees the repeated heads and the scaled q."""
    kwargs = dict(num_heads=4, num_kv_heads=2, logit_scaling="llama4", llama4_floor_scale=2.0)
    tokens_BT = jnp.asarray(np.random.default_rng(0).integers(0, 13, (2, LENGTH)), jnp.int32)
    positions_BT = jnp.asarray(PACKED_POSITIONS_BT)
    outs = []
    for impl in ("naive", "dot_product_attention"):
        model = Transformer(tiny_config("alibi+rope", attention_impl=impl, **kwargs))
        params = model.init(jax.random.key(0), tokens_BT, positions_BT)
        outs.append(model.apply(params, tokens_BT, positions_BT, jnp.asarray(PACKED_SEGMENTS_BT)))
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_kv_heads": 3}, "num_kv_heads=3 must divide model.num_heads=4"),
        ({"num_kv_heads": 0}, "num_kv_heads must be a positive integer"),
        ({"num_kv_heads": True}, "num_kv_heads must be a positive integer"),
        ({"logit_scaling": "log"}, "logit_scaling must be one of"),
        ({"llama4_floor_scale": 0.0}, "llama4_floor_scale must be a number > 0"),
        ({"ssmax_scale": float("nan")}, "ssmax_scale must be a finite number"),
        ({"attention_sink": 1}, "attention_sink must be True or False"),
        ({"position": "stickbreaking", "attention_sink": True}, "no denominator to join"),
        ({"position": "stickbreaking", "logit_scaling": "ssmax"}, "derivation"),
        ({"attention_sink": True, "attention_impl": "dot_product_attention"}, "cannot take"),
    ],
    ids=str,
)
def test_bad_layouts_are_clear_errors(overrides: dict, message: str) -> None:
    kwargs = {"vocab_size": 13, "d_model": 32, "num_heads": 4, "position": "rope", **overrides}
    with pytest.raises(ValueError, match=message):
        checks.validate(ModelConfig(**kwargs))


def test_auto_does_not_pick_the_fused_kernel_with_a_sink() -> None:
    cfg = tiny_config("rope", dtype="bfloat16")
    assert choose_impl(cfg, 64, False, backend="gpu") == "dot_product_attention"
    sinked = tiny_config("rope", dtype="bfloat16", attention_sink=True)
    assert choose_impl(sinked, 64, False, backend="gpu") == "naive"


def test_stickbreaking_takes_grouped_heads() -> None:
    tiny_config("stickbreaking", num_heads=4, num_kv_heads=1)  # validates


def test_train_config_reads_the_layout_fields() -> None:
    from copejax.config.base import base_config
    from copejax.training.plan import model_config

    config = base_config()
    config.model.num_kv_heads = 2
    config.model.attention_sink = True
    config.model.logit_scaling = "ssmax"

    task = types.SimpleNamespace(vocab=list(range(5)), seq_len=16)
    cfg = model_config(config, task)
    assert (cfg.num_kv_heads, cfg.attention_sink, cfg.logit_scaling) == (2, True, "ssmax")
    del config.model.num_kv_heads  # a config saved before the field existed
    assert model_config(config, task).num_kv_heads is None
