"""Selective attention against NumPy references written from the paper (Leviathan et al. 2024,
arXiv 2410.02703, Section 3 and Figure 2).

The reference builds ``F_ij`` by explicit loops over the masking tokens k (``j < k < i``, same
segment, key j not the segment's first token) of ``relu(l^h_kj)`` (or sigmoid), in float64,
not by the implementation's exclusive cumulative sums or block prefixes.
"""

from __future__ import annotations

import functools
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
from copejax.ops.selective import accumulated_penalty_BTS, selection_BTS
from copejax.positions.base import AttentionContext
from copejax.positions.registry import make_scheme
from tests import test_blockwise_equivalence as equivalence
from tests import test_decode as decode_tests
from tests.conftest import PACKED_POSITIONS_BT, PACKED_SEGMENTS_BT, perturbed, tiny_config
from tests.ops import test_engine as engine_tests

SEGMENTS_BT = np.array([[1, 1, 1, 2, 2, 2, 2, 2], [1, 1, 1, 1, 1, 1, 1, 1]])


def _f(z: np.ndarray, nonlinearity: str) -> np.ndarray:
    return np.maximum(z, 0.0) if nonlinearity == "relu" else 0.5 * (1.0 + np.tanh(0.5 * z))


def _ref_penalty(
    logits_TS: np.ndarray, segments_T: np.ndarray, nonlinearity: str = "relu"
) -> np.ndarray:
    """F_ij = sum over masking tokens k with j < k < i of f(l_kj), same segment, j not first."""
    length = len(segments_T)
    f_TS = np.zeros((length, length))
    for i in range(length):
        for j in range(i + 1):
            first = j == 0 or segments_T[j] != segments_T[j - 1]
            if first or segments_T[i] != segments_T[j]:
                continue
            f_TS[i, j] = sum(
                _f(logits_TS[k, j], nonlinearity)
                for k in range(j + 1, i)
                if segments_T[k] == segments_T[j]
            )
    return f_TS


def _ref_attention(p: dict, x_BTD: np.ndarray, segments_BT: np.ndarray, options: dict):
    q = np.einsum("BTD,DNH->BTNH", x_BTD, p["query"])
    k = np.einsum("BTD,DNH->BTNH", x_BTD, p["key"])
    v = np.einsum("BTD,DNH->BTNH", x_BTD, p["value"])
    batch, length, heads, head_dim = q.shape
    head = options.get("head", 0)
    threshold = options.get("prune_threshold")
    budget = options.get("prune_budget")
    y = np.zeros_like(q)
    pruned = 0
    for b in range(batch):
        logits_NTS = np.einsum("TNH,SNH->NTS", q[b], k[b]) / math.sqrt(head_dim)
        f_TS = _ref_penalty(logits_NTS[head], segments_BT[b], options.get("nonlinearity", "relu"))
        evicted: set[int] = set()
        for i in range(length):
            keys = [j for j in range(i + 1) if segments_BT[b, j] == segments_BT[b, i]]
            if budget is not None:  # evict the buffered key with the largest F, oldest first
                buffer = [j for j in keys if j not in evicted]
                if len(buffer) > budget:
                    evicted.add(max(buffer, key=lambda j: (f_TS[i, j], -j)))
                kept = [j for j in keys if j not in evicted]
                pruned += len(keys) - len(kept)
                keys = kept
            if threshold is not None:
                kept = [j for j in keys if f_TS[i, j] <= threshold]
                pruned += len(keys) - len(kept)
                keys = kept
            for n in range(heads):
                scores = np.array([logits_NTS[n, i, j] - f_TS[i, j] for j in keys])
                w = np.exp(scores - scores.max())
                w /= w.sum()
                y[b, i, n] = sum(wj * v[b, j, n] for wj, j in zip(w, keys, strict=True))
    return np.einsum("BTNH,NHD->BTD", y, p["out"]), pruned


def _layer(options: dict, **model: object) -> tuple[Attention, dict, dict, np.ndarray]:
    cfg = tiny_config("selective", position_options=options, **model)
    attention = Attention(cfg)
    rng = np.random.default_rng(0)
    x_BTD = jnp.asarray(rng.normal(size=(2, 8, cfg.d_model)), jnp.float32)
    variables = attention.init(jax.random.key(0), x_BTD, _ctx(x_BTD))
    params = nn.unbox(variables["params"])
    # Larger projections than the initialisation, so that many selection logits are > 0.
    params = {
        name: {"kernel": jnp.asarray(0.4 * rng.normal(size=value["kernel"].shape), jnp.float32)}
        for name, value in params.items()
    }
    flat = {name: np.asarray(params[name]["kernel"], np.float64) for name in params}
    return attention, {"params": params}, flat, np.asarray(x_BTD)


