"""Selective attention's penalties on the TPU kernels (arXiv 2410.02703), from the CPU.

In TPU interpret mode, values against NumPy in float64 (``F_ij = sum_{k < i} S_kj`` from the
paper's equations, :func:`tests.ops.kernels.test_selective_kernel.penalty_BTS`) and the
gradients of q, k, v and the other terms' arrays against ``jax.vjp`` of the dense float32
maths; grouped KV heads, packed segments, a window with and without sinks, relu and sigmoid,
float32 and bfloat16, and lengths of several query and key tiles (200 tokens: 4 query tiles
of 64 and 2 key tiles of 128, padded to 256), and the forward in calls of R query tiles, the
prefix carried and the call's first tile scalar-prefetched, as where one call's prefix would
pass the queries' bytes. The Mosaic export of the four kernels, and the model on the TPU
kernels against its naive path. TPU interpret mode costs seconds per call:
the default set keeps one short case (4 query tiles of 16, one key tile: a TPU key tile
holds 128 keys or the whole padded sequence), the export and the refusals.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from copejax.model.kernel_terms import kernel_refusal
from copejax.ops.kernels import selective_attention, selective_prefix, tpu_selective_backward
from copejax.ops.kernels.selective import SelectiveTerm
from copejax.ops.kernels.tpu_selective import tpu_selective_forward_call
from copejax.positions import registry
from tests.ops.kernels.test_selective_kernel import _check, _inputs, _kernel
from tests.ops.kernels.test_tpu_kernels import _on_tpu_kernels, exported_to_tpu

SLOW = pytest.mark.slow
SMALL = {"T": 40, "N": 2, "G": 1, "block_q": 16, "block_k": 16, "segments": (17, 15, 8)}
LARGE = {"T": 200, "N": 4, "G": 2, "block_q": 64, "block_k": 128, "segments": (90, 70, 40)}
# Six query tiles of 64 (384 padded tokens, three key tiles): calls of four pad the last.
SIX = {"T": 300, "N": 2, "G": 1, "block_q": 64, "block_k": 128, "segments": (140, 100, 60)}


def test_small_float32_window_sinks_gqa_packed_terms() -> None:
    _check(SMALL, "float32", 12, 2, nonlinearity="relu", terms=True, backend="tpu")


@SLOW
@pytest.mark.parametrize(
    ("dtype", "window", "sinks", "nonlinearity", "terms"),
    [
        ("float32", None, 0, "relu", False),
        ("float32", 100, 3, "relu", True),
        ("float32", 100, 0, "sigmoid", True),
        ("bfloat16", None, 0, "relu", True),
        ("bfloat16", 100, 3, "sigmoid", False),
    ],
)
def test_several_tiles(dtype: str, window, sinks: int, nonlinearity: str, terms: bool) -> None:
    _check(LARGE, dtype, window, sinks, nonlinearity=nonlinearity, terms=terms, backend="tpu")


@pytest.mark.parametrize(
    ("shape", "cap"), [(SMALL, 1), pytest.param(SIX, 4, marks=SLOW)], ids=["4x1", "6_in_2x4"]
)
def test_forward_in_calls_of_few_query_tiles(
    monkeypatch: pytest.MonkeyPatch, shape: dict, cap: int
) -> None:
    """The forward as a loop of calls of ``cap`` query tiles (four calls of one; six tiles in
    two calls of four, the last padded), the prefix carried from call to call, the call's
    first tile scalar-prefetched: the same values and gradients."""
    monkeypatch.setattr(selective_prefix, "MAX_CALL_TILES", cap)
    window = 12 if shape is SMALL else 100
    _check(shape, "float32", window, 2, nonlinearity="relu", terms=True, backend="tpu")


@SLOW
def test_several_tiles_in_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Grouped heads, a window with sinks, sigmoid and other terms in bfloat16, the forward in
    calls of one query tile of 64 (four calls)."""
    monkeypatch.setattr(selective_prefix, "MAX_CALL_TILES", 1)
    _check(LARGE, "bfloat16", 100, 3, nonlinearity="sigmoid", terms=True, backend="tpu")


