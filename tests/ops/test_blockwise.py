"""Blockwise CoPE / FoX / stick-breaking attention equal the naive (B, N, T, S) path.

Values and gradients for every variant, on random float32 inputs with packed segments and a
length that the block size does not divide; a NumPy loop reference of CoPE (Golovneva et al.
2024, arXiv 2405.18719, eq. 3-9) for the forward; no (T, S)-sized array in the jaxpr of the
blockwise forward or gradient; the Transformer with attention_impl="blockwise" equals "naive".
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.attention import Attention, causal_segment_mask_BTS
from copejax.model import Transformer
from copejax.ops import blockwise as bw
from copejax.ops import cope as cope_ops
from copejax.ops.blockwise_cope import blockwise_cope_attention
from copejax.ops.blockwise_fox import blockwise_fox_attention
from copejax.ops.blockwise_stickbreaking import blockwise_stickbreaking_attention
from copejax.positions.base import AttentionContext, masked_softmax_BNTS
from copejax.positions.fox import fox_decay_bias
from copejax.positions.stickbreaking import stickbreaking_allowed_BTS, stickbreaking_weights
from tests.conftest import tiny_config

B, T, N, H, BLOCK = 2, 19, 2, 4, 8  # 19 = 2 * 8 + 3: the last block is padded


def _inputs(seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)

    def normal(*shape: int, scale: float = 1.0) -> jax.Array:
        return jnp.asarray(scale * rng.normal(size=shape), jnp.float32)

    segments_BT = np.sort(rng.integers(0, 3, (B, T)), axis=1)
    segments_BT[1] = 0  # one row without packing
    return {
        "q": normal(B, T, N, H, scale=1.5),
        "k": normal(B, T, N, H, scale=1.5),
        "v": normal(B, T, N, H),
        "gate_k": normal(B, T, N, H, scale=1.5),
        "seg": jnp.asarray(segments_BT, jnp.int32),
        "logf": -jnp.abs(normal(B, T, N)),
    }


def _logits_BNTS(q_BTNH: jax.Array, k_BTNH: jax.Array) -> jax.Array:
    return jnp.einsum("BTNH,BSNH->BNTS", q_BTNH, k_BTNH) / math.sqrt(H)


def _weighted(weights_BNTS: jax.Array, v_BTNH: jax.Array) -> jax.Array:
    return jnp.einsum("BNTS,BSNH->BTNH", weights_BNTS, v_BTNH)


# CoPE variants: (gates, position term, options for both paths).
COPE_VARIANTS = {
    "keys-interpolate": ("keys", "interpolate", {}),
    "keys-interpolate-pmax2": ("keys", "interpolate", {"p_max": 2}),  # saturated blocks skip
    "keys-interpolate-noskip": ("keys", "interpolate", {"p_max": 2, "skip_saturated": False}),
    "per-head-table": ("keys", "interpolate", {"per_head": True}),
    "sep_keys": ("sep_keys", "interpolate", {}),
    "values": ("values", "interpolate", {}),
    "alibi": ("keys", "alibi", {}),
    "mlp": ("keys", "mlp", {}),
    "mlp-values": ("values", "mlp", {"p_max": 3}),
    "unit-gates": ("keys", "interpolate", {"force_unit_gates": True, "p_max": 4}),
    "scaled-term": ("sep_keys", "alibi", {"scale_position_term": True}),
}


def _cope_params(position_term: str, per_head: bool, p_max: int, seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    table_shape = (N, p_max, H) if per_head else (p_max, H)
    params = {
        "interpolate": {"pos_emb": rng.normal(size=table_shape)},
        "alibi": {"slopes_N": rng.normal(size=(N,))},
        "mlp": {
            "w_in": rng.normal(size=(5,)) * 3,
            "b_in": rng.normal(size=(5,)),
            "w_out": rng.normal(size=(5, H)),
        },
    }[position_term]
    return {key: jnp.asarray(value, jnp.float32) for key, value in params.items()}


def _cope_both(variant: str) -> tuple:
    """(naive fn, blockwise fn, their differentiable args) for one CoPE variant."""
    gates, term, opts = COPE_VARIANTS[variant]
    p_max = opts.get("p_max", 6)
    unit, scaled = opts.get("force_unit_gates", False), opts.get("scale_position_term", False)
    data = _inputs()
    mask_BTS = causal_segment_mask_BTS(data["seg"], B, T)

    def gate_keys(args: dict) -> jax.Array | None:
        if gates == "keys":
            return None
        return args["gate_k"] if gates == "sep_keys" else args["v"]

    def naive(args: dict) -> jax.Array:
        logits_BNTS = _logits_BNTS(args["q"], args["k"])
        other = gate_keys(args)
        gate_logits = logits_BNTS if other is None else _logits_BNTS(args["q"], other)
        gates_BNTS = cope_ops.cope_gates(gate_logits, mask_BTS, unit)
        p_BNTS = cope_ops.cope_positions(gates_BNTS, p_max)
        if term == "interpolate":
            term_BNTS = cope_ops.cope_interpolated_term(args["q"], args["pos_emb"], p_BNTS)
        elif term == "alibi":
            term_BNTS = cope_ops.cope_alibi_term(args["slopes_N"], p_BNTS)
        else:
            term_BNTS = cope_ops.cope_mlp_term(
                args["q"], p_BNTS, args["w_in"], args["b_in"], args["w_out"], input_scale=0.25
            )
        if scaled:
            term_BNTS = term_BNTS / math.sqrt(H)
        return _weighted(masked_softmax_BNTS(logits_BNTS + term_BNTS, mask_BTS), args["v"])

    def blocked(args: dict) -> jax.Array:
        mlp = (args["w_in"], args["b_in"], args["w_out"]) if term == "mlp" else None
        return blockwise_cope_attention(
            args["q"],
            args["k"],
            args["v"],
            data["seg"],
            p_max=p_max,
            position_term=term,
            pos_emb=args.get("pos_emb"),
            slopes_N=args.get("slopes_N"),
            mlp_params=mlp,
            mlp_input_scale=0.25,
            gate_k_BTNH=gate_keys(args),
            force_unit_gates=unit,
            scale_position_term=scaled,
            block=BLOCK,
            skip_saturated=opts.get("skip_saturated", True),
        )

    args = {key: data[key] for key in ("q", "k", "v")}
    if gates == "sep_keys":
        args["gate_k"] = data["gate_k"]
    args.update(_cope_params(term, opts.get("per_head", False), p_max))
    return naive, blocked, args


def _assert_same_values_and_grads(naive, blocked, args: dict) -> None:
    cotangent = jnp.asarray(np.random.default_rng(7).normal(size=(B, T, N, H)), jnp.float32)

    @jax.jit
    def both(args: dict) -> tuple:
        def grads(fn) -> dict:
            return jax.grad(lambda a: jnp.sum(fn(a) * cotangent))(args)

        return naive(args), blocked(args), grads(naive), grads(blocked)

    y_naive, y_block, g_naive, g_block = both(args)
    np.testing.assert_allclose(np.asarray(y_block), np.asarray(y_naive), rtol=1e-5, atol=1e-5)
    for key in args:
        expected, got = np.asarray(g_naive[key]), np.asarray(g_block[key])
        scale = max(1.0, float(np.abs(expected).max()))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * scale, err_msg=key)
        assert np.abs(expected).max() > 0, f"gradient of {key} is zero: the test would be empty"


FAST_COPE_VARIANTS = ("keys-interpolate-pmax2", "mlp-values", "scaled-term")


@pytest.mark.parametrize(
    "variant",
    [
        v if v in FAST_COPE_VARIANTS else pytest.param(v, marks=pytest.mark.slow)
        for v in sorted(COPE_VARIANTS)
    ],
)
def test_cope_blockwise_equals_naive(variant: str) -> None:
    _assert_same_values_and_grads(*_cope_both(variant))


def _cope_numpy(data: dict, e: jax.Array, p_max: int) -> np.ndarray:
    """CoPE by loops from eq. 3-9: gates, capped suffix counts, interpolated q.e, softmax."""
    q, k, v, e = (np.asarray(x, np.float64) for x in (data["q"], data["k"], data["v"], e))
    seg = np.asarray(data["seg"])
    out = np.zeros(q.shape)
    for b in range(B):
        for n in range(N):
            for i in range(T):
                keys = [j for j in range(i + 1) if seg[b, j] == seg[b, i]]
                logit = {j: q[b, i, n] @ k[b, j, n] / math.sqrt(H) for j in keys}
                gate = {j: 1 / (1 + math.exp(-logit[j])) for j in keys}
                score = {}
                for j in keys:
                    p = min(sum(gate[m] for m in keys if m >= j), p_max - 1)
                    lo, hi = math.floor(p), math.ceil(p)
                    z_lo, z_hi = q[b, i, n] @ e[lo], q[b, i, n] @ e[hi]
                    score[j] = logit[j] + (p - lo) * z_hi + (1 - p + lo) * z_lo
                top = max(score.values())
                weight = {j: math.exp(s - top) for j, s in score.items()}
                total = sum(weight.values())
                out[b, i, n] = sum(weight[j] / total * v[b, j, n] for j in keys)
    return out


def test_cope_blockwise_matches_numpy_loops() -> None:
    data = _inputs(3)
    e = _cope_params("interpolate", False, 6, seed=4)["pos_emb"]
    y = blockwise_cope_attention(
        data["q"], data["k"], data["v"], data["seg"], p_max=6, pos_emb=e, block=5
    )
    expected = _cope_numpy(data, e, 6)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-5)


def test_fox_blockwise_equals_naive() -> None:
    data = _inputs(1)
    mask_BTS = causal_segment_mask_BTS(data["seg"], B, T)

    def naive(a: dict) -> jax.Array:
        logits_BNTS = _logits_BNTS(a["q"], a["k"]) + fox_decay_bias(a["logf"], mask_BTS)
        return _weighted(masked_softmax_BNTS(logits_BNTS, mask_BTS), a["v"])

    def blocked(a: dict) -> jax.Array:
        return blockwise_fox_attention(a["q"], a["k"], a["v"], a["logf"], data["seg"], block=BLOCK)

    args = {key: data[key] for key in ("q", "k", "v", "logf")}
    _assert_same_values_and_grads(naive, blocked, args)


@pytest.mark.parametrize("include_self", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_stickbreaking_blockwise_equals_naive(include_self: bool) -> None:
    data = _inputs(2)
    allowed_BTS = stickbreaking_allowed_BTS(
        causal_segment_mask_BTS(data["seg"], B, T), include_self
    )

    def naive(a: dict) -> jax.Array:
        weights_BNTS, _ = stickbreaking_weights(_logits_BNTS(a["q"], a["k"]), allowed_BTS)
        return _weighted(weights_BNTS, a["v"])

    def blocked(a: dict) -> jax.Array:
        return blockwise_stickbreaking_attention(
            a["q"], a["k"], a["v"], data["seg"], include_self=include_self, block=BLOCK
        )

    _assert_same_values_and_grads(naive, blocked, {key: data[key] for key in ("q", "k", "v")})


# No (T, S) intermediate: every array in the jaxpr, sub-jaxprs included, has at most one
# dimension >= T.
def _avals(jaxpr: jax.extend.core.Jaxpr):
    for var in (*jaxpr.invars, *jaxpr.constvars):
        yield var.aval
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield var.aval
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from _avals(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _avals(sub)


def _square_arrays(fn, *args, length: int) -> list[tuple[int, ...]]:
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    shapes = [tuple(getattr(a, "shape", ())) for a in _avals(jaxpr)]
    return [s for s in shapes if sum(d >= length for d in s) >= 2]


def test_blockwise_jaxprs_have_no_length_squared_array() -> None:
    length, block = 512, 64
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, length, 1, 4)), jnp.float32) for _ in range(3))
    seg = jnp.zeros((1, length), jnp.int32)
    logf = jnp.zeros((1, length, 1), jnp.float32)
    e = jnp.zeros((8, 4), jnp.float32)
    programs = {
        "cope": lambda q, k, v: blockwise_cope_attention(
            q, k, v, seg, p_max=8, pos_emb=e, gate_k_BTNH=v, block=block
        ),
        "fox": lambda q, k, v: blockwise_fox_attention(q, k, v, logf, seg, block=block),
        "stickbreaking": lambda q, k, v: blockwise_stickbreaking_attention(
            q, k, v, seg, block=block
        ),
    }
    for name, fn in programs.items():
        grad = jax.grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v) ** 2), argnums=(0, 1, 2))
        assert _square_arrays(fn, q, k, v, length=length) == [], name
        assert _square_arrays(grad, q, k, v, length=length) == [], name
    # The check can fail: the naive path has (T, S) arrays.
    naive = lambda q, k, v: _weighted(jax.nn.softmax(_logits_BNTS(q, k)), v)
    assert _square_arrays(naive, q, k, v, length=length)


FOX_SHIFTS = {"key_shift": True, "value_shift": True, "output_gate": True, "qk_norm": True}


def test_fox_pro_shift_layer_has_no_length_squared_array() -> None:
    """FoX with key and value shift, blockwise: token shift reads segment ids, not the mask.

    The layer's jaxpr (forward and gradient) is traced with ``mask_BTS=None``, so any read of
    the (B, T, T) mask fails; the model's compiled forward + backward (which builds the mask
    and must drop it) holds no (T, T) buffer either.
    """
    length = 512
    options = {**FOX_SHIFTS, "attention_impl": "blockwise", "block_size": 64}
    cfg = tiny_config("fox", position_options=options, num_layers=1, max_len=length)
    rng = np.random.default_rng(0)
    x_BTD = jnp.asarray(rng.normal(size=(1, length, cfg.d_model)), jnp.float32)
    positions_BT = jnp.arange(length)[None]
    segments_BT = jnp.asarray(np.repeat([0, 1], length // 2)[None], jnp.int32)
    attention = Attention(cfg)

    def ctx(x_BTD: jax.Array, mask_BTS: jax.Array | None) -> AttentionContext:
        return AttentionContext(
            x_BTD=x_BTD,
            q_positions_BT=positions_BT,
            k_positions_BS=positions_BT,
            mask_BTS=mask_BTS,
            segment_ids_BT=segments_BT,
        )

    params = attention.init(
        jax.random.key(0), x_BTD, ctx(x_BTD, causal_segment_mask_BTS(segments_BT, 1, length))
    )
    layer = lambda p, x: attention.apply(p, x, ctx(x, None))[0]
    grad = jax.grad(lambda p, x: jnp.sum(layer(p, x) ** 2), argnums=(0, 1))
    assert _square_arrays(layer, params, x_BTD, length=length) == []
    assert _square_arrays(grad, params, x_BTD, length=length) == []

    model = Transformer(cfg)
    tokens_BT = jnp.zeros((1, length), jnp.int32)
    model_params = model.init(jax.random.key(0), tokens_BT, positions_BT, segments_BT)
    loss = lambda p: jnp.sum(model.apply(p, tokens_BT, positions_BT, segments_BT))
    hlo = jax.jit(jax.grad(loss)).lower(model_params).compile().as_text()
    shapes = {
        tuple(int(d) for d in dims.split(",")) for dims in re.findall(r"\[(\d+(?:,\d+)+)\]", hlo)
    }
    assert [s for s in shapes if sum(d >= length for d in s) >= 2] == []


# Through the model: the scheme option picks the path; same logits and parameter gradients.
def _model_values_and_grads(position: str, options: dict, impl: str) -> tuple:
    rng = np.random.default_rng(0)
    tokens_BT = jnp.asarray(rng.integers(0, 13, (B, T)), jnp.int32)
    segments_BT = jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), axis=1), jnp.int32)
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    options = {**options, "attention_impl": impl, "block_size": BLOCK}
    cfg = tiny_config(position, position_options=options, num_layers=1, max_len=32)
    model = Transformer(cfg)
    params = model.init(jax.random.key(0), tokens_BT, positions_BT, segments_BT)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    # Random values everywhere (CoPE's e and MLP output start at zero).
    params = jax.tree.unflatten(
        tree,
        [x + 0.3 * jax.random.normal(key, x.shape) for x, key in zip(leaves, keys, strict=True)],
    )

    def loss(p: dict) -> jax.Array:
        return jnp.sum(jnp.sin(model.apply(p, tokens_BT, positions_BT, segments_BT)))

    return jax.jit(jax.value_and_grad(loss))(params)


MODEL_VARIANTS = [
    ("cope+rope", {}),
    pytest.param(
        "fox",
        {"output_gate": True, "qk_norm": True, "key_shift": True, "value_shift": True},
        marks=pytest.mark.slow,
    ),
    pytest.param("cope", {"gates": "sep_keys", "position_term": "mlp"}, marks=pytest.mark.slow),
    pytest.param("cope", {"gates": "values", "per_head_embeddings": True}, marks=pytest.mark.slow),
    pytest.param("cope", {"position_term": "alibi", "p_max": 4}, marks=pytest.mark.slow),
    pytest.param(
        "cope", {"position_term": "alibi", "alibi_slopes": "press"}, marks=pytest.mark.slow
    ),
    pytest.param("fox", {}, marks=pytest.mark.slow),
    pytest.param("stickbreaking", {}, marks=pytest.mark.slow),
    pytest.param("stickbreaking", {"include_self": True}, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("position", "options"), MODEL_VARIANTS)
def test_model_blockwise_equals_naive(position: str, options: dict) -> None:
    value_naive, grads_naive = _model_values_and_grads(position, options, "naive")
    value_block, grads_block = _model_values_and_grads(position, options, "blockwise")
    np.testing.assert_allclose(float(value_block), float(value_naive), rtol=1e-5)
    for expected, got in zip(
        jax.tree.leaves(grads_naive), jax.tree.leaves(grads_block), strict=True
    ):
        scale = max(1.0, float(np.abs(np.asarray(expected)).max()))
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5 * scale)


def test_auto_goes_blockwise_from_the_threshold_unless_sowing() -> None:
    assert not bw.use_blockwise("auto", 1023, 1024, sowing=False)
    assert bw.use_blockwise("auto", 1024, 1024, sowing=False)
    assert not bw.use_blockwise("auto", 4096, 1024, sowing=True)
    assert bw.use_blockwise("blockwise", 8, 1024, sowing=True)
    assert not bw.use_blockwise("naive", 10**6, 1024, sowing=False)


def test_sown_intermediates_come_from_the_naive_path() -> None:
    cfg = tiny_config("cope", position_options={"blockwise_min_len": 4}, num_layers=1)
    tokens_BT = jnp.zeros((1, 8), jnp.int32)
    positions_BT = jnp.arange(8)[None]
    model = Transformer(cfg)
    params = model.init(jax.random.key(0), tokens_BT, positions_BT)
    _, state = model.apply(params, tokens_BT, positions_BT, mutable=["intermediates"])
    sown = jax.tree_util.tree_leaves_with_path(state)
    assert any("gates_BNTS" in jax.tree_util.keystr(path) for path, _ in sown)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"attention_impl": "flash"}, "attention_impl must be one of"),
        ({"block_size": 0}, "block_size must be a positive integer"),
        ({"blockwise_min_len": 1.5}, "blockwise_min_len must be a positive integer"),
    ],
)
@pytest.mark.parametrize("position", ["cope", "fox", "stickbreaking"])
def test_bad_options_raise(position: str, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny_config(position, position_options=options)


def test_bad_block_raises() -> None:
    with pytest.raises(ValueError, match="block size must be a positive integer, got 0"):
        bw.num_blocks(10, 0)
