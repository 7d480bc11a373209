"""Stick-breaking attention against NumPy references from the paper's equation.

Tan et al. 2024 (arXiv 2410.17980): ``A_ij = beta_ij prod_{j<k<i} (1 - beta_ik)``,
``beta = sigmoid(z)``, written here as explicit products over keys in float64.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model.attention import Attention
from copejax.model.transformer import Transformer
from copejax.ops import engine, engine_blocks
from copejax.ops.segments import causal_mask_BTS
from copejax.positions.base import AttentionContext
from copejax.positions.stickbreaking import stickbreaking_allowed_BTS, stickbreaking_weights
from tests.conftest import tiny_config, tokens_and_positions

SEGMENTS_BT = np.array([[1, 1, 1, 2, 2, 2, 2, 2], [1, 1, 1, 1, 1, 1, 1, 1]])


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # 1 / (1 + exp(-z)) without overflow


def _mask(segments_BT: np.ndarray) -> np.ndarray:
    return np.asarray(causal_mask_BTS(jnp.asarray(segments_BT), jnp.asarray(segments_BT)))


def _ref_weights(
    z_BNTS: np.ndarray, segments_BT: np.ndarray, include_self: bool
) -> tuple[np.ndarray, np.ndarray]:
    """A_ij = beta_ij prod_{j<k<i} (1 - beta_ik) (k <= i with include_self), same segment."""
    beta = _sigmoid(z_BNTS.astype(np.float64))
    batch, heads, length, _ = z_BNTS.shape
    weights = np.zeros(z_BNTS.shape)
    leftover = np.ones((batch, heads, length))
    for b in range(batch):
        for n in range(heads):
            for i in range(length):
                last = i if include_self else i - 1
                keys = [j for j in range(last + 1) if segments_BT[b, j] == segments_BT[b, i]]
                for j in keys:
                    weights[b, n, i, j] = beta[b, n, i, j] * np.prod(
                        [1 - beta[b, n, i, k] for k in keys if k > j]
                    )
                leftover[b, n, i] = np.prod([1 - beta[b, n, i, k] for k in keys])
    return weights, leftover


@pytest.mark.parametrize("impl", ["associative_scan", "cumsum"])
@pytest.mark.parametrize("include_self", [False, True])
def test_weights_match_products_of_one_minus_beta(include_self: bool, impl: str) -> None:
    rng = np.random.default_rng(0)
    z_BNTS = rng.normal(size=(2, 3, 8, 8)) * 3
    allowed_BTS = stickbreaking_allowed_BTS(jnp.asarray(_mask(SEGMENTS_BT)), include_self)
    weights, leftover = stickbreaking_weights(jnp.asarray(z_BNTS, jnp.float32), allowed_BTS, impl)
    expected_w, expected_left = _ref_weights(z_BNTS, SEGMENTS_BT, include_self)
    np.testing.assert_allclose(np.asarray(weights), expected_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(leftover), expected_left, rtol=1e-5, atol=1e-6)
    weights = np.asarray(weights)
    assert np.all((weights >= 0) & (weights <= 1))
    np.testing.assert_allclose(weights.sum(-1), 1 - np.asarray(leftover), atol=1e-5)
    first = weights[:, :, 0]  # the first token has no key unless it may see itself
    if include_self:
        np.testing.assert_allclose(first[..., 0], _sigmoid(z_BNTS[:, :, 0, 0]), rtol=1e-5)
    else:
        assert np.all(first == 0) and np.all(weights[0, :, 3] == 0)  # segment starts


def test_self_is_excluded_by_default_and_included_on_request() -> None:
    mask_BTS = jnp.asarray(_mask(SEGMENTS_BT))
    diagonal = np.eye(8, dtype=bool)
    assert not np.any(np.asarray(stickbreaking_allowed_BTS(mask_BTS, False))[:, diagonal])
    assert np.all(np.asarray(stickbreaking_allowed_BTS(mask_BTS, True))[:, diagonal])


def _layer(include_self: bool) -> tuple[Attention, dict, np.ndarray]:
    cfg = tiny_config("stickbreaking", position_options={"include_self": include_self})
    attention = Attention(cfg)
    x_BTD = jnp.asarray(np.random.default_rng(1).normal(size=(2, 8, cfg.d_model)), jnp.float32)
    variables = attention.init(jax.random.key(0), x_BTD, _ctx(x_BTD))
    # Larger q, k weights than the initial ones, so the breaks are far from sigmoid(0) = 0.5.
    params = nn.unbox(variables["params"])
    for name in ("query", "key"):
        params[name] = {"kernel": params[name]["kernel"] * 60}
    return attention, {"params": params}, np.asarray(x_BTD)


def _ctx(x_BTD: jax.Array) -> AttentionContext:
    positions_BT = jnp.zeros(SEGMENTS_BT.shape, jnp.int32)
    return AttentionContext.create(x_BTD, positions_BT, jnp.asarray(SEGMENTS_BT))


@pytest.mark.parametrize("include_self", [False, True])
def test_layer_matches_reference_and_sows_leftover(include_self: bool) -> None:
    attention, variables, x_BTD = _layer(include_self)
    apply = jax.jit(lambda v, x: attention.apply(v, x, _ctx(x), mutable=["intermediates"]))
    (y_BTD, _), state = apply(variables, jnp.asarray(x_BTD))
    p = {k: np.asarray(v["kernel"], np.float64) for k, v in variables["params"].items()}
    x64 = x_BTD.astype(np.float64)
    q = np.einsum("BTD,DNH->BTNH", x64, p["query"])
    k = np.einsum("BTD,DNH->BTNH", x64, p["key"])
    v = np.einsum("BTD,DNH->BTNH", x64, p["value"])
    z_BNTS = np.einsum("BTNH,BSNH->BNTS", q, k) / math.sqrt(q.shape[-1])
    assert np.abs(z_BNTS).max() > 5  # the test exercises saturated breaks too
    weights, leftover = _ref_weights(z_BNTS, SEGMENTS_BT, include_self)
    y = np.einsum("BNTS,BSNH,NHD->BTD", weights, v, p["out"])
    np.testing.assert_allclose(np.asarray(y_BTD), y, rtol=1e-4, atol=1e-5)
    sown = state["intermediates"]
    np.testing.assert_allclose(
        np.asarray(sown["stickbreaking"]["leftover"][0]), leftover, atol=1e-5
    )
    np.testing.assert_allclose(np.asarray(sown["attention_weights"][0]), weights, atol=1e-5)


def _ref_group_norm(y_BTNH: np.ndarray, scale_NH: np.ndarray, shift_NH: np.ndarray) -> np.ndarray:
    """torch.nn.GroupNorm(N, N H) on the heads' concatenated outputs: one group per head."""
    mean = y_BTNH.mean(-1, keepdims=True)
    var = ((y_BTNH - mean) ** 2).mean(-1, keepdims=True)
    return (y_BTNH - mean) / np.sqrt(var + 1e-5) * scale_NH + shift_NH


