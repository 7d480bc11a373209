"""The dk / dv kernels' launch on a GPU grid (batch row, head, key tile): the block specs of
their operands and outputs and the terms' gradients they return, shared by the softmax,
stick-breaking and CoPE backward (:mod:`copejax.ops.kernels.backward`) and Shaw's
(:mod:`copejax.ops.kernels.relative_calls`).

Shape letters as in :mod:`copejax.ops.kernels.forward`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from copejax.ops.kernels.tiles import Plan


def dkdv_operand_specs(
    plan: Plan,
    *,
    length_q: int,
    dim: int,
    width: int,
    whole_keys: bool = False,
) -> list[pl.BlockSpec]:
    """The specs of (q, k, v, dO, lse, D, the query ints, the key ints): every query ((T, H) of
    the program's head), the program's key tile of keys and values (its
    key/value head; ``whole_keys``: all of them, for programs that walk several key tiles),
    all output cotangents, log-sum-exps and D, all query ints and the key tile's key ints."""
    groups = plan.groups
    sk, tile = (length_q, lambda j: 0) if whole_keys else (plan.size_k, lambda j: j)
    return [
        pl.BlockSpec((None, length_q, None, dim), lambda b, n, j: (b, 0, n, 0)),
        pl.BlockSpec((None, sk, None, dim), lambda b, n, j: (b, tile(j), n // groups, 0)),
        pl.BlockSpec((None, sk, None, width), lambda b, n, j: (b, tile(j), n // groups, 0)),
        pl.BlockSpec((None, length_q, None, width), lambda b, n, j: (b, 0, n, 0)),
        pl.BlockSpec((None, None, length_q), lambda b, n, j: (b, n, 0)),
        pl.BlockSpec((None, None, length_q), lambda b, n, j: (b, n, 0)),
        pl.BlockSpec((None, length_q), lambda b, n, j: (b, 0)),
        pl.BlockSpec((None, length_q), lambda b, n, j: (b, 0)),
    ] + [pl.BlockSpec((None, sk), lambda b, n, j: (b, tile(j)))] * 3


def dkdv_outputs(
    plan: Plan,
    terms: list[dict],
    *,
    batch: int,
    heads: int,
    length_k: int,
    dim: int,
    width: int,
    dtypes: tuple[jnp.dtype, jnp.dtype] = (jnp.float32, jnp.float32),
    whole_keys: bool = False,
) -> tuple[list[pl.BlockSpec], list[jax.ShapeDtypeStruct]]:
    """The outputs' specs and shapes: dk and dv per query head (float32 with grouped heads,
    to be summed over each group; else ``dtypes``, the keys' and the values'), each term's
    per-key gradient (B, N, S) and parameter rows' partial sum per key tile (B, N, count_k,
    P); blocks of the program's key tile, or with ``whole_keys`` whole rows (programs that
    walk several key tiles)."""
    f32 = jnp.float32
    sk, tile = (length_k, lambda j: 0) if whole_keys else (plan.size_k, lambda j: j)
    rows = plan.count_k if whole_keys else None
    k_sizes = [None for t in terms if t["k"] is not None]
    p_sizes = [t["params"].shape[1] for t in terms if t["params"] is not None]
    out_specs = [
        pl.BlockSpec((None, sk, None, dim), lambda b, n, j: (b, tile(j), n, 0)),
        pl.BlockSpec((None, sk, None, width), lambda b, n, j: (b, tile(j), n, 0)),
    ]
    out_specs += [pl.BlockSpec((None, None, sk), lambda b, n, j: (b, n, tile(j))) for _ in k_sizes]
    out_specs += [
        pl.BlockSpec((None, None, rows, size), lambda b, n, j: (b, n, tile(j), 0))
        for size in p_sizes
    ]
    dk_dtype, dv_dtype = dtypes if plan.groups == 1 else (f32, f32)
    out_shape = [
        jax.ShapeDtypeStruct((batch, length_k, heads, dim), dk_dtype),
        jax.ShapeDtypeStruct((batch, length_k, heads, width), dv_dtype),
    ]
    out_shape += [jax.ShapeDtypeStruct((batch, heads, length_k), f32) for _ in k_sizes]
    out_shape += [jax.ShapeDtypeStruct((batch, heads, plan.count_k, size), f32) for size in p_sizes]
    return out_specs, out_shape


def term_gradients(terms: list[dict], dqv: list, rest: list) -> list[dict]:
    """Each term's gradients {"params", "q", "k"} from the dq kernel's per-query outputs
    ``dqv`` and the dk / dv kernel's per-key and parameter outputs ``rest``, in the order of
    the terms that have them."""
    grads = [{"params": None, "q": None, "k": None} for _ in terms]
    q_terms = [g for g, t in zip(grads, terms, strict=True) if t["q"] is not None]
    k_terms = [g for g, t in zip(grads, terms, strict=True) if t["k"] is not None]
    p_terms = [g for g, t in zip(grads, terms, strict=True) if t["params"] is not None]
    dkv, dparams = rest[: len(k_terms)], rest[len(k_terms) :]
    for key, owners, values in (
        ("q", q_terms, dqv),
        ("k", k_terms, dkv),
        ("params", p_terms, dparams),
    ):
        for grad, value in zip(owners, values, strict=True):
            grad[key] = value
    return grads
