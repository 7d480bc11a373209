"""DAPE against NumPy references written from the paper (Zheng et al. 2024, arXiv 2405.14722,
section 3): scores ``A + B + f(A, B)`` with ``f`` one hidden LeakyReLU layer over the 2N
concatenated logits of a pair, computed here by explicit loops over pairs and hidden units in
float64.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model import checks, decode
from copejax.model.attention import Attention
from copejax.model.config import ModelConfig
from copejax.model.transformer import Transformer
from copejax.positions.alibi import alibi_slopes
from copejax.positions.base import AttentionContext
from tests import test_blockwise_equivalence as equivalence
from tests.conftest import PACKED_POSITIONS_BT, PACKED_SEGMENTS_BT, perturbed, tiny_config

SEGMENTS_BT = np.array([[1, 1, 1, 2, 2, 2, 2, 2], [1, 1, 1, 1, 1, 1, 1, 1]])
POSITIONS_BT = np.array([[0, 1, 2, 0, 1, 2, 3, 4], list(range(8))])


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.log1p(np.exp(x))


def _static(p: dict, options: dict, i: int, j: int, heads: int) -> np.ndarray:
    """B_ij per head: Kerple log -r1 log(1 + r2 |i - j|) or ALiBi -m (i - j)."""
    if options.get("static_bias", "kerple") == "kerple":
        r1, r2 = _softplus(p["r1_raw"]), _softplus(p["r2_raw"])
        return -r1 * np.log(1.0 + r2 * abs(i - j))
    return -alibi_slopes(heads) * (i - j)


def _mlp(p: dict, x: np.ndarray, slope: float) -> np.ndarray:
    width = p["mlp_b_in"].shape[0]
    hidden = np.array([x @ p["mlp_w_in"][:, u] + p["mlp_b_in"][u] for u in range(width)])
    hidden = np.where(hidden > 0, hidden, slope * hidden)
    return hidden @ p["mlp_w_out"] + p["mlp_b_out"]


def _ref_attention(p: dict, x_BTD: np.ndarray, options: dict) -> np.ndarray:
    q = np.einsum("BTD,DNH->BTNH", x_BTD, p["query"])
    k = np.einsum("BTD,DNH->BTNH", x_BTD, p["key"])
    v = np.einsum("BTD,DNH->BTNH", x_BTD, p["value"])
    batch, length, heads, head_dim = q.shape
    slope = options.get("negative_slope", 0.01)
    y = np.zeros_like(q)
    for b in range(batch):
        for i in range(length):
            keys = [j for j in range(i + 1) if SEGMENTS_BT[b, j] == SEGMENTS_BT[b, i]]
            scores_JN = []
            for j in keys:
                a = np.array([q[b, i, n] @ k[b, j, n] for n in range(heads)]) / math.sqrt(head_dim)
                bias = _static(p, options, POSITIONS_BT[b, i], POSITIONS_BT[b, j], heads)
                scores_JN.append(a + bias + _mlp(p, np.concatenate([a, bias]), slope))
            scores_JN = np.array(scores_JN)
            for n in range(heads):
                w = np.exp(scores_JN[:, n] - scores_JN[:, n].max())
                w /= w.sum()
                y[b, i, n] = sum(wj * v[b, j, n] for wj, j in zip(w, keys, strict=True))
    return np.einsum("BTNH,NHD->BTD", y, p["out"])


def _ctx(x_BTD: jax.Array) -> AttentionContext:
    return AttentionContext.create(x_BTD, jnp.asarray(POSITIONS_BT), jnp.asarray(SEGMENTS_BT))


def _layer(options: dict, **model: object) -> tuple[Attention, dict, dict, np.ndarray]:
    cfg = tiny_config("dape", position_options=options, **model)
    attention = Attention(cfg)
    rng = np.random.default_rng(0)
    x_BTD = jnp.asarray(rng.normal(size=(2, 8, cfg.d_model)), jnp.float32)
    variables = attention.init(jax.random.key(0), x_BTD, _ctx(x_BTD))
    params = nn.unbox(variables["params"])
    site = {
        name: jnp.asarray(value + 0.3 * rng.normal(size=value.shape), jnp.float32)
        for name, value in params["dape"].items()
    }
    params = {**params, "dape": site}
    flat = {name: np.asarray(params[name]["kernel"], np.float64) for name in ("query", "key")}
    flat.update({name: np.asarray(params[name]["kernel"], np.float64) for name in ("value", "out")})
    flat.update({name: np.asarray(value, np.float64) for name, value in site.items()})
    return attention, {"params": params}, flat, np.asarray(x_BTD)


@pytest.mark.parametrize(
    ("options", "impl"),
    [
        ({}, "naive"),
        ({}, "blockwise"),
        ({"static_bias": "alibi", "hidden": 5}, "naive"),
        ({"static_bias": "alibi", "negative_slope": 0.2}, "blockwise"),
    ],
    ids=str,
)
def test_layer_matches_numpy_reference(options: dict, impl: str) -> None:
    attention, variables, flat, x_BTD = _layer(options, attention_impl=impl, attention_block=3)
    y_BTD, _ = jax.jit(attention.apply)(variables, jnp.asarray(x_BTD), _ctx(jnp.asarray(x_BTD)))
    expected = _ref_attention(flat, x_BTD.astype(np.float64), options)
    np.testing.assert_allclose(np.asarray(y_BTD), expected, rtol=1e-4, atol=1e-5)


def _model(position: str, options: dict, impl: str = "naive") -> tuple[Transformer, dict]:
    cfg = tiny_config(
        position, position_options=options, num_layers=1, attention_impl=impl, attention_block=3
    )
    model = Transformer(cfg)
    params = model.init(jax.random.key(0), _tokens(), jnp.asarray(PACKED_POSITIONS_BT))["params"]
    return model, nn.unbox(perturbed(params))


def _tokens() -> jax.Array:
    return jnp.asarray(np.random.default_rng(0).integers(0, 13, (2, 8)), jnp.int32)


def test_zero_mlp_output_is_kerple() -> None:
    """With the MLP's output layer zero, f = 0 and DAPE-Kerple is Kerple (log) exactly."""
    model, params = _model("dape", {})
    site = dict(params["block_0"]["attention"]["dape"])
    kerple_site = {"r1_raw": site["r1_raw"], "r2_raw": site["r2_raw"]}
    site["mlp_w_out"] = jnp.zeros_like(site["mlp_w_out"])
    site["mlp_b_out"] = jnp.zeros_like(site["mlp_b_out"])
    attention = {**params["block_0"]["attention"], "dape": site}
    dape_params = {**params, "block_0": {**params["block_0"], "attention": attention}}
    shared = {k: v for k, v in params["block_0"]["attention"].items() if k != "dape"}
    kerple_attention = {**shared, "kerple": kerple_site}
    kerple_params = {**params, "block_0": {**params["block_0"], "attention": kerple_attention}}
    kerple, _ = _model("kerple", {})
    args = (_tokens(), jnp.asarray(PACKED_POSITIONS_BT), jnp.asarray(PACKED_SEGMENTS_BT))
    np.testing.assert_allclose(
        np.asarray(model.apply({"params": dape_params}, *args)),
        np.asarray(kerple.apply({"params": kerple_params}, *args)),
        rtol=1e-6,
        atol=1e-6,
    )
    assert not np.allclose(
        np.asarray(model.apply({"params": params}, *args)),
        np.asarray(kerple.apply({"params": kerple_params}, *args)),
    ), "a live MLP must change the output"


