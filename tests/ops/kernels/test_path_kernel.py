"""PaTH on the fused kernels (Yang et al. 2025, arXiv 2505.16381), in interpret mode.

- ``offset_attention`` (the kernels with ``Plan.q_offset``: later queries against earlier
  keys) against dense attention under the token indices' mask: output and log-sum-exp
  against NumPy (float64); gradients, the log-sum-exp's cotangent included, against
  ``jax.grad`` of the dense float32 maths.
- ``path_attention`` (:mod:`copejax.model.kernel_path`: kernels between chunks, XLA within)
  against PaTH's logits from explicit products of the matrices ``I - beta w w^T`` in NumPy
  (float64); gradients of q, k, v, w and beta against ``jax.grad`` of the naive path's walk
  over keys (``path_logits_BNQK``).

With grouped KV heads, packed segments, a window, a per-token term (PaTH-FoX's decay) and a
length that needs padding. The whole model on the kernels against the naive path:
``test_kernel_registry.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model import kernel_path
from copejax.model.kernel_path import path_attention
from copejax.model.transformer import Transformer
from copejax.ops.engine_blocks import BlockTerm
from copejax.ops.kernels.gpu_lowering import lower_for_gpu
from copejax.ops.kernels.offset import offset_attention
from copejax.ops.kernels.terms import KernelTerm
from copejax.ops.kernels.tiles import MASKED_LOGIT
from copejax.positions.path import path_logits_BNQK
from tests.conftest import perturbed, tiny_config
from tests.ops.kernels.reference import mask_BTS
from tests.ops.kernels.test_fused_attention import _decay
from tests.ops.kernels.test_kernel_registry import _compare, _config
from tests.ops.kernels.tolerances import assert_close

B, T, N, G, H, TILE = 1, 40, 2, 1, 16, 16  # T: three tiles, the last one padded
SEGMENTS_BT = np.array([[0] * 17 + [1] * 15 + [2] * 8], np.int32)
POSITIONS_BT = np.array([np.r_[np.arange(17), np.arange(15), np.arange(8)]])
NO_RANK_BT = np.zeros((B, T), np.int32)
SLOW = pytest.mark.slow


def _inputs(dtype, seed: int = 0, length: int = T) -> dict:
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.normal(size=shape)
    w = normal(B, length, G, H)
    return {
        "q": jnp.asarray(normal(B, length, N, H), dtype),
        "k": jnp.asarray(normal(B, length, G, H), dtype),
        "v": jnp.asarray(normal(B, length, G, H), dtype),
        "w": jnp.asarray(w / np.linalg.norm(w, axis=-1, keepdims=True), jnp.float32),
        "beta": jnp.asarray(rng.uniform(0.0, 2.0, (B, length, G)), jnp.float32),
        "c": jnp.asarray(np.cumsum(-rng.uniform(0, 0.3, (B, length, N)), axis=1), jnp.float32),
    }


def _decay_term(c_BTN: jax.Array) -> KernelTerm:
    return KernelTerm("decay", _decay, q_values_BTN=c_BTN, k_values_BSN=c_BTN)


def _decay_BNTS(c_BTN, xp=jnp):
    c_BNT = xp.moveaxis(c_BTN, 2, 1)
    return c_BNT[:, :, :, None] - c_BNT[:, :, None, :]


# ------------------------------------------------------------------ offset attention

OFFSET, KEYS = 16, 24  # queries: tokens 16..39 (two tiles, one padded); keys: tokens 0..23


def _offset(
    x: dict,
    *,
    offset: int = OFFSET,
    length_k: int = KEYS,
    window: int | None,
    tokens: tuple = (POSITIONS_BT, SEGMENTS_BT),
    blocks: tuple[int, int] = (TILE, TILE),
    **kwargs,
):
    """offset_attention of the queries of tokens ``offset`` on to the keys of tokens before
    ``length_k``, with the decay term; ``tokens``: (positions, segment ids) (B, T),
    ``blocks``: (block_q, block_k); ``kwargs``: interpret, backend."""
    positions_BT, segments_BT = (jnp.asarray(a) for a in tokens)
    c_BTN = x["c"]
    term = KernelTerm(
        "decay", _decay, q_values_BTN=c_BTN[:, offset:], k_values_BSN=c_BTN[:, :length_k]
    )
    return offset_attention(
        x["q"][:, offset:],
        x["k"][:, :length_k],
        x["v"][:, :length_k],
        offset=offset,
        q_positions_BT=positions_BT[:, offset:],
        k_positions_BS=positions_BT[:, :length_k],
        q_segment_ids_BT=segments_BT[:, offset:],
        k_segment_ids_BS=segments_BT[:, :length_k],
        terms=[term],
        window=window,
        block_q=blocks[0],
        block_k=blocks[1],
        **kwargs,
    )


def _offset_dense(
    x: dict,
    *,
    offset: int = OFFSET,
    length_k: int = KEYS,
    window: int | None,
    segments_BT=SEGMENTS_BT,
    xp=jnp,
):
    """Dense attention of tokens ``offset`` on to the keys before ``length_k`` under the
    causal, segment and window mask of token indices: (output (B, T - offset, N, H),
    log-sum-exp (B, T - offset, N) with MASKED_LOGIT where no key)."""
    heads, dim = x["q"].shape[2:]
    allowed_BTS = mask_BTS(segments_BT, window, 0, np.zeros_like(segments_BT))
    allowed = allowed_BTS[:, None, offset:, :length_k]
    f32 = xp.float64 if xp is np else xp.float32
    q, k, v, c = (xp.asarray(x[key], f32) for key in ("q", "k", "v", "c"))
    k, v = (xp.repeat(a[:, :length_k], heads // x["k"].shape[2], axis=2) for a in (k, v))
    decay_BNTS = _decay_BNTS(c, xp)[:, :, offset:, :length_k]
    s = xp.einsum("btnh,bsnh->bnts", q[:, offset:], k) / np.sqrt(dim) + decay_BNTS
    s = xp.where(allowed, s, MASKED_LOGIT)
    top = xp.max(s, axis=-1, keepdims=True)
    p = xp.where(allowed, xp.exp(s - top), 0.0)
    total = xp.sum(p, axis=-1)
    seen = total > 0
    safe = xp.where(seen, total, 1.0)
    out = xp.einsum("bnts,bsnh->btnh", p / safe[..., None], v)
    lse = xp.where(seen, top[..., 0] + xp.log(safe), MASKED_LOGIT)
    return out, xp.moveaxis(lse, 1, 2)


def test_offset_attention_equals_numpy() -> None:
    """Queries from token 16 against keys up to token 23: the diagonal inside the key block,
    a window, and segment 2's queries (tokens 32..39), which see no key here."""
    x = _inputs(jnp.float32)
    out, lse = jax.jit(functools.partial(_offset, window=20))(x)
    x64 = {key: np.asarray(value, np.float64) for key, value in x.items()}
    want_out, want_lse = _offset_dense(x64, window=20, xp=np)
    assert_close(out, want_out, dtype="float32", summands=T, roundings=0)
    seen = want_lse > MASKED_LOGIT / 2
    assert seen.any() and (~seen).any()
    np.testing.assert_array_equal(np.asarray(lse) > MASKED_LOGIT / 2, seen)
    assert_close(lse[seen], want_lse[seen], dtype="float32", summands=T, roundings=0)


