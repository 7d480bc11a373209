"""Which arrays of a traced computation grow faster than its length: the O(T) memory claims,
checked by tracing at two lengths.

``length_squared_shapes`` (in ``tests/ops/test_engine.py``) finds arrays with two
dimensions >= T. An array such as a table-gradient slab per query tile, (T / Q, P, H) with
P = T, has one: it is O(T^2 H / Q) all the same. Here the jaxpr is traced at T and at 2T, its
arrays are paired in order (by primitive and rank; the levels that an associative scan adds
at 2T are unpaired), and a paired array whose size grows by more than ``MAX_GROWTH`` is
reported, as is an unpaired one larger than twice the largest array at T. Arrays of fewer
elements than 2T tokens are not reported (pairing slips on an associative scan's slices of a
few elements).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterator

import jax

MAX_GROWTH = 2.25  # doubling the length; a little over 2 for padding to whole tiles


Shape = tuple[int, ...]


def producer_avals(jaxpr: jax.extend.core.Jaxpr) -> Iterator[tuple[str, jax.core.AbstractValue]]:
    """``(producer, aval)`` of every array of ``jaxpr``, sub-jaxprs (scan, cond, custom_vjp,
    remat, pallas_call) included, in order; the producer is the primitive's name, or "in" for
    inputs and constants."""
    for var in (*jaxpr.invars, *jaxpr.constvars):
        yield "in", var.aval
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield eqn.primitive.name, var.aval
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from producer_avals(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from producer_avals(sub)


def sized_avals(jaxpr: jax.extend.core.Jaxpr) -> Iterator[tuple[tuple[str, int], Shape]]:
    """``((producer, rank), shape)`` of every array of ``jaxpr``, as :func:`producer_avals`."""
    for producer, aval in producer_avals(jaxpr):
        shape = tuple(getattr(aval, "shape", ()))
        yield (producer, len(shape)), shape


def live_jaxpr(jaxpr: jax.extend.core.Jaxpr) -> jax.extend.core.Jaxpr:
    """``jaxpr`` without the equations no output reads (as XLA drops them before it plans
    memory): the kernel path's unread block terms, such as selective attention's engine
    prefix, which the site computes for every path."""
    from jax._src.interpreters import partial_eval as pe

    return pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))[0]


def superlinear_arrays(trace: Callable[[int], jax.extend.core.Jaxpr], length: int) -> list[str]:
    """The arrays of ``trace(2 * length)`` that grow faster than the length, described as
    ``"producer: shape at T -> shape at 2T"`` (empty when every array is O(T))."""
    short, long = list(sized_avals(trace(length))), list(sized_avals(trace(2 * length)))
    matcher = difflib.SequenceMatcher(
        a=[key for key, _ in short], b=[key for key, _ in long], autojunk=False
    )
    bound = 2 * max(math.prod(shape) for _, shape in short)
    found = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            for (key, before), (_, after) in zip(short[i1:i2], long[j1:j2], strict=True):
                if math.prod(after) > max(MAX_GROWTH * math.prod(before), 2 * length):
                    found.append(f"{key[0]}: {before} -> {after}")
        else:
            found += [
                f"{key[0]}: ? -> {after}" for key, after in long[j1:j2] if math.prod(after) > bound
            ]
    return found