AUTHORS_FORMS = [
    {"remainder_bias": True},
    {"head_norm": True},
    {"remainder_bias": True, "head_norm": True, "include_self": True},
]


@pytest.mark.parametrize("impl", ["naive", "blockwise"])
@pytest.mark.parametrize("form", AUTHORS_FORMS, ids="+".join)
def test_authors_form_matches_reference_on_both_paths(form: dict, impl: str) -> None:
    """The authors' SBAttention: y + rem * head_bias, then GroupNorm per head, then out."""
    cfg = tiny_config(
        "stickbreaking", position_options=form, attention_impl=impl, attention_block=4
    )
    attention = Attention(cfg)
    rng = np.random.default_rng(3)
    x_BTD = jnp.asarray(rng.normal(size=(2, 8, cfg.d_model)), jnp.float32)
    params = nn.unbox(attention.init(jax.random.key(0), x_BTD, _ctx(x_BTD))["params"])
    for name in ("query", "key"):
        params[name] = {"kernel": params[name]["kernel"] * 60}
    site = {
        name: jnp.asarray(rng.normal(size=value.shape) + name.endswith("scale"), jnp.float32)
        for name, value in params["stickbreaking"].items()
    }
    params["stickbreaking"] = site
    y_BTD, _ = jax.jit(attention.apply)({"params": params}, x_BTD, _ctx(x_BTD))

    p = {k: np.asarray(params[k]["kernel"], np.float64) for k in ("query", "key", "value", "out")}
    x64 = np.asarray(x_BTD, np.float64)
    q, k, v = (np.einsum("BTD,DNH->BTNH", x64, p[name]) for name in ("query", "key", "value"))
    z_BNTS = np.einsum("BTNH,BSNH->BNTS", q, k) / math.sqrt(q.shape[-1])
    weights, leftover_BNT = _ref_weights(z_BNTS, SEGMENTS_BT, form.get("include_self", False))
    y = np.einsum("BNTS,BSNH->BTNH", weights, v)
    if form.get("remainder_bias"):
        y = y + np.moveaxis(leftover_BNT, 1, 2)[..., None] * np.asarray(site["head_bias"])
    if form.get("head_norm"):
        y = _ref_group_norm(y, np.asarray(site["head_norm_scale"]), site["head_norm_shift"])
    expected = np.einsum("BTNH,NHD->BTD", y, p["out"])
    np.testing.assert_allclose(np.asarray(y_BTD), expected, rtol=1e-4, atol=1e-4)


