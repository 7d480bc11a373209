"""Shaw's relative positions in the fused kernels (arXiv 1803.02155) against a dense reference.

The reference is eq. 1 of the CoPE paper as written: every allowed pair's
``q_i . (k_j + e[d_ij]) / sqrt(H)`` with e[d_ij] looked up per pair (no band, no z = q . e),
the capped table reading its last row beyond P - 1 and the uncapped one adding nothing there.
Values against NumPy in float64; gradients of q, k, v, the table and another term's
per-token values against ``jax.grad`` of the dense float32 maths, in float32 and bfloat16;
grouped KV heads, packed segments (positions restart), a window with sinks, a table shorter
than the segments (capped or not), a length of several tiles, and positions that jump within
a segment (a pair then reads several bands). The model's naive path is compared in
``test_kernel_registry.py``, which now counts relative and relative_capped as covered.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.ops.kernels.attention import fused_attention
from copejax.ops.kernels.gpu_lowering import lower_for_gpu
from copejax.ops.kernels.relative import RelativeTerm
from copejax.ops.kernels.terms import KernelTerm
from tests.conftest import tiny_config
from tests.ops.kernels.reference import attention_jnp, attention_numpy, mask_BTS
from tests.ops.kernels.test_fused_attention import (
    POSITIONS_BT,
    RANK_BT,
    SEGMENTS_BT,
    B,
    H,
    N,
    T,
    _decay,
    _inputs,
    on_layout,
)
from tests.ops.kernels.tolerances import assert_close

ROWS = 12  # far below the longest segment (72 keys): capping and vanishing both happen
# Positions that jump by 3 within each segment: a tile pair spans 3 x (Q + K) distances.
JUMPING_BT = 3 * POSITIONS_BT
SLOW = pytest.mark.slow
# The interpret-mode kernels run in microseconds at these sizes; XLA's CPU backend compiles
# them in about half the time without its optimisations.
QUICK = {"xla_backend_optimization_level": 0}


def _with_table(x: dict, rows: int = ROWS, seed: int = 3) -> dict:
    table = np.random.default_rng(seed).normal(size=(rows, H))
    return {**x, "table": jnp.asarray(table, jnp.float32)}


def _kernel(
    x: dict,
    *,
    capped: bool,
    window: int | None,
    sinks: int,
    positions=POSITIONS_BT,
    layout: tuple = (SEGMENTS_BT, RANK_BT),
    **options: object,
):
    """Shaw's term beside a decay term on the kernels; ``layout``: (segment ids, ranks);
    ``options`` for fused_attention (default tiles: 32 queries, 16 keys)."""
    return fused_attention(
        x["q"],
        x["k"],
        x["v"],
        q_positions_BT=jnp.asarray(positions),
        k_positions_BT=jnp.asarray(positions),
        segment_ids_BT=jnp.asarray(layout[0]),
        terms=[KernelTerm("decay", _decay, q_values_BTN=x["c"], k_values_BSN=x["c"])],
        window=window,
        sink_tokens=sinks,
        k_rank_BT=jnp.asarray(layout[1]),
        relative=RelativeTerm(x["table"], capped),
        **{"block_q": 32, "block_k": 16, **options},
    )


def _bias(x: dict, capped: bool, positions: np.ndarray, xp) -> jax.Array:
    """The decay term plus eq. 1's ``q_i . e[d_ij] / sqrt(H)``, e looked up per pair."""
    rows = x["table"].shape[0]
    distance_BTS = np.maximum(positions[:, :, None] - positions[:, None, :], 0)
    e_BTSH = xp.asarray(x["table"])[np.minimum(distance_BTS, rows - 1)]
    term = xp.einsum("btnh,btsh->bnts", xp.asarray(x["q"]), e_BTSH) / np.sqrt(H)
    if not capped:
        term = xp.where((distance_BTS < rows)[:, None], term, 0.0)
    c = xp.moveaxis(xp.asarray(x["c"]), 2, 1)
    return term + c[:, :, :, None] - c[:, :, None, :]


def _value_and_pull(kernel, x: dict, cot: jax.Array) -> tuple[jax.Array, dict]:
    """The kernel's output and its vjp of ``cot``, compiled as one top-level program."""

    def both(x: dict, cot: jax.Array) -> tuple[jax.Array, dict]:
        y, pull = jax.vjp(kernel, x)
        return y, pull(cot.astype(y.dtype))[0]

    return jax.jit(both, compiler_options=QUICK)(x, cot)


def _values(capped: bool, window: int | None, sinks: int, positions: np.ndarray) -> None:
    x = _with_table(_inputs(jnp.float32))
    kernel = functools.partial(_kernel, capped=capped, window=window, sinks=sinks)
    y = jax.jit(lambda x: kernel(x, positions=positions), compiler_options=QUICK)(x)
    allowed = mask_BTS(SEGMENTS_BT, window, sinks, RANK_BT)
    x64 = {key: np.asarray(value, np.float64) for key, value in x.items()}
    expected = attention_numpy(x["q"], x["k"], x["v"], _bias(x64, capped, positions, np), allowed)
    assert_close(y, expected, dtype="float32", summands=T, roundings=0)


@pytest.mark.parametrize(
    ("capped", "window", "sinks"),
    [
        pytest.param(True, None, 0, marks=SLOW),
        pytest.param(False, None, 0, marks=SLOW),
        pytest.param(True, 20, 3, marks=SLOW),
        pytest.param(False, 20, 3, marks=SLOW),
    ],
)
def test_values_equal_numpy(capped: bool, window: int | None, sinks: int) -> None:
    _values(capped, window, sinks, POSITIONS_BT)


