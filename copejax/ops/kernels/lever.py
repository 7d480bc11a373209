"""A setting that kernels read while they are traced: the GPU benchmark's levers (issue 45).

The benchmark's arms trace the same kernels with another launch or layout choice (warps,
prefix sums or matmuls, carry groups, full pairs without the mask) that only a GPU can say
pays. A :class:`TracingLever` holds such a choice as a stack, innermost setting last, so that
the arms' context managers nest; ``None`` leaves the enclosing setting (or the default) in
place. The levers themselves live with what they set:
:func:`copejax.ops.kernels.triton_params.warps_for_tracing` and ``scan_for_tracing``,
:func:`copejax.ops.kernels.carry_groups.carry_groups_for_tracing`,
:func:`copejax.ops.kernels.padding.full_tiles_for_tracing`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Generic, TypeVar

_T = TypeVar("_T")


class TracingLever(Generic[_T]):
    """A traced-time setting: ``value()`` is the innermost :meth:`setting`'s, or ``default``."""

    def __init__(self, default: _T) -> None:
        self.default = default
        self._stack: list[_T] = []

    def value(self) -> _T:
        """The innermost setting, or the default outside every :meth:`setting`."""
        return self._stack[-1] if self._stack else self.default

    @contextlib.contextmanager
    def setting(self, value: _T | None) -> Iterator[None]:
        """Kernels traced inside read ``value`` (None: the enclosing setting)."""
        if value is None:
            yield
            return
        self._stack.append(value)
        try:
            yield
        finally:
            self._stack.pop()
