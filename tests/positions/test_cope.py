"""CoPE (Golovneva et al. 2024, arXiv 2405.18719) against a loop port of Appendix B's listing,
and, for CoPE-ALiBi and CoPE-MLP, against Appendix C's eq. 10 and its MLP description, with
each choice the paper leaves open named where the reference makes it."""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model.transformer import Transformer
from copejax.ops.cope import cope_positions
from copejax.positions import registry
from copejax.positions.base import AttentionContext, Dims, masked_softmax_BNTS
from copejax.positions.cope import CoPE
from tests.conftest import tiny_config, tokens_and_positions

B, T, N, H, D = 2, 6, 2, 8, 16
DIMS = Dims(d_model=D, num_heads=N, head_dim=H, num_layers=1, max_len=T)


# ----------------------------------------------------------------------------------------------
# The NumPy reference: Appendix B's listing with explicit loops, float64.
# ----------------------------------------------------------------------------------------------


def _sigmoid(x: float) -> float:
    if x == -np.inf:
        return 0.0
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def _gelu(x: float) -> float:
    return 0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0)))


# CoPE-ALiBi, written from Appendix C's eq. 10:  a_ij = Softmax(q_i^T k_j + m . p_ij), "m is
# a head-specific slope fixed before training" (or "a learned parameter, specific for each
# head and layer, and initialized from 0"). Choices the paper leaves open, and copejax's:
# - the sign of a fixed slope: eq. 10 adds +m p_ij, and the paper lists the slope sets as
#   positive numbers ({1, 1/2^2, ...}); with +m a key behind more gated tokens would get a
#   *higher* logit. copejax reads the listed slopes as ALiBi's penalty magnitudes (Press et
#   al.: -m |i - j|), i.e. m = -slope. A learned m is used as written in eq. 10 (+m p_ij).
# - "press" slopes: Press et al.'s geometric m_h = 2^(-8 h / N), h = 1..N (Appendix D).
# - p_ij: eq. 4's sum of gates, capped at p_max - 1 as the listing's clamp does (section 4's
#   text writes min(p_ij, p_max)); eq. 10 itself says nothing of a cap.
# - q_i^T k_j is scaled by 1/sqrt(H) as in the listing, the m p_ij term is not.


def _alibi_m(opts: dict[str, Any], params: dict, head: int, heads: int) -> float:
    """m of eq. 10 for one head: the learned value, or minus a fixed slope (copejax's sign)."""
    slopes = opts.get("alibi_slopes")
    if slopes is None:
        return float(params["alibi_slopes"][head])  # learned: eq. 10 as written
    if slopes == "press":
        return -(2.0 ** (-8.0 * (head + 1) / heads))
    return -float(slopes[head])


def paper_alibi_term(p_ij: float, m: float) -> float:
    """Eq. 10's position term m . p_ij."""
    return m * p_ij


# CoPE-MLP, from Appendix C: "instead of using interpolation (Eq. (5)) we learn the
# positional encodings by training an N-dimensional MLP layer", i.e. e[p_ij] = MLP(p_ij) in
# R^H and, as eq. 6, a_ij = Softmax(q_i^T (k_j + e[p_ij])), so the term is q_i . MLP(p_ij).
# Choices the paper leaves open, and copejax's: one hidden layer of N units; its activation
# (GELU, the erf form); its input (p_ij / p_max, to keep it in [0, 1)); no output bias (it
# would add q_i . b, the same for every key, which the softmax cancels); the initialisation
# (hidden unit f a ramp starting at p = f p_max / N, output weights zero, so the term starts
# at zero like the listing's e). The reference builds the vector e[p_ij] and then takes the
# dot product, as eq. 6 reads; the implementation never builds it.


def paper_mlp_term(q_i: np.ndarray, p_ij: float, params: dict, p_max: int) -> float:
    """q_i . MLP(p_ij) with MLP(p) = W_out^T gelu(w_in * p / p_max + b_in)."""
    x = p_ij / p_max
    w_in, b_in = params["mlp_w_in"], params["mlp_b_in"]
    hidden = np.array([_gelu(w * x + b) for w, b in zip(w_in, b_in, strict=True)])
    e_p = hidden @ params["mlp_w_out"]  # e[p_ij] in R^H
    return float(q_i @ e_p)


