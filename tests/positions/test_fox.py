"""FoX against NumPy references written from the paper's equations (Lin et al. 2025, eq. 4-6).

The references use explicit loops and products of forget gates ``F_ij = prod_{l=j+1..i} f_l``
(not the log-space prefix sums of the implementation), in float64.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model import decode
from copejax.model.attention import Attention
from copejax.model.transformer import Transformer
from copejax.ops import scan
from copejax.ops.fox_core import fox_decay_bias, fox_log_forget_gates, token_shift
from copejax.ops.segments import causal_mask_BTS
from copejax.positions.base import AttentionContext, masked_softmax_BNTS
from copejax.positions.fox import PRO_OPTIONS
from copejax.positions.registry import make_scheme
from tests.conftest import tiny_config, tokens_and_positions

PRO = tuple(PRO_OPTIONS)
SEGMENTS_BT = np.array([[1, 1, 1, 2, 2, 2, 2, 2], [1, 1, 1, 1, 1, 1, 1, 1]])


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # 1 / (1 + exp(-z)) without overflow


def _mask(segments_BT: np.ndarray) -> np.ndarray:
    return np.asarray(causal_mask_BTS(jnp.asarray(segments_BT), jnp.asarray(segments_BT)))


def _ref_decay(f_BTN: np.ndarray, mask_BTS: np.ndarray) -> np.ndarray:
    """D_ij = log prod_{l=j+1..i} f_l where allowed, 0 elsewhere (loops, float64)."""
    batch, length, heads = f_BTN.shape
    d_BNTS = np.zeros((batch, heads, length, length))
    for b in range(batch):
        for n in range(heads):
            for i in range(length):
                for j in range(length):
                    if mask_BTS[b, i, j]:
                        d_BNTS[b, n, i, j] = np.log(np.prod(f_BTN[b, j + 1 : i + 1, n]))
    return d_BNTS


def _ref_shift(x_BTNH: np.ndarray, a_BTN: np.ndarray, segments_BT: np.ndarray) -> np.ndarray:
    out = np.empty_like(x_BTNH)
    for b in range(x_BTNH.shape[0]):
        for t in range(x_BTNH.shape[1]):
            same = t > 0 and segments_BT[b, t - 1] == segments_BT[b, t]
            prev_NH = x_BTNH[b, t - 1] if same else np.zeros_like(x_BTNH[b, t])
            a_N1 = a_BTN[b, t][:, None]
            out[b, t] = a_N1 * x_BTNH[b, t] + (1 - a_N1) * prev_NH
    return out


def _ref_rms(x_BTNH: np.ndarray, scale_NH: np.ndarray) -> np.ndarray:
    rms = np.sqrt(np.mean(x_BTNH**2, axis=-1, keepdims=True) + 1e-6)
    return x_BTNH / rms * scale_NH


def _ref_attention(
    p: dict, x_BTD: np.ndarray, segments_BT: np.ndarray, options: dict
) -> np.ndarray:
    """Forgetting attention layer, float64, from the equations."""
    x_BTD = x_BTD.astype(np.float64)
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    q = np.einsum("BTD,DNH->BTNH", x_BTD, p["query"])
    k = np.einsum("BTD,DNH->BTNH", x_BTD, p["key"])
    v = np.einsum("BTD,DNH->BTNH", x_BTD, p["value"])
    if options.get("key_shift"):
        k = _ref_shift(k, _sigmoid(x_BTD @ p["key_shift_w"]), segments_BT)
    if options.get("value_shift"):
        v = _ref_shift(v, _sigmoid(x_BTD @ p["value_shift_w"]), segments_BT)
    if options.get("qk_norm"):
        q, k = _ref_rms(q, p["q_norm_scale"]), _ref_rms(k, p["k_norm_scale"])
    if options.get("unit_forget_gate"):
        f_BTN = np.ones((*x_BTD.shape[:2], q.shape[2]))
    else:
        f_BTN = _sigmoid(x_BTD @ p["forget_w"] + p["forget_b"])
    mask_BTS = _mask(segments_BT)
    batch, length, heads, head_dim = q.shape
    y = np.zeros_like(q)
    for b in range(batch):
        for n in range(heads):
            for i in range(length):
                keys = [j for j in range(length) if mask_BTS[b, i, j]]
                scores = np.array(
                    [
                        q[b, i, n] @ k[b, j, n] / math.sqrt(head_dim)
                        + np.log(np.prod(f_BTN[b, j + 1 : i + 1, n]))
                        for j in keys
                    ]
                )
                w = np.exp(scores - scores.max())
                w /= w.sum()
                y[b, i, n] = sum(wj * v[b, j, n] for wj, j in zip(w, keys, strict=True))
    if options.get("output_norm"):  # the authors' FusedGroupNormGated: norm, scale, then gate
        y = _ref_rms(y, p["output_norm_scale"])
    if options.get("output_gate"):
        y = y * _sigmoid(np.einsum("BTD,DNH->BTNH", x_BTD, p["output_gate_w"]))
    return np.einsum("BTNH,NHD->BTD", y, p["out"])


def _layer(
    options: dict, seed: int = 0, **model: object
) -> tuple[Attention, dict, dict, np.ndarray]:
    """An Attention layer with random (not initial) site parameters and a random input."""
    cfg = tiny_config("fox", position_options=options, **model)
    attention = Attention(cfg)
    rng = np.random.default_rng(seed)
    x_BTD = jnp.asarray(rng.normal(size=(2, 8, cfg.d_model)), jnp.float32)
    variables = attention.init(jax.random.key(seed), x_BTD, _ctx(x_BTD, SEGMENTS_BT))
    params = nn.unbox(variables["params"])
    site = {}
    for name, value in params.get("fox", {}).items():
        scale = 1.0 if name.endswith("_b") else 0.3
        offset = 1.0 if name.endswith("scale") else 0.0
        site[name] = jnp.asarray(offset + scale * rng.normal(size=value.shape), jnp.float32)
    params = {**params, "fox": site} if site else params
    flat = {name: params[name]["kernel"] for name in ("query", "key", "value", "out")}
    flat.update(site)
    return attention, {"params": params}, flat, np.asarray(x_BTD)


def _ctx(x_BTD: jax.Array, segments_BT: np.ndarray) -> AttentionContext:
    positions_BT = jnp.zeros(segments_BT.shape, jnp.int32)
    return AttentionContext.create(x_BTD, positions_BT, jnp.asarray(segments_BT))


@pytest.mark.parametrize(
    "options",
    [
        {},
        pytest.param({"output_gate": True}, marks=pytest.mark.slow),
        pytest.param({"output_norm": True}, marks=pytest.mark.slow),
        {"output_norm": True, "output_gate": True},
        pytest.param({"qk_norm": True}, marks=pytest.mark.slow),
        pytest.param({"key_shift": True}, marks=pytest.mark.slow),
        pytest.param({"value_shift": True}, marks=pytest.mark.slow),
        dict.fromkeys(PRO, True),
        {"unit_forget_gate": True, "qk_norm": True},
    ],
    ids=lambda o: "+".join(o) or "plain",
)
def test_layer_matches_numpy_reference(options: dict) -> None:
    attention, variables, flat, x_BTD = _layer(options)
    y_BTD, _ = jax.jit(attention.apply)(
        variables, jnp.asarray(x_BTD), _ctx(jnp.asarray(x_BTD), SEGMENTS_BT)
    )
    expected = _ref_attention(flat, x_BTD, SEGMENTS_BT, options)
    np.testing.assert_allclose(np.asarray(y_BTD), expected, rtol=1e-4, atol=1e-5)


def test_pro_is_the_authors_five_components() -> None:
    assert set(PRO_OPTIONS) == {
        "output_gate",
        "output_norm",
        "qk_norm",
        "key_shift",
        "value_shift",
    }
    assert all(PRO_OPTIONS.values())


def test_pro_output_norm_on_the_blockwise_path_matches_numpy_reference() -> None:
    """The output norm is an output-site change: the blockwise path gets it too."""
    options = dict(PRO_OPTIONS)
    attention, variables, flat, x_BTD = _layer(
        options, attention_impl="blockwise", attention_block=4
    )
    y_BTD, _ = jax.jit(attention.apply)(
        variables, jnp.asarray(x_BTD), _ctx(jnp.asarray(x_BTD), SEGMENTS_BT)
    )
    expected = _ref_attention(flat, x_BTD, SEGMENTS_BT, options)
    np.testing.assert_allclose(np.asarray(y_BTD), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", ["associative_scan", "cumsum"])
def test_decay_bias_is_log_of_products_of_gates(impl: str) -> None:
    rng = np.random.default_rng(3)
    z_BTN = rng.normal(size=(2, 8, 3)) * 2
    logf_BTN = fox_log_forget_gates(
        jnp.asarray(z_BTN, jnp.float32), jnp.eye(3, dtype=jnp.float32), jnp.zeros(3)
    )
    mask_BTS = _mask(SEGMENTS_BT)
    bias_BNTS = fox_decay_bias(logf_BTN, jnp.asarray(mask_BTS), impl)
    expected = _ref_decay(_sigmoid(z_BTN), mask_BTS)
    np.testing.assert_allclose(np.asarray(bias_BNTS), expected, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(bias_BNTS)[~np.broadcast_to(mask_BTS[:, None], expected.shape)] == 0)


def test_token_shift_restarts_at_packed_segment_starts() -> None:
    """Row 0 packs two segments: its token 3 (segment 2's first) mixes in nothing of token 2."""
    rng = np.random.default_rng(6)
    x_BTNH = rng.normal(size=(2, 8, 3, 4)).astype(np.float32)
    a_BTN = rng.random((2, 8, 3)).astype(np.float32)
    got = token_shift(jnp.asarray(x_BTNH), jnp.asarray(a_BTN), jnp.asarray(SEGMENTS_BT))
    np.testing.assert_allclose(
        np.asarray(got), _ref_shift(x_BTNH, a_BTN, SEGMENTS_BT), rtol=1e-6, atol=1e-6
    )
    first_of_second = a_BTN[0, 3][:, None] * x_BTNH[0, 3]
    np.testing.assert_allclose(np.asarray(got)[0, 3], first_of_second, rtol=1e-6, atol=1e-6)
    # Without segment ids the row is one segment: only t = 0 starts.
    unpacked = token_shift(jnp.asarray(x_BTNH), jnp.asarray(a_BTN), None)
    one_segment_BT = np.zeros_like(SEGMENTS_BT)
    np.testing.assert_allclose(
        np.asarray(unpacked), _ref_shift(x_BTNH, a_BTN, one_segment_BT), rtol=1e-6, atol=1e-6
    )


def test_decode_cache_keeps_one_raw_key_and_value_per_row() -> None:
    """Token shift needs only the previous token: no per-slot raw k / v in the cache."""
    options = {"key_shift": True, "value_shift": True}
    cfg = tiny_config("fox", position_options=options, num_layers=1)
    cache = decode.init_cache(cfg, batch=2, max_len=16)
    shapes = {
        jax.tree_util.keystr(path): leaf.shape
        for path, leaf in jax.tree_util.tree_leaves_with_path(cache)
    }
    raw = {path: shape for path, shape in shapes.items() if "previous_raw" in path}
    heads, head_dim = cfg.num_heads, cfg.resolved_head_dim
    assert sorted(raw.values()) == [(2, 1, heads, head_dim)] * 2, shapes
    assert not any("fox_raw" in path for path in shapes), shapes


def test_segment_cumsum_restarts_exactly() -> None:
    rng = np.random.default_rng(4)
    x_BT = rng.normal(size=(2, 8)).astype(np.float32) * 100
    starts_BT = np.zeros((2, 8), bool)
    starts_BT[0, 3] = starts_BT[1, 5] = True
    expected = np.zeros((2, 8))
    for b in range(2):
        total = 0.0
        for t in range(8):
            total = x_BT[b, t] if starts_BT[b, t] else total + x_BT[b, t]
            expected[b, t] = total
    got = scan.segment_cumsum(jnp.asarray(x_BT), jnp.asarray(starts_BT), axis=1)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6, atol=1e-4)
    # Nothing before a start reaches the sums after it, not even through the gradient.
    sum_at_5 = lambda x: scan.segment_cumsum(x, jnp.asarray(starts_BT), axis=1)[0, 5]
    grad = jax.jit(jax.grad(sum_at_5))(jnp.asarray(x_BT))
    assert np.all(np.asarray(grad)[0, :3] == 0) and np.all(np.asarray(grad)[0, 3:6] == 1)


