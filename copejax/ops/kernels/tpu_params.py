"""The fused kernels on TPU: Pallas's Mosaic TPU backend, its layouts and limits (issue 45).

Backend: :mod:`copejax.ops.kernels.tpu_forward` and :mod:`~copejax.ops.kernels.tpu_backward`
are FlashAttention-2 (Dao 2023, arXiv 2307.08691) written for Mosaic TPU, the only Pallas
backend a TPU has, with the terms' tile functions, stick-breaking
(:mod:`~copejax.ops.kernels.tpu_stick`) in place of the softmax, CoPE's carried count
(:mod:`~copejax.ops.kernels.tpu_cope`), selective attention's penalties
(:mod:`~copejax.ops.kernels.tpu_selective`) and Shaw's tables
(:mod:`~copejax.ops.kernels.tpu_relative`: the table in HBM, a band of it per step by DMA);
the GPU kernels
(:mod:`copejax.ops.kernels.forward`) are Triton-shaped and Mosaic refuses their blocks. What
differs from the GPU kernels, and why:

- layout: queries (B, N, T, H), keys and values (B, G, S, H): Mosaic wants each block's last
  two dims divisible by (8, 128) or equal to the array's, so the (None, Q, None, H) blocks of
  the (B, T, N, H) arrays are refused. Per-query integers and values are (B, [N,] T, 1)
  arrays read as (Q, 1) tiles, per-key ones (B, [N,] 1, S) read as (1, K) tiles, parameter
  rows (N, 1, P) read as (1, P): 2-D tiles that broadcast to the pair's (Q, K), which the
  terms' tile functions take as they take the GPU's (Q,) and (K,)
  (:func:`copejax.ops.kernels.terms.pair_grid`, :func:`~copejax.ops.kernels.terms.batch_rows`).
- grid: a fourth grid axis walks the key tiles (the query tiles in the dk / dv kernel),
  "arbitrary" (sequential) in ``dimension_semantics``, with the running statistics and
  accumulators in VMEM scratch, initialised at the first step and written at the last; a
  skipped pair is a ``pl.when`` that does nothing, and the block index maps clamp the walked
  axis to the tiles that may be live (:meth:`~copejax.ops.kernels.tiles.Plan.key_tiles`),
  so that Pallas's pipeline fetches no new block for a skipped one.
- block sizes: the key tile has at least 128 keys (the lane width; a (1, K) block needs
  K % 128 == 0) unless one tile holds the whole sequence; the query tile is the caller's
  (a power of two >= 16: bfloat16's (16, 128) tiling). ``fused_attention`` raises
  ``block_k`` below 128 to 128 on TPU.

VMEM per program, counted from the blocks (two buffers each), the scratch and four (Q, K)
float32 temporaries, with (Q, 1) tiles padded to (Q, 128) and (1, K) tiles to (8, K): at
Q = K = 128 and H = W = 128 the forward needs about 1.2 MiB in bfloat16 and 1.4 MiB in
float32, the dq kernel 1.3 / 1.5 MiB, the dk / dv kernel 1.5 / 1.8 MiB (each term adds at
most 0.2 MiB; selective attention's kernels about 0.5 MiB more in the forward and 0.7 MiB in
each backward kernel, counted the same way: the selecting head's q and k tiles, P or R, the
selection and its three bfloat16 pieces, the (Q, Q) triangle and the selecting head's
float32 gradients; Shaw's table adds its (R, H) float32 band, two in the dq kernel, and
(Q, R) float32 temporaries: about 0.6 MiB at R = 256, H = 128); at Q = K = 256 and H = 256
about 4.5 MiB in float32. Only stick-breaking's and CoPE's
dk / dv kernels grow with T: they keep two carries for the head's queries (r and u; the
count and S), 8 bytes per query (16 with query tiles under the 128 lanes: 256 KiB at T =
16384, Q = 64), which the 16 MiB of v4 / v5e hold up to about T = 800K at Q = 64. Every
other operand is tiled along T, so T is bounded by HBM (q, k, v, o and the (B, N, T)
statistics: at H = 128 the forward holds about 1.3 KiB per token and head in bfloat16
(q, k, v and a float32 o) and 2 KiB in float32, the backward about twice that (dO, dq and
float32 dk, dv per query head), plus selective attention's prefix per (query tile, key)
through its forward, at most the queries' bytes (in calls of R query tiles beyond,
:mod:`~copejax.ops.kernels.tpu_selective`; its backward's, 4 bytes per query tile and key of
a key tile, in VMEM), and Shaw's table gradient, (P + 2R) x H float32 per batch row; the
statistics as lane-dense rows, :mod:`~copejax.ops.kernels.tpu_rows`) and by int32
positions (below 2**30, the padding keys' rank), not by VMEM, within the 16 MiB default
scoped VMEM of v4 / v5e (32 MiB on v5p / v6e).

Checked without a TPU: the tests run the kernels in TPU interpret mode
(``pltpu.InterpretParams``, which simulates VMEM, DMAs and the grid order) and export the
forward and backward to ``platforms=["tpu"]``, which runs Pallas's Mosaic lowering (block
shape rules, supported primitives) on the CPU. Mosaic's own layout passes run where libtpu
compiles the program: ``experiments.kernel_tpu`` compiles every covered scheme's model for
compile-only v4, v5e, v5p and v6e chips (no TPU needed, libtpu in ``.venv-ptx``), which
also gives XLA's TPU memory plan (``experiments/results/kernel_tpu.md``). Speed on a TPU is
unmeasured.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from copejax.ops.kernels.tiles import Plan
from copejax.ops.kernels.tpu_rows import query_rows, read_rows, row_spec

LANES = 128  # a (1, K) block's K must be a multiple of this (or the whole axis)
ANY = pl.BlockSpec(memory_space=pl.ANY)  # an operand left in HBM, read and written by DMA
BACKENDS = ("triton", "tpu")


def kernel_backend(backend: str | None = None) -> str:
    """The kernels' backend: ``backend`` if given, else "tpu" on a TPU and "triton" elsewhere
    (a GPU, or interpret mode on the CPU)."""
    if backend is None:
        return "tpu" if jax.default_backend() == "tpu" else "triton"
    if backend not in BACKENDS:
        raise ValueError(f"kernel: backend must be one of {BACKENDS} or None, got {backend!r}")
    return backend


def compiler_params(
    semantics: tuple[str, ...] = ("parallel", "parallel", "parallel", "arbitrary"),
) -> pltpu.CompilerParams:
    """Mosaic's parameters: by default the batch, head and outer tile axes parallel (megacore
    may split them), the walked tile axis sequential (the scratch carries across it)."""
    return pltpu.CompilerParams(dimension_semantics=semantics)


def interpret_mode(plan: Plan) -> pltpu.InterpretParams | bool:
    """TPU interpret mode (the CPU's way to run Mosaic kernels; uninitialised memory reads
    as NaN, so a missed initialisation shows) or False (compile for the TPU)."""
    return pltpu.InterpretParams() if plan.interpret else False


NT = (((1,), (1,)), ((), ()))  # a . b^T, the form Mosaic's matmul takes transposed


def key_step(plan: Plan, step: jax.Array, newest_first: bool) -> jax.Array:
    """The key tile a forward / dq grid step walks: in order, or newest first (the carries of
    stick-breaking's forward and dq and of CoPE's forward sum over the newer tiles)."""
    return plan.count_k - 1 - step if newest_first else step


def tile_index(
    plan: Plan, outer: jax.Array, walked: jax.Array, *, keys: bool, newest_first: bool = False
) -> jax.Array:
    """The walked tile a block index map fetches: the step's tile (:func:`key_step` when
    ``keys``) clamped to the tiles that may be live for the outer tile (key tiles of query
    tile ``outer`` when ``keys``, else the query tiles of key tile ``outer``), so a skipped
    step refetches nothing."""
    if keys:
        walked = key_step(plan, walked, newest_first)
    first, end = plan.key_tiles(outer) if keys else plan.query_tiles(outer)
    count = plan.count_k if keys else plan.count_q
    # With a query offset and a window a range may be empty (end <= first): any valid tile.
    return jnp.clip(jnp.clip(walked, first, jnp.maximum(end - 1, first)), 0, count - 1)


def step_live(plan: Plan, qi: jax.Array, kj: jax.Array, refs: tuple) -> tuple[jax.Array, tuple]:
    """Whether the step's pair (query tile qi, key tile kj) is walked and may hold an
    allowed entry, and the mask's arguments (first query, first key, (Q, 1) and (1, K)
    segment ids, (1, K) ranks) from the (q_seg, k_seg, k_rank) refs."""
    qseg_ref, kseg_ref, krank_ref = refs
    mask_args = (qi * plan.size_q, kj * plan.size_k, qseg_ref[...], kseg_ref[...], krank_ref[...])
    first, end = plan.key_tiles(qi)
    return (kj >= first) & (kj < end) & plan.live(*mask_args), mask_args


def when_live(
    plan: Plan, live: jax.Array, mask_args: tuple, compute: Callable, *, mask_free: bool
) -> None:
    """Runs ``compute(allowed_QK)`` on a live step (:func:`step_live`); with
    ``plan.full_tiles`` and ``mask_free`` (``compute`` takes None) a full pair
    (:meth:`~copejax.ops.kernels.tiles.Plan.full`) takes a second body with None for the
    mask, without its compares and selects."""
    masked = lambda: compute(plan.allowed_QK(*mask_args))
    if not (plan.full_tiles and mask_free):
        pl.when(live)(masked)
        return
    full = plan.full(*mask_args[:4])
    pl.when(live & full)(lambda: compute(None))
    pl.when(live & jnp.logical_not(full))(masked)


def read_refs(refs: list) -> list:
    """The refs' blocks, None where a term has no such array."""
    return [None if r is None else r[...] for r in refs]


