"""The fused kernels (copejax.ops.kernels) against a dense reference, in interpret mode.

Values against NumPy in float64, gradients (q, k, v, the terms' parameters and per-token
values) against ``jax.grad`` of the dense float32 maths, with grouped KV heads, packed
segments, a window with sinks, three kinds of term (per-head parameters, a one-hot table,
per-token values) and a length that spans several tiles and needs padding.
"""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.ops.kernels.attention import fused_attention
from copejax.ops.kernels.gpu_lowering import lower_for_gpu
from copejax.ops.kernels.terms import KernelTerm, pair_grid, table_lookup
from copejax.ops.kernels.tiles import Plan
from tests.ops.kernels.full_pairs import full_and_masked, total
from tests.ops.kernels.reference import attention_jnp, attention_numpy, mask_BTS
from tests.ops.kernels.tolerances import assert_close

B, T, N, G, H, P = 2, 72, 4, 2, 16, 8  # T: 5 tiles of 16 keys, padded to 80
SEGMENTS_BT = np.array([[0] * T, [0] * 30 + [1] * 25 + [2] * 17], np.int32)
POSITIONS_BT = np.array([np.arange(T), np.r_[np.arange(30), np.arange(25), np.arange(17)]])
RANK_BT = POSITIONS_BT.astype(np.int32)


def _slope(p, tile):  # ALiBi-like: a parameter per head times the distance
    # (either tile layout: the GPU kernels' (Q,) / (K,), the TPU kernels' (Q, 1) / (1, K))
    q_Q1, k_1K = pair_grid(tile.q_positions_Q, tile.k_positions_K)
    slope = jnp.sum(p, axis=-1, keepdims=p.ndim == 2)  # the row's single entry
    return -slope * (q_Q1 - k_1K).astype(jnp.float32)


def _table(p, tile):  # a bucket table read by distance, clipped to P - 1
    q_Q1, k_1K = pair_grid(tile.q_positions_Q, tile.k_positions_K)
    return table_lookup(jnp.clip(q_Q1 - k_1K, 0, P - 1), p)


def _decay(p, tile):  # FoX-like: per-token values, c_i - c_j
    q_Q1, k_1K = pair_grid(tile.q_values_Q, tile.k_values_K)
    return q_Q1 - k_1K


class _SlopeRows:
    """``_slope`` as a separable term (copejax.ops.kernels.separable): the row -m (i - o) and
    the column m (j - o), its slope differentiable (ALiBi's kernel term stops it)."""

    def origin(self, p, positions_X, values_X):
        return jnp.min(positions_X.astype(jnp.float32))

    def row(self, p, positions_Q, values_Q, origin):
        return -jnp.sum(p) * (positions_Q.astype(jnp.float32) - origin)

    def col(self, p, positions_K, values_K, origin, unit):
        return jnp.sum(p) * unit * (positions_K.astype(jnp.float32) - origin)

    def __call__(self, p, tile):
        return _slope(p, tile)


class _DecayRows:
    """``_decay`` as a separable term: the row c_i - o and the column o - c_j."""

    def origin(self, p, positions_X, values_X):
        return jax.lax.stop_gradient(jnp.max(values_X))

    def row(self, p, positions_Q, values_Q, origin):
        return values_Q - origin

    def col(self, p, positions_K, values_K, origin, unit):
        return (origin - values_K) * unit

    def __call__(self, p, tile):
        return _decay(p, tile)