def test_authors_form_at_initialisation_adds_nothing_but_the_norm() -> None:
    """head_bias starts at 0: remainder_bias alone equals the equation's output at init."""
    tokens_BT, positions_BT = tokens_and_positions()
    plain = Transformer(tiny_config("stickbreaking"))
    authors = Transformer(tiny_config("stickbreaking", position_options={"remainder_bias": True}))
    params = authors.init(jax.random.key(0), tokens_BT, positions_BT)
    plain_params = plain.init(jax.random.key(0), tokens_BT, positions_BT)
    np.testing.assert_allclose(
        np.asarray(authors.apply(params, tokens_BT, positions_BT)),
        np.asarray(plain.apply(plain_params, tokens_BT, positions_BT)),
        rtol=1e-6,
        atol=1e-6,
    )


def test_the_engine_returns_the_log_stick_remainder() -> None:
    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 8, 3, 4)) * 3, jnp.float32) for _ in range(3))
    seg, positions = jnp.asarray(SEGMENTS_BT), jnp.zeros(SEGMENTS_BT.shape, jnp.int32)
    y, log_leftover_BNT = engine.blockwise_attention(
        q,
        k,
        v,
        q_positions_BT=positions,
        k_positions_BS=positions,
        q_segment_ids_BT=seg,
        k_segment_ids_BS=seg,
        normalizer=engine_blocks.Normalizer("stickbreaking", include_self=False),
        block=4,
        backward="remat",  # the statistic comes with the remat walk (flash keeps only y)
    )
    assert y.shape == (2, 8, 3, 4)
    z_BNTS = np.einsum("BTNH,BSNH->BNTS", np.asarray(q, np.float64), np.asarray(k)) / 2.0
    _, expected_BNT = _ref_weights(z_BNTS, SEGMENTS_BT, False)
    np.testing.assert_allclose(np.exp(np.asarray(log_leftover_BNT)), expected_BNT, atol=1e-5)


def test_extreme_logits_give_finite_values_and_gradients() -> None:
    rng = np.random.default_rng(2)
    z_BNTS = jnp.asarray(rng.choice([-1e4, 1e4], size=(2, 3, 8, 8)), jnp.float32)
    allowed_BTS = stickbreaking_allowed_BTS(jnp.asarray(_mask(SEGMENTS_BT)), False)

    def loss(z_BNTS: jax.Array) -> jax.Array:
        weights, leftover = stickbreaking_weights(z_BNTS, allowed_BTS)
        return jnp.sum(weights * jnp.arange(8.0)) + jnp.sum(leftover)

    value, grad = jax.jit(jax.value_and_grad(loss))(z_BNTS)
    assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(grad)))
    weights, _ = stickbreaking_weights(z_BNTS, allowed_BTS)
    expected, _ = _ref_weights(np.asarray(z_BNTS), SEGMENTS_BT, False)  # exact 0s and 1s
    np.testing.assert_allclose(np.asarray(weights), expected, atol=1e-6)


def test_extreme_scale_model_is_finite() -> None:
    model = Transformer(tiny_config("stickbreaking"))
    tokens_BT, positions_BT = tokens_and_positions()
    params = nn.unbox(model.init(jax.random.key(0), tokens_BT, positions_BT))

    def scaled(path: tuple, p: jax.Array) -> jax.Array:
        names = {getattr(k, "key", None) for k in path}
        return p * 3e3 if names & {"query", "key"} else p

    big = jax.tree_util.tree_map_with_path(scaled, params)

    def loss(p: dict) -> jax.Array:
        return jnp.sum(model.apply(p, tokens_BT, positions_BT, jnp.asarray(SEGMENTS_BT)))

    value, grads = jax.jit(jax.value_and_grad(loss))(big)
    assert np.isfinite(float(value))
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree_util.tree_leaves(grads))


def test_segments_do_not_leak() -> None:
    model = Transformer(tiny_config("stickbreaking", num_layers=1))
    tokens_BT, _ = tokens_and_positions(batch=1)
    segments_BT = jnp.asarray(SEGMENTS_BT[:1])
    positions_BT = jnp.asarray([[0, 1, 2, 0, 1, 2, 3, 4]])
    params = model.init(jax.random.key(0), tokens_BT, positions_BT)
    emb = model.apply(params, tokens_BT, positions_BT, True, method=Transformer.embed)

    def second_segment(x_BTD: jax.Array) -> jax.Array:
        logits_BTV = model.apply(
            params, emb.replace(x_BTD=x_BTD), segments_BT, method=Transformer.forward_embedded
        )
        return logits_BTV[0, 3:].sum()

    grad_BTD = np.asarray(jax.jit(jax.grad(second_segment))(emb.x_BTD))
    assert np.all(grad_BTD[0, :3] == 0.0), "second segment depends on the first"
    assert np.any(grad_BTD[0, 4:] != 0.0)