def read_terms(p_refs: list, qv_refs: list, kv_refs: list) -> tuple[list, list, list]:
    """The terms' (parameters, per-query values as (Q, 1) columns, per-key values) of a grid
    step, from their blocks: the per-query values are (1, Q) rows in HBM
    (:func:`~copejax.ops.kernels.tpu_rows.read_rows`), the others read as they are."""
    return read_refs(p_refs), read_rows(qv_refs), read_refs(kv_refs)


def kv_head(n: jax.Array, groups: int) -> jax.Array:
    """The key/value head of query head n, ``n // groups`` as truncating division (floor
    division's sign op has a Mosaic lowering that reads the TPU's chip info, so a kernel
    using it does not export from a CPU)."""
    return jax.lax.div(n, jnp.int32(groups))


def by_query_heads(x_BTNX: jax.Array) -> jax.Array:
    """(B, T, N, X) -> (B, N, T, X): the TPU kernels' layout."""
    return jnp.moveaxis(x_BTNX, 2, 1)


def from_query_heads(x_BNTX: jax.Array) -> jax.Array:
    """(B, N, T, X) -> (B, T, N, X): back to the GPU kernels' (and the caller's) layout."""
    return jnp.moveaxis(x_BNTX, 1, 2)


def tpu_ints(ints: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The (B, T) integers as (B, T, 1) for queries and (B, 1, S) for keys."""
    out = {key: ints[key][:, :, None] for key in ("q_pos", "q_seg")}
    out.update({key: ints[key][:, None, :] for key in ("k_pos", "k_seg", "k_rank")})
    return out


def tpu_terms(plan: Plan, terms: list[dict]) -> list[dict]:
    """The terms' arrays as (N, 1, P) rows, (B, N, count_q, 1, Q) query values
    (:func:`~copejax.ops.kernels.tpu_rows.query_rows`) and (B, N, 1, S) key values."""
    out = []
    for term in terms:
        p, q, k = term["params"], term["q"], term["k"]
        out.append(
            {
                "params": None if p is None else p[:, None, :],
                "q": None if q is None else query_rows(plan, q),
                "k": None if k is None else k[:, :, None, :],
            }
        )
    return out


def term_operands(
    plan: Plan, terms: list[dict], *, q_tile, k_tile
) -> tuple[tuple, list, list[pl.BlockSpec]]:
    """The TPU layout's term operands with block specs for a grid (b, n, outer, walked):
    ``q_tile(outer, walked)`` / ``k_tile(outer, walked)`` give the query / key tile a step
    reads. Returns (which arrays each term has, operands, specs)."""
    has, operands, specs = [], [], []
    for term in terms:
        has.append(tuple(term[key] is not None for key in ("params", "q", "k")))
        if term["params"] is not None:
            size = term["params"].shape[-1]
            operands.append(term["params"])
            specs.append(pl.BlockSpec((None, 1, size), lambda b, n, i, j: (n, 0, 0)))
        if term["q"] is not None:
            operands.append(term["q"])
            specs.append(row_spec(plan, q_tile))
        if term["k"] is not None:
            operands.append(term["k"])
            specs.append(
                pl.BlockSpec(
                    (None, None, 1, plan.size_k), lambda b, n, i, j: (b, n, 0, k_tile(i, j))
                )
            )
    return tuple(has), operands, specs


def dma_copy(src: object, dst: object, sem: object) -> None:
    """A DMA between HBM and VMEM refs, waited for (the next step's may overlap it)."""
    copy = pltpu.make_async_copy(src, dst, sem)
    copy.start()
    copy.wait()


def dma_add(rows: object, buffer: object, sem: object, value: jax.Array) -> None:
    """``rows`` (an HBM slice) += ``value``, through the VMEM ``buffer`` of its shape (the
    kernels that add to float32 sums in HBM walk those rows' steps in order)."""
    dma_copy(rows, buffer, sem)
    buffer[...] += value
    dma_copy(buffer, rows, sem)


def tpu_per_head_specs(arrays: tuple) -> list[pl.BlockSpec]:
    """Block specs of (N, R, C) arrays (CoPE's parameters) read whole by head, for a grid
    (b, n, outer, walked)."""
    return [pl.BlockSpec((None, *x.shape[1:]), lambda b, n, i, j: (n, 0, 0)) for x in arrays]
