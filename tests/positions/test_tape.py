"""TAPE (arXiv 2501.00712) against NumPy loops written from eq. 6, 7, 8 in the paper's notation
(the choices they leave open named above the references), and its identities:
RoPE at initialisation, O(R) invariance / equivariance (eq. 4, 5), permutation equivariance,
the Table 6 ablations and the section 3.3 retrofit."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

from copejax.model.transformer import Block, Transformer
from copejax.positions.base import AttentionContext, Dims
from copejax.positions.rope import apply_rope, rope_inv_freq
from copejax.positions.tape import PAPER_OPTIONS, Tape, TapeCarry
from copejax.positions.tape_core import rope_tape_embeddings, tape_mix, tape_qk, tape_update
from copejax.training.tape_retrofit import (
    retrofit_rope_params,
    tape_config_from_rope,
    tape_param_mask,
)
from tests.conftest import tiny_config, tokens_and_positions

DIMS = Dims(d_model=8, num_heads=2, head_dim=4, num_layers=1, max_len=8)


# ----------------------------------------------------------------------------- the paper
# The references below are eq. 6, 7 and 8 as the paper writes them, in its notation (C = M B
# channels of a token cut into M blocks, each with a position matrix e_{i,m}). What the
# equations leave open, and the reading copejax takes (each reference follows it, named):
# - Orientation of e. The text calls e_{i,m} an L x D matrix and eq. 8 applies W1 (B' x L)
#   on its left, which needs L rows; eq. 6's Gram e_{j,m}^T e_{i,m} is L x L only for a D x L
#   matrix. We keep L x D (text, eq. 8) and read eq. 6's Gram as e_{i,m} e_{j,m}^T.
# - Query and key. Eq. 6 writes (W_Q x_{j,m})^T phi(.) (W_K x_{i,m}); we read query i, key j.
# - phi. "In practice, we can let L = B and phi be an identity mapping": B = L here.
# - Heads. Eq. 6 sums all M blocks into one logit (one head). With N heads, head h's logit
#   sums the blocks cut from its own H channels (K = H / L of them, M = N K).
# - Which channels form a block. "Dividing the channel dimension into M segments" reads as
#   contiguous segments: copejax's layout="interleaved". layout="half" (RoPE's rotate-half
#   pairing, the default) puts features k, k + H / L, ... of a head in block k instead.
# - Eq. 7's attention map. Eq. 7 normalises exp(alpha_{i,j,m}) per block; "in practice, we
#   share the attention map between Eq. 6 and 7": each block is mixed with its head's map
#   (softmax over the allowed keys of the head's logits), the one attention uses.
# - Eq. 8's x~_{j,m}: "the output of attention used for token mixing", block m of it. copejax
#   reads the attention output after the output projection (the carry site's input), cut by
#   the same block layout; psi is a two-layer MLP (GELU, tanh form) R^B -> R^B'. The residual
#   e + e^ ("we also introduce residual connections") is added.


def _paper_blocks(heads: int, head_dim: int, size: int, layout: str) -> list[tuple[int, list]]:
    """(head, channels of the C = N H vector) of each block m = 0..M-1, from the layout."""
    per_head = head_dim // size
    blocks = []
    for m in range(heads * per_head):
        head, k = divmod(m, per_head)
        if layout == "interleaved":  # the paper's contiguous segments of the channels
            channels = list(range(m * size, (m + 1) * size))
        else:  # rotate-half: features k, k + H / L, ... of the head
            channels = [head * head_dim + k + row * per_head for row in range(size)]
        blocks.append((head, channels))
    return blocks


def paper_eq6_logits(q_TC: np.ndarray, k_TC: np.ndarray, e_TMLD: np.ndarray, blocks) -> np.ndarray:
    """alpha_{i,j} per head: the sum over its blocks m of q_{i,m}^T e_{i,m} e_{j,m}^T k_{j,m}."""
    length = q_TC.shape[0]
    heads = 1 + max(head for head, _ in blocks)
    alpha = np.zeros((heads, length, length))
    for i in range(length):
        for j in range(length):
            for m, (head, channels) in enumerate(blocks):
                gram = e_TMLD[i, m] @ e_TMLD[j, m].T  # phi = identity, L x L
                alpha[head, i, j] += q_TC[i, channels] @ gram @ k_TC[j, channels]
    return alpha


def paper_eq7(e_TMLD: np.ndarray, weights_NTS: np.ndarray, blocks) -> np.ndarray:
    """e~_{j,m} = sum_i w_{j,i} e_{i,m}, w the map of block m's head (shared with eq. 6)."""
    mixed = np.zeros(e_TMLD.shape)
    for j in range(e_TMLD.shape[0]):
        for m, (head, _) in enumerate(blocks):
            for i in range(e_TMLD.shape[0]):
                mixed[j, m] += weights_NTS[head, j, i] * e_TMLD[i, m]
    return mixed