def _inputs(dtype, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
    return {
        "q": normal(B, T, N, H),
        "k": normal(B, T, G, H),
        "v": normal(B, T, G, H),
        "slopes": jnp.asarray(rng.uniform(0.05, 0.5, (N, 1)), jnp.float32),
        "table": jnp.asarray(rng.normal(size=(N, P)), jnp.float32),
        "c": jnp.asarray(np.cumsum(-rng.uniform(0, 0.3, (B, T, N)), axis=1), jnp.float32),
    }


def on_layout(x: dict, **options) -> jax.Array:
    """:func:`fused_attention` of ``x``'s q, k and v on this module's layout (two rows, the
    second packing three documents; positions restart in each), with ``options``."""
    return fused_attention(
        x["q"],
        x["k"],
        x["v"],
        q_positions_BT=jnp.asarray(POSITIONS_BT),
        k_positions_BT=jnp.asarray(POSITIONS_BT),
        segment_ids_BT=jnp.asarray(SEGMENTS_BT),
        **options,
    )


def _kernel(
    x: dict,
    *,
    window: int | None,
    sinks: int,
    interpret: bool | None = None,
    separable: bool = False,
) -> jax.Array:
    """``separable``: the slope and decay terms as rows and columns, which the softmax
    kernels keep out of their walks' scores and add to the log-sum-exp."""
    slope, decay = (_SlopeRows(), _DecayRows()) if separable else (_slope, _decay)
    terms = [
        KernelTerm("slope", slope, params_NP=x["slopes"]),
        KernelTerm("table", _table, params_NP=x["table"]),
        KernelTerm("decay", decay, q_values_BTN=x["c"], k_values_BSN=x["c"]),
    ]
    return on_layout(
        x,
        terms=terms,
        window=window,
        sink_tokens=sinks,
        k_rank_BT=jnp.asarray(RANK_BT),
        block_q=32,
        block_k=16,
        interpret=interpret,
    )


def _bias_BNTS(x: dict, xp=jnp):
    distance_BTS = POSITIONS_BT[:, :, None] - POSITIONS_BT[:, None, :]
    slopes, table, c = (xp.asarray(x[key], xp.float32) for key in ("slopes", "table", "c"))
    bias = -slopes[None, :, :1, None] * distance_BTS[:, None].astype(np.float32)
    bias = bias + xp.moveaxis(table[:, np.clip(distance_BTS, 0, P - 1)], 0, 1)
    c_BNT = xp.moveaxis(c, 2, 1)
    return bias + c_BNT[:, :, :, None] - c_BNT[:, :, None, :]


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    ("window", "sinks", "separable"),
    [
        pytest.param(None, 0, False, marks=SLOW),
        pytest.param(20, 0, False, marks=SLOW),
        (20, 3, False),
        (20, 3, True),
        pytest.param(None, 0, True, marks=SLOW),
    ],
)
def test_values_equal_numpy(window: int | None, sinks: int, separable: bool) -> None:
    x = _inputs(jnp.float32)
    run = functools.partial(_kernel, window=window, sinks=sinks, separable=separable)
    y = jax.jit(run)(x)
    allowed = mask_BTS(SEGMENTS_BT, window, sinks, RANK_BT)
    x64 = {key: np.asarray(value, np.float64) for key, value in x.items()}
    expected = attention_numpy(x["q"], x["k"], x["v"], _bias_BNTS(x64, np), allowed)
    assert_close(y, expected, dtype="float32", summands=T, roundings=0)


@pytest.mark.parametrize(
    ("dtype", "window", "sinks", "separable"),
    [
        ("float32", 20, 3, False),
        ("float32", 20, 3, True),
        pytest.param("bfloat16", None, 0, False, marks=SLOW),
        pytest.param("float32", None, 0, False, marks=SLOW),
        pytest.param("bfloat16", 20, 3, False, marks=SLOW),
        pytest.param("bfloat16", 20, 3, True, marks=SLOW),
    ],
)
def test_gradients_equal_dense(dtype: str, window: int | None, sinks: int, separable: bool) -> None:
    x = _inputs(jnp.dtype(dtype))
    allowed = jnp.asarray(mask_BTS(SEGMENTS_BT, window, sinks, RANK_BT))
    cot = jnp.asarray(np.random.default_rng(5).normal(size=(B, T, N, H)), jnp.float32)

    def kernel(x):
        y = _kernel(x, window=window, sinks=sinks, separable=separable)
        return y.astype(jnp.float32)

    def dense(x):  # the same inputs in float32: only the kernel's roundings differ
        x32 = {key: value.astype(jnp.float32) for key, value in x.items()}
        y = attention_jnp(x32["q"], x32["k"], x32["v"], _bias_BNTS(x32), allowed)
        return y

    y, pull = jax.vjp(jax.jit(kernel), x)
    y_ref, pull_ref = jax.vjp(dense, x)
    (grads,), (grads_ref,) = jax.jit(pull)(cot), pull_ref(cot)
    assert_close(y, y_ref, dtype=dtype, summands=T, roundings=2)
    pairs = B * T * T // 2  # what a parameter's gradient sums over
    for key, summands in [("q", T), ("k", T), ("v", T), ("c", T), ("slopes", pairs)]:
        assert grads[key].dtype == x[key].dtype
        assert_close(grads[key], grads_ref[key], dtype=dtype, summands=summands, roundings=4)
    assert_close(grads["table"], grads_ref["table"], dtype=dtype, summands=pairs, roundings=4)


