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
path enters only if it was the fastest at every measured shape of that length, and a length
measured at one shape only admits a win of at least 1.2x over the rules' path
(``bench_kernels_page.ONE_SHAPE_MARGIN``). The first GPU page (an H100, 2026-11-27) measured
one shape, (B, N, H) = (2, 4, 64) at T = 4096: ALiBi, T5, FoX and stick-breaking on the
kernels beat their rules' paths there (cuDNN with a (B, N, T, S) bias, the engine's walk).
Plain nope's kernel beat cuDNN by 1.11x only, under the margin, so nope keeps cuDNN.

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


_H100 = "experiments/results/bench_kernels_gpu.md 2026-11-27"
# Filled from GPU/TPU pages only (see the module docstring), as their pages print them.
MEASURED: tuple[Measurement, ...] = (
    Measurement("gpu", "bfloat16", "alibi", 4096, "kernel", 1.57, _H100),
    Measurement("gpu", "bfloat16", "fox", 4096, "kernel", 1.46, _H100),
    Measurement("gpu", "bfloat16", "stickbreaking", 4096, "kernel", 22.7, _H100),
    Measurement("gpu", "bfloat16", "t5", 4096, "kernel", 13.9, _H100),
)


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