@pytest.mark.parametrize(("offset", "length_k"), [(OFFSET, KEYS), (32, 32)])
def test_offset_attention_gradients_with_the_lse_cotangent(offset: int, length_k: int) -> None:
    """Gradients of q, k, v and the term's values; (32, 32): every key before every query,
    PaTH's levels' case."""
    x = _inputs(jnp.float32)
    rng = np.random.default_rng(7)
    cot_out = jnp.asarray(rng.normal(size=(B, T - offset, N, H)), jnp.float32)
    cot_lse = jnp.asarray(rng.normal(size=(B, T - offset, N)), jnp.float32)

    def loss(run):
        def value(x):
            out, lse = run(x, offset=offset, length_k=length_k, window=None)
            seen = lse > MASKED_LOGIT / 2  # a constant where no key: no cotangent there
            return jnp.sum(out * cot_out) + jnp.sum(jnp.where(seen, lse, 0.0) * cot_lse)

        return jax.grad(value)

    dx, dx_ref = jax.jit(loss(_offset))(x), loss(_offset_dense)(x)
    for key in ("q", "k", "v", "c"):
        assert_close(dx[key], dx_ref[key], dtype="float32", summands=T, roundings=0)


def test_offset_attention_lowers_to_triton() -> None:
    """The three kernels with a query offset have a Triton lowering (from the CPU)."""
    x = {key: value.astype(jnp.bfloat16) for key, value in _inputs(jnp.float32).items()}
    x["c"] = x["c"].astype(jnp.float32)

    def loss(q_BTNH):
        out, lse = _offset({**x, "q": q_BTNH}, window=20, interpret=False)
        return jnp.sum(out) + jnp.sum(jnp.where(lse > MASKED_LOGIT / 2, lse, 0.0))

    text = lower_for_gpu(jax.jit(jax.grad(loss)), x["q"]).as_text()
    for name in ("copejax_attention_forward", "copejax_attention_dq", "copejax_attention_dkdv"):
        assert name in text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"offset": 0}, "offset must be a positive integer, got 0"),
        ({"offset": 2.0}, "offset must be a positive integer, got 2.0"),
        ({"offset": 4, "window": 0}, "window must be a positive integer"),
        ({"offset": 4, "k": jnp.zeros((B, T, 3, H))}, "G must divide N"),
    ],
)
def test_offset_attention_refuses_bad_arguments(kwargs: dict, message: str) -> None:
    x = _inputs(jnp.float32)
    k = kwargs.pop("k", x["k"])
    args = {
        "q_positions_BT": jnp.asarray(POSITIONS_BT),
        "k_positions_BS": jnp.asarray(POSITIONS_BT),
        "q_segment_ids_BT": jnp.asarray(SEGMENTS_BT),
        "k_segment_ids_BS": jnp.asarray(SEGMENTS_BT),
        "block_q": TILE,
        "block_k": TILE,
    }
    with pytest.raises(ValueError, match=message):
        offset_attention(x["q"], k, x["v"], **{**args, **kwargs})