def _ctx(x_BTD: jax.Array) -> AttentionContext:
    positions_BT = jnp.zeros(SEGMENTS_BT.shape, jnp.int32)
    return AttentionContext.create(x_BTD, positions_BT, jnp.asarray(SEGMENTS_BT))


SLOW = pytest.mark.slow
LAYER_CASES = [
    ({}, "naive"),
    ({}, "blockwise"),
    pytest.param({"nonlinearity": "sigmoid"}, "naive", marks=SLOW),
    ({"nonlinearity": "sigmoid", "head": 1}, "blockwise"),
    ({"prune_threshold": 0.5}, "naive"),
    pytest.param({"prune_threshold": 0.5, "head": 1}, "blockwise", marks=SLOW),
    ({"prune_budget": 3}, "naive"),
    pytest.param({"prune_budget": 2, "nonlinearity": "sigmoid"}, "blockwise", marks=SLOW),
]


@pytest.mark.parametrize(("options", "impl"), LAYER_CASES, ids=str)
def test_layer_matches_numpy_reference(options: dict, impl: str) -> None:
    attention, variables, flat, x_BTD = _layer(
        options, attention_impl=impl, attention_block=3, attention_backward="remat"
    )
    y_BTD, _ = jax.jit(attention.apply)(variables, jnp.asarray(x_BTD), _ctx(jnp.asarray(x_BTD)))
    expected, pruned = _ref_attention(flat, x_BTD.astype(np.float64), SEGMENTS_BT, options)
    if "prune_threshold" in options or "prune_budget" in options:
        assert pruned > 0, "the case must prune some keys"
    np.testing.assert_allclose(np.asarray(y_BTD), expected, rtol=1e-4, atol=1e-5)


def test_selection_constraints_and_accumulation_by_hand() -> None:
    """Constant logits c > 0: S = c off the diagonal and the first column, F_ij = c (i - j - 1)."""
    length, c = 5, 0.7
    allowed_BTS = jnp.tril(jnp.ones((length, length), bool))[None]
    first_BS = jnp.arange(length)[None] == 0
    index = jnp.arange(length)
    s_BTS = selection_BTS(jnp.full((1, length, length), c), allowed_BTS, first_BS, index, index)
    f_BTS = np.asarray(accumulated_penalty_BTS(s_BTS))[0]
    expected = np.zeros((length, length))
    for i in range(length):
        for j in range(1, i):
            expected[i, j] = c * (i - j - 1)
    np.testing.assert_allclose(f_BTS, expected, rtol=1e-6)
    s = np.asarray(s_BTS)[0]
    assert np.all(np.diag(s) == 0) and np.all(s[:, 0] == 0) and np.all(np.triu(s, 1) == 0)


def _model(options: dict, impl: str = "naive", **overrides: object) -> tuple[Transformer, dict]:
    cfg = tiny_config(
        "selective",
        position_options=options,
        num_layers=1,
        attention_impl=impl,
        attention_block=3,
        **overrides,
    )
    model = Transformer(cfg)
    tokens_BT = _tokens()
    params = model.init(jax.random.key(0), tokens_BT, jnp.asarray(PACKED_POSITIONS_BT))["params"]
    return model, nn.unbox(perturbed(params, scale=0.3))


def _tokens() -> jax.Array:
    return jnp.asarray(np.random.default_rng(0).integers(0, 13, (2, 8)), jnp.int32)


def test_zero_selecting_head_is_plain_causal_attention() -> None:
    """With the selecting head's query projection zero, relu(0) = 0: F = 0 and selective
    attention is NoPE exactly (the paper's change is the only difference)."""
    model, params = _model({})
    kernel = params["block_0"]["attention"]["query"]["kernel"]
    silent = jax.tree.map(lambda x: x, params)
    silent["block_0"]["attention"]["query"]["kernel"] = kernel.at[:, 0].set(0.0)
    nope = Transformer(tiny_config("nope", num_layers=1))
    args = (_tokens(), jnp.asarray(PACKED_POSITIONS_BT), jnp.asarray(PACKED_SEGMENTS_BT))
    np.testing.assert_array_equal(
        np.asarray(model.apply({"params": silent}, *args)),
        np.asarray(nope.apply({"params": silent}, *args)),
    )
    assert not np.allclose(
        np.asarray(model.apply({"params": params}, *args)),
        np.asarray(nope.apply({"params": params}, *args)),
    ), "with a live selecting head the penalty must change the output"


