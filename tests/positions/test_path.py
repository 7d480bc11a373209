"""PaTH against a NumPy reference written from the paper's equations (Yang et al. 2025,
arXiv 2505.16381, eq. for A_ij and H_t; w and beta as the authors' layer).

The reference builds each H_s = I - beta_s w_s w_s^T as an explicit (H, H) matrix and
multiplies ``q_i^T H_i H_{i-1} ... H_{j+1} k_j`` in float64, with loops over tokens (not the
key walk of the implementation). With grouped key/value heads (K < N) w and beta are per
key/value head, as fla's layer: query head n uses key head g = n // (N / K), its w and beta.
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
from copejax.ops.path_block import path_block_logits, path_wy, unit_upper_inverse
from copejax.ops.segments import segment_starts_BT
from copejax.positions.base import AttentionContext
from copejax.positions.path import path_logits_BNQK, path_w
from copejax.positions.registry import make_scheme
from tests.conftest import tiny_config
from tests.test_blockwise_equivalence import _check_blockwise_equals_naive, _check_engine_decoding
from tests.test_decode import STEPS, _check_prefill_then_steps

SEGMENTS_BT = np.array([[1, 1, 1, 2, 2, 2, 2, 2], [1, 1, 1, 1, 1, 1, 1, 1]])


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def _ref_w_beta(p: dict, x_BTD: np.ndarray, segments_BT: np.ndarray) -> tuple[np.ndarray, ...]:
    """w_t = normalise(silu(sum_c conv_c * u_{t-c})) over the token's own segment, and
    beta_t = 2 sigmoid(W x_t + b); per key/value head, (B, T, K, H) and (B, T, K)."""
    u = np.einsum("BTD,DR,RKH->BTKH", x_BTD, p["w_down"], p["w_up"])
    batch, length = segments_BT.shape
    conv = np.zeros_like(u)
    for b in range(batch):
        for t in range(length):
            for c in range(p["w_conv"].shape[0]):
                s = t - c
                if s >= 0 and np.all(segments_BT[b, s : t + 1] == segments_BT[b, t]):
                    conv[b, t] += p["w_conv"][c] * u[b, s]
    silu = conv * _sigmoid(conv)
    w = silu / np.sqrt(np.sum(silu**2, axis=-1, keepdims=True) + 1e-6)
    beta = 2.0 * _sigmoid(np.einsum("BTD,DK->BTK", x_BTD, p["beta_w"]) + p["beta_b"])
    return w, beta


def _ref_logits(q, k, w, beta, segments_BT) -> np.ndarray:
    """A_ij = q_i^T (H_i ... H_{j+1}) k_j / sqrt(H) on allowed pairs, -inf elsewhere; q has
    N heads, k, w, beta K heads (query head n reads key head n // (N / K))."""
    batch, length, heads, width = q.shape
    group = heads // k.shape[2]
    out = np.full((batch, heads, length, length), -np.inf)
    eye = np.eye(width)
    for b in range(batch):
        for n in range(heads):
            g = n // group
            for i in range(length):
                for j in range(i + 1):
                    if segments_BT[b, i] != segments_BT[b, j]:
                        continue
                    product = eye
                    for s in range(i, j, -1):  # H_i first, H_{j+1} last (rightmost)
                        h_s = eye - beta[b, s, g] * np.outer(w[b, s, g], w[b, s, g])
                        product = product @ h_s
                    out[b, n, i, j] = q[b, i, n] @ product @ k[b, j, g] / math.sqrt(width)
    return out


def _ctx(x_BTD: jax.Array) -> AttentionContext:
    positions_BT = jnp.zeros(SEGMENTS_BT.shape, jnp.int32)
    return AttentionContext.create(x_BTD, positions_BT, jnp.asarray(SEGMENTS_BT))


@pytest.mark.parametrize("impl", ["naive", "blockwise"])
@pytest.mark.parametrize(
    ("heads", "kv_heads"),
    [
        pytest.param(2, None, marks=pytest.mark.slow),
        (4, 2),
        pytest.param(4, 1, marks=pytest.mark.slow),
    ],
)
def test_layer_matches_reference(impl: str, heads: int, kv_heads: int | None) -> None:
    cfg = tiny_config(
        "path", attention_impl=impl, attention_block=3, num_heads=heads, num_kv_heads=kv_heads
    )
    attention = Attention(cfg)
    x_BTD = jnp.asarray(np.random.default_rng(1).normal(size=(2, 8, cfg.d_model)), jnp.float32)
    params = nn.unbox(attention.init(jax.random.key(0), x_BTD, _ctx(x_BTD))["params"])
    # beta far from 1 on some tokens (bias +-2), so reflections and contractions both occur.
    group_heads = cfg.resolved_kv_heads
    assert params["path"]["beta_b"].shape == (group_heads,)
    assert params["path"]["w_up"].shape[1] == group_heads
    params["path"]["beta_b"] = jnp.asarray([2.0, -2.0][:group_heads])
    for name in ("query", "key"):  # logits of order 1, not 0.01, so the term is visible
        params[name] = {"kernel": params[name]["kernel"] * 30}
    y_BTD, _ = jax.jit(attention.apply)({"params": params}, x_BTD, _ctx(x_BTD))

    x64 = np.asarray(x_BTD, np.float64)
    p = {k: np.asarray(v["kernel"], np.float64) for k, v in params.items() if k != "path"}
    site = {k: np.asarray(v, np.float64) for k, v in params["path"].items()}
    q = np.einsum("BTD,DNH->BTNH", x64, p["query"])
    k = np.einsum("BTD,DKH->BTKH", x64, p["key"])
    v = np.einsum("BTD,DKH->BTKH", x64, p["value"])
    w, beta = _ref_w_beta(site, x64, SEGMENTS_BT)
    logits = _ref_logits(q, k, w, beta, SEGMENTS_BT)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    v_heads = np.repeat(v, heads // v.shape[2], axis=2)  # query head n reads n // (N / K)
    y = np.einsum("BNTS,BSNH,NHD->BTD", weights, v_heads, p["out"])
    # The position term is live: PaTH differs from plain softmax attention on these inputs.
    k_heads = np.repeat(k, heads // k.shape[2], axis=2)
    content = np.einsum("BTNH,BSNH->BNTS", q, k_heads) / math.sqrt(q.shape[-1])
    allowed = np.isfinite(logits)
    assert np.abs(logits[allowed] - content[allowed]).max() > 0.5
    np.testing.assert_allclose(np.asarray(y_BTD), y, rtol=1e-4, atol=1e-5)


def _unit(shape: tuple[int, ...], seed: int) -> np.ndarray:
    w = np.random.default_rng(seed).normal(size=shape)
    return w / np.linalg.norm(w, axis=-1, keepdims=True)


def test_reflections_cancel_and_preserve_norms() -> None:
    """beta = 2: H = I - 2 w w^T is a reflection (H^2 = I, orthogonal). Two equal consecutive
    reflections cancel, so A_{s+1, s-1} = q . k; and the walked query keeps its norm."""
    length, heads, width = 5, 2, 4
    rng = np.random.default_rng(0)
    q = rng.normal(size=(1, length, heads, width))
    k = rng.normal(size=(1, length, heads, width))
    w = _unit((1, length, heads, width), 1)
    w[:, 3] = w[:, 2]  # H_3 = H_2
    beta = np.full((1, length, heads), 2.0)
    index = jnp.arange(length)
    logits, r = path_logits_BNQK(
        *(jnp.asarray(a, jnp.float32) for a in (q, k, w, beta)), q_index_Q=index, k_index_K=index
    )
    np.testing.assert_allclose(
        np.asarray(logits[0, :, 3, 1]),
        np.einsum("NH,NH->N", q[0, 3], k[0, 1]),
        rtol=1e-5,
        atol=1e-6,
    )
    # r_i = H_0 H_1 ... H_i q_i after the walk (every key s <= i applied): norms kept.
    np.testing.assert_allclose(
        np.linalg.norm(np.asarray(r), axis=-1), np.linalg.norm(q, axis=-1), rtol=1e-5
    )
    # beta = 2 with w_{j+1} = w: A_{j+1, j} = q . (k - 2 (w.k) w), the reflected key.
    reflected = k[0, 2] - 2 * np.sum(w[0, 3] * k[0, 2], -1, keepdims=True) * w[0, 3]
    np.testing.assert_allclose(
        np.asarray(logits[0, :, 3, 2]),
        np.einsum("NH,NH->N", q[0, 3], reflected),
        rtol=1e-5,
        atol=1e-6,
    )


def test_beta_zero_is_plain_attention_and_contractions_shrink() -> None:
    """beta = 0: H = I, the logits are q . k. beta in (0, 2): |1 - beta| < 1 along w, so the
    walked queries never grow."""
    length, heads, width = 6, 2, 4
    rng = np.random.default_rng(3)
    q, k = rng.normal(size=(2, 1, length, heads, width))
    w = _unit((1, length, heads, width), 4)
    index = jnp.arange(length)
    zeros = np.zeros((1, length, heads))
    args = [jnp.asarray(a, jnp.float32) for a in (q, k, w)]
    logits, _ = path_logits_BNQK(
        *args, jnp.asarray(zeros, jnp.float32), q_index_Q=index, k_index_K=index
    )
    np.testing.assert_allclose(np.asarray(logits), np.einsum("BTNH,BSNH->BNTS", q, k), rtol=1e-5)
    beta = jnp.asarray(rng.uniform(0.1, 1.9, size=(1, length, heads)), jnp.float32)
    _, r = path_logits_BNQK(*args, beta, q_index_Q=index, k_index_K=index)
    assert np.all(np.linalg.norm(np.asarray(r), axis=-1) < np.linalg.norm(q, axis=-1))


def test_convolution_never_reads_across_a_segment_start() -> None:
    """w of a segment's tokens does not change with the previous segment's inputs."""
    rng = np.random.default_rng(5)
    u = rng.normal(size=(2, 8, 2, 4))
    conv = rng.normal(size=(3, 2, 4))
    starts = segment_starts_BT(jnp.asarray(SEGMENTS_BT))
    slots = jnp.arange(8)
    w = path_w(jnp.asarray(u), jnp.asarray(conv), starts, slots)
    u2 = u.copy()
    u2[:, :3] += 10.0  # row 0: segment 1; row 1: the same document continues
    w2 = path_w(jnp.asarray(u2), jnp.asarray(conv), starts, slots)
    np.testing.assert_array_equal(np.asarray(w[0, 3:]), np.asarray(w2[0, 3:]))
    assert not np.allclose(np.asarray(w[1, 3:5]), np.asarray(w2[1, 3:5]))  # taps 1, 2 read them
    np.testing.assert_allclose(np.linalg.norm(np.asarray(w), axis=-1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("bad", [{"rank": 0}, {"conv_size": 1.5}, {"rank": True}])
def test_bad_options_are_refused(bad: dict) -> None:
    cfg_error = pytest.raises(ValueError, match=next(iter(bad)))
    with cfg_error:
        tiny_config("path", position_options=bad)


def test_path_fox_is_the_composite() -> None:
    """PaTH-FoX (the paper's section 3.3) is ``path+fox``: both bias sites, summed."""
    scheme = make_scheme("path+fox")
    assert scheme.walk_carry and "bias" in scheme.sites


def test_wy_form_equals_the_explicit_products() -> None:
    """The engine's UT / WY form: per key block, P = H_c ... H_{c+K-1} = I - W^T T W, and each
    key's in-block suffix H_{c+K-1} ... H_{j+1} k_j (blocks of 3 over 7 keys, one padded)."""
    size, length, width = 3, 7, 4
    rng = np.random.default_rng(7)
    k = rng.normal(size=(1, length, 1, width))
    w = _unit((1, length, 1, width), 8)
    beta = rng.uniform(0.0, 2.0, size=(1, length, 1))
    t, suffix = path_wy(*(jnp.asarray(a, jnp.float32) for a in (k, w, beta)), size)
    eye = np.eye(width)
    h = [eye - beta[0, s, 0] * np.outer(w[0, s, 0], w[0, s, 0]) for s in range(length)]
    for start in range(0, length, size):
        keys = range(start, min(start + size, length))
        product = eye
        for s in keys:
            product = product @ h[s]
        rows = np.asarray(t[0, start : start + size, 0, : len(keys)])
        w_block = w[0, start : start + size, 0]
        np.testing.assert_allclose(eye - w_block.T @ rows @ w_block, product, atol=1e-5)
        for j in keys:
            expected = k[0, j, 0]
            for s in range(j + 1, keys[-1] + 1):  # H_{j+1} first, H_{c+K-1} last
                expected = h[s] @ expected
            np.testing.assert_allclose(np.asarray(suffix[0, j, 0]), expected, atol=1e-5)


@pytest.mark.parametrize("size", [1, 3, 8, pytest.param(13, marks=pytest.mark.slow)])
def test_unit_upper_inverse_equals_numpy(size: int) -> None:
    """Block doubling against numpy.linalg.inv in float64, sizes padded and not; and the UT
    matrix of equal reflections (w all equal, beta = 2), whose inverse is moderate although
    its strict triangle's powers are not."""
    rng = np.random.default_rng(13)
    u = np.eye(size) + np.triu(rng.normal(size=(2, 3, size, size)), 1)
    got = np.asarray(unit_upper_inverse(jnp.asarray(u, jnp.float32)))
    np.testing.assert_allclose(got, np.linalg.inv(u), rtol=1e-4, atol=1e-4)
    reflections = np.eye(size) + np.triu(np.full((size, size), 2.0), 1)
    got = np.asarray(unit_upper_inverse(jnp.asarray(reflections, jnp.float32)))
    np.testing.assert_allclose(got, np.linalg.inv(reflections), atol=1e-5)
    # The custom backward against central differences of numpy's inverse (float64).
    cot = rng.normal(size=u.shape)
    grad = np.asarray(
        jax.grad(lambda a: jnp.sum(unit_upper_inverse(a) * cot))(jnp.asarray(u, jnp.float32))
    )
    for index in [(0, 0, 0, size - 1), (1, 2, 0, 0), (0, 1, size // 2, size - 1)]:
        step = np.zeros_like(u)
        step[index] = 1e-6
        want = np.sum((np.linalg.inv(u + step) - np.linalg.inv(u - step)) * cot) / 2e-6
        np.testing.assert_allclose(grad[index], want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(("q_start", "k_start"), [(0, 0), (2, 0), (5, 1), (0, 3)])
def test_block_logits_equal_the_explicit_products(q_start: int, k_start: int) -> None:
    """The matrix form of a key block holding queries (the engine's diagonal pair) against
    explicit (H, H) products, float64: queries at ``q_start + i`` carrying r_i from newer
    blocks, keys at ``k_start + j``; query i takes the H of the block's keys up to its own.
    Offsets put queries before, inside and after the block (decoding, padded blocks)."""
    size, queries, heads, width = 4, 5, 2, 3
    rng = np.random.default_rng(11)
    r = rng.normal(size=(1, queries, heads, width))
    k = rng.normal(size=(1, size, heads, width))
    w = _unit((1, size, heads, width), 12)
    beta = rng.uniform(0.0, 2.0, size=(1, size, heads))
    beta[0, 1] = 2.0  # a reflection
    t, _ = path_wy(*(jnp.asarray(a, jnp.float32) for a in (k, w, beta)), size)
    logits, r_after = path_block_logits(
        *(jnp.asarray(a, jnp.float32) for a in (r, k, w)),
        t,
        q_index_Q=q_start + jnp.arange(queries),
        k_index_K=k_start + jnp.arange(size),
    )
    eye = np.eye(width)
    for n in range(heads):
        h = [eye - beta[0, s, n] * np.outer(w[0, s, n], w[0, s, n]) for s in range(size)]
        for i in range(queries):
            last = q_start + i - k_start  # the block's last key the query takes
            for j in range(size):
                product = eye  # H_{j+1} ... H_last, increasing order
                for s in range(j + 1, min(last, size - 1) + 1):
                    product = product @ h[s]
                want = (product @ r[0, i, n]) @ k[0, j, n]
                np.testing.assert_allclose(float(logits[0, n, i, j]), want, atol=1e-5)
            carried = r[0, i, n]
            for s in range(min(last, size - 1), -1, -1):  # H_0 ... H_last r_i
                carried = h[s] @ carried
            np.testing.assert_allclose(np.asarray(r_after[0, i, n]), carried, atol=1e-5)


@pytest.mark.slow  # test_layer_matches_reference[4-2-blockwise] keeps K < N on the engine
@pytest.mark.parametrize("kv_heads", [2, 1])
def test_grouped_heads_blockwise_values_and_gradients_equal_naive(kv_heads: int) -> None:
    """K < N on the engine (the WY form and the in-block part both read the repeated w, beta)
    against the naive path: logits and every parameter's gradient."""
    _check_blockwise_equals_naive("path", {}, num_heads=4, num_kv_heads=kv_heads)


@pytest.mark.slow  # about 15 s; PaTH's decode is covered by tests/test_decode.py
def test_grouped_heads_decode_equals_full_forward() -> None:
    """Prefill then single steps with K = 2 of N = 4 heads: the cache's K-head keys take the
    K-head rank-1 updates; naive and engine decoding."""
    _check_prefill_then_steps("path", {}, STEPS, num_heads=4, num_kv_heads=2)
    _check_engine_decoding("path", {}, num_heads=4, num_kv_heads=2)


def test_decode_cache_holds_key_value_heads() -> None:
    """The cache holds K heads of keys, w, beta and u (B, S, K, ...), not N."""
    cfg = tiny_config("path", num_heads=4, num_kv_heads=2)
    slots = decode.init_cache(cfg, 2, 8)["block_0"]["attention"]["key_cache"]
    head_dim = cfg.resolved_head_dim
    assert slots["key"].shape == slots["path_w"].shape == slots["path_u"].shape
    assert slots["key"].shape == (2, 8, 2, head_dim)
    assert slots["path_beta"].shape == (2, 8, 2)


def test_sink_tokens_beside_a_window_are_refused_with_the_reason() -> None:
    from copejax.model import checks
    from copejax.model.config import ModelConfig

    cfg = ModelConfig(vocab_size=8, position="path", window=4, window_sink_tokens=1)
    with pytest.raises(ValueError, match=r"'path' cannot keep sink tokens beside a window"):
        checks.validate(cfg)
