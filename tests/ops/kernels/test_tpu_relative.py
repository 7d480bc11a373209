"""Shaw's relative positions in the TPU kernels (copejax.ops.kernels.tpu_relative), from the CPU.

The reference is the CoPE paper's eq. 1 as written (``q_i . (k_j + e[d_ij]) / sqrt(H)``, e
looked up per pair; the capped table reads its last row beyond P - 1, the uncapped one adds
nothing there), with a FoX-like per-token term beside it: values against NumPy in float64,
gradients of q, k, v, the table and the term's values against ``jax.grad`` of the dense
float32 maths, in float32 and bfloat16, in TPU interpret mode, with grouped KV heads, packed
segments (positions restart), a window with sinks, a table shorter than the segments and
several query and key tiles. Positions that count up take the fast path (a band per pair,
placed by per-row lane rotations); positions that jump take the walk (the band's columns one
by one); both are checked, and :class:`PairGeometry` is checked to pick them. The pieces:
the barrel shifter against NumPy, the reversed table against its definition, and the
Mosaic lowering of all three kernels. The compiles for real chips are ``test_tpu_compile``'s.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from copejax.ops.kernels.relative import RelativeTerm
from copejax.ops.kernels.tpu_relative import (
    PairGeometry,
    reversed_table,
    rotate,
    tpu_relative,
)
from tests.ops.kernels.reference import attention_jnp, attention_numpy, mask_BTS
from tests.ops.kernels.test_relative_kernel import _bias
from tests.ops.kernels.test_relative_kernel import _kernel as relative_kernel
from tests.ops.kernels.test_tpu_kernels import (
    POSITIONS_BT,
    RANK_BT,
    SEGMENTS_BT,
    SINKS,
    WINDOW,
    B,
    H,
    N,
    T,
    exported_to_tpu,
)
from tests.ops.kernels.test_tpu_kernels import _inputs as tpu_inputs
from tests.ops.kernels.tolerances import assert_close

ROWS = 12  # far below the longest segment (200 keys): capping and vanishing both happen
JUMPING_BT = 3 * POSITIONS_BT  # a pair's distances then span 3 (Q + K): the walk
SLOW = pytest.mark.slow


def _inputs(dtype, rows: int = ROWS) -> dict:
    """test_tpu_kernels' q, k, v and per-token values, with Shaw's table (P, H)."""
    x = {key: value for key, value in tpu_inputs(dtype).items() if key in ("q", "k", "v", "c")}
    table = np.random.default_rng(3).normal(size=(rows, H))
    return {**x, "table": jnp.asarray(table, jnp.float32)}


def _kernel(x: dict, *, capped: bool, window: int | None, sinks: int, positions) -> jax.Array:
    """test_relative_kernel's call on the TPU kernels: 4 query tiles of 64, 2 key tiles."""
    return relative_kernel(
        x,
        capped=capped,
        window=window,
        sinks=sinks,
        positions=positions,
        layout=(SEGMENTS_BT, RANK_BT),
        block_q=64,
        block_k=128,
        backend="tpu",
    )


def _dense(x: dict, capped: bool, positions: np.ndarray, allowed: np.ndarray, xp=jnp):
    """Eq. 1 with e looked up per pair, plus the decay term; NumPy or jnp."""
    reference = attention_numpy if xp is np else attention_jnp
    return reference(x["q"], x["k"], x["v"], _bias(x, capped, positions, xp), allowed)


def _values(capped: bool, window: int | None, sinks: int, positions: np.ndarray) -> None:
    x = _inputs(jnp.float32)
    kernel = functools.partial(_kernel, capped=capped, window=window, sinks=sinks)
    y = jax.jit(functools.partial(kernel, positions=positions))(x)
    x64 = {key: np.asarray(value, np.float64) for key, value in x.items()}
    allowed = mask_BTS(SEGMENTS_BT, window, sinks, RANK_BT)
    expected = _dense(x64, capped, positions, allowed, np)
    assert_close(y, expected, dtype="float32", summands=T, roundings=0)


