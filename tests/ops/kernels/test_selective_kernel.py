"""Selective attention's penalties in the fused kernels (arXiv 2410.02703) against a dense
reference of the paper's equations.

``S_kj = relu(q_k . k_j / sqrt(H))`` of the selecting head (zero unless j < k in one segment
and j is not the segment's first token), ``F_ij = sum_{k < i} S_kj`` subtracted from every
head's logits: values against NumPy in float64, gradients of q, k, v (every head) against
``jax.vjp`` of the dense float32 maths, which also equals the model's naive-path cores
(``copejax.ops.selective``); grouped KV heads, packed segments, a window with sinks, lengths
of several tiles (padded). The whole model against its naive path is in
``test_kernel_registry.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.ops import segments
from copejax.ops.kernels import selective_prefix
from copejax.ops.kernels.attention import fused_attention
from copejax.ops.kernels.cope import CopeStatic, CopeTerm
from copejax.ops.kernels.gpu_lowering import lower_for_gpu
from copejax.ops.kernels.selective import SelectiveTerm
from copejax.ops.kernels.selective_prefix import call_tiles, prefix_call, rows_of
from copejax.ops.kernels.terms import KernelTerm
from copejax.ops.kernels.tiles import Plan
from copejax.ops.selective import accumulated_penalty_BTS, selection_BTS
from tests.conftest import tiny_config
from tests.ops.kernels.reference import attention_jnp, attention_numpy, mask_BTS
from tests.ops.kernels.test_fused_attention import _decay, _slope
from tests.ops.kernels.tolerances import assert_close

SLOW = pytest.mark.slow
# Default cases: 3 tiles of 16, the last padded; the slow ones: 72 keys in tiles of 32 / 16.
SMALL = {"T": 40, "N": 2, "G": 1, "block_q": 16, "block_k": 16, "segments": (17, 15, 8)}
LARGE = {"T": 72, "N": 4, "G": 2, "block_q": 32, "block_k": 16, "segments": (30, 25, 17)}
SMALL_MHA = {**SMALL, "G": 2}  # no grouped heads: dk and dv in the inputs' dtype
B, H, HEAD = 2, 16, 1  # the selecting head reads key/value head HEAD // (N / G)


def _layout(shape: dict) -> tuple[np.ndarray, np.ndarray]:
    """(segment ids, rank in segment) (B, T): row 0 one document, row 1 packed."""
    lengths = shape["segments"]
    ids = np.array([[0] * shape["T"], np.repeat(np.arange(len(lengths)), lengths)], np.int32)
    rank = np.array([np.arange(shape["T"]), np.concatenate([np.arange(n) for n in lengths])])
    return ids, rank.astype(np.int32)


def _inputs(shape: dict, dtype, seed: int = 0, terms: bool = False) -> dict:
    """q, k, v; with ``terms`` also two other terms' arrays: ALiBi-like slopes (N, 1) and
    FoX-like per-token values (B, T, N)."""
    rng = np.random.default_rng(seed)
    normal = lambda *s: jnp.asarray(rng.normal(size=s), dtype)
    t, n, g = shape["T"], shape["N"], shape["G"]
    x = {"q": normal(B, t, n, H), "k": normal(B, t, g, H), "v": normal(B, t, g, H)}
    if terms:
        x["slopes"] = jnp.asarray(rng.uniform(0.05, 0.5, (n, 1)), jnp.float32)
        x["c"] = jnp.asarray(np.cumsum(-rng.uniform(0, 0.3, (B, t, n)), axis=1), jnp.float32)
    return x


def _terms_BNTS(x: dict, rank_BT: np.ndarray, xp=jnp):
    """The other terms' dense bias: -slope_n (i - j) + c_i - c_j (positions: segment ranks)."""
    if "slopes" not in x:
        return 0.0
    distance = (rank_BT[:, :, None] - rank_BT[:, None, :]).astype(np.float32)
    slopes, c = xp.asarray(x["slopes"], xp.float32), xp.moveaxis(xp.asarray(x["c"]), 2, 1)
    return -slopes[None, :, :1, None] * distance[:, None] + c[:, :, :, None] - c[:, :, None, :]