@pytest.mark.parametrize("impl", ["naive", pytest.param("blockwise", marks=pytest.mark.slow)])
def test_gradient_wrt_future_inputs_is_exactly_zero(impl: str) -> None:
    model, params = _model({"prune_threshold": 1.0}, impl)
    tokens_BT = _tokens()[:1]
    positions_BT = jnp.asarray(PACKED_POSITIONS_BT[:1])
    emb = model.apply({"params": params}, tokens_BT, positions_BT, True, method=Transformer.embed)

    def output_at(x_BTD: jax.Array, t: int) -> jax.Array:
        logits = model.apply(
            {"params": params}, emb.replace(x_BTD=x_BTD), method=Transformer.forward_embedded
        )
        return logits[0, t].sum()

    grad_at = jax.jit(jax.grad(output_at))  # t traced: one program for the three rows
    for t in (1, 4, 6):
        grad_BTD = np.asarray(grad_at(emb.x_BTD, t))
        assert np.all(grad_BTD[0, t + 1 :] == 0.0), f"leak into t={t}"
        assert np.any(grad_BTD[0, : t + 1] != 0.0)


def _decoded(model: Transformer, params: dict, chunks: list[int]) -> tuple[np.ndarray, dict]:
    tokens_BT = _tokens()
    cache = decode.init_cache(model.cfg, 2, 8)
    step = jax.jit(functools.partial(model.apply, decode=True, mutable=["cache"]))
    outputs, start = [], 0
    for size in chunks:
        end = start + size
        logits, variables = step(
            {"params": params, "cache": cache},
            tokens_BT[:, start:end],
            jnp.asarray(PACKED_POSITIONS_BT[:, start:end]),
            jnp.asarray(PACKED_SEGMENTS_BT[:, start:end]),
        )
        cache, start = variables["cache"], end
        outputs.append(np.asarray(logits))
    return np.concatenate(outputs, axis=1), cache


@pytest.mark.parametrize(
    ("options", "impl", "chunks"),
    [
        ({}, "blockwise", [5, 1, 1, 1]),
        pytest.param({"prune_threshold": 0.3}, "naive", [4, 1, 1, 1, 1], marks=pytest.mark.slow),
        pytest.param({"prune_budget": 2}, "naive", [3, 1, 2, 1, 1], marks=pytest.mark.slow),
        pytest.param({"prune_budget": 3}, "blockwise", [5, 1, 1, 1], marks=pytest.mark.slow),
        pytest.param(
            {"prune_threshold": 0.3, "nonlinearity": "sigmoid"},
            "blockwise",
            [1, 3, 2, 2],
            marks=pytest.mark.slow,
        ),
    ],
    ids=str,
)
def test_prefill_then_steps_equal_full_forward(options: dict, impl: str, chunks: list) -> None:
    model, params = _model(options, impl)
    full = np.asarray(
        jax.jit(model.apply)(
            {"params": params},
            _tokens(),
            jnp.asarray(PACKED_POSITIONS_BT),
            jnp.asarray(PACKED_SEGMENTS_BT),
        )
    )
    decoded, _ = _decoded(model, params, chunks)
    np.testing.assert_allclose(decoded, full, rtol=2e-5, atol=2e-5)


@pytest.mark.slow
def test_cached_penalty_is_the_next_query_s_accumulated_mask() -> None:
    """After 8 decoded tokens the cache holds sum_{k <= 7} S_kj: the F row that a 9th query
    of the same segment reads in a full forward pass over 9 tokens."""
    model, params = _model({})
    tokens_BT = jnp.asarray(np.random.default_rng(0).integers(0, 13, (2, 9)), jnp.int32)
    segments_BT = np.concatenate([PACKED_SEGMENTS_BT, PACKED_SEGMENTS_BT[:, -1:]], axis=1)
    positions_BT = np.concatenate([PACKED_POSITIONS_BT, PACKED_POSITIONS_BT[:, -1:] + 1], axis=1)
    cache = decode.init_cache(model.cfg, 2, 9)
    for start, end in [(0, 3), (3, 4), (4, 8)]:
        _, variables = model.apply(
            {"params": params, "cache": cache},
            tokens_BT[:, start:end],
            jnp.asarray(positions_BT[:, start:end]),
            jnp.asarray(segments_BT[:, start:end]),
            decode=True,
            mutable=["cache"],
        )
        cache = variables["cache"]
    site_cache = cache["block_0"]["attention"]["selective"]["penalty"]
    cached_BS = np.asarray(site_cache["selective_penalty"])
    _, state = model.apply(
        {"params": params},
        tokens_BT,
        jnp.asarray(positions_BT),
        jnp.asarray(segments_BT),
        mutable=["intermediates"],
    )
    site = state["intermediates"]["block_0"]["attention"]["selective"]
    f_BTS = np.asarray(site["penalty_BTS"][0])
    same_BS = segments_BT[:, :8] == segments_BT[:, 8:9]
    np.testing.assert_allclose(cached_BS[:, :8][same_BS], f_BTS[:, 8, :8][same_BS], atol=1e-5)
    assert np.any(cached_BS[:, :8][same_BS] > 0)
    assert np.all(cached_BS[:, 0] == 0)  # the first token is never masked


