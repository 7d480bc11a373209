"""What the fused kernels' backward programs share (issue 45): the terms' pull-backs and the
key tile program's running sums.

A pair's score cotangent ``dS`` (Q, K) pulled back through the terms' tile biases
(:func:`copejax.ops.kernels.terms.tile_bias_QK`, differentiated with ``jax.vjp`` inside the
kernel) gives a dq program its per-query values' gradients (FoX: row sums of dS) and a dk/dv
program its per-key values' (FoX: minus the column sums) and parameters' gradients; each is
added to the program's running sums over the pairs it walks. The softmax backward, the
stick-breaking one and the term kernels (CoPE, Shaw, selective) share this, whatever their
dS is. A term that brings its parameters' pull-back (T5's table, FIRE's MLP:
:func:`~copejax.ops.kernels.terms.pulled_by_hand`) is pulled back by it in the dk / dv programs,
CoPE's dk / dv and selective attention's backward (:func:`terms_vjp`).

``inputs`` is a pair's (params, q values, k values, q positions, k positions), the lists
with None where a term has no such array, as :func:`copejax.ops.kernels.tiles.scores_QK`
reads it. Shape letters: Q / K the tile's queries / keys, H head dim, W value width.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from copejax.ops.kernels.exact_dots import pieces_dot
from copejax.ops.kernels.separable import is_separable, outer_sum
from copejax.ops.kernels.terms import TermTile, pulled_by_hand, tile_bias_QK
from copejax.ops.kernels.tiles import Plan


def add_present(sums: list, grads: list) -> list:
    """``sums`` plus the entries of ``grads`` that are not None, in order (a term without
    such an array has None there and no running sum)."""
    present = [g for g in grads if g is not None]
    return [s + g for s, g in zip(sums, present, strict=True)]


def pull_query_values(plan: Plan, ds_QK: jax.Array, inputs: tuple, sums: list) -> list:
    """A dq program's per-query value sums plus this pair's pull-back of ``ds_QK``: through
    a separable term's row (:mod:`copejax.ops.kernels.separable`) from dS's row sums, through
    the others' tile functions by autodiff."""
    if not sums:
        return sums
    params, q_values, k_values, q_pos_Q, k_pos_K = inputs
    rows = [is_separable(b) for b in plan.biases]
    tiles = [i for i, sep in enumerate(rows) if not sep]
    pick = lambda xs: [xs[i] for i in tiles]

    def bias(qv: list) -> jax.Array:
        arrays = (pick(params), qv, pick(k_values))
        return tile_bias_QK(tuple(pick(plan.biases)), arrays, q_pos_Q, k_pos_K)

    grads = [None] * len(q_values)
    for i, g in zip(tiles, jax.vjp(bias, pick(q_values))[1](ds_QK)[0], strict=True):
        grads[i] = g
    for i in (i for i, sep in enumerate(rows) if sep and q_values[i] is not None):
        _, _, pull = _separable_vjp(
            plan.biases[i],
            params[i],
            values=(q_values[i], k_values[i]),
            positions=(q_pos_Q, k_pos_K),
        )
        grads[i] = pull(jnp.sum(ds_QK, axis=-1), None)[1]
    return add_present(sums, grads)


def pull_key_values_and_params(
    plan: Plan, ds_QK: jax.Array, inputs: tuple, key_sums: list, param_sums: list
) -> tuple[list, list]:
    """A dk/dv program's per-key value and parameter sums plus this pair's pull-backs."""
    if not (key_sums or param_sums):
        return key_sums, param_sums
    params, q_values, k_values, q_pos_Q, k_pos_K = inputs
    arrays = (params, q_values, k_values)
    _, pull = terms_vjp(
        plan.biases, arrays, q_pos_Q, k_pos_K, with_bias=False, key_sums_on_tensor_cores=True
    )
    g_params, _, g_kv = pull(ds_QK)
    return add_present(key_sums, g_kv), add_present(param_sums, g_params)