def paper_eq8(e_tilde_LD: np.ndarray, psi_F: np.ndarray, w1_FL: np.ndarray, w2_LF: np.ndarray):
    """e^_{j,m} = W2 diag(psi(x~_{j,m})) W1 e~_{j,m}, W1 in R^{B' x L}, W2 in R^{L x B'}."""
    return w2_LF @ np.diag(psi_F) @ w1_FL @ e_tilde_LD


def _flat(params: dict) -> dict:
    return traverse_util.flatten_dict(nn.meta.unbox(params), sep="/")


def _unflat(flat: dict) -> dict:
    return traverse_util.unflatten_dict(flat, sep="/")


def _gelu(x: np.ndarray) -> np.ndarray:  # flax's default (tanh) GELU
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


# ----------------------------------------------------------------------------- eq. 6


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_tensorial_logits_match_eq6_loops(rng: np.random.Generator, layout: str) -> None:
    b, t, n, h, size, coords = 2, 4, 2, 6, 2, 3
    q = rng.normal(size=(b, t, n, h)).astype(np.float32)
    k = rng.normal(size=(b, t, n, h)).astype(np.float32)
    e = rng.normal(size=(b, t, n * h // size, size, coords)).astype(np.float32)
    q2 = np.asarray(tape_qk(jnp.asarray(q), jnp.asarray(e), layout, True))
    k2 = np.asarray(tape_qk(jnp.asarray(k), jnp.asarray(e), layout, True))
    got = np.einsum("btnh,bsnh->bnts", q2, k2)
    blocks = _paper_blocks(n, h, size, layout)
    for bb in range(b):
        want = paper_eq6_logits(
            q[bb].reshape(t, n * h).astype(np.float64), k[bb].reshape(t, n * h), e[bb], blocks
        )
        np.testing.assert_allclose(got[bb], want, rtol=1e-5, atol=1e-5)


def test_vector_logits_match_phi_scalar_times_identity(rng: np.random.Generator) -> None:
    b, t, n, h, size, coords = 1, 4, 2, 4, 2, 4
    q = rng.normal(size=(b, t, n, h)).astype(np.float32)
    k = rng.normal(size=(b, t, n, h)).astype(np.float32)
    e = rng.normal(size=(b, t, n * h // size, 1, coords)).astype(np.float32)
    q2 = np.asarray(tape_qk(jnp.asarray(q), jnp.asarray(e), "half", False))
    k2 = np.asarray(tape_qk(jnp.asarray(k), jnp.asarray(e), "half", False))
    got = np.einsum("btnh,bsnh->bnts", q2, k2)
    # Table 6's vector ablation: phi(s) = s I, so block m adds (q_{i,m} . k_{j,m})(e_i . e_j).
    q_flat, k_flat = q[0].reshape(t, n * h), k[0].reshape(t, n * h)
    want = np.zeros((b, n, t, t))
    for i in range(t):
        for j in range(t):
            for m, (hd, channels) in enumerate(_paper_blocks(n, h, size, "half")):
                content = q_flat[i, channels] @ k_flat[j, channels]
                want[0, hd, i, j] += content * (e[0, i, m, 0] @ e[0, j, m, 0])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_initialisation_rotates_like_rope(rng: np.random.Generator, layout: str) -> None:
    b, t, n, h = 2, 5, 2, 8
    x = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32)
    positions = jnp.asarray(rng.integers(0, 50, (b, t)), jnp.int32)
    e = rope_tape_embeddings(positions, n, h, 10000.0)
    want = apply_rope(x, positions, rope_inv_freq(h, 10000.0), layout)
    np.testing.assert_allclose(np.asarray(tape_qk(x, e, layout, True)), want, atol=1e-6)


def test_vector_rope_initialisation_gives_cosine_of_distance(rng: np.random.Generator) -> None:
    positions = jnp.asarray([[0, 3, 7, 20]], jnp.int32)
    e = np.asarray(rope_tape_embeddings(positions, 1, 4, 100.0, tensorial=False))
    theta = 100.0 ** (-np.arange(0, 4, 2) / 4)
    for i in range(4):
        for j in range(4):
            for m in range(2):
                dist = int(positions[0, i] - positions[0, j])
                want = math.cos(theta[m] * dist)
                assert abs(e[0, i, m, 0] @ e[0, j, m, 0] - want) < 1e-5


# ----------------------------------------------------------------------------- eq. 7, 8


def test_mixing_matches_eq7_loops(rng: np.random.Generator) -> None:
    b, t, n, h, size, coords = 2, 5, 2, 6, 2, 4
    q = rng.normal(size=(b, t, n * h))
    k = rng.normal(size=(b, t, n * h))
    e = rng.normal(size=(b, t, n * h // size, size, coords)).astype(np.float32)
    blocks = _paper_blocks(n, h, size, "half")
    causal = np.tril(np.ones((t, t), bool))
    weights = np.zeros((b, n, t, t), np.float32)
    for bb in range(b):  # the shared map: softmax over allowed keys of the head's eq. 6 logits
        alpha = np.where(causal, paper_eq6_logits(q[bb], k[bb], e[bb], blocks), -np.inf)
        w = np.exp(alpha - alpha.max(-1, keepdims=True))
        weights[bb] = w / w.sum(-1, keepdims=True)
    got = np.asarray(tape_mix(jnp.asarray(e), jnp.asarray(weights)))
    for bb in range(b):
        want = paper_eq7(e[bb].astype(np.float64), weights[bb], blocks)
        np.testing.assert_allclose(got[bb], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("equivariant", [True, False])
def test_update_matches_eq8_loops(rng: np.random.Generator, equivariant: bool) -> None:
    b, t, blocks, size, coords, hidden = 2, 3, 4, 2, 3, 5
    e = rng.normal(size=(b, t, blocks, size, coords)).astype(np.float32)
    gates = rng.normal(size=(b, t, blocks, hidden)).astype(np.float32)
    width = size if equivariant else size * coords
    w1 = rng.normal(size=(hidden, width)).astype(np.float32)
    w2 = rng.normal(size=(width, hidden)).astype(np.float32)
    got = np.asarray(tape_update(*map(jnp.asarray, (e, gates, w1, w2)), equivariant))
    want = np.zeros_like(e, dtype=np.float64)
    for bb in range(b):
        for j in range(t):
            for m in range(blocks):
                if equivariant:
                    want[bb, j, m] = paper_eq8(e[bb, j, m], gates[bb, j, m], w1, w2)
                else:  # Table 6: W1 in R^{B' x (L D)} acts on the flattened matrix
                    flat = paper_eq8(e[bb, j, m].reshape(-1), gates[bb, j, m], w1, w2)
                    want[bb, j, m] = flat.reshape(size, coords)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _site_and_params(scheme: Tape, carry: TapeCarry, attn_out: jax.Array, seed: int = 0):
    site = scheme.attention_module(DIMS)
    params = nn.meta.unbox(
        site.init(jax.random.key(seed), carry, attn_out, attn_out, method=site.carry_after_mlp)
    )
    # Random W2 so that the update is not identically zero.
    w2 = params["params"]["w2"]
    params["params"]["w2"] = jax.random.normal(jax.random.key(seed + 1), w2.shape)
    return site, params


def _random_carry(rng: np.random.Generator, scheme: Tape, t: int = 4) -> TapeCarry:
    m = DIMS.num_heads * DIMS.head_dim // scheme.block
    e = jnp.asarray(rng.normal(size=(2, t, m, scheme.rows, scheme.cols)), jnp.float32)
    mixed = jnp.asarray(rng.normal(size=e.shape), jnp.float32)
    return TapeCarry(e_BTMLR=e, mixed_BTMLR=mixed)


def test_site_update_matches_eq8_with_psi_on_attention_output_blocks(
    rng: np.random.Generator,
) -> None:
    scheme = Tape(init="random", coords=3, hidden=6)
    carry = _random_carry(rng, scheme)
    attn_out = jnp.asarray(rng.normal(size=(2, 4, DIMS.d_model)), jnp.float32)
    site, params = _site_and_params(scheme, carry, attn_out)
    got = np.asarray(
        site.apply(params, carry, attn_out, attn_out, method=site.carry_after_mlp).e_BTMLR
    )
    p = {k: np.asarray(v) for k, v in _flat(params["params"]).items()}
    e, mixed, x = map(np.asarray, (carry.e_BTMLR, carry.mixed_BTMLR, attn_out))
    blocks = _paper_blocks(DIMS.num_heads, DIMS.head_dim, scheme.block, "half")
    want = e.astype(np.float64).copy()  # the residual e + e^
    for bb in range(2):
        for j in range(4):
            for m, (_, channels) in enumerate(blocks):
                x_tilde = x[bb, j, channels]  # block m of the attention output (after W_O)
                hid = _gelu(x_tilde @ p["psi_in/kernel"] + p["psi_in/bias"])
                psi = hid @ p["psi_out/kernel"] + p["psi_out/bias"]
                want[bb, j, m] += paper_eq8(mixed[bb, j, m], psi, p["w1"], p["w2"])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_site_update_with_psi_on_heads_shares_the_gates_of_a_head(
    rng: np.random.Generator,
) -> None:
    """psi_input="head" (the appendix's B = 64 -> B' = 48): psi reads head h's H features of
    the attention output, and its gates enter eq. 8 for every block of that head."""
    scheme = Tape(init="random", coords=3, hidden=6, psi_input="head")
    carry = _random_carry(rng, scheme)
    attn_out = jnp.asarray(rng.normal(size=(2, 4, DIMS.d_model)), jnp.float32)
    site, params = _site_and_params(scheme, carry, attn_out)
    got = np.asarray(
        site.apply(params, carry, attn_out, attn_out, method=site.carry_after_mlp).e_BTMLR
    )
    p = {k: np.asarray(v) for k, v in _flat(params["params"]).items()}
    assert p["psi_in/kernel"].shape == (DIMS.head_dim, 6)
    e, mixed, x = map(np.asarray, (carry.e_BTMLR, carry.mixed_BTMLR, attn_out))
    per_head = DIMS.head_dim // scheme.block
    want = e.astype(np.float64).copy()
    for bb in range(2):
        for j in range(4):
            for hd in range(DIMS.num_heads):
                x_head = x[bb, j, hd * DIMS.head_dim : (hd + 1) * DIMS.head_dim]
                psi = _gelu(x_head @ p["psi_in/kernel"] + p["psi_in/bias"])
                psi = psi @ p["psi_out/kernel"] + p["psi_out/bias"]
                for kk in range(per_head):
                    m = hd * per_head + kk
                    want[bb, j, m] += paper_eq8(mixed[bb, j, m], psi, p["w1"], p["w2"])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_paper_options_keep_the_rope_identity_at_init() -> None:
    tokens, positions = tokens_and_positions()
    rope = Transformer(tiny_config("rope"))
    tape = Transformer(tiny_config("tape", position_options=PAPER_OPTIONS))
    rope_params = rope.init(jax.random.key(0), tokens, positions)
    tape_params = _copy_shared(rope_params, tape.init(jax.random.key(1), tokens, positions))
    np.testing.assert_allclose(
        np.asarray(tape.apply(tape_params, tokens, positions)),
        np.asarray(rope.apply(rope_params, tokens, positions)),
        rtol=1e-5,
        atol=1e-5,
    )


# ----------------------------------------------------------------------------- ablations


def test_contextualize_switches_pick_the_update_sources(rng: np.random.Generator) -> None:
    attn_out = jnp.asarray(rng.normal(size=(2, 4, DIMS.d_model)), jnp.float32)
    other_out = jnp.asarray(rng.normal(size=attn_out.shape), jnp.float32)
    weights = jax.nn.softmax(jnp.asarray(rng.normal(size=(2, 2, 4, 4)), jnp.float32), -1)
    ctx = AttentionContext(attn_out, None, None)
    results = {}
    for mode in ("both", "attention", "mlp"):
        scheme = Tape(contextualize=mode)
        carry = TapeCarry(_random_carry(rng, scheme).e_BTMLR)
        site, params = _site_and_params(scheme, _random_carry(rng, scheme), attn_out)
        mixed = tape_mix(carry.e_BTMLR, weights)  # eq. 7, as the attention mixes values
        mixed_BTNC = mixed.reshape(*mixed.shape[:2], DIMS.num_heads, -1)
        after = site.apply(params, carry, mixed_BTNC, ctx, method=site.carry_after_attention)
        out = [
            site.apply(params, after, a, a, method=site.carry_after_mlp).e_BTMLR
            for a in (attn_out, other_out)
        ]
        results[mode] = (carry, after, out, params)
    carry, after, (out, out_other), params = results["attention"]
    assert "psi_in" not in params["params"]  # no psi: token features do not enter
    np.testing.assert_array_equal(out, out_other)
    w = params["params"]
    want = carry.e_BTMLR + tape_update(tape_mix(carry.e_BTMLR, weights), None, w["w1"], w["w2"])
    np.testing.assert_allclose(out, want, atol=1e-6)
    carry, after, (out, out_other), params = results["mlp"]
    assert after.mixed_BTMLR is None  # no attention mixing
    assert not np.allclose(out, out_other)
    assert not np.allclose(out, carry.e_BTMLR)
    carry, after, (out, out_other), params = results["both"]
    np.testing.assert_allclose(after.mixed_BTMLR, tape_mix(carry.e_BTMLR, weights), atol=1e-6)
    assert not np.allclose(out, out_other)


# ----------------------------------------------------------------------------- identities


def _copy_shared(src: dict, dst: dict) -> dict:
    flat_src, flat_dst = _flat(src), _flat(dst)
    for key, value in flat_src.items():
        assert flat_dst[key].shape == value.shape, key
        flat_dst[key] = value
    return _unflat(flat_dst)


@pytest.mark.parametrize(
    ("layout", "block"),
    [
        ("half", "llama"),
        # The layouts are also compared at the qk site above; these add whole-model coverage.
        pytest.param("interleaved", "llama", marks=pytest.mark.slow),
        pytest.param("half", "gpt2", marks=pytest.mark.slow),
    ],
)
def test_tape_at_init_equals_rope_model(layout: str, block: str) -> None:
    tokens, _ = tokens_and_positions()
    positions = jnp.asarray(np.random.default_rng(3).integers(0, 40, tokens.shape), jnp.int32)
    rope = Transformer(tiny_config("rope", block=block, position_options={"layout": layout}))
    tape = Transformer(tiny_config("tape", block=block, position_options={"layout": layout}))
    rope_params = rope.init(jax.random.key(0), tokens, positions)
    tape_params = _copy_shared(rope_params, tape.init(jax.random.key(1), tokens, positions))
    want = np.asarray(jax.jit(rope.apply)(rope_params, tokens, positions))
    got = np.asarray(jax.jit(tape.apply)(tape_params, tokens, positions))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # The identity is W2 = 0's doing: a non-zero W2 (and psi gates away from psi(0) = 0, as
    # the tiny initial attention outputs give) moves the positions and the logits.
    flat = _flat(tape_params)
    for key in [k for k in flat if k.endswith(("tape/w2", "psi_out/bias"))]:
        flat[key] = jax.random.normal(jax.random.key(2), flat[key].shape)
    moved = np.asarray(jax.jit(tape.apply)(_unflat(flat), tokens, positions))
    assert np.abs(moved - want).max() > 1e-3


def _random_orthogonal(rng: np.random.Generator, size: int) -> np.ndarray:
    q, r = np.linalg.qr(rng.normal(size=(size, size)))
    return (q * np.sign(np.diag(r))).astype(np.float32)


def _block_setup(rng: np.random.Generator, **options: object):
    cfg = tiny_config("tape", position_options=dict(init="random", coords=4, **options))
    scheme = cfg.scheme
    b, t = 2, 6
    x = jnp.asarray(rng.normal(size=(b, t, cfg.d_model)), jnp.float32)
    m = scheme.num_blocks(cfg.dims)
    e = jnp.asarray(rng.normal(size=(b, t, m, scheme.rows, scheme.cols)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    ctx = AttentionContext.create(
        x, positions, carry=TapeCarry(e), explicit_mask_BTS=jnp.ones((b, t, t), bool)
    )
    block = Block(cfg)
    params = nn.meta.unbox(block.init(jax.random.key(0), x, ctx))
    site = params["params"]["attention"]["tape"]
    # Non-zero W2 and psi gates of order one, so that the position update is not ~0.
    site["w2"] = jax.random.normal(jax.random.key(1), site["w2"].shape)
    site["psi_out"]["bias"] = jax.random.normal(jax.random.key(2), site["psi_out"]["bias"].shape)
    return block, params, x, e, ctx


@pytest.mark.parametrize("causal", [True, False])
def test_block_is_orthogonally_invariant_and_equivariant(
    rng: np.random.Generator, causal: bool
) -> None:
    block, params, x, e, ctx = _block_setup(rng)
    if causal:
        ctx = ctx.replace(
            explicit_mask_BTS=jnp.broadcast_to(jnp.tril(jnp.ones((6, 6), bool)), (2, 6, 6))
        )
    rot = jnp.asarray(_random_orthogonal(rng, 4))
    x_out, carry = block.apply(params, x, ctx)
    x_rot, carry_rot = block.apply(params, x, ctx.replace(carry=TapeCarry(e @ rot)))
    np.testing.assert_allclose(x_rot, x_out, rtol=1e-5, atol=1e-5)  # eq. 4
    np.testing.assert_allclose(carry_rot.e_BTMLR, carry.e_BTMLR @ rot, atol=1e-4)  # eq. 5
    assert np.abs(carry.e_BTMLR - e).max() > 1e-2  # the update is not trivially zero


def test_without_rotation_equivariance_the_update_is_not_equivariant(
    rng: np.random.Generator,
) -> None:
    block, params, x, e, ctx = _block_setup(rng, equivariant=False)
    rot = jnp.asarray(_random_orthogonal(rng, 4))
    x_out, carry = block.apply(params, x, ctx)
    x_rot, carry_rot = block.apply(params, x, ctx.replace(carry=TapeCarry(e @ rot)))
    np.testing.assert_allclose(x_rot, x_out, rtol=1e-5, atol=1e-5)  # logits still invariant
    assert np.abs(carry_rot.e_BTMLR - carry.e_BTMLR @ rot).max() > 1e-2


def test_block_is_permutation_equivariant_without_causal_mask(rng: np.random.Generator) -> None:
    block, params, x, e, ctx = _block_setup(rng)
    perm = rng.permutation(x.shape[1])
    x_out, carry = block.apply(params, x, ctx)
    ctx_p = ctx.replace(x_BTD=x[:, perm], carry=TapeCarry(e[:, perm]))
    x_p, carry_p = block.apply(params, x[:, perm], ctx_p)
    np.testing.assert_allclose(x_p, x_out[:, perm], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(carry_p.e_BTMLR, carry.e_BTMLR[:, perm], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"block": 3}, "not divisible by block=3"),
        ({"init": "rope", "coords": 4}, "init='rope' needs block=2 and coords=2"),
        ({"init": "sinusoid"}, "init must be one of"),
        ({"contextualize": "neither"}, "contextualize must be one of"),
        ({"hidden": 0}, "hidden must be a positive integer"),
        ({"psi_input": "token"}, "psi_input must be one of"),
    ],
)
def test_bad_options_raise(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny_config("tape", position_options=options)


def test_psi_needs_heads_to_tile_the_model_width() -> None:
    with pytest.raises(ValueError, match="must equal num_heads"):
        tiny_config("tape", head_dim=8)
    tiny_config("tape", head_dim=8, position_options={"contextualize": "attention"})


# ----------------------------------------------------------------------------- retrofit


def test_retrofit_is_identical_and_the_mask_trains_only_tape() -> None:
    rope_cfg = tiny_config("rope", position_options={"layout": "interleaved"})
    tokens, positions = tokens_and_positions()
    rope = Transformer(rope_cfg)
    rope_params = rope.init(jax.random.key(0), tokens, positions)
    tape_cfg = tape_config_from_rope(rope_cfg, hidden=8)
    assert tape_cfg.scheme.layout == "interleaved"
    tape = Transformer(tape_cfg)
    tape_params = retrofit_rope_params(rope_params, tape_cfg, jax.random.key(1))
    np.testing.assert_allclose(
        tape.apply(tape_params, tokens, positions),
        rope.apply(rope_params, tokens, positions),
        rtol=1e-5,
        atol=1e-5,
    )
    mask = tape_param_mask(tape_params)
    flat_mask = _flat(mask)
    new_keys = set(_flat(tape_params)) - set(_flat(rope_params))
    assert new_keys and {k for k, v in flat_mask.items() if v} == new_keys

    def loss(p: dict) -> jax.Array:
        return jnp.mean(jax.nn.logsumexp(tape.apply(p, tokens, positions), -1))

    params = nn.meta.unbox(tape_params)
    mask = nn.meta.unbox(mask)
    frozen = jax.tree_util.tree_map(lambda m: not m, mask)
    tx = optax.chain(optax.masked(optax.sgd(0.1), mask), optax.masked(optax.set_to_zero(), frozen))
    updates, _ = tx.update(jax.jit(jax.grad(loss))(params), tx.init(params), params)
    new = _flat(optax.apply_updates(params, updates))
    old = _flat(params)
    for key in set(old) - new_keys:
        np.testing.assert_array_equal(new[key], old[key], err_msg=key)
    # At W2 = 0 only W2 has a gradient (psi and W1 feed into it), and only in the layers
    # whose output positions are read by a later layer.
    assert not np.array_equal(
        new["params/block_0/attention/tape/w2"], old["params/block_0/attention/tape/w2"]
    )


def test_retrofit_rejects_non_rope_configs() -> None:
    with pytest.raises(ValueError, match="position='rope'"):
        tape_config_from_rope(tiny_config("nope"))
    with pytest.raises(ValueError, match=r"fraction=1\.0"):
        tape_config_from_rope(tiny_config("rope", position_options={"fraction": 0.5}))
    with pytest.raises(ValueError, match=r"p=1\.0: p-RoPE"):
        tape_config_from_rope(tiny_config("rope", position_options={"p": 0.5}))
    with pytest.raises(ValueError, match="fixes the TAPE option 'coords'"):
        tape_config_from_rope(tiny_config("rope"), coords=4)


def test_retrofit_carries_ntk_scaling_and_refuses_linear_and_yarn() -> None:
    """NTK scaling is a change of base: the converted model is identical. Linear and YaRN
    scaling have no counterpart in TAPE's initial state: a clear error, not a silent drift."""
    tokens, _ = tokens_and_positions()
    positions = jnp.asarray(np.random.default_rng(4).integers(0, 60, tokens.shape), jnp.int32)
    rope_cfg = tiny_config("rope", position_options={"scaling": "ntk", "factor": 4.0})
    rope = Transformer(rope_cfg)
    rope_params = rope.init(jax.random.key(0), tokens, positions)
    tape_cfg = tape_config_from_rope(rope_cfg)
    h = rope_cfg.resolved_head_dim
    assert tape_cfg.scheme.base == pytest.approx(10000.0 * 4.0 ** (h / (h - 2)))
    tape_params = retrofit_rope_params(rope_params, tape_cfg, jax.random.key(1))
    np.testing.assert_allclose(
        Transformer(tape_cfg).apply(tape_params, tokens, positions),
        rope.apply(rope_params, tokens, positions),
        rtol=1e-5,
        atol=1e-5,
    )
    for scaling in ("linear", "yarn"):
        cfg = tiny_config("rope", position_options={"scaling": scaling, "factor": 4.0})
        with pytest.raises(ValueError, match=f"scaling='{scaling}'.*allowed: scaling='none'"):
            tape_config_from_rope(cfg)