def reference_cope(
    inp: dict[str, np.ndarray],
    params: dict[str, np.ndarray],
    opts: dict[str, Any],
    num_positions: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Returns (term, gates, positions), each (B, N, T, S), from the listing's algorithm.

    ``inp`` holds q, k, v (B, T, N, H), the layer input x (B, T, D) and the mask (B, T, S).
    """
    q, k, v, x = (np.asarray(inp[key], np.float64) for key in ("q", "k", "v", "x"))
    mask = inp["mask"]
    batch, length, heads, hd = q.shape
    keys = k.shape[1]
    gates_src = opts.get("gates", "keys")
    term_kind = opts.get("position_term", "interpolate")
    term = np.zeros((batch, heads, length, keys))
    gates = np.zeros_like(term)
    positions = np.zeros_like(term)
    if gates_src == "sep_keys":
        w = params["gate_key"]["kernel"]
        other = np.einsum("bsd,dnh->bsnh", x, w)
    elif gates_src == "values":
        other = v
    else:
        other = k
    for b in range(batch):
        for n in range(heads):
            for i in range(length):
                qi = q[b, i, n]
                # attn_logits = q k^T / sqrt(d) + mask.log(); gates = sigmoid(attn_logits)
                g = np.zeros(keys)
                for j in range(keys):
                    logit = float(qi @ other[b, j, n]) / math.sqrt(hd)
                    logit = logit if mask[b, i, j] else -np.inf
                    g[j] = _sigmoid(logit)
                    if opts.get("force_unit_gates"):
                        g[j] = 1.0 if mask[b, i, j] else 0.0
                # pos = gates.flip(-1).cumsum(-1).flip(-1).clamp(max=npos_max - 1)
                pos = np.zeros(keys)
                for j in range(keys):
                    total = 0.0
                    for kk in range(j, keys):
                        total += g[kk]
                    pos[j] = min(total, num_positions - 1)
                for j in range(keys):
                    p = pos[j]
                    if term_kind == "interpolate":
                        table = params["pos_emb"]
                        e = table[n] if table.ndim == 3 else table
                        logits_int = [float(qi @ e[r]) for r in range(num_positions)]
                        c, f = math.ceil(p), math.floor(p)
                        wgt = p - f
                        value = logits_int[c] * wgt + logits_int[f] * (1 - wgt)
                    elif term_kind == "alibi":
                        value = paper_alibi_term(p, _alibi_m(opts, params, n, heads))
                    else:
                        value = paper_mlp_term(qi, p, params, num_positions)
                    if opts.get("scale_position_term"):
                        value /= math.sqrt(hd)
                    term[b, n, i, j] = value
                gates[b, n, i] = g
                positions[b, n, i] = pos
    return term, gates, positions


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _mask(segments: bool, seed: int = 0) -> np.ndarray:
    causal = np.tril(np.ones((T, T), bool))
    mask = np.broadcast_to(causal, (B, T, T)).copy()
    if segments:
        rng = np.random.default_rng(seed)
        seg = np.sort(rng.integers(0, 2, (B, T)), axis=1)
        mask &= seg[:, :, None] == seg[:, None, :]
    return mask


def _inputs(scale: float = 1.0, seed: int = 0, segments: bool = True) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return dict(
        q=scale * rng.normal(size=(B, T, N, H)).astype(np.float32),
        k=scale * rng.normal(size=(B, T, N, H)).astype(np.float32),
        v=rng.normal(size=(B, T, N, H)).astype(np.float32),
        x=rng.normal(size=(B, T, D)).astype(np.float32),
        mask=_mask(segments, seed),
    )


def _ctx(inp: dict[str, np.ndarray]) -> AttentionContext:
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    return AttentionContext(
        x_BTD=jnp.asarray(inp["x"]),
        q_positions_BT=positions,
        k_positions_BS=positions,
        explicit_mask_BTS=jnp.asarray(inp["mask"]),
    )


def _qk_then_bias(mdl: nn.Module, q, k, v, ctx: AttentionContext) -> jax.Array:
    """What attention.py does around the bias site: qk, scaled content logits, bias."""
    q, k, v = mdl.qk(q, k, v, ctx)
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) / math.sqrt(q.shape[-1])
    return mdl.bias(q, k, v, logits, ctx)


def _randomise(params: Any, seed: int, scale: float = 0.5) -> Any:
    """Random values for every parameter (the listing initialises e at zero)."""
    leaves, tree = jax.tree_util.tree_flatten(nn.unbox(params))
    rng = np.random.default_rng(seed)
    new = [jnp.asarray(scale * rng.normal(size=leaf.shape), leaf.dtype) for leaf in leaves]
    return jax.tree_util.tree_unflatten(tree, new)


def _site_setup(
    position: str, opts: dict[str, Any], inp: dict[str, np.ndarray], dims: Dims = DIMS
) -> tuple[nn.Module, Any]:
    scheme = registry.make_scheme(position, opts)
    scheme.validate(dims)
    site = scheme.attention_module(dims)
    ctx = _ctx(inp)
    args = (jnp.asarray(inp["q"]), jnp.asarray(inp["k"]), jnp.asarray(inp["v"]), ctx)
    params = site.init(jax.random.key(0), *args, method=_qk_then_bias)
    return site, _randomise(params, seed=7)


def _run(site: nn.Module, params: Any, inp: dict[str, np.ndarray]) -> tuple[np.ndarray, dict]:
    ctx = _ctx(inp)
    args = (jnp.asarray(inp["q"]), jnp.asarray(inp["k"]), jnp.asarray(inp["v"]), ctx)
    term, state = site.apply(params, *args, method=_qk_then_bias, mutable=["intermediates"])
    inter = {
        "/".join(str(getattr(p, "key", p)) for p in path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(state.get("intermediates", {}))
    }
    return np.asarray(term), inter


def _find(inter: dict[str, np.ndarray], name: str) -> np.ndarray:
    (value,) = [v for key, v in inter.items() if name in key]
    return value


def _np_params(params: Any) -> dict:
    return jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params.get("params", {}))


# ----------------------------------------------------------------------------------------------
# Against the reference, every variant
# ----------------------------------------------------------------------------------------------

VARIANTS: list[dict[str, Any]] = [
    {},
    {"gates": "sep_keys"},
    {"gates": "values"},
    {"per_head_embeddings": True},
    {"p_max": 3},
    {"p_max": 16},
    {"p_max": None},  # p_max = T = max_len
    {"p_max": 1},
    {"scale_position_term": True},
    {"force_unit_gates": True, "p_max": 4},
    {"gates": "values", "p_max": 2},
    {"position_term": "alibi"},
    {"position_term": "alibi", "alibi_slopes": "press"},
    {"position_term": "alibi", "alibi_slopes": (1.0, 0.5), "gates": "sep_keys"},
    {"position_term": "alibi", "alibi_slopes": [0.25, 2.0], "p_max": 3},
    {"position_term": "mlp", "mlp_hidden": 5},
    {"position_term": "mlp", "mlp_hidden": 7, "p_max": 3, "scale_position_term": True},
    {"share_layers": True, "gates": "sep_keys"},
]


@pytest.mark.parametrize("opts", VARIANTS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_every_variant_matches_the_listing(opts: dict[str, Any]) -> None:
    inp = _inputs(seed=3)
    site, params = _site_setup("cope", opts, inp)
    term, inter = _run(site, params, inp)
    num_positions = CoPE(**opts).num_positions(DIMS)
    want, gates, positions = reference_cope(inp, _np_params(params), opts, num_positions)
    allowed = np.broadcast_to(inp["mask"][:, None], term.shape)
    assert term.dtype == np.float32 and term.shape == (B, N, T, T)
    np.testing.assert_allclose(term[allowed], want[allowed], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_find(inter, "gates_BNTS"), gates, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(_find(inter, "positions_BNTS"), positions, rtol=1e-5, atol=1e-5)
    assert positions.max() <= num_positions - 1
    if opts.get("p_max") == 3 or opts.get("force_unit_gates"):
        assert positions.max() == num_positions - 1  # the cap is exercised


def test_masked_keys_contribute_exactly_zero_to_gates_and_positions() -> None:
    inp = _inputs(seed=4)
    site, params = _site_setup("cope", {}, inp)
    _, inter = _run(site, params, inp)
    gates, positions = _find(inter, "gates_BNTS"), _find(inter, "positions_BNTS")
    masked = ~np.broadcast_to(inp["mask"][:, None], gates.shape)
    assert np.all(gates[masked] == 0.0)
    # Positions of future keys are sums over masked gates only: exactly zero.
    future = np.broadcast_to(~np.tril(np.ones((T, T), bool)), gates.shape)
    assert np.all(positions[future] == 0.0)
    # Changing a future key changes nothing at all in the bias of earlier queries.
    inp2 = dict(inp, k=inp["k"].copy())
    inp2["k"][:, -1] += 5.0
    term1, _ = _run(site, params, inp)
    term2, _ = _run(site, params, inp2)
    np.testing.assert_array_equal(term1[:, :, :-1], term2[:, :, :-1])


# ----------------------------------------------------------------------------------------------
# The paper's identity: all gates 1 is relative PE with embeddings e[i - j + 1]
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p_max", [T + 1, 3])
def test_unit_gates_equal_relative_pe_with_e_at_i_minus_j_plus_1(p_max: int) -> None:
    inp = _inputs(seed=5, segments=False)
    site, params = _site_setup("cope", {"force_unit_gates": True, "p_max": p_max}, inp)
    term, _ = _run(site, params, inp)
    e = np.asarray(params["params"]["pos_emb"], np.float64)
    q = inp["q"].astype(np.float64)
    for b in range(B):
        for n in range(N):
            for i in range(T):
                for j in range(i + 1):
                    rel = min(i - j + 1, p_max - 1)  # eq. (1) with the p_max cap
                    want = q[b, i, n] @ e[rel]
                    np.testing.assert_allclose(term[b, n, i, j], want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Numerics: extreme logits, float32 positions in bfloat16
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"gates": "sep_keys"},
        {"gates": "values"},
        {"position_term": "alibi"},
        {"position_term": "mlp", "mlp_hidden": 4},
        {"p_max": 3, "scale_position_term": True},
    ],
    ids=str,
)
def test_finite_values_and_gradients_at_logits_of_1e4(opts: dict[str, Any]) -> None:
    inp = _inputs(scale=1.0, seed=6)
    rng = np.random.default_rng(11)
    # Logits of both signs beyond 1e4 in the same rows: gates saturate at 0 and at 1.
    inp["q"] = np.abs(inp["q"]) * 60.0
    inp["k"] = rng.choice([-1.0, 1.0], size=(B, T, N, 1)).astype(np.float32) * np.abs(inp["k"]) * 60
    inp["v"] = np.sign(inp["k"]) * np.abs(inp["v"]) * 60.0
    inp["x"] = inp["x"] * 1e3
    site, params = _site_setup("cope", opts, inp)
    ctx = _ctx(inp)

    def loss(params: Any, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) / math.sqrt(H)
        bias = site.apply(params, q, k, v, logits, ctx, method=site.bias)
        weights = masked_softmax_BNTS(logits + bias, ctx.mask_BTS)
        return jnp.sum(weights * jnp.arange(T)) + jnp.sum(jnp.where(ctx.mask_BTS[:, None], bias, 0))

    q, k, v = (jnp.asarray(inp[key]) for key in ("q", "k", "v"))
    logits = np.einsum("btnh,bsnh->bnts", inp["q"], inp["k"]) / math.sqrt(H)
    allowed = np.broadcast_to(inp["mask"][:, None], logits.shape)
    assert logits[allowed].max() > 1e4 and logits[allowed].min() < -1e4  # really extreme
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(params, q, k, v)
    assert np.isfinite(float(value))
    for leaf in jax.tree_util.tree_leaves(grads):
        assert np.all(np.isfinite(np.asarray(leaf)))


def test_positions_accumulate_in_float32_from_bfloat16_gates() -> None:
    length = 300  # bfloat16 cannot represent 257: a bfloat16 sum would be off
    gates = jnp.ones((1, 1, 1, length), jnp.bfloat16)
    positions = cope_positions(gates, p_max=length + 1)
    assert positions.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(positions)[0, 0, 0], np.arange(length, 0, -1))


def _model_intermediates(position: str, **overrides: object) -> tuple[Any, dict, jax.Array]:
    model = Transformer(tiny_config(position, **overrides))
    tokens_BT, positions_BT = tokens_and_positions()
    params = model.init(jax.random.key(0), tokens_BT, positions_BT)
    logits, state = model.apply(params, tokens_BT, positions_BT, mutable=["intermediates"])
    plain = model.apply(params, tokens_BT, positions_BT)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(plain))  # sow changes nothing
    inter = {
        "/".join(str(getattr(p, "key", p)) for p in path): leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(state.get("intermediates", {}))
    }
    return params, inter, logits


def test_bfloat16_model_keeps_gates_and_positions_in_float32() -> None:
    opts = {"force_unit_gates": True, "p_max": 32}
    _, inter, logits = _model_intermediates("cope", dtype="bfloat16", position_options=opts)
    assert logits.dtype == jnp.float32
    positions = [v for key, v in inter.items() if "positions_BNTS" in key]
    assert len(positions) == 2  # one per layer
    causal = np.tril(np.ones((8, 8)))
    rel = (np.arange(8)[:, None] - np.arange(8)[None, :] + 1) * causal
    for pos in positions:
        assert pos.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(pos), np.broadcast_to(rel, pos.shape))


def test_sowed_intermediates_have_shapes_and_ranges() -> None:
    _, inter, _ = _model_intermediates("cope", position_options={"p_max": 4})
    causal = np.tril(np.ones((8, 8), bool))
    for name in ("gates_BNTS", "positions_BNTS", "position_attention_BNTS"):
        found = [np.asarray(v) for key, v in inter.items() if name in key]
        assert len(found) == 2, name
        for value in found:
            assert value.shape == (2, 2, 8, 8) and value.dtype == np.float32
    for gates in (np.asarray(v) for key, v in inter.items() if "gates_BNTS" in key):
        assert np.all((gates >= 0) & (gates <= 1))
        assert np.all(gates[..., ~causal] == 0)
    for pos in (np.asarray(v) for key, v in inter.items() if "positions_BNTS" in key):
        assert np.all((pos >= 0) & (pos <= 3))
    for att in (np.asarray(v) for key, v in inter.items() if "position_attention" in key):
        np.testing.assert_allclose(att.sum(-1), 1.0, rtol=1e-5)
        assert np.all(att[..., ~causal] == 0)


# ----------------------------------------------------------------------------------------------
# Parameters: per layer vs shared across layers (Table 8), p_max = T
# ----------------------------------------------------------------------------------------------


def _count(params: Any, name: str) -> int:
    return sum(
        int(np.prod(leaf.shape))
        for path, leaf in jax.tree_util.tree_leaves_with_path(nn.unbox(params))
        if name in "/".join(str(getattr(p, "key", p)) for p in path)
    )


@pytest.mark.parametrize(
    ("opts", "name", "per_layer"),
    [
        ({}, "pos_emb", 64 * 16),
        ({"p_max": None}, "pos_emb", 16 * 16),  # p_max = T = max_len = 16
        ({"per_head_embeddings": True, "p_max": 16}, "pos_emb", 2 * 16 * 16),
        ({"position_term": "alibi"}, "alibi_slopes", 2),
        ({"position_term": "mlp"}, "mlp_w", 64 + 64 * 16),
        ({"gates": "sep_keys"}, "gate_key", 32 * 2 * 16),
    ],
)
def test_parameter_counts_per_layer_and_shared(
    opts: dict[str, Any], name: str, per_layer: int
) -> None:
    tokens_BT, positions_BT = tokens_and_positions()
    counts = []
    for share in (False, True):
        model = Transformer(tiny_config("cope", position_options=dict(opts, share_layers=share)))
        params = model.init(jax.random.key(0), tokens_BT, positions_BT)
        counts.append(_count(params, name))
        assert model.cfg.scheme.share_across_layers is share
    assert counts == [2 * per_layer, per_layer]  # tiny_config has 2 layers


def test_shared_embeddings_are_one_table_used_by_every_layer() -> None:
    opts = {"share_layers": True, "p_max": 8}
    params, inter, _ = _model_intermediates("cope", position_options=opts)
    assert _count(params, "pos_emb") == 8 * 16
    assert len([k for k in inter if "gates_BNTS" in k]) == 2  # still applied in both layers


def test_fixed_alibi_slopes_have_no_parameters() -> None:
    tokens_BT, positions_BT = tokens_and_positions()
    opts = {"position_term": "alibi", "alibi_slopes": "press"}
    model = Transformer(tiny_config("cope", position_options=opts))
    params = model.init(jax.random.key(0), tokens_BT, positions_BT)
    assert _count(params, "alibi") == 0 and _count(params, "pos_emb") == 0


# ----------------------------------------------------------------------------------------------
# Combinations (Table 5)
# ----------------------------------------------------------------------------------------------


def _rope_half(x: np.ndarray, base: float = 10000.0) -> np.ndarray:
    """RoFormer rotation, rotate-half layout, positions 0..T-1, float64."""
    half = x.shape[-1] // 2
    freq = base ** (-np.arange(0, x.shape[-1], 2) / x.shape[-1])
    angle = np.arange(x.shape[1])[:, None] * freq  # (T, half)
    cos, sin = np.cos(angle)[None, :, None], np.sin(angle)[None, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def test_cope_plus_rope_gates_use_the_rotated_logits() -> None:
    inp = _inputs(seed=8)
    opts = {"p_max": 4}
    site, params = _site_setup("cope+rope", opts, inp)
    term, inter = _run(site, params, inp)
    q_rot, k_rot = (_rope_half(inp[key].astype(np.float64)) for key in ("q", "k"))
    cope_params = _np_params(params)
    (cope_params,) = cope_params.values()  # the composite's one parametrised part
    want, gates, _ = reference_cope(dict(inp, q=q_rot, k=k_rot), cope_params, opts, 4)
    allowed = np.broadcast_to(inp["mask"][:, None], term.shape)
    np.testing.assert_allclose(_find(inter, "gates_BNTS"), gates, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(term[allowed], want[allowed], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gates", ["keys", "sep_keys", "values"])
def test_cope_plus_rope_gates_and_absolute_positions(gates: str) -> None:
    """As CoPE's ``gates`` docstring states: in cope+rope, "keys" gates depend on i - j only;
    "sep_keys" and "values" gates (rotated q_i against unrotated k'_j or v_j) change when every
    position shifts by the same amount, and so does the position term q_i . e[p] (rotated q)."""
    inp = _inputs(seed=10, segments=False)
    site, params = _site_setup("cope+rope", {"gates": gates}, inp)
    args = (jnp.asarray(inp["q"]), jnp.asarray(inp["k"]), jnp.asarray(inp["v"]))

    def run(shift: int) -> tuple[np.ndarray, np.ndarray]:
        positions = jnp.broadcast_to(jnp.arange(T) + shift, (B, T))
        ctx = _ctx(inp).replace(q_positions_BT=positions, k_positions_BS=positions)
        term, state = site.apply(
            params, *args, ctx, method=_qk_then_bias, mutable=["intermediates"]
        )
        inter = {
            "/".join(str(getattr(p, "key", p)) for p in path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(state["intermediates"])
        }
        return np.asarray(term), _find(inter, "gates_BNTS")

    term0, gates0 = run(0)
    term7, gates7 = run(7)
    if gates == "keys":
        np.testing.assert_allclose(gates7, gates0, atol=1e-5)
    else:
        assert np.abs(gates7 - gates0).max() > 1e-2
    assert np.abs(term7 - term0).max() > 1e-3  # the position term reads the rotated q


def test_cope_plus_relative_sums_both_biases() -> None:
    assert "relative" in registry.names(), "relative (cope+relative, Table 5) is not registered"
    inp = _inputs(seed=9)
    combo, combo_params = _site_setup("cope+relative", {"p_max": 5}, inp)
    term, _ = _run(combo, combo_params, inp)
    parts = combo_params["params"]
    cope_part = next(v for v in parts.values() if "pos_emb" in v)
    relative_part = next(v for v in parts.values() if "pos_emb" not in v)
    cope_site, _ = _site_setup("cope", {"p_max": 5}, inp)
    relative_site, _ = _site_setup("relative", {}, inp)
    cope_term, _ = _run(cope_site, {"params": cope_part}, inp)
    relative_term, _ = _run(relative_site, {"params": relative_part}, inp)
    allowed = np.broadcast_to(inp["mask"][:, None], term.shape)
    np.testing.assert_allclose(
        term[allowed], (cope_term + relative_term)[allowed], rtol=1e-5, atol=1e-5
    )


def test_learned_alibi_slope_is_eq10_as_written_and_fixed_slopes_are_penalties() -> None:
    """Eq. 10 adds +m p_ij: a learned m enters with its own sign. Fixed slopes are read as
    ALiBi penalty magnitudes (m = -slope): more gated tokens lower the logit."""
    inp = _inputs(seed=11)
    site, params = _site_setup("cope", {"position_term": "alibi"}, inp)
    m = jnp.asarray([0.5, -0.25])
    params = {"params": {**params["params"], "alibi_slopes": m}}
    term, inter = _run(site, params, inp)
    positions = _find(inter, "positions_BNTS")
    allowed = np.broadcast_to(inp["mask"][:, None], term.shape)
    want = np.asarray(m)[None, :, None, None] * positions
    np.testing.assert_allclose(term[allowed], want[allowed], rtol=1e-6, atol=1e-6)
    fixed, fixed_params = _site_setup(
        "cope", {"position_term": "alibi", "alibi_slopes": (1, 2)}, inp
    )
    term, inter = _run(fixed, fixed_params, inp)
    want = -np.asarray([1.0, 2.0])[None, :, None, None] * _find(inter, "positions_BNTS")
    np.testing.assert_allclose(term[allowed], want[allowed], rtol=1e-6, atol=1e-6)
    assert np.all(term[allowed] <= 0)


def test_option_names_do_not_clash_with_rope() -> None:
    cope_options = set(registry.option_names(CoPE))
    assert not cope_options & set(registry.option_names(registry.get("rope")))
    scheme = registry.make_scheme(
        "cope+rope", {"p_max": 16, "gates": "values", "base": 500.0, "share_layers": True}
    )
    assert scheme.parts[0].p_max == 16 and scheme.parts[0].share_layers
    assert scheme.parts[1].base == 500.0


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("opts", "message"),
    [
        ({"p_max": 0}, "p_max"),
        ({"p_max": -3}, "p_max"),
        ({"p_max": 2.5}, "p_max"),
        ({"gates": "queries"}, "gates"),
        ({"position_term": "sine"}, "position_term"),
        ({"mlp_hidden": 0}, "mlp_hidden"),
        ({"alibi_slopes": (1.0,)}, "alibi_slopes"),
        ({"alibi_slopes": (1.0, -0.5)}, "alibi_slopes"),
        ({"alibi_slopes": "geometric"}, "alibi_slopes"),
        ({"scan_impl": "loop"}, "scan_impl"),
    ],
)
def test_bad_options_raise_value_error_naming_them(opts: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        registry.make_scheme("cope", opts).validate(DIMS)


@pytest.mark.parametrize(
    "opts",
    [
        {"gates": "sep_keys", "position_term": "mlp", "mlp_hidden": 4, "p_max": 3},
        {"gates": "values", "position_term": "alibi", "share_layers": True},
        {"per_head_embeddings": True, "p_max": 4, "scale_position_term": True},
    ],
    ids=str,
)
def test_variants_in_the_model_are_causal_with_random_parameters(opts: dict[str, Any]) -> None:
    model = Transformer(tiny_config("cope", position_options=opts))
    tokens_BT, positions_BT = tokens_and_positions(batch=1)
    params = _randomise(model.init(jax.random.key(0), tokens_BT, positions_BT), seed=3, scale=0.3)
    emb = model.apply(params, tokens_BT, positions_BT, True, method=Transformer.embed)

    def output_at(x_BTD: jax.Array, t: int) -> jax.Array:
        logits_BTV = model.apply(
            params, emb.replace(x_BTD=x_BTD), method=Transformer.forward_embedded
        )
        return logits_BTV[0, t].sum()

    grad_fn = jax.jit(jax.grad(output_at), static_argnums=1)
    for t in (3,):
        grad_BTD = np.asarray(grad_fn(emb.x_BTD, t))
        assert np.all(grad_BTD[0, t + 1 :] == 0.0)
        assert np.all(np.isfinite(grad_BTD)) and np.any(grad_BTD[0, : t + 1] != 0.0)