@pytest.mark.slow
def test_blockwise_decoding_equals_full_forward() -> None:
    """Prefill of 5 (two engine blocks), then steps, every call on the engine."""
    model, params = _model("dape", {"static_bias": "alibi"}, "blockwise")
    full = np.asarray(
        model.apply(
            {"params": params},
            _tokens(),
            jnp.asarray(PACKED_POSITIONS_BT),
            jnp.asarray(PACKED_SEGMENTS_BT),
        )
    )
    cache = decode.init_cache(model.cfg, 2, 8)
    outputs, start = [], 0
    for size in (5, 1, 1, 1):
        end = start + size
        logits, variables = model.apply(
            {"params": params, "cache": cache},
            _tokens()[:, start:end],
            jnp.asarray(PACKED_POSITIONS_BT[:, start:end]),
            jnp.asarray(PACKED_SEGMENTS_BT[:, start:end]),
            decode=True,
            mutable=["cache"],
        )
        cache, start = variables["cache"], end
        outputs.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(outputs, 1), full, rtol=2e-5, atol=2e-5)


def test_initialisation_follows_pytorch_linear() -> None:
    """Weights and biases uniform in +-1/sqrt(fan_in); Kerple's r1, r2 start at 1."""
    _, params = _model("dape", {"hidden": 32})
    cfg = tiny_config("dape", num_layers=1)
    model = Transformer(cfg)
    raw = nn.unbox(
        model.init(jax.random.key(3), _tokens(), jnp.asarray(PACKED_POSITIONS_BT))["params"]
    )
    site = raw["block_0"]["attention"]["dape"]
    heads = cfg.num_heads
    for name, fan_in in (("mlp_w_in", 2 * heads), ("mlp_b_in", 2 * heads), ("mlp_w_out", 32)):
        values = np.asarray(site[name])
        assert np.all(np.abs(values) <= 1 / math.sqrt(fan_in)), name
        assert np.std(values) > 0.2 / math.sqrt(fan_in), name
    np.testing.assert_allclose(_softplus(np.asarray(site["r1_raw"], np.float64)), 1.0, rtol=1e-6)
    assert params["block_0"]["attention"]["dape"]["mlp_w_in"].shape == (2 * heads, 32)


def test_dot_product_attention_is_refused() -> None:
    """The bias reads the content logits: no fused kernel can take it precomputed."""
    with pytest.raises(ValueError, match="dot_product_attention"):
        checks.validate(
            ModelConfig(vocab_size=13, position="dape", attention_impl="dot_product_attention")
        )


@pytest.mark.parametrize(
    ("options", "word"),
    [
        ({"static_bias": "fire"}, "static_bias"),
        ({"hidden": 0}, "hidden"),
        ({"negative_slope": 1.5}, "negative_slope"),
        ({"r1_init": -1.0}, "r1_init"),
    ],
    ids=str,
)
def test_bad_options_raise(options: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        tiny_config("dape", position_options=options)


@pytest.mark.slow
def test_engine_values_and_gradients_equal_naive_with_alibi() -> None:
    """The registry-wide equivalence check (packed rows, blocks of 3) for DAPE-ALiBi."""
    equivalence.test_blockwise_values_and_gradients_equal_naive(("dape", {"static_bias": "alibi"}))


@pytest.mark.slow
def test_engine_jit_equals_eager() -> None:
    attention, variables, _, x_BTD = _layer({}, attention_impl="blockwise", attention_block=3)
    ctx = _ctx(jnp.asarray(x_BTD))
    eager, _ = attention.apply(variables, jnp.asarray(x_BTD), ctx)
    jitted, _ = jax.jit(attention.apply)(variables, jnp.asarray(x_BTD), ctx)
    np.testing.assert_allclose(np.asarray(eager), np.asarray(jitted), rtol=1e-5, atol=1e-6)
