"""Separable kernel terms (copejax.ops.kernels.separable): ALiBi's and FoX's tile bias as a
row plus a column, against NumPy; their origin's precision at long positions; the column
sums the GPU's dk / dv programs take on the tensor cores; and what the softmax kernels' walks
do per pair with them (one add: the row stays out of the walk)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model.kernel_alibi import AlibiTile
from copejax.model.kernel_fox import FoxTile
from copejax.ops.kernels.pullbacks import key_sums_K
from copejax.ops.kernels.separable import is_separable, origins, outer_sum, query_rows
from copejax.ops.kernels.terms import KernelTerm, TermTile, tile_bias_QK
from copejax.ops.kernels.tiles import LOG2E
from tests.ops.kernels.full_pairs import kernel_jaxprs
from tests.ops.kernels.test_fused_attention import _inputs, on_layout

Q, K = 16, 32
EPS32 = float(np.finfo(np.float32).eps)


def _alibi_case(rng: np.random.Generator, start: int) -> tuple:
    q_pos = start + rng.integers(0, 64, Q)
    k_pos = start + rng.integers(-64, 64, K)
    slope = rng.uniform(0.01, 0.9)
    exact = -slope * (q_pos[:, None] - k_pos[None, :]).astype(np.float64)
    p = jnp.asarray([slope], jnp.float32)
    pos = (jnp.asarray(q_pos, jnp.int32), jnp.asarray(k_pos, jnp.int32))
    return AlibiTile(), p, pos, (None, None), slope, exact


def _fox_case(rng: np.random.Generator, start: int) -> tuple:
    c = -start * 0.5 + np.cumsum(-rng.uniform(0, 0.5, 128))  # prefix sums of log forget gates
    c = c.astype(np.float32)
    q_c, k_c = c[64 + rng.integers(0, 64, Q)], c[rng.integers(0, 128, K)]
    exact = q_c[:, None].astype(np.float64) - k_c[None, :]
    pos = (jnp.zeros(Q, jnp.int32), jnp.zeros(K, jnp.int32))
    return FoxTile(), None, pos, (jnp.asarray(q_c), jnp.asarray(k_c)), None, exact


CASES = {"alibi": _alibi_case, "fox": _fox_case}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("layout", ["gpu", "tpu"])
def test_the_sides_sum_to_the_tile_function_at_any_origin(name: str, layout: str) -> None:
    """row(o) + col(o) is the term's (Q, K) tile function, and NumPy's maths, whichever
    side's origin is taken (the kernels take the side their walk holds fixed) or none."""
    tile_fn, p, (q_pos, k_pos), (q_v, k_v), _, exact = CASES[name](np.random.default_rng(0), 0)
    assert is_separable(tile_fn)
    if layout == "tpu":  # the Mosaic kernels' (Q, 1) / (1, K)
        q_pos, k_pos = q_pos[:, None], k_pos[None, :]
        q_v, k_v = (None, None) if q_v is None else (q_v[:, None], k_v[None, :])
    tile = TermTile(q_pos, k_pos, q_v, k_v)
    scale = np.max(np.abs(exact))
    dense = np.asarray(tile_fn(p, tile))
    np.testing.assert_allclose(dense, exact, rtol=0, atol=4 * EPS32 * scale)
    for given in (tile_fn.origin(p, q_pos, q_v), tile_fn.origin(p, k_pos, k_v), 3.0):
        origin = jnp.float32(given)
        sides = outer_sum(
            tile_fn.row(p, q_pos, q_v, origin), tile_fn.col(p, k_pos, k_v, origin, 1.0)
        )
        np.testing.assert_allclose(np.asarray(sides), exact, rtol=0, atol=4 * EPS32 * scale)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_origin_keeps_the_sides_exact_at_long_positions(name: str) -> None:
    """At positions near 16,000 the scores' bias (log2 units) as the softmax kernels take it,
    the column plus the row, stays within a few float32 roundings of the tile's largest bias:
    the sides are taken from the tile's origin, so they round at the tile's distances. From
    origin 0 they would round at the positions' magnitude (about 100x here), which this
    bound catches."""
    tile_fn, p, (q_pos, k_pos), (q_v, k_v), _, exact = CASES[name](np.random.default_rng(1), 16000)
    term = KernelTerm(name, tile_fn)
    arrays = ([p], [q_v], [k_v])

    def error(at: list) -> float:
        col_QK, _ = tile_bias_QK((term.bias,), arrays, q_pos, k_pos, LOG2E, at=at, split_rows=True)
        rows_Q = query_rows((term.bias,), [p], [q_v], q_pos, at)
        got = np.asarray(col_QK, np.float64) + np.asarray(rows_Q, np.float64)[:, None] * LOG2E
        want = exact * LOG2E
        return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))

    assert error(origins((term.bias,), [p], [q_v], q_pos)) < 8 * EPS32
    assert error(origins((term.bias,), [p], [k_v], k_pos)) < 8 * EPS32
    assert error([jnp.float32(0.0)]) > 8 * EPS32  # the bound would catch a missing origin