@pytest.mark.parametrize(
    "capped", [pytest.param(True, marks=SLOW), pytest.param(False, marks=SLOW)]
)
def test_values_with_jumping_positions(capped: bool) -> None:
    """A pair whose distances span more than one band walks as many bands as it needs."""
    _values(capped, None, 0, JUMPING_BT)


@pytest.mark.parametrize(
    ("dtype", "capped", "window", "sinks"),
    [
        pytest.param("float32", True, 20, 3, marks=SLOW),
        pytest.param("float32", False, None, 0, marks=SLOW),
        pytest.param("bfloat16", True, None, 0, marks=SLOW),
        pytest.param("bfloat16", False, 20, 3, marks=SLOW),
    ],
)
def test_gradients_equal_dense(dtype: str, capped: bool, window: int | None, sinks: int) -> None:
    x = _with_table(_inputs(jnp.dtype(dtype)))
    allowed = jnp.asarray(mask_BTS(SEGMENTS_BT, window, sinks, RANK_BT))
    cot = jnp.asarray(np.random.default_rng(5).normal(size=(B, T, N, H)), jnp.float32)

    def kernel(x):
        return _kernel(x, capped=capped, window=window, sinks=sinks).astype(jnp.float32)

    def dense(x):
        x32 = {key: value.astype(jnp.float32) for key, value in x.items()}
        bias = _bias(x32, capped, POSITIONS_BT, jnp)
        return attention_jnp(x32["q"], x32["k"], x32["v"], bias, allowed)

    y, grads = _value_and_pull(kernel, x, cot)
    y_ref, pull_ref = jax.vjp(dense, x)
    (grads_ref,) = pull_ref(cot)
    assert_close(y, y_ref, dtype=dtype, summands=T, roundings=2)
    for key in ("q", "k", "v", "c"):
        assert grads[key].dtype == x[key].dtype
        assert_close(grads[key], grads_ref[key], dtype=dtype, summands=T, roundings=4)
    # the capped table's last row sums most of the B T^2 / 2 pairs of every head
    assert_close(grads["table"], grads_ref["table"], dtype=dtype, summands=B * T * T, roundings=4)


def test_gradients_tiny_jumping_positions() -> None:
    """The default suite's case: one batch row of two packed segments whose positions jump
    by 2 (pairs read two bands; the capped table's last row alone in older pairs), 16-tiles."""
    rng = np.random.default_rng(7)
    length, heads = 32, 1
    segments_1T = np.array([[0] * 20 + [1] * 12], np.int32)
    positions_1T = 2 * np.r_[np.arange(20), np.arange(12)][None]
    x = {key: jnp.asarray(rng.normal(size=(1, length, heads, H)), jnp.float32) for key in "qkv"}
    x["table"] = jnp.asarray(rng.normal(size=(ROWS, H)), jnp.float32)
    allowed = jnp.asarray(mask_BTS(segments_1T, None, 0, positions_1T))
    cot = jnp.asarray(rng.normal(size=(1, length, heads, H)), jnp.float32)

    def kernel(x):
        return fused_attention(
            x["q"],
            x["k"],
            x["v"],
            q_positions_BT=jnp.asarray(positions_1T),
            k_positions_BT=jnp.asarray(positions_1T),
            segment_ids_BT=jnp.asarray(segments_1T),
            block_q=16,
            block_k=16,
            relative=RelativeTerm(x["table"], capped=True),
        )

    def dense(x):
        bias = _bias({**x, "c": jnp.zeros((1, length, heads))}, True, positions_1T, jnp)
        return attention_jnp(x["q"], x["k"], x["v"], bias, allowed)

    y, grads = _value_and_pull(kernel, x, cot)
    y_ref, pull_ref = jax.vjp(dense, x)
    (grads_ref,) = pull_ref(cot)
    assert_close(y, y_ref, dtype="float32", summands=length, roundings=0)
    for key in "qkv":
        assert_close(grads[key], grads_ref[key], dtype="float32", summands=length, roundings=0)
    pairs = length * length
    assert_close(grads["table"], grads_ref["table"], dtype="float32", summands=pairs, roundings=0)


def test_lowers_to_triton() -> None:
    """The forward and both backward kernels, with the band walk, the one-row case and
    the table gradient's atomic adds, have a Triton lowering, checked from the CPU."""
    x = _with_table(_inputs(jnp.bfloat16))

    def loss(x):
        y = on_layout(
            x,
            relative=RelativeTerm(x["table"], capped=True),
            interpret=False,
        )
        return jnp.sum(y.astype(jnp.float32))

    text = lower_for_gpu(jax.jit(jax.grad(loss)), x).as_text()
    for name in ("copejax_attention_forward", "copejax_attention_dq", "copejax_attention_dkdv"):
        assert name in text
    assert "atomic_rmw" in text  # the dq kernel adds the table's gradient with atomics


def test_refuses_other_normalizers() -> None:
    x = _with_table(_inputs(jnp.float32))
    with pytest.raises(ValueError, match="Shaw's relative term runs with the softmax"):
        on_layout(
            x,
            relative=RelativeTerm(x["table"], capped=True),
            normalizer="stickbreaking",
            include_self=False,
        )


@pytest.mark.parametrize(
    ("position", "named"),
    [
        ("relative+stickbreaking", "stickbreaking"),
        ("cope+relative_capped", "cope"),
        ("relative+relative_capped", "relative_capped"),
    ],
)
def test_model_refuses_combinations_by_name(position: str, named: str) -> None:
    """One Shaw table per layer, with the softmax and without CoPE's carried count."""
    part = position.rsplit("+", maxsplit=1)[-1] if position.startswith("cope") else "relative"
    with pytest.raises(
        ValueError, match=f"no kernel for scheme '{part}': its table with .*{named}"
    ):
        tiny_config(position, attention_impl="kernel")
