"""The kernels' jaxprs counted, and a kernel call run with full pairs mask-free and with every
pair masked (``copejax.ops.kernels.tiles.Plan.run_pair``; the benchmark's lever
``full_tiles_for_tracing``): what the full-pair tests of the softmax, CoPE, stick-breaking
and TPU kernels share."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.extend
import jax.numpy as jnp

from copejax.ops.kernels.padding import full_tiles_for_tracing
from tests.ops.kernels.tolerances import assert_close


def kernel_jaxprs(jaxpr: jax.extend.core.Jaxpr) -> dict:
    """Each pallas_call's kernel jaxpr by its name, sub-jaxprs searched too."""
    found = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            params = eqn.params
            name = getattr(params.get("name_and_src_info"), "name", None) or params.get("name")
            found[name] = params["jaxpr"]
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found.update(kernel_jaxprs(sub))
    return found


def matmuls(jaxpr: jax.extend.core.Jaxpr, in_walk: bool = False) -> tuple[int, int]:
    """(dot_generals outside any loop, inside one): a kernel's once-per-program matmuls and
    its walk's per-pair ones."""
    once = per_pair = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            once, per_pair = (once, per_pair + 1) if in_walk else (once + 1, per_pair)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            a, b = matmuls(sub, in_walk or eqn.primitive.name in ("while", "scan"))
            once, per_pair = once + a, per_pair + b
    return once, per_pair


def kernel_matmuls(run: Callable[[dict], jax.Array], x: dict, cot: jax.Array) -> dict:
    """Each kernel's (once, per pair) matmuls in ``run``'s forward + backward, traced."""
    jaxpr = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(run(x) * cot)))(x).jaxpr
    return {name: matmuls(kernel) for name, kernel in kernel_jaxprs(jaxpr).items()}


def full_and_masked(
    run: Callable[[dict], jax.Array], x: dict, cot: jax.Array, *, values: bool = True
) -> tuple[dict, dict]:
    """Each kernel's matmuls (:func:`kernel_matmuls`) with full pairs mask-free, then with
    every pair masked; with ``values`` the two runs' values and gradients of ``cot`` are
    checked equal first."""
    outs, counts = [], []
    for full in (True, False):
        with full_tiles_for_tracing(full):
            if values:
                y, pull = jax.vjp(run, x)
                outs.append((y, pull(cot)[0]))
            counts.append(kernel_matmuls(run, x, cot))
    if values:
        for got, want in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1]), strict=True):
            assert_close(got, want, dtype="float32", summands=1, roundings=0)
    return counts[0], counts[1]


def total(counts: dict) -> int:
    """All matmuls of all kernels."""
    return sum(sum(pair) for pair in counts.values())
