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

from copejax.ops.kernels.terms import TermTile, pulled_by_hand, tile_bias_QK
from copejax.ops.kernels.tiles import Plan


def add_present(sums: list, grads: list) -> list:
    """``sums`` plus the entries of ``grads`` that are not None, in order (a term without
    such an array has None there and no running sum)."""
    present = [g for g in grads if g is not None]
    return [s + g for s, g in zip(sums, present, strict=True)]


def pull_query_values(plan: Plan, ds_QK: jax.Array, inputs: tuple, sums: list) -> list:
    """A dq program's per-query value sums plus this pair's pull-back of ``ds_QK``."""
    if not sums:
        return sums
    params, q_values, k_values, q_pos_Q, k_pos_K = inputs

    def bias(qv: list) -> jax.Array:
        return tile_bias_QK(plan.biases, (params, qv, k_values), q_pos_Q, k_pos_K)

    return add_present(sums, jax.vjp(bias, q_values)[1](ds_QK)[0])


def pull_key_values_and_params(
    plan: Plan, ds_QK: jax.Array, inputs: tuple, key_sums: list, param_sums: list
) -> tuple[list, list]:
    """A dk/dv program's per-key value and parameter sums plus this pair's pull-backs."""
    if not (key_sums or param_sums):
        return key_sums, param_sums
    params, q_values, k_values, q_pos_Q, k_pos_K = inputs
    arrays = (params, q_values, k_values)
    _, pull = terms_vjp(plan.biases, arrays, q_pos_Q, k_pos_K, with_bias=False)
    g_params, _, g_kv = pull(ds_QK)
    return add_present(key_sums, g_kv), add_present(param_sums, g_params)


def terms_vjp(
    biases: tuple,
    arrays: tuple[list, list, list],
    q_pos_Q: jax.Array,
    k_pos_K: jax.Array,
    *,
    with_bias: bool = True,
) -> tuple[jax.Array, Callable]:
    """``jax.vjp`` of :func:`~copejax.ops.kernels.terms.tile_bias_QK` in (params, q values,
    k values), except that a term pulled by hand (:func:`~copejax.ops.kernels.terms.
    pulled_by_hand`) is evaluated as is and its parameters pulled back by its
    ``pull_params``: (bias_QK, pull), ``pull(ds_QK)`` giving the three lists of gradients
    (None where a term has no such array). ``with_bias=False``: the terms pulled by hand are
    left out of bias_QK (a caller that reads only ``pull``: a kernel lowers dead code too)."""
    params, q_values, k_values = arrays
    by_hand = [pulled_by_hand(b) for b in biases]
    auto = [i for i, hand in enumerate(by_hand) if not hand]
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

    def pull(ds_QK: jax.Array) -> tuple[list, list, list]:
        grads = [[None] * len(params) for _ in range(3)]
        for got, into in zip(pull_auto(ds_QK), grads, strict=True):
            for i, g in zip(auto, got, strict=True):
                into[i] = g
        for i, tile in tiles.items():
            grads[0][i] = biases[i].pull_params(params[i], tile, ds_QK)
        return grads[0], grads[1], grads[2]

    return bias_QK, pull


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