# ------------------------------------------------------------------ PaTH through the levels


def _path_scores_numpy(x: dict) -> np.ndarray:
    """PaTH's q_i^T H_i H_{i-1} ... H_{j+1} k_j / sqrt(H) (j <= i) from explicit (H, H)
    matrices ``I - beta_s w_s w_s^T`` of the query head's key/value head, float64."""
    q, k, w, beta = (np.asarray(x[key], np.float64) for key in ("q", "k", "w", "beta"))
    householder = np.eye(H) - beta[..., None, None] * w[..., :, None] * w[..., None, :]
    length = q.shape[1]
    scores = np.zeros((B, N, length, length))
    for b in range(B):
        for n in range(N):
            g = n // (N // G)
            for i in range(length):
                product = np.eye(H)
                for j in range(i, -1, -1):
                    scores[b, n, i, j] = q[b, i, n] @ product @ k[b, j, g]
                    product = product @ householder[b, j, g]
    return scores / np.sqrt(H)


def _path(
    x: dict,
    *,
    chunk: int,
    window: int | None,
    tokens: tuple = (POSITIONS_BT, SEGMENTS_BT),
) -> jax.Array:
    """path_attention with the decay term; ``tokens``: (positions, segment ids) (B, T)."""
    groups = N // G
    term = BlockTerm(
        None,
        k_arrays={
            "w": jnp.repeat(x["w"], groups, axis=2),
            "beta": jnp.repeat(x["beta"], groups, axis=2),
        },
    )
    return path_attention(
        term,
        x["q"],
        x["k"],
        x["v"],
        q_positions_BT=jnp.asarray(tokens[0]),
        k_positions_BT=jnp.asarray(tokens[0]),
        segment_ids_BT=jnp.asarray(tokens[1]),
        terms=(_decay_term(x["c"]),),
        window=window,
        block=TILE,
        chunk=chunk,
    )


