"""What the fused kernels' backward programs share (issue 45): the terms' pull-backs and the
key tile program's running sums.

A pair's score cotangent ``dS`` (Q, K) pulled back through the terms' tile biases
(:func:`copejax.ops.kernels.terms.tile_bias_QK`, differentiated with ``jax.vjp`` inside the
kernel) gives a dq program its per-query values' gradients (FoX: row sums of dS) and a dk/dv
program its per-key values' (FoX: minus the column sums) and parameters' gradients; each is
added to the program's running sums over the pairs it walks. The softmax backward, the
stick-breaking one and the term kernels (CoPE, Shaw, selective) share this, whatever their
dS is.

``inputs`` is a pair's (params, q values, k values, q positions, k positions), the lists
with None where a term has no such array, as :func:`copejax.ops.kernels.tiles.scores_QK`
reads it. Shape letters: Q / K the tile's queries / keys, H head dim, W value width.
"""

from __future__ import annotations

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
    by_hand = [pulled_by_hand(b) for b in plan.biases]
    auto = [i for i, hand in enumerate(by_hand) if not hand]
    pick = lambda xs: [xs[i] for i in auto]

    def bias(p: list, kv: list) -> jax.Array:
        arrays = (p, pick(q_values), kv)
        return tile_bias_QK(tuple(pick(plan.biases)), arrays, q_pos_Q, k_pos_K)

    g_auto, g_kv_auto = jax.vjp(bias, pick(params), pick(k_values))[1](ds_QK)
    g_params, g_kv = [None] * len(params), [None] * len(k_values)
    for i, g, gkv in zip(auto, g_auto, g_kv_auto, strict=True):
        g_params[i], g_kv[i] = g, gkv
    for i, hand in enumerate(by_hand):
        if hand:  # its own pull-back: a term pulled by hand has parameters, no key values
            if k_values[i] is not None:
                raise ValueError(f"term {i} brings pull_params but has per-key values")
            tile = TermTile(q_pos_Q, k_pos_K, q_values[i], k_values[i])
            g_params[i] = plan.biases[i].pull_params(params[i], tile, ds_QK)
    return add_present(key_sums, g_kv), add_present(param_sums, g_params)


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
