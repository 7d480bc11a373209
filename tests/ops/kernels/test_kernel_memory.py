"""Issue 45's memory target, structurally: on ``attention_impl="kernel"`` no (T, S)-sized
array exists anywhere in the traced forward and backward of a whole model, kernel bodies
included (they hold tiles and per-query or per-key rows), for every scheme the kernels cover;
and, traced at T and 2T, no array grows faster than T (an array of one length dimension can
still be O(T^2), a slab per query tile), except the one the README states: selective
attention's per-query-tile prefix (PaTH's queries per key chunk, O(T^2 H / C), were the other
until its levels, :mod:`copejax.model.path_levels`). The XLA temporaries at 16K
against cuDNN's are measured on a GPU (``experiments/bench_kernels_gpu.py``)."""

from __future__ import annotations

import functools

import jax
import pytest

from copejax.model.kernel_terms import kernel_refusal
from copejax.positions import registry
from tests.ops.memory_growth import producer_avals, superlinear_arrays
from tests.ops.test_engine import gradient_jaxpr, length_squared_shapes

COVERED = [n for n in registry.names() if kernel_refusal(registry.make_scheme(n)) is None]
SUPERLINEAR = {  # the README's memory column states it; strict: fixing it fails the test
    "selective": "the forward's prefix of older query tiles' selections: O(T^2 / Q) per row",
}


@pytest.mark.parametrize("position", COVERED)
def test_kernel_model_gradient_holds_no_length_squared_array(position: str) -> None:
    """Every array in the jaxpr of the loss gradient has at most one dimension >= T."""
    jaxpr = gradient_jaxpr(position, 256, "kernel")
    assert _has_pallas(jaxpr), f"{position}: no kernel in the traced gradient"
    square = length_squared_shapes(jaxpr, 256)
    assert not square, f"{position}: (T, S)-sized arrays {square[:5]}"


@pytest.mark.parametrize(
    "position",
    [
        pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=SUPERLINEAR[n]))
        if n in SUPERLINEAR
        else n
        for n in COVERED
    ],
)
def test_kernel_model_gradient_arrays_grow_linearly(position: str) -> None:
    """Traced at 256 and 512 tokens, no array of the loss gradient grows faster than T."""
    grown = superlinear_arrays(functools.partial(gradient_jaxpr, position, impl="kernel"), 256)
    assert not grown, f"{position}: arrays that grow faster than T: {grown[:5]}"


def _has_pallas(jaxpr: jax.extend.core.Jaxpr) -> bool:
    """Whether a pallas_call appears anywhere in the jaxpr, sub-jaxprs included."""
    return any(producer == "pallas_call" for producer, _ in producer_avals(jaxpr))