def _path_naive(x: dict, *, window: int | None, segments_BT: np.ndarray = SEGMENTS_BT):
    """The naive path's walk over keys, dense softmax, float32."""
    x = {key: value.astype(jnp.float32) for key, value in x.items()}
    repeat = lambda a: jnp.repeat(a, N // G, axis=2)
    length = x["q"].shape[1]
    logits_BNTS, _ = path_logits_BNQK(
        x["q"],
        repeat(x["k"]),
        repeat(x["w"]),
        repeat(x["beta"][..., None])[..., 0],
        q_index_Q=jnp.arange(length),
        k_index_K=jnp.arange(length),
    )
    s = logits_BNTS / np.sqrt(H) + _decay_BNTS(x["c"])
    rank_BT = np.zeros_like(segments_BT)
    allowed = jnp.asarray(mask_BTS(segments_BT, window, 0, rank_BT))[:, None]
    weights = jax.nn.softmax(jnp.where(allowed, s, MASKED_LOGIT), axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", weights, repeat(x["v"]))


@pytest.mark.parametrize(("chunk", "window"), [(16, 12), pytest.param(32, None, marks=SLOW)])
def test_path_attention_equals_householder_products(chunk: int, window: int | None) -> None:
    x = _inputs(jnp.float32)
    y = jax.jit(functools.partial(_path, chunk=chunk, window=window))(x)
    x64 = {key: np.asarray(value, np.float64) for key, value in x.items()}
    s = _path_scores_numpy(x64) + _decay_BNTS(x64["c"], np)
    allowed = mask_BTS(SEGMENTS_BT, window, 0, NO_RANK_BT)[:, None]
    s = np.where(allowed, s, -np.inf)
    weights = np.exp(s - s.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    want = np.einsum("bnts,bsnh->btnh", weights, np.repeat(x64["v"], N // G, axis=2))
    # Each logit is a product of up to T matrices: T more reorderings than a dot product.
    assert_close(y, want, dtype="float32", summands=2 * T, roundings=0)


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=SLOW)])
def test_path_attention_gradients_equal_the_naive_walk(dtype: str) -> None:
    x = _inputs(jnp.dtype(dtype))
    cot = jnp.asarray(np.random.default_rng(5).normal(size=(B, T, N, H)), jnp.float32)

    def kernel(x):
        return _path(x, chunk=16, window=12).astype(jnp.float32)

    y, pull = jax.vjp(jax.jit(kernel), x)
    y_ref, pull_ref = jax.vjp(functools.partial(_path_naive, window=12), x)
    (grads,), (grads_ref,) = jax.jit(pull)(cot), pull_ref(cot)
    # bfloat16: q, k, v and each level's queries and keys are rounded before the kernels'
    # matmuls.
    assert_close(y, y_ref, dtype=dtype, summands=2 * T, roundings=3)
    for key in ("q", "k", "v", "w", "beta", "c"):
        assert grads[key].dtype == x[key].dtype
        assert_close(grads[key], grads_ref[key], dtype=dtype, summands=2 * T, roundings=6)


LONG = 120  # 8 chunks of 16 (the last padded): three levels, queries in every half


@pytest.mark.parametrize("window", [None, 70])
def test_path_attention_levels_equal_householder_products_and_the_naive_walk(window) -> None:
    """One segment over three levels of chunk pairs, so that every climb carries pairs (a
    query in the newest chunk sees keys of every older one): values against the explicit
    products (float64), gradients against the naive walk's."""
    x = _inputs(jnp.float32, seed=7, length=LONG)
    tokens = (np.arange(LONG)[None], np.zeros((B, LONG), np.int32))
    run = jax.jit(functools.partial(_path, chunk=16, window=window, tokens=tokens))
    x64 = {key: np.asarray(value, np.float64) for key, value in x.items()}
    s = _path_scores_numpy(x64) + _decay_BNTS(x64["c"], np)
    s = np.where(mask_BTS(tokens[1], window, 0, tokens[1])[:, None], s, -np.inf)
    weights = np.exp(s - s.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    want = np.einsum("bnts,bsnh->btnh", weights, np.repeat(x64["v"], N // G, axis=2))
    y, pull = jax.vjp(run, x)
    assert_close(y, want, dtype="float32", summands=2 * LONG, roundings=0)
    cot = jnp.asarray(np.random.default_rng(8).normal(size=y.shape), jnp.float32)
    naive = functools.partial(_path_naive, window=window, segments_BT=tokens[1])
    (grads,), (grads_ref,) = jax.jit(pull)(cot), jax.vjp(naive, x)[1](cot)
    for key in ("q", "k", "v", "w", "beta", "c"):
        assert_close(grads[key], grads_ref[key], dtype="float32", summands=2 * LONG, roundings=6)


def test_path_attention_leaf_groups_change_no_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunks' pairs in sequential groups (a small ``LEAF_GROUP_BYTES``: four groups of
    one chunk) give the one-group values and gradients."""
    x = _inputs(jnp.float32)
    cot = jnp.asarray(np.random.default_rng(5).normal(size=(B, T, N, H)), jnp.float32)

    def value_and_grads() -> tuple:
        y, pull = jax.vjp(jax.jit(functools.partial(_path, chunk=16, window=12)), x)
        return y, pull(cot)[0]

    assert kernel_path.leaf_groups(4, N, 16) == 1
    want = value_and_grads()
    monkeypatch.setattr(kernel_path, "LEAF_GROUP_BYTES", 16 * 16 * 4)
    assert kernel_path.leaf_groups(4, N, 16) == 4
    got = value_and_grads()
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_close(g, w, dtype="float32", summands=2 * T, roundings=1)


# ------------------------------------------------------------------ through the model


def test_path_fox_model_logits_equal_naive() -> None:
    """PaTH-FoX's model on the kernels (``attention_impl="kernel"``: three chunks of 16 keys,
    GQA, packed segments, a window) gives the naive path's logits."""
    tokens_BT = jnp.asarray(np.random.default_rng(0).integers(0, 13, (B, T)), jnp.int32)
    positions_BT, ids_BT = jnp.asarray(POSITIONS_BT), jnp.asarray(SEGMENTS_BT)
    naive, kernel = (
        Transformer(_config("path+fox", impl, "float32", 12, 0)) for impl in ("naive", "kernel")
    )
    params = perturbed(jax.jit(naive.init)(jax.random.key(0), tokens_BT, positions_BT)["params"])
    logits = [
        jax.jit(m.apply)({"params": params}, tokens_BT, positions_BT, ids_BT)
        for m in (naive, kernel)
    ]
    assert_close(logits[1], logits[0], dtype="float32", summands=2 * T, roundings=0)


@SLOW
def test_path_fox_model_equals_naive_with_the_attention_sink() -> None:
    """Values and every parameter's gradient, with GPT-OSS's sink folded into the merged
    softmax (the registry's slow tests run path and path+fox without it)."""
    _compare("path+fox", "float32", window=12, sinks=0, attention_sink=True)


@pytest.mark.parametrize("position", ["path+cope", "stickbreaking+path", "path+selective"])
def test_refuses_path_with_parts_that_read_its_logits(position: str) -> None:
    with pytest.raises(ValueError, match="no kernel for scheme 'path': its transformed logits"):
        tiny_config(position, attention_impl="kernel")
