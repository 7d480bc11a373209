"""Issue 45's memory target, structurally: on ``attention_impl="kernel"`` no (T, S)-sized
array exists anywhere in the traced forward and backward of a whole model, kernel bodies
included (they hold tiles and per-query or per-key rows), for every scheme the kernels cover;
and, traced at T and 2T, no array grows faster than T (an array of one length dimension can
still be O(T^2), a slab per query tile). Selective attention's prefix per (query tile, key)
held O(T^2 / Q) until its forward ran in calls of R query tiles where the prefix would pass
the queries' bytes (:func:`copejax.ops.kernels.selective_prefix.call_tiles`; at these short lengths
one call unless capped, as here); PaTH's queries per key chunk, O(T^2 H / C), until its levels
(:mod:`copejax.model.path_levels`). The XLA temporaries at 16K against cuDNN's are measured
on a GPU (``experiments/bench_kernels_gpu.py``) and compiled for one without it
(``experiments/kernel_memory.py``)."""

from __future__ import annotations

import jax
import pytest

from copejax.model.kernel_terms import kernel_refusal
from copejax.ops.kernels import selective_prefix
from copejax.positions import registry
from tests.ops.memory_growth import live_jaxpr, producer_avals, superlinear_arrays
from tests.ops.test_engine import gradient_jaxpr, length_squared_shapes

COVERED = [n for n in registry.names() if kernel_refusal(registry.make_scheme(n)) is None]


@pytest.mark.parametrize("position", COVERED)
def test_kernel_model_gradient_holds_no_length_squared_array(position: str) -> None:
    """Every array in the jaxpr of the loss gradient has at most one dimension >= T."""
    jaxpr = gradient_jaxpr(position, 256, "kernel")
    assert _has_pallas(jaxpr), f"{position}: no kernel in the traced gradient"
    square = length_squared_shapes(jaxpr, 256)
    assert not square, f"{position}: (T, S)-sized arrays {square[:5]}"


@pytest.mark.parametrize("position", COVERED)
def test_kernel_model_gradient_arrays_grow_linearly(
    monkeypatch: pytest.MonkeyPatch, position: str
) -> None:
    """Traced at 256 and 512 tokens, no array that the loss gradient reads grows faster than
    T (selective attention's forward in calls of one query tile, as at long lengths; in one
    call its prefix, (B, T / Q, S), is found)."""
    monkeypatch.setattr(selective_prefix, "MAX_CALL_TILES", 1)
    trace = lambda length: live_jaxpr(gradient_jaxpr(position, length, "kernel"))
    grown = superlinear_arrays(trace, 256)
    assert not grown, f"{position}: arrays that grow faster than T: {grown[:5]}"


def test_growth_check_sees_selective_prefix_in_one_call() -> None:
    """The check above can fail: selective attention's forward in one call (at these lengths,
    uncapped) holds its prefix per (query tile, key), which grows as T^2 / Q."""
    trace = lambda length: live_jaxpr(gradient_jaxpr("selective", length, "kernel"))
    grown = superlinear_arrays(trace, 256)
    assert [g for g in grown if g.startswith("pallas_call")], grown


def _has_pallas(jaxpr: jax.extend.core.Jaxpr) -> bool:
    """Whether a pallas_call appears anywhere in the jaxpr, sub-jaxprs included."""
    return any(producer == "pallas_call" for producer, _ in producer_avals(jaxpr))