def test_unit_forget_gate_equals_plain_softmax_model() -> None:
    tokens_BT, positions_BT = tokens_and_positions()
    nope = Transformer(tiny_config("nope"))
    fox = Transformer(tiny_config("fox", position_options={"unit_forget_gate": True}))
    params = nope.init(jax.random.key(0), tokens_BT, positions_BT)
    segments_BT = jnp.asarray(SEGMENTS_BT)
    expected = nope.apply(params, tokens_BT, positions_BT, segments_BT)
    np.testing.assert_allclose(
        np.asarray(fox.apply(params, tokens_BT, positions_BT, segments_BT)),
        np.asarray(expected),
        rtol=1e-6,
        atol=1e-6,
    )
    # ... and the forget gate does change the model when it is not forced to 1.
    fox_gated = Transformer(tiny_config("fox"))
    gated_params = fox_gated.init(jax.random.key(0), tokens_BT, positions_BT)
    gated = fox_gated.apply(gated_params, tokens_BT, positions_BT, segments_BT)
    assert not np.allclose(np.asarray(gated), np.asarray(expected), atol=1e-4)


def test_segments_do_not_leak_values_or_gradients() -> None:
    options = dict.fromkeys(PRO, True)
    model = Transformer(tiny_config("fox", position_options=options, num_layers=1))
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
    assert np.any(grad_BTD[0, 3:] != 0.0)
    other_tokens_BT = tokens_BT.at[0, :3].set((tokens_BT[0, :3] + 5) % 13)
    apply = jax.jit(model.apply)
    a = apply(params, tokens_BT, positions_BT, segments_BT)
    b = apply(params, other_tokens_BT, positions_BT, segments_BT)
    np.testing.assert_array_equal(np.asarray(a[0, 3:]), np.asarray(b[0, 3:]))