@pytest.mark.parametrize("include_self", [False, True])
def test_bfloat16_close_to_float32(include_self: bool) -> None:
    options = {"include_self": include_self}
    tokens_BT, positions_BT = tokens_and_positions()
    model32 = Transformer(tiny_config("stickbreaking", position_options=options))
    model16 = Transformer(tiny_config("stickbreaking", position_options=options, dtype="bfloat16"))
    params = model32.init(jax.random.key(0), tokens_BT, positions_BT)
    segments_BT = jnp.asarray(SEGMENTS_BT)
    out32 = jax.jit(model32.apply)(params, tokens_BT, positions_BT, segments_BT)
    out16 = jax.jit(model16.apply)(params, tokens_BT, positions_BT, segments_BT)
    np.testing.assert_allclose(np.asarray(out16), np.asarray(out32), atol=0.05, rtol=0.05)


@pytest.mark.parametrize(
    ("options", "word"),
    [
        ({"include_self": "no"}, "include_self"),
        ({"scan_impl": "x"}, "scan"),
        ({"head_norm": 1}, "head_norm"),
        ({"remainder_bias": "yes"}, "remainder_bias"),
    ],
)
def test_bad_options_raise(options: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        tiny_config("stickbreaking", position_options=options)


@pytest.mark.parametrize("backward", ["flash", pytest.param("remat", marks=pytest.mark.slow)])
@pytest.mark.parametrize("include_self", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_used_up_sticks_skip_older_blocks_with_the_same_values_and_gradients(
    include_self: bool, backward: str
) -> None:
    """Large logits use every query's stick up within a few keys (log remainder below
    -STICK_SPENT), and the engine then skips the older key blocks: its output equals the NumPy
    reference of the weights, and its gradients those of the naive (B, N, T, S) weights."""
    rng = np.random.default_rng(5)
    length, block = 32, 4
    q, k, v = (
        jnp.asarray(rng.normal(size=(1, length, 2, 4)) + m, jnp.float32) for m in (3.0, 3.0, 0.0)
    )
    seg = jnp.zeros((1, length), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(length), (1, length))
    z_BNTS = np.einsum("BTNH,BSNH->BNTS", np.asarray(q, np.float64), np.asarray(k)) / 2.0
    allowed = np.tril(np.ones((length, length)), 0 if include_self else -1).astype(bool)
    softplus = np.where(allowed, np.logaddexp(0.0, z_BNTS), 0.0)
    newer = np.cumsum(softplus[..., ::-1], axis=-1)[..., ::-1]  # sum_{k >= j} sp_ik
    skipped = sum(
        bool(np.all(newer[..., qb * block : (qb + 1) * block, (kb + 1) * block] >= 110.0))
        for qb in range(length // block)
        for kb in range(qb - 1)
    )
    assert skipped >= 10

    normalizer = engine_blocks.Normalizer("stickbreaking", include_self=include_self)

    def blockwise(q, k, v):
        return engine.blockwise_attention(
            q, k, v, q_positions_BT=positions, k_positions_BS=positions,
            q_segment_ids_BT=seg, k_segment_ids_BS=seg, normalizer=normalizer,
            block=block, backward=backward,
        )[0]  # fmt: skip

    def naive(q, k, v):
        z = jnp.einsum("BTNH,BSNH->BNTS", q, k) / 2.0
        allowed_BTS = stickbreaking_allowed_BTS(causal_mask_BTS(seg, seg), include_self)
        weights_BNTS, _ = stickbreaking_weights(z, allowed_BTS)
        return jnp.einsum("BNTS,BSNH->BTNH", weights_BNTS, v)

    weights, _ = _ref_weights(z_BNTS, np.zeros((1, length), int), include_self)
    expected = np.einsum("BNTS,BSNH->BTNH", weights, np.asarray(v, np.float64))
    np.testing.assert_allclose(blockwise(q, k, v), expected, rtol=1e-5, atol=1e-5)
    cot = jnp.asarray(rng.normal(size=(1, length, 2, 4)), jnp.float32)
    grads = [
        jax.grad(lambda *a, f=f: jnp.sum(f(*a) * cot), argnums=(0, 1, 2))(q, k, v)
        for f in (blockwise, naive)
    ]
    for got, want in zip(*grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
