"""The terms' arrays as kernel operands: block specs and how a kernel body reads them back
(:mod:`copejax.ops.kernels.forward`, :mod:`~copejax.ops.kernels.backward`,
:mod:`~copejax.ops.kernels.stick`), and the zeros that outputs added to with atomics start
from."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from copejax.ops.kernels.tiles import Plan


def term_refs(refs: list, has: tuple[tuple[bool, bool, bool], ...]) -> tuple[list, list, list]:
    """Splits a kernel's term refs (params, q values, k values of each term, those present)
    into three lists with None where a term has no such array."""
    params, q_values, k_values = [], [], []
    it = iter(refs)
    for has_params, has_q, has_k in has:
        params.append(next(it) if has_params else None)
        q_values.append(next(it) if has_q else None)
        k_values.append(next(it) if has_k else None)
    return params, q_values, k_values


def term_operands(
    plan: Plan, terms: list[dict], *, q_block: bool, k_block: bool
) -> tuple[tuple, list, list]:
    """The terms' arrays as kernel operands, with their block specs for a grid
    (b, n, tile): per-query values cut to the program's query tile (``q_block``) or whole,
    per-key values likewise (``k_block``), parameter rows by head. Returns (which arrays
    each term has, operands, specs)."""
    has, operands, specs = [], [], []
    for term in terms:
        has.append(tuple(term[key] is not None for key in ("params", "q", "k")))
        if term["params"] is not None:
            size = term["params"].shape[1]
            operands.append(term["params"])
            specs.append(pl.BlockSpec((None, size), lambda b, n, i: (n, 0)))
        for key, blocked, size in (("q", q_block, plan.size_q), ("k", k_block, plan.size_k)):
            if term[key] is None:
                continue
            operands.append(term[key])
            if blocked:
                specs.append(pl.BlockSpec((None, None, size), lambda b, n, i: (b, n, i)))
            else:
                whole = term[key].shape[2]
                specs.append(pl.BlockSpec((None, None, whole), lambda b, n, i: (b, n, 0)))
    return tuple(has), operands, specs


def per_head_specs(arrays: tuple) -> list[pl.BlockSpec]:
    """Block specs of (N, R, C) arrays (CoPE's parameters) read whole by head, for a grid
    (b, n, tile)."""
    return [pl.BlockSpec((None, *x.shape[1:]), lambda b, n, i: (n, 0, 0)) for x in arrays]


def zeros_after(zero: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """float32 zeros of ``shape`` broadcast from ``zero``, a float32 scalar computed in the
    backward (``D * 0``, which XLA does not fold: D could be inf or NaN), for an output that
    a kernel adds to with atomics, aliased to it. A broadcast of a constant has no operand,
    and XLA's scheduler placed those of selective attention's atomic outputs early in the
    forward, where they raised the layer's peak by their size (40 MiB at T = 16384,
    (B, N, H) = (2, 4, 64), on the H100 target)."""
    return jnp.broadcast_to(zero, shape)