def terms_vjp(
    biases: tuple,
    arrays: tuple[list, list, list],
    q_pos_Q: jax.Array,
    k_pos_K: jax.Array,
    *,
    with_bias: bool = True,
    key_sums_on_tensor_cores: bool = False,
) -> tuple[jax.Array, Callable]:
    """``jax.vjp`` of :func:`~copejax.ops.kernels.terms.tile_bias_QK` in (params, q values,
    k values), except that a term pulled by hand (:func:`~copejax.ops.kernels.terms.
    pulled_by_hand`) is evaluated as is and its parameters pulled back by its
    ``pull_params``: (bias_QK, pull), ``pull(ds_QK)`` giving the three lists of gradients
    (None where a term has no such array). ``with_bias=False``: the terms pulled by hand are
    left out of bias_QK (a caller that reads only ``pull``: a kernel lowers dead code too).

    A separable term (:mod:`copejax.ops.kernels.separable`) is pulled back through its row
    and column from dS's row and column sums; ``key_sums_on_tensor_cores``: the column sums
    as :func:`key_sums_K` takes them on a GPU (the dk / dv programs of
    :mod:`copejax.ops.kernels.key_tile`; in selective attention's backward, which keeps the
    sum, that matmul added 175 PTX instructions and 96 bytes of spill)."""
    params, q_values, k_values = arrays
    by_hand = [pulled_by_hand(b) for b in biases]
    rows = [is_separable(b) for b in biases]
    auto = [i for i, (hand, sep) in enumerate(zip(by_hand, rows, strict=True)) if not (hand or sep)]
    pick = lambda xs: [xs[i] for i in auto]
    for i, hand in enumerate(by_hand):
        if hand and (q_values[i] is not None or k_values[i] is not None):
            raise ValueError(f"term {i} brings pull_params but has per-query or per-key values")

    def bias(p: list, qv: list, kv: list) -> jax.Array:
        return tile_bias_QK(tuple(pick(biases)), (p, qv, kv), q_pos_Q, k_pos_K)

    bias_QK, pull_auto = jax.vjp(bias, pick(params), pick(q_values), pick(k_values))
    tiles = {i: TermTile(q_pos_Q, k_pos_K, None, None) for i, hand in enumerate(by_hand) if hand}
    for i, tile in tiles.items() if with_bias else ():
        bias_QK = bias_QK + biases[i](params[i], tile).astype(jnp.float32)
    separable = [i for i, sep in enumerate(rows) if sep]
    sides = {
        i: _separable_vjp(
            biases[i], params[i], values=(q_values[i], k_values[i]), positions=(q_pos_Q, k_pos_K)
        )
        for i in separable
    }
    for row_Q, col_K, _ in sides.values():
        bias_QK = bias_QK + outer_sum(row_Q, col_K)

    def pull(ds_QK: jax.Array) -> tuple[list, list, list]:
        grads = [[None] * len(params) for _ in range(3)]
        for got, into in zip(pull_auto(ds_QK), grads, strict=True):
            for i, g in zip(auto, got, strict=True):
                into[i] = g
        for i, tile in tiles.items():
            grads[0][i] = biases[i].pull_params(params[i], tile, ds_QK)
        if sides:
            g_row_Q = jnp.sum(ds_QK, axis=-1)
            on_cores = key_sums_on_tensor_cores and k_pos_K.ndim == 1  # the GPU's layout
            g_col_K = key_sums_K(ds_QK) if on_cores else jnp.sum(ds_QK, axis=0)
        for i, (_, _, pull_sides) in sides.items():
            grads[0][i], grads[1][i], grads[2][i] = pull_sides(g_row_Q, g_col_K)
        return grads[0], grads[1], grads[2]

    return bias_QK, pull


def _separable_vjp(
    bias: Any, params_P: Any, *, values: tuple, positions: tuple
) -> tuple[jax.Array, jax.Array, Callable]:
    """A separable term's row, column and the pull-back of their cotangents (the row and
    column sums of dS) to (params, q values, k values); ``values`` and ``positions``: the
    tile's (queries', keys')."""
    (q_values_Q, k_values_K), (q_pos_Q, k_pos_K) = values, positions
    origin = bias.origin(params_P, q_pos_Q, q_values_Q)
    row_Q, pull_row = jax.vjp(lambda p, v: bias.row(p, q_pos_Q, v, origin), params_P, q_values_Q)
    col_K, pull_col = jax.vjp(
        lambda p, v: bias.col(p, k_pos_K, v, origin, 1.0), params_P, k_values_K
    )

    def pull(g_row_Q: jax.Array, g_col_K: jax.Array | None) -> tuple:
        """(params, q values, k values) gradients; ``g_col_K`` None: the row's alone."""
        g_p, g_q = pull_row(g_row_Q)
        if g_col_K is None:
            return g_p, g_q, None
        g_p_col, g_k = pull_col(g_col_K)
        return None if params_P is None else g_p + g_p_col, g_q, g_k

    return row_Q, col_K, pull


def key_sums_K(ds_QK: jax.Array) -> jax.Array:
    """Each key's sum of dS over the tile's queries, float32 (K,), as the GPU kernels take
    it: a float32-exact matmul on the tensor cores, ``dS^T e_0`` in bfloat16 pieces
    (:func:`~copejax.ops.kernels.exact_dots.pieces_dot`). As a sum, a reduction across the
    warpgroup's rows, Triton computed the pair's softmax twice: FoX's dk / dv kernel held
    2,826 PTX instructions, 1,722 without its column sums, 2,374 with this."""
    first_QC = jax.lax.broadcasted_iota(jnp.int32, (ds_QK.shape[0], 16), 1) == 0
    sums_KC = pieces_dot(ds_QK, first_QC.astype(jnp.float32), (0, 0), False)
    return jnp.sum(sums_KC, axis=1)


def key_tile_sums(plan: Plan, k_KH: jax.Array, v_KW: jax.Array, refs: tuple) -> tuple:
    """A dk/dv program's running sums, zero: (dk_KH, dv_KW, per-key values, parameters),
    float32; ``refs`` = (per-key value gradient refs, parameter gradient refs)."""
    dkv_refs, dp_refs = refs
    return (
        jnp.zeros(k_KH.shape, jnp.float32),
        jnp.zeros(v_KW.shape, jnp.float32),
        [jnp.zeros((plan.size_k,), jnp.float32) for _ in dkv_refs],
        [jnp.zeros(r.shape, jnp.float32) for r in dp_refs],
    )


def write_key_tile_sums(
    sums: tuple, dk_ref: Any, dv_ref: Any, refs: tuple, at: tuple | None = None
) -> None:
    """Writes a dk/dv program's sums (:func:`key_tile_sums`'s order) to its output refs: their
    blocks, or ``at`` = (the key tile's rows, its parameter row) of whole-row refs."""
    dk_KH, dv_KW, dkv, dparams = sums
    dkv_refs, dp_refs = refs
    keys, row = (slice(None), None) if at is None else at
    dk_ref[keys, :] = dk_KH.astype(dk_ref.dtype)
    dv_ref[keys, :] = dv_KW.astype(dv_ref.dtype)
    for ref, value in zip(dkv_refs, dkv, strict=True):
        ref[keys] = value
    for ref, value in zip(dp_refs, dparams, strict=True):
        if row is None:
            ref[...] = value
        else:
            ref[row, :] = value[None, :]