def test_pruned_keys_get_zero_weight_and_stay_pruned() -> None:
    model, params = _model({"prune_threshold": 0.3})
    _, state = model.apply(
        {"params": params},
        _tokens(),
        jnp.asarray(PACKED_POSITIONS_BT),
        jnp.asarray(PACKED_SEGMENTS_BT),
        mutable=["intermediates"],
    )
    site = state["intermediates"]["block_0"]["attention"]
    f_BTS = np.asarray(site["selective"]["penalty_BTS"][0])
    weights_BNTS = np.asarray(site["attention_weights"][0])
    pruned_BTS = f_BTS > 0.3
    assert pruned_BTS.any()
    assert np.all(weights_BNTS[np.broadcast_to(pruned_BTS[:, None], weights_BNTS.shape)] == 0.0)
    # F never decreases down a column (S >= 0), so a pruned key stays pruned.
    allowed_BTS = np.tril(np.ones((8, 8), bool))[None] & (
        PACKED_SEGMENTS_BT[:, :, None] == PACKED_SEGMENTS_BT[:, None, :]
    )
    for b in range(2):
        for j in range(8):
            rows = [i for i in range(8) if allowed_BTS[b, i, j]]
            column = f_BTS[b, rows, j]
            assert np.all(np.diff(column) >= 0)


def test_dot_product_attention_is_refused() -> None:
    with pytest.raises(ValueError, match="dot_product_attention"):
        checks.validate(
            ModelConfig(vocab_size=13, position="selective", attention_impl="dot_product_attention")
        )


@pytest.mark.parametrize(
    ("options", "word"),
    [
        ({"head": 2}, "head"),
        ({"head": -1}, "head"),
        ({"nonlinearity": "tanh"}, "nonlinearity"),
        ({"prune_threshold": 0.0}, "prune_threshold"),
        ({"prune_threshold": float("inf")}, "prune_threshold"),
        ({"prune_budget": 0}, "prune_budget"),
        ({"prune_budget": 2.5}, "prune_budget"),
    ],
    ids=str,
)
def test_bad_options_raise(options: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        tiny_config("selective", position_options=options)


def test_scheme_is_parameter_free() -> None:
    _, params = _model({})
    assert "selective" not in params["block_0"]["attention"]
    assert make_scheme("selective").paper.endswith("2410.02703")


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant",
    [
        ("selective+rope", {}),
        ("selective", {"prune_threshold": 0.5, "nonlinearity": "sigmoid"}),
        ("selective", {"prune_budget": 3}),
    ],
    ids=str,
)
def test_engine_values_and_gradients_equal_naive_for_variants(variant: tuple) -> None:
    """The registry-wide equivalence check (packed rows, blocks of 3) on the paper's pairing
    with RoPE and on the pruning and sigmoid options."""
    equivalence.test_blockwise_values_and_gradients_equal_naive(variant)


@pytest.mark.slow
def test_selective_plus_rope_decodes_like_the_full_forward() -> None:
    decode_tests._check_prefill_then_steps("selective+rope", {}, decode_tests.STEPS)


@pytest.mark.slow
def test_engine_jit_equals_eager_with_every_option() -> None:
    options = {"prune_budget": 2, "prune_threshold": 1.0, "nonlinearity": "sigmoid", "head": 1}
    attention, variables, _, x_BTD = _layer(options, attention_impl="blockwise", attention_block=3)
    ctx = _ctx(jnp.asarray(x_BTD))
    eager, _ = attention.apply(variables, jnp.asarray(x_BTD), ctx)
    jitted, _ = jax.jit(attention.apply)(variables, jnp.asarray(x_BTD), ctx)
    np.testing.assert_allclose(np.asarray(eager), np.asarray(jitted), rtol=1e-5, atol=1e-6)


def test_engine_gradient_with_budget_holds_no_length_squared_array() -> None:
    """The eviction scan and the (B, S, G) prefix keep one axis >= T per array."""
    length = 96
    cfg = tiny_config(
        "selective",
        position_options={"prune_budget": 8},
        num_layers=1,
        max_len=length,
        attention_impl="blockwise",
        attention_block=16,
    )
    model = Transformer(cfg)
    tokens_BT = jnp.zeros((1, length), jnp.int32)
    positions_BT = jnp.arange(length)[None]
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens_BT, positions_BT))

    def loss(p: object) -> jax.Array:
        return jnp.sum(model.apply(p, tokens_BT, positions_BT))

    jaxpr = jax.make_jaxpr(jax.grad(loss))(params).jaxpr
    shapes = [tuple(getattr(a, "shape", ())) for a in engine_tests._avals(jaxpr)]
    assert not [s for s in shapes if sum(d >= length for d in s) >= 2]