@pytest.mark.parametrize(
    ("window", "sinks", "offset"),
    [(None, 0, 0), (9, 0, 0), (9, 2, 0), (40, 0, 0), (None, 0, 32), (9, 0, 32), (9, 2, 32)],
)
def test_tile_walks_skip_exactly_the_empty_pairs(
    window: int | None, sinks: int, offset: int
) -> None:
    """The forward / dq walks (key tiles of a query tile) and the dk / dv walks (query tiles
    of a key tile) compute the same tile pairs: those that meet the causal band (and the
    window's, or hold a sink) and whose segment ranges meet. So no pair with an allowed
    entry is skipped, and pairs outside the window's band or across segments are. A pair
    the kernels run without the mask (``Plan.full``) has every entry allowed. With a
    query offset (:mod:`copejax.ops.kernels.offset`) query row r is token ``offset + r``."""
    plan = Plan(16, 8, (80 - offset) // 16, 10, window, sinks, 1, (), True, q_offset=offset)
    segments = np.r_[[0] * 30, [1] * 25, [2] * 25].astype(np.int32)
    rank = np.r_[np.arange(30), np.arange(25), np.arange(25)].astype(np.int32)
    allowed = mask_BTS(segments[None], window, sinks, rank[None])[0]
    skipped, full = 0, 0
    for qi in range(plan.count_q):
        first, end = (int(x) for x in plan.key_tiles(jnp.int32(qi)))
        for kj in range(plan.count_k):
            qs = np.arange(offset + qi * 16, offset + qi * 16 + 16)  # tokens
            ks = np.arange(kj * 8, kj * 8 + 8)
            args = (jnp.int32(qi * 16), jnp.int32(kj * 8), segments[qs], segments[ks], rank[ks])
            live = first <= kj < end and bool(plan.live(*args))
            q_first, q_end = (int(x) for x in plan.query_tiles(jnp.int32(kj)))
            assert live == (q_first <= qi < q_end and bool(plan.live(*args)))
            distance = qs[:, None] - ks[None, :]
            near = (distance >= 0) & (distance < (window or 10**9))
            if sinks:
                near |= (distance >= 0) & (rank[ks] < sinks)[None, :]
            segments_meet = set(segments[qs]) & set(segments[ks])
            assert live == (near.any() and bool(segments_meet)), (qi, kj)
            if allowed[np.ix_(qs, ks)].any():
                assert live
                np.testing.assert_array_equal(plan.allowed_QK(*args), allowed[np.ix_(qs, ks)])
            skipped += (kj * 8 <= qs[-1]) and not live
            if bool(plan.full(*args[:4])):
                assert live and allowed[np.ix_(qs, ks)].all(), (qi, kj)
                full += 1
            elif sinks == 0:  # with sinks a pair may be all allowed through them
                assert not allowed[np.ix_(qs, ks)].all(), (qi, kj)
    assert skipped > 0  # segment 2's queries skip segment 0's keys at least
    # no (16, 8) pair fits inside a window of 9
    assert (full > 0) == (window is None or window >= 16 + 8 - 1)


def test_full_pairs_run_without_the_mask_to_the_same_values() -> None:
    """Row 0 is one document, so its pairs below the diagonal are full (``Plan.full``): the
    GPU softmax kernels run them in a second body, without the mask's compares and selects
    (twice the matmuls in the kernels' jaxprs). Masking every pair instead (the benchmark's
    lever) gives the same values and gradients."""
    x = _inputs(jnp.float32)
    cot = jnp.asarray(np.random.default_rng(4).normal(size=(B, T, N, H)), jnp.float32)
    full, masked = full_and_masked(functools.partial(_kernel, window=None, sinks=0), x, cot)
    assert [total(full), total(masked)] == [18, 9]  # forward 2, dq 3, dk / dv 4 per pair


def test_lowers_to_triton() -> None:
    """Every op of the forward and both backward kernels has a Triton lowering (the GPU
    backend), checked from the CPU: lowering, not compiling, needs no GPU."""
    x = _inputs(jnp.bfloat16)

    def loss(x):
        y = _kernel(x, window=20, sinks=3, interpret=False)
        return jnp.sum(y.astype(jnp.float32))

    lowered = lower_for_gpu(jax.jit(jax.grad(loss)), x)
    text = lowered.as_text()
    for name in ("copejax_attention_forward", "copejax_attention_dq", "copejax_attention_dkdv"):
        assert name in text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_q": 24}, "power of two"),
        ({"block_k": 8}, "block must be an integer >= 16"),
        ({"window": 0}, "window must be a positive integer"),
        ({"window": 4, "sink_tokens": 2, "k_rank_BT": None}, "sink_tokens needs k_rank_BT"),
    ],
)
def test_refuses_bad_arguments(kwargs: dict, message: str) -> None:
    x = _inputs(jnp.float32)
    args = {
        "q_positions_BT": jnp.asarray(POSITIONS_BT),
        "k_positions_BT": jnp.asarray(POSITIONS_BT),
        "segment_ids_BT": jnp.asarray(SEGMENTS_BT),
        **kwargs,
    }
    with pytest.raises(ValueError, match=message):
        fused_attention(x["q"], x["k"], x["v"], **args)
