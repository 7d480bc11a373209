"""Lowering the Triton kernels for a GPU from a CPU-only machine, on either jax the project
runs (the pinned 0.10 and the GPU machine's 0.11).

jax 0.11 reads the target GPU's kind when it lowers a Triton kernel and, with no GPU present,
asks for an abstract one (``jax.sharding.AbstractDevice`` on an abstract mesh); jax 0.10
lowers without it. An abstract H100 stands in for the missing GPU where the installed jax
has the class.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import jax

H100 = "NVIDIA H100 80GB HBM3"
H100_SMS = 132


def abstract_gpu() -> contextlib.AbstractContextManager:
    """A context in which lowering for "cuda" targets an H100 (a no-op where jax lowers
    Triton kernels without one)."""
    device = getattr(jax.sharding, "AbstractDevice", None)
    if device is None:
        return contextlib.nullcontext()
    mesh = jax.sharding.AbstractMesh(
        (1,),
        ("gpu",),
        (jax.sharding.AxisType.Auto,),  # not Explicit, its default: no sharding in the types
        abstract_device=device(device_kind=H100, num_cores=H100_SMS, platform="gpu"),
    )
    return jax.sharding.use_abstract_mesh(mesh)


def lower_for_gpu(jitted: Callable, *args: object) -> jax.stages.Lowered:
    """``jitted`` (a ``jax.jit`` function) traced on ``args`` and lowered for a CUDA GPU."""
    with abstract_gpu():
        return jitted.trace(*args).lower(lowering_platforms=("cuda",))