def penalty_BTS(q, k, ids_BT, nonlinearity: str, *, xp=jnp):
    """F_ij = sum_{k < i} S_kj from the paper's equations (Section 3), float64 with
    ``xp=np``."""
    groups = q.shape[2] // k.shape[2]
    logits = xp.einsum("bth,bsh->bts", q[:, :, HEAD], k[:, :, HEAD // groups])
    logits = logits / np.sqrt(q.shape[-1])
    index = np.arange(ids_BT.shape[1])
    first = np.concatenate([np.ones((B, 1), bool), ids_BT[:, 1:] != ids_BT[:, :-1]], axis=1)
    keep = index[None, :, None] > index[None, None, :]
    keep = keep & (ids_BT[:, :, None] == ids_BT[:, None, :]) & ~first[:, None, :]
    if nonlinearity == "relu":
        s = xp.maximum(logits, 0.0)
    else:
        s = 1.0 / (1.0 + xp.exp(-logits))
    s = xp.where(keep, s, 0.0)
    return xp.cumsum(s, axis=1) - s


def _kernel(
    x: dict,
    shape: dict,
    window,
    sinks: int,
    *,
    nonlinearity="relu",
    interpret=None,
    backend: str = "triton",
):
    ids, rank = _layout(shape)
    positions = jnp.asarray(rank)
    terms = []
    if "slopes" in x:
        terms = [
            KernelTerm("slope", _slope, params_NP=x["slopes"]),
            KernelTerm("decay", _decay, q_values_BTN=x["c"], k_values_BSN=x["c"]),
        ]
    return fused_attention(
        x["q"],
        x["k"],
        x["v"],
        q_positions_BT=positions,
        k_positions_BT=positions,
        segment_ids_BT=jnp.asarray(ids),
        window=window,
        sink_tokens=sinks,
        k_rank_BT=jnp.asarray(rank),
        block_q=shape["block_q"],
        block_k=shape["block_k"],
        interpret=interpret,
        terms=terms,
        selective=SelectiveTerm(HEAD, nonlinearity),
        backend=backend,
    )


def _check(
    shape: dict,
    dtype: str,
    window,
    sinks: int,
    *,
    nonlinearity: str = "relu",
    terms: bool = False,
    backend: str = "triton",
) -> None:
    """Values (float32 inputs: against NumPy float64) and the gradients of q, k, v and the
    other terms' arrays (the kernels of ``backend``, in interpret mode on the CPU)."""
    x = _inputs(shape, jnp.dtype(dtype), terms=terms)
    ids, rank = _layout(shape)
    allowed = mask_BTS(ids, window, sinks, rank)
    length = shape["T"]
    cot = np.random.default_rng(5).normal(size=(B, length, shape["N"], H))
    cot = jnp.asarray(cot, jnp.float32)

    def kernel(x):
        y = _kernel(x, shape, window, sinks, nonlinearity=nonlinearity, backend=backend)
        return y.astype(jnp.float32)

    def dense(x, frozen: bool = False):  # the same inputs in float32: only roundings differ
        x32 = {key: value.astype(jnp.float32) for key, value in x.items()}
        f = penalty_BTS(x32["q"], x32["k"], ids, nonlinearity)
        f = jax.lax.stop_gradient(f) if frozen else f
        bias = _terms_BNTS(x32, rank) - f[:, None]
        return attention_jnp(x32["q"], x32["k"], x32["v"], bias, jnp.asarray(allowed))

    def with_grads(function, x, cot):  # one compilation of the kernels, forward and backward
        y, pull = jax.vjp(function, x)
        return y, pull(cot)[0]

    y, grads = jax.jit(functools.partial(with_grads, kernel))(x, cot)

    def references(x, cot):  # with F, and with F held constant: one compilation
        frozen = functools.partial(dense, frozen=True)
        return with_grads(dense, x, cot), with_grads(frozen, x, cot)[1]

    (y_ref, grads_ref), frozen = jax.jit(references)(x, cot)
    if dtype == "float32":
        x64 = {key: np.asarray(value, np.float64) for key, value in x.items()}
        f64 = penalty_BTS(x64["q"], x64["k"], ids, nonlinearity, xp=np)
        bias = _terms_BNTS(x64, rank, np) - f64[:, None]
        expected = attention_numpy(x64["q"], x64["k"], x64["v"], bias, allowed)
        assert_close(y, expected, dtype=dtype, summands=length, roundings=0)
        assert float(np.max(np.where(allowed, f64, 0))) > 1.0  # the penalties are live
    assert_close(y, y_ref, dtype=dtype, summands=length, roundings=2)
    # F sums up to T selections into each logit, and its gradient up to T queries' dF
    pairs = B * length * length // 2  # what a parameter's gradient sums over
    for key in x:
        assert grads[key].dtype == x[key].dtype
        summands = pairs if key == "slopes" else 2 * length
        assert_close(grads[key], grads_ref[key], dtype=dtype, summands=summands, roundings=4)
    # The selecting head's q and k get the selection's gradient, not a constant F's.
    for key, head in (("q", HEAD), ("k", HEAD // (shape["N"] // shape["G"]))):
        gap = np.abs(np.asarray(grads_ref[key] - frozen[key], np.float32)[:, :, head])
        assert gap.max() > 0.05 * np.abs(np.asarray(grads_ref[key], np.float32)).max()


def test_small_float32_window_sinks_gqa_packed() -> None:
    _check(SMALL, "float32", window=12, sinks=2, terms=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_small_without_grouped_heads(dtype: str) -> None:
    """One key/value head per query head: the selecting head's dk is summed in float32 with
    the selection's inside the backward kernel and rounded once."""
    _check(SMALL_MHA, dtype, window=None, sinks=0, terms=True)


def test_large_penalties_keep_float32_precision() -> None:
    """F reaching ~540 (T = 128, large selections): the backward recomputes each pair's F as
    the forward does (P summed from zero in the prefix kernel's order), so the gradients stay
    within a few float32 eps of the dense float32 path's. Recovering P as a difference from its
    total instead put errors of eps * P_top on every pair: ~180 eps here."""
    length = 128
    shape = {"T": length, "N": 2, "G": 2, "block_q": 16, "block_k": 16}
    shape["segments"] = (length - 20, 20)
    x = _inputs(shape, jnp.float32)
    x = {key: value * (3.0 if key in "qk" else 1.0) for key, value in x.items()}
    ids, rank = _layout(shape)
    allowed = mask_BTS(ids, None, 0, rank)
    cot = jnp.asarray(np.random.default_rng(5).normal(size=(B, length, 2, H)), jnp.float32)

    def dense(x):
        f = penalty_BTS(x["q"], x["k"], ids, "relu")
        return attention_jnp(x["q"], x["k"], x["v"], -f[:, None], jnp.asarray(allowed))

    def grads(function, x):
        return jax.vjp(function, x)[1](cot)[0]

    kernel = functools.partial(_kernel, shape=shape, window=None, sinks=0)
    got = jax.jit(functools.partial(grads, lambda x: kernel(x).astype(jnp.float32)))(x)
    want = jax.jit(functools.partial(grads, dense))(x)
    f = np.where(allowed, np.asarray(penalty_BTS(x["q"], x["k"], ids, "relu")), 0.0)
    assert f.max() > 500.0
    eps = float(jnp.finfo(jnp.float32).eps)
    for key in "qkv":
        error = float(jnp.max(jnp.abs(got[key] - want[key])) / jnp.max(jnp.abs(want[key])))
        assert error < 50 * eps, (key, error / eps)


@pytest.mark.parametrize("cap", [1, 2])
def test_forward_in_calls_of_few_query_tiles(monkeypatch: pytest.MonkeyPatch, cap: int) -> None:
    """The forward as a loop of calls of ``cap`` query tiles (three tiles: with 2, the last
    call padded), the prefix carried from call to call: the same values and gradients."""
    monkeypatch.setattr(selective_prefix, "MAX_CALL_TILES", cap)
    _check(SMALL, "float32", window=12, sinks=2, terms=True)


@SLOW
def test_several_tiles_in_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Grouped heads, a window with sinks and other terms in bfloat16, the forward in calls of
    two query tiles of 32 (the second padded)."""
    monkeypatch.setattr(selective_prefix, "MAX_CALL_TILES", 2)
    _check(LARGE, "bfloat16", 20, 3, terms=True)


def test_forward_calls_keep_the_prefix_within_the_queries_bytes() -> None:
    """One call where P (B, rows, S) float32 fits in the queries' (B, T, N, H) bytes, else
    calls of R tiles with P's within them: issue 45's (2, 4, 64) and (4, 16, 128) in
    bfloat16, tiles of 64."""
    for tiles, heads, dim, length in ((256, 4, 64, 16384), (1024, 4, 64, 65536)):
        r = call_tiles(tiles, heads, dim, 2)
        assert r == 128 and r * length * 4 <= length * heads * dim * 2
    assert call_tiles(256, 16, 128, 2) == 256  # T = 16384: one call
    assert call_tiles(3, 2, 16, 4) == rows_of(3)  # short: one call, rows padded as before
    assert call_tiles(4096, 1, 16, 2) == selective_prefix.MIN_CALL_TILES


@SLOW
@pytest.mark.parametrize(
    ("dtype", "window", "sinks", "nonlinearity", "terms"),
    [
        ("float32", None, 0, "relu", False),
        ("float32", 20, 3, "relu", True),
        ("float32", 20, 0, "sigmoid", False),
        ("bfloat16", None, 0, "relu", True),
        ("bfloat16", 20, 3, "relu", False),
    ],
)
def test_several_tiles(dtype: str, window, sinks: int, nonlinearity: str, terms: bool) -> None:
    _check(LARGE, dtype, window, sinks, nonlinearity=nonlinearity, terms=terms)


@SLOW
@pytest.mark.parametrize("window", [None, 12])
def test_reference_is_the_naive_path(window) -> None:
    """The dense F equals the model's naive-path cores (``selection_BTS`` on the layer's
    mask, window included, then ``accumulated_penalty_BTS``) on every allowed pair: the
    window, which the kernels leave out of S, changes no F a query sees."""
    x = _inputs(SMALL, jnp.float32)
    ids, rank = _layout(SMALL)
    allowed = mask_BTS(ids, window, 2 if window else 0, rank)
    groups = SMALL["N"] // SMALL["G"]
    logits = jnp.einsum("bth,bsh->bts", x["q"][:, :, HEAD], x["k"][:, :, HEAD // groups]) / 4.0
    index = jnp.arange(SMALL["T"])
    first = segments.segment_starts_BT(jnp.asarray(ids))
    s = selection_BTS(logits, jnp.asarray(allowed), first, index, index)
    naive = accumulated_penalty_BTS(s)
    dense = penalty_BTS(x["q"], x["k"], ids, "relu")
    np.testing.assert_allclose(np.where(allowed, naive, 0), np.where(allowed, dense, 0), atol=1e-5)
    assert float(jnp.max(jnp.where(allowed, dense, 0))) > 1.0  # the penalties are live


@SLOW
def test_prefix_sums_the_older_query_tiles() -> None:
    """P[g, j] = sum over the queries before query tile g of S_kj."""
    x = _inputs(LARGE, jnp.float32)
    ids, _ = _layout(LARGE)
    padded, size_q, size_k = 96, LARGE["block_q"], LARGE["block_k"]  # 3 query tiles, 6 key
    plan = Plan(size_q, size_k, 3, 6, None, 0, 2, (), True)
    pad = lambda a, value: np.pad(a, ((0, 0), (0, padded - a.shape[1])), constant_values=value)
    ids_q, ids_k = pad(ids, -1), pad(ids, -2)
    starts = np.asarray(segments.segment_starts_BT(jnp.asarray(ids_k)), np.int32)
    ints = {
        "q_seg": jnp.asarray(ids_q),
        "k_seg": jnp.asarray(ids_k),
        "k_start": jnp.asarray(starts),
    }
    q = jnp.pad(x["q"], ((0, 0), (0, padded - 72), (0, 0), (0, 0)))
    k = jnp.pad(x["k"], ((0, 0), (0, padded - 72), (0, 0), (0, 0)))
    prefix = np.asarray(prefix_call(plan, "relu", q, k, head=HEAD, ints=ints)[0])
    assert prefix.shape == (B, rows_of(3), padded)
    x64 = {key: np.asarray(value, np.float64) for key, value in x.items()}
    f = penalty_BTS(x64["q"], x64["k"], ids, "relu", xp=np)  # F at the tiles' first queries
    for g in range(3):
        np.testing.assert_allclose(prefix[:, g, :72], f[:, g * size_q], atol=1e-4)


@pytest.mark.parametrize(
    ("shape", "cap"), [(SMALL, None), (SMALL_MHA, None), (SMALL, 2)], ids=["gqa", "mha", "calls"]
)
def test_lowers_to_triton(monkeypatch: pytest.MonkeyPatch, shape: dict, cap: int | None) -> None:
    """The prefix, forward and backward kernels, with other terms, have Triton lowerings
    (checked from the CPU), the backward's atomic adds included; without grouped heads the
    backward writes dk and dv in the inputs' dtype; and the forward as a loop of calls, their
    first query tile an operand."""
    monkeypatch.setattr(selective_prefix, "MAX_CALL_TILES", cap)
    x = _inputs(shape, jnp.bfloat16, terms=True)

    def loss(x):
        y = _kernel(x, shape, window=12, sinks=2, interpret=False)
        return jnp.sum(y.astype(jnp.float32))

    text = lower_for_gpu(jax.jit(jax.grad(loss)), x).as_text()
    for name in ("selective_prefix", "attention_forward", "selective_backward"):
        assert f"copejax_{name}" in text
    assert "copejax_attention_dq" not in text  # dq comes from the backward's atomic adds


@pytest.mark.parametrize(
    ("selective", "kwargs", "message"),
    [
        (SelectiveTerm(2), {}, r"selective head must be an integer in \[0, 2\), got 2"),
        (SelectiveTerm(0, "tanh"), {}, "selective nonlinearity must be one of"),
        (SelectiveTerm(0), {"normalizer": "stickbreaking", "include_self": False}, "stick"),
        (
            SelectiveTerm(0),
            {"cope": CopeTerm(jnp.zeros((4, H)), CopeStatic(4))},
            r"the terms of copejax.ops.kernels.terms only, got \['cope'\]",
        ),
    ],
)
def test_fused_attention_refuses(selective, kwargs: dict, message: str) -> None:
    x = _inputs(SMALL, jnp.float32)
    ids, rank = _layout(SMALL)
    with pytest.raises(ValueError, match=message):
        fused_attention(
            x["q"],
            x["k"],
            x["v"],
            q_positions_BT=jnp.asarray(rank),
            k_positions_BT=jnp.asarray(rank),
            segment_ids_BT=jnp.asarray(ids),
            selective=selective,
            **kwargs,
        )


@pytest.mark.parametrize(
    ("position", "options", "named"),
    [
        ("selective", {"prune_threshold": 2.0}, "prune_threshold=2.0"),
        ("selective", {"prune_budget": 4}, "prune_budget=4"),
        ("selective+cope", {}, r"its penalties with \['cope'\]"),
        ("selective+stickbreaking", {}, r"\['stickbreaking'\]"),
    ],
)
def test_model_refuses_variants_by_name(position: str, options: dict, named: str) -> None:
    with pytest.raises(ValueError, match=f"no kernel for scheme 'selective': .*{named}"):
        tiny_config(position, attention_impl="kernel", position_options=options)


@pytest.mark.parametrize("position", ["selective", "selective+rope", "selective+fox+alibi"])
def test_model_covers_the_default_options(position: str) -> None:
    assert tiny_config(position, attention_impl="kernel").attention_impl == "kernel"