def test_calls_share_one_kernel_and_keep_the_prefix_per_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In calls, the prefix and forward kernels are each traced once, inside a loop (four
    calls of one tile), and the prefix they pass is (B, R, 1, S) per call, not (B, count_q,
    1, S)."""
    monkeypatch.setattr(selective_prefix, "MAX_CALL_TILES", 1)
    x = _inputs(SMALL, jnp.dtype("float32"))
    run = lambda x: _kernel(x, SMALL, None, 0, nonlinearity="relu", backend="tpu")
    jaxpr = jax.make_jaxpr(run)(x).jaxpr
    assert _equations(jaxpr, "scan")  # three calls, one loop (fori_loop of static bounds)
    calls = [(e.params["name"], [v.aval.shape for v in e.invars]) for e in _pallas_calls(jaxpr)]
    assert [name for name, _ in calls] == [
        "copejax_selective_prefix_tpu",
        "copejax_selective_forward_tpu",
    ]
    forward_operands = calls[1][1]
    assert (2, 1, 1, 64) in forward_operands  # B, R = 1, 1, S (40 tokens padded to 64)
    assert (2, 4, 1, 64) not in forward_operands  # B, count_q, 1, S: one call's


@pytest.mark.parametrize("cap", [None, 1], ids=["one_call", "calls"])
def test_lowers_to_mosaic_tpu(monkeypatch: pytest.MonkeyPatch, cap: int | None) -> None:
    """The prefix, forward and backward kernels, with every scheme's term beside the
    penalties, GQA and a window with sinks, pass Pallas's Mosaic TPU lowering (exported from
    the CPU; Mosaic's layout passes run only on a TPU), in one call or (``cap``) in calls of
    one query tile, its first tile scalar-prefetched; no float32 per (query tile, key)
    leaves the backward (R stays in VMEM)."""
    monkeypatch.setattr(selective_prefix, "MAX_CALL_TILES", cap)
    # Four query heads on two key/value heads; two key tiles, four query tiles.
    text = exported_to_tpu(
        heads=4, kv_heads=2, with_terms=True, selective=SelectiveTerm(3, "sigmoid")
    )
    assert text.count("tpu_custom_call") == 3
    for name in ("prefix", "forward", "backward"):
        assert f"copejax_selective_{name}_tpu" in text


def test_the_backward_sums_the_prefix_again() -> None:
    """The backward kernel reads no prefix per (query tile, key) from the forward (it sums P
    again in VMEM, in the prefix kernel's order): the prefix kernel's (B, count_q, 1, S) is
    an output of the forward's and an input of the forward kernel only."""
    x = _inputs(SMALL, jnp.dtype("float32"))

    def gradients(x: dict) -> dict:
        run = lambda x: _kernel(x, SMALL, None, 0, nonlinearity="relu", backend="tpu")
        y, pull = jax.vjp(lambda x: run(x).astype(jnp.float32), x)
        return pull(jnp.ones_like(y))

    calls = {}  # each kernel's operand shapes, by name
    for eqn in _pallas_calls(jax.make_jaxpr(gradients)(x).jaxpr):
        calls[eqn.params["name"]] = [v.aval.shape for v in eqn.invars]
    prefix_shape = (2, 4, 1, 64)  # B, count_q (40 tokens padded to 64, tiles of 16), 1, S
    assert (
        calls["copejax_selective_prefix_tpu"]
        and prefix_shape not in calls["copejax_selective_prefix_tpu"]
    )
    assert prefix_shape in calls["copejax_selective_forward_tpu"]
    assert prefix_shape not in calls["copejax_selective_backward_tpu"]


def test_a_prefix_past_the_vmem_budget_is_refused_by_name(monkeypatch) -> None:
    """Past ``PREFIX_VMEM_BYTES`` the backward refuses, naming the sizes and the way out."""
    monkeypatch.setattr(tpu_selective_backward, "PREFIX_VMEM_BYTES", 2048)  # < 8 rows of 128
    with pytest.raises(ValueError, match=r"4096 bytes for 4 query tiles of 16.*block_q"):
        _check(SMALL, "float32", None, 0, backend="tpu")


def _equations(jaxpr: jax.extend.core.Jaxpr, primitive: str) -> list:
    """Every ``primitive`` equation of ``jaxpr``, sub-jaxprs included."""
    found = [e for e in jaxpr.eqns if e.primitive.name == primitive]
    for eqn in jaxpr.eqns:
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    found += _equations(sub.jaxpr, primitive)
    return found


def _pallas_calls(jaxpr: jax.extend.core.Jaxpr) -> list:
    """Every pallas_call equation of ``jaxpr``, sub-jaxprs included."""
    return _equations(jaxpr, "pallas_call")


@pytest.mark.parametrize(
    ("position", "options"),
    [
        ("selective", {}),
        ("selective+rope", {}),
        ("selective+fox+alibi", {}),
        ("selective", {"nonlinearity": "sigmoid"}),
    ],
)
def test_the_kernels_run_selective(position: str, options: dict) -> None:
    scheme = registry.make_scheme(position, options)
    assert kernel_refusal(scheme) is None


@pytest.mark.parametrize(
    ("options", "named"),
    [({"prune_threshold": 2.0}, "prune_threshold=2.0"), ({"prune_budget": 4}, "prune_budget=4")],
)
def test_the_kernels_refuse_pruning_by_name(options: dict, named: str) -> None:
    refusal = kernel_refusal(registry.make_scheme("selective", options))
    assert refusal is not None and named in refusal


@SLOW
@pytest.mark.parametrize(
    ("position", "dtype", "window", "sinks"),
    [
        ("selective", "float32", 12, 2),
        ("selective+fox", "float32", None, 0),
        ("selective+rope", "bfloat16", 12, 2),
        ("selective+fire", "float32", 12, 2),  # FIRE's custom VJP in the backward kernel
    ],
)
def test_model_on_tpu_kernels_equals_naive(
    position: str, dtype: str, window, sinks: int, monkeypatch
) -> None:
    """The whole model on the TPU kernels equals the naive path (values and every
    parameter's gradient), GQA, packed segments."""
    from tests.ops.kernels import test_kernel_registry

    _on_tpu_kernels(monkeypatch)
    traced = []

    def forward_call(*args, **kwargs):
        traced.append(True)
        return tpu_selective_forward_call(*args, **kwargs)

    monkeypatch.setattr(selective_attention, "tpu_selective_forward_call", forward_call)
    test_kernel_registry._compare(position, dtype, window=window, sinks=sinks)
    assert traced