def test_extreme_logits_and_gates_give_finite_values_and_gradients() -> None:
    rng = np.random.default_rng(5)
    mask_BTS = jnp.asarray(_mask(SEGMENTS_BT))
    logits_BNTS = jnp.asarray(rng.choice([-1e4, 1e4], size=(2, 3, 8, 8)), jnp.float32)
    gate_z_BTN = jnp.asarray(rng.choice([-1e4, 1e4], size=(2, 8, 3)), jnp.float32)

    def loss(logits_BNTS: jax.Array, gate_z_BTN: jax.Array) -> jax.Array:
        logf_BTN = fox_log_forget_gates(gate_z_BTN, jnp.eye(3), jnp.zeros(3))
        weights_BNTS = masked_softmax_BNTS(
            logits_BNTS + fox_decay_bias(logf_BTN, mask_BTS), mask_BTS
        )
        return jnp.sum(weights_BNTS * jnp.arange(8.0))

    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(logits_BNTS, gate_z_BTN)
    assert np.isfinite(float(value))
    assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)


def test_extreme_scale_model_is_finite() -> None:
    """Huge q, k and forget-gate weights: logits and log gates far beyond 1e4 in the model."""
    options = {"output_gate": True, "key_shift": True, "value_shift": True}  # no qk_norm
    model = Transformer(tiny_config("fox", position_options=options))
    tokens_BT, positions_BT = tokens_and_positions()
    params = nn.unbox(model.init(jax.random.key(0), tokens_BT, positions_BT))

    def scaled(path: tuple, p: jax.Array) -> jax.Array:
        names = {getattr(k, "key", None) for k in path}
        return p * 3e3 if names & {"query", "key", "forget_w", "forget_b"} else p

    big = jax.tree_util.tree_map_with_path(scaled, params)

    def loss(p: dict) -> jax.Array:
        return jnp.sum(model.apply(p, tokens_BT, positions_BT, jnp.asarray(SEGMENTS_BT)))

    value, grads = jax.jit(jax.value_and_grad(loss))(big)
    assert np.isfinite(float(value))
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree_util.tree_leaves(grads))


def test_bfloat16_with_every_pro_option_close_to_float32() -> None:
    options = dict.fromkeys(PRO, True)
    tokens_BT, positions_BT = tokens_and_positions()
    model32 = Transformer(tiny_config("fox", position_options=options))
    model16 = Transformer(tiny_config("fox", position_options=options, dtype="bfloat16"))
    params = model32.init(jax.random.key(0), tokens_BT, positions_BT)
    segments_BT = jnp.asarray(SEGMENTS_BT)
    out32 = model32.apply(params, tokens_BT, positions_BT, segments_BT)
    out16 = model16.apply(params, tokens_BT, positions_BT, segments_BT)
    np.testing.assert_allclose(np.asarray(out16), np.asarray(out32), atol=0.05, rtol=0.05)


@pytest.mark.parametrize(
    ("options", "word"),
    [
        ({"qk_norm": "yes"}, "qk_norm"),
        ({"forget_bias_init": float("nan")}, "forget_bias_init"),
        ({"scan_impl": "fft"}, "scan_impl"),
    ],
)
def test_bad_options_raise(options: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        tiny_config("fox", position_options=options)
    assert make_scheme("fox", {"forget_bias_init": 3.0}).forget_bias_init == 3.0
