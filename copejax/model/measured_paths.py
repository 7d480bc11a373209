"""What ``attention_impl="auto"`` takes where a benchmark measured the paths side by side.

Issue 45: "auto" takes the fastest measured path per backend for every covered scheme. Each
:class:`Measurement` records, for one (backend, dtype, scheme, key count), the path that was
fastest among those measured side by side in one process, with its time over the fastest
nope's and the page that holds the numbers. :func:`measured_impl` answers for a call of
``length_k`` keys with the measurement at the largest measured length at or below it (a
path that wins at T keeps winning at longer T in every measurement so far: the engine's walk
and the naive path only fall further behind); below the shortest measured length, and for
anything unmeasured, ``auto`` keeps its rules (:func:`copejax.model.attention_paths.rule_impl`).

The table is filled from a GPU run of ``python -m experiments.bench_kernels_gpu``, whose page
ends with the entries to paste here (``experiments.bench_kernels_gpu.dispatch_entries``): a
path enters only if it was the fastest at every measured shape of that length. No GPU has
measured the fused kernels yet, so the table is empty and ``auto`` never takes them.

Shape letters: none (static facts about calls).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Measurement:
    """The fastest measured attention path of one (backend, dtype, scheme, key count).

    Attributes:
      backend: ``jax.default_backend()`` of the measurement ("gpu", "tpu", "cpu").
      dtype: ``model.dtype`` of the measured layer ("bfloat16", "float32").
      scheme: ``model.position`` as configured (a registry name or a composite "a+b").
      keys: the sequence length measured (T = S).
      impl: the fastest path there, one of ``model.attention_impl``'s explicit values.
      ratio: its time over the fastest nope arm's in the same rounds.
      source: the page and date of the measurement.
    """

    backend: str
    dtype: str
    scheme: str
    keys: int
    impl: str
    ratio: float
    source: str


# Filled from GPU/TPU pages only (see the module docstring); empty until one is measured.
MEASURED: tuple[Measurement, ...] = ()


def measured_impl(
    backend: str,
    dtype: str,
    scheme: str,
    length_k: int,
    table: tuple[Measurement, ...] | None = None,
) -> Measurement | None:
    """The measurement ``auto`` follows for a call of ``length_k`` keys: the one of this
    backend, dtype and scheme at the largest measured length <= ``length_k``; None if none."""
    table = MEASURED if table is None else table
    fits = [
        m
        for m in table
        if (m.backend, m.dtype, m.scheme) == (backend, dtype, scheme) and m.keys <= length_k
    ]
    return max(fits, key=lambda m: m.keys) if fits else None