def _gradients(dtype: str, capped: bool, window: int | None, sinks: int, positions) -> None:
    x = _inputs(jnp.dtype(dtype))
    allowed = jnp.asarray(mask_BTS(SEGMENTS_BT, window, sinks, RANK_BT))
    cot = jnp.asarray(np.random.default_rng(5).normal(size=(B, T, N, H)), jnp.float32)
    kernel = functools.partial(
        _kernel, capped=capped, window=window, sinks=sinks, positions=positions
    )

    def dense(x):  # the same inputs in float32: only the kernel's roundings differ
        x32 = {key: value.astype(jnp.float32) for key, value in x.items()}
        return _dense(x32, capped, positions, allowed)

    y, pull = jax.vjp(jax.jit(lambda x: kernel(x).astype(jnp.float32)), x)
    y_ref, pull_ref = jax.vjp(dense, x)
    (grads,), (grads_ref,) = jax.jit(pull)(cot), pull_ref(cot)
    assert_close(y, y_ref, dtype=dtype, summands=T, roundings=2)
    for key in ("q", "k", "v", "c"):
        assert grads[key].dtype == x[key].dtype
        assert_close(grads[key], grads_ref[key], dtype=dtype, summands=T, roundings=4)
    # the capped table's last row sums most of the B T^2 / 2 pairs of every head
    pairs = B * N * T * T // 2
    assert_close(grads["table"], grads_ref["table"], dtype=dtype, summands=pairs, roundings=4)


@pytest.mark.parametrize(
    ("dtype", "capped", "window", "sinks"),
    [("float32", True, WINDOW, SINKS), ("bfloat16", False, None, 0)],
)
def test_gradients_fast_path(dtype: str, capped: bool, window: int | None, sinks: int) -> None:
    """The default suite's cases: counting positions, packed segments; a window with sinks and
    the capped table in float32, the uncapped one in bfloat16 (the band in two pieces)."""
    _gradients(dtype, capped, window, sinks, POSITIONS_BT)


def test_gradients_walk() -> None:
    """Jumping positions: every pair walks its bands column by column."""
    _gradients("float32", False, None, 0, JUMPING_BT)


@SLOW
@pytest.mark.parametrize(
    ("capped", "window", "sinks", "jumping"),
    [(True, None, 0, False), (False, WINDOW, SINKS, False), (True, WINDOW, SINKS, True)],
)
def test_values_equal_numpy(capped: bool, window: int | None, sinks: int, jumping: bool) -> None:
    _values(capped, window, sinks, JUMPING_BT if jumping else POSITIONS_BT)


@SLOW
@pytest.mark.parametrize(
    ("dtype", "capped", "window", "sinks", "jumping"),
    [
        ("bfloat16", True, WINDOW, SINKS, False),
        ("float32", False, WINDOW, SINKS, False),
        ("bfloat16", True, None, 0, True),
    ],
)
def test_gradients_equal_dense(
    dtype: str, capped: bool, window: int | None, sinks: int, jumping: bool
) -> None:
    _gradients(dtype, capped, window, sinks, JUMPING_BT if jumping else POSITIONS_BT)