def test_the_column_sums_on_tensor_cores_are_float32_exact() -> None:
    """:func:`key_sums_K` (bfloat16 pieces times a one-hot column) equals float64's column
    sums within float32's summation bound, over entries of very different magnitudes."""
    rng = np.random.default_rng(2)
    ds = rng.normal(size=(64, 32)) * 10.0 ** rng.uniform(-6, 3, (64, 32))
    ds = ds.astype(np.float32)
    got = np.asarray(jax.jit(key_sums_K)(jnp.asarray(ds)), np.float64)
    want = ds.astype(np.float64).sum(axis=0)
    bound = 64 * EPS32 * np.abs(ds).astype(np.float64).sum(axis=0)
    assert np.all(np.abs(got - want) <= bound)
    assert np.all(np.abs(got - ds.sum(axis=0, dtype=np.float32).astype(np.float64)) <= bound)


def _ops_in_walks(jaxpr: jax.extend.core.Jaxpr, shape: tuple, in_walk: bool = False) -> tuple:
    """(elementwise ops with a (Q, K) result, matmuls) inside a kernel's loops: its walk's
    per-pair work, both bodies of a pair (full and masked) counted."""
    tile_ops = dots = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if in_walk and name == "dot_general":
            dots += 1
        elif in_walk and name not in ("broadcast_in_dim", "iota", "jit", "pjit"):
            tile_ops += sum(getattr(v.aval, "shape", None) == shape for v in eqn.outvars)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            a, b = _ops_in_walks(sub, shape, in_walk or name in ("while", "scan"))
            tile_ops, dots = tile_ops + a, dots + b
    return tile_ops, dots


def _walk_ops(terms: Callable, x: dict) -> dict:
    """Each softmax kernel's (per-pair (Q, K) ops, per-pair matmuls), traced."""

    def run(x):
        y = on_layout(x, terms=terms(x), block_q=16, block_k=16, interpret=True)
        return jnp.sum(y * x["cot"])

    jaxpr = jax.make_jaxpr(jax.grad(run))(x).jaxpr
    return {n: _ops_in_walks(j, (16, 16)) for n, j in kernel_jaxprs(jaxpr).items()}


def test_the_softmax_walks_pay_one_add_per_pair_for_alibi_and_fox() -> None:
    """In the plain softmax kernels' forward and dq walks a separable term costs each pair
    one (Q, K) add, the column's, in each body (full and masked): its row stays out of the
    walk (the log-sum-exp takes it), and its column is scaled per key. As (Q, K) tile
    functions they cost three to four more per body. FoX's dk / dv walk takes its column
    sums as three more matmuls per body (:func:`key_sums_K`), not as a reduction. (The dk /
    dv walks' other counts hold dead code that the lowering drops, ALiBi's slope gradient,
    so they are not compared.)"""
    x = dict(_inputs(jnp.float32))
    x["cot"] = jnp.ones(x["q"].shape, jnp.float32)
    heads = x["q"].shape[2]
    slopes = jnp.asarray(np.linspace(0.1, 0.5, heads)[:, None], jnp.float32)
    alibi = lambda x: [KernelTerm("alibi", AlibiTile(), params_NP=slopes)]
    fox = lambda x: [KernelTerm("fox", FoxTile(), q_values_BTN=x["c"], k_values_BSN=x["c"])]
    dense = lambda x: [KernelTerm("alibi", _tile_function(AlibiTile()), params_NP=slopes)]
    nope = _walk_ops(lambda x: [], x)
    walks = ("copejax_attention_forward", "copejax_attention_dq")
    for terms in (alibi, fox):
        got = _walk_ops(terms, x)
        assert {n: got[n][0] - nope[n][0] for n in walks} == dict.fromkeys(walks, 2), got
        assert {n: got[n][1] - nope[n][1] for n in walks} == dict.fromkeys(walks, 0), got
    got = _walk_ops(fox, x)["copejax_attention_dkdv"]
    assert got[1] - nope["copejax_attention_dkdv"][1] == 2 * 3
    got = _walk_ops(dense, x)
    assert all(got[n][0] - nope[n][0] >= 6 for n in walks), got


def _tile_function(separable: Any) -> Callable:
    """A separable term's (Q, K) tile function alone: the kernels cannot take it apart."""

    def tile_fn(p: jax.Array | None, tile: TermTile) -> jax.Array:
        return separable(p, tile)

    return tile_fn
