"""The GPU compiler parameters of the fused kernels: Pallas's Triton backend (issue 45).

Why Triton and not Mosaic GPU: the kernels are written against the portable ``pl.pallas_call``
API (block specs, ``pl.ds`` slices of refs, ``lax.fori_loop`` / ``lax.cond``, ``dot_general``
with a float32 accumulator), which runs in interpret mode on the CPU, where CI tests it, and
lowers to Triton on GPUs. Mosaic GPU in jax 0.10.2 takes ``pl.pallas_call`` kernels only as a
deprecated path and wants ``plgpu.kernel`` with explicit warpgroup matmuls, shared-memory
layouts and barriers, which interpret mode on a CPU cannot run (jax 0.11 deprecates the Triton
backend in favour of it). jax 0.11.2, the GPU machine's (Python 3.12 or later, so not CI's
3.11), still registers the Triton lowering for ``triton.CompilerParams`` with the same
``num_warps`` / ``num_stages`` and the same ``pallas_call`` / ``BlockSpec`` / ``pl.ds`` API
(read from its source), warning ``jax-pallas-triton``; it needs a GPU (or an abstract one) to
lower, where 0.10.2 lowers from the CPU for compute capability 9.0, which the tests use.
Passing ``CompilerParams`` of the Triton backend pins the backend whatever
``jax_pallas_use_mosaic_gpu`` says. A Mosaic GPU port of the same tiles (a Hopper ``wgmma``
pipeline) is the next step once a GPU measures the Triton one. The TPU runs its own Mosaic
kernels of the same maths (:mod:`copejax.ops.kernels.tpu_params`: a (B, N, T, H) layout, since
Mosaic refuses the (None, Q, None, H) blocks used here, and a grid axis over key tiles instead
of the in-kernel loop). Triton also wants power-of-two block shapes: the head dim and value
width must be powers of two on a GPU (:func:`copejax.ops.kernels.attention.fused_attention`
refuses others there), and parameter rows are padded to one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from jax.experimental.pallas import triton as pltriton

from copejax.ops.kernels.lever import TracingLever

_WARPS: TracingLever[int | None] = TracingLever(None)  # warps_for_tracing's setting


def compiler_params(head_dim: int) -> pltriton.CompilerParams:
    """Triton's launch parameters: 4 warps up to H = 64, 8 above (the choice of
    ``jax.experimental.pallas.ops.gpu.attention``), or what :func:`warps_for_tracing` says;
    two pipeline stages."""
    warps = _WARPS.value() or (4 if head_dim <= 64 else 8)
    return pltriton.CompilerParams(num_warps=warps, num_stages=2)


@contextlib.contextmanager
def warps_for_tracing(warps: int | None) -> Iterator[None]:
    """Kernels traced inside take ``warps`` warps (None: the default above), for the GPU
    benchmark's arms: with 8 warps at H = 64 the H100 target spills less (ALiBi's dk / dv
    236 -> 48 bytes per thread, FoX's 128 -> 0; ``experiments/kernel_ptx.py``), which only a
    GPU can say is faster."""
    with _WARPS.setting(warps):
        yield


# Whether the GPU kernels' within-tile sums (stick-breaking's, CoPE's count, selective
# attention's penalties) are prefix sums (Triton's scan, copejax.ops.kernels.stick.tile_sum)
# rather than tensor-core matmuls with a triangular ones matrix, innermost setting last
# (scan_for_tracing). On the H100 target (experiments/kernel_ptx.py) the bfloat16-pieces
# matmuls held stick-breaking's forward at 255 registers with 12 more wgmma per tile; the
# scan's forward takes 197 and spills nothing (dq 572 -> 36, dk/dv 1548 -> 696 spilled
# bytes). The TPU kernels keep the matmuls (Mosaic lowers no cumsum).
_GPU_SCAN: TracingLever[bool] = TracingLever(True)


def gpu_scan() -> bool:
    """Whether GPU kernels traced now take :func:`tile_sum`'s prefix sums (default True)."""
    return _GPU_SCAN.value()


@contextlib.contextmanager
def scan_for_tracing(scan: bool | None) -> Iterator[None]:
    """GPU kernels traced inside take the prefix sums (True) or the tensor-core matmuls
    (False; None: the default), for the GPU benchmark's arms: the scan spills less on the
    H100 target, which only a GPU can say is faster."""
    with _GPU_SCAN.setting(scan):
        yield


# Whether stick-breaking's GPU kernels take log(1 + u) as ``lg2.approx(1 + u) ln 2`` (the
# stick-breaking authors' Triton softplus takes that form; copejax.ops.kernels.stick.
# log1p_gpu) rather than jnp.log1p, which Pallas's Triton lowering sends to libdevice's
# log1pf: about 30 instructions a value, ~45% of stick-breaking's forward kernel's PTX on the
# H100 target. The approximation loses up to ~1e-7 of each key's softplus, summed over the
# keys; off by default until a GPU measures what it buys (approx_log1p_for_tracing).
_APPROX_LOG1P: TracingLever[bool] = TracingLever(False)


def approx_log1p() -> bool:
    """Whether stick-breaking's GPU kernels traced now take the approximate log1p."""
    return _APPROX_LOG1P.value()


@contextlib.contextmanager
def approx_log1p_for_tracing(approx: bool | None) -> Iterator[None]:
    """Stick-breaking's GPU kernels traced inside take ``lg2.approx`` for log1p (True) or
    libdevice's log1pf (False; None: the enclosing setting), for the GPU benchmark's arms."""
    with _APPROX_LOG1P.setting(approx):
        yield


def program_barrier(interpret: bool) -> None:
    """A barrier across the Triton program's threads (``bar.sync``: the program's memory
    accesses before it are visible to all its threads after it), where one thread loads what
    another stored through global memory: the carries a dk / dv program keeps in place across
    key tiles (:mod:`copejax.ops.kernels.carry_groups`). Nothing in interpret mode, which runs
    a program as one sequential computation (and has no rule for the primitive)."""
    if not interpret:
        pltriton.debug_barrier()