def test_pair_geometry_picks_the_path() -> None:
    """Counting positions (a tile pair across three packed segments, and one whose distances
    all lie beyond the table) take the fast path with row shifts ``top - a_i``; jumping
    positions walk, with the bands their clamped rows need."""
    static = tpu_relative(ROWS, True, 64, 128)
    q_pos_Q1 = jnp.asarray(POSITIONS_BT[1, 136:200, None])
    k_pos_1K = jnp.asarray(POSITIONS_BT[1, None, 72:200])
    same = SEGMENTS_BT[1, 136:200, None] == SEGMENTS_BT[1, None, 72:200]
    causal = np.arange(136, 200)[:, None] >= np.arange(72, 200)[None, :]
    allowed_QK = jnp.asarray(same & causal)
    geo = PairGeometry(static, q_pos_Q1, k_pos_1K, allowed_QK)
    assert bool(geo.fast)
    # a_i = pos_i - pos_j + j is the query's index minus the key tile's first index, 72
    a_Q = np.arange(136, 200) - 72
    assert int(geo.top) == a_Q.max()
    np.testing.assert_array_equal(np.asarray(geo.shift_Q1)[:, 0], a_Q.max() - a_Q)
    far_Q1, near_1K = 1000 + jnp.arange(64)[:, None], jnp.arange(128)[None]
    far = PairGeometry(static, far_Q1, near_1K, jnp.ones_like(allowed_QK))
    assert bool(far.fast) and int(far.top) == ROWS + 128 - 1  # clipped: every row beyond
    jumping = PairGeometry(static, 3 * q_pos_Q1, 3 * k_pos_1K, allowed_QK)
    assert not bool(jumping.fast)
    assert int(jumping.hi) == ROWS - 1 and int(jumping.bands) == 1  # rows clamp to P - 1
    uncapped = tpu_relative(400, False, 64, 128)
    walk = PairGeometry(uncapped, 5 * q_pos_Q1, 5 * k_pos_1K, allowed_QK)
    # distances 0 .. 5 x 69 (segment 1's queries at positions 46..69 see its keys from 0)
    assert int(walk.hi) == 5 * 69 and int(walk.bands) == 2


def test_reversed_table_reads_each_distance() -> None:
    """Row t of ``rev`` is the row distance E - t reads: e[clip(d, 0, P - 1)], or 0 from P on
    for the uncapped table; E = P + R - 1 down to -R."""
    table_PH = jnp.asarray(np.random.default_rng(1).normal(size=(ROWS, 4)), jnp.float32)
    for capped in (True, False):
        static = tpu_relative(ROWS, capped, 64, 128)
        rev = np.asarray(reversed_table(static, table_PH))
        assert rev.shape == (ROWS + 2 * static.band, 4)
        for t, distance in enumerate(range(static.edge, -static.band - 1, -1)):
            row = np.asarray(table_PH)[min(max(distance, 0), ROWS - 1)]
            expected = row if capped or distance < ROWS else np.zeros(4)
            np.testing.assert_array_equal(rev[t], expected, err_msg=f"distance {distance}")


@pytest.mark.parametrize("left", [True, False])
def test_rotate_shifts_each_row(left: bool) -> None:
    """The barrel shifter in a TPU interpret-mode kernel: row i rotated by its own s_i."""
    size_q, size_r, limit = 16, 256, 128
    rng = np.random.default_rng(2)
    x = rng.normal(size=(size_q, size_r)).astype(np.float32)
    shift = rng.integers(0, limit + 1, (size_q, 1)).astype(np.int32)

    def kernel(x_ref, s_ref, o_ref):
        o_ref[...] = rotate(x_ref[...], s_ref[...], left=left, limit=limit)

    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float32),
        interpret=pltpu.InterpretParams(),
    )(jnp.asarray(x), jnp.asarray(shift))
    sign = 1 if left else -1
    expected = np.stack([np.roll(x[i], -sign * int(shift[i, 0])) for i in range(size_q)])
    np.testing.assert_array_equal(np.asarray(out), expected)


def test_lowers_to_mosaic_tpu() -> None:
    """The three kernels with Shaw's term (its DMAs, rotations, walk and the dq kernel's
    aliased slab) pass Pallas's Mosaic TPU lowering, exported from the CPU."""
    table = jnp.ones((40, 16), jnp.float32)
    text = exported_to_tpu(
        heads=2, kv_heads=1, with_terms=True, relative=RelativeTerm(table, capped=True)
    )
    assert text.count("tpu_custom_call") == 3
    for name in ("forward", "dq", "dkdv"):
        assert f"copejax_attention_{name}_tpu" in text
