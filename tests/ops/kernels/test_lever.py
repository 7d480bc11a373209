"""The GPU benchmark's tracing levers (copejax.ops.kernels.lever): nesting, None, restore."""

from __future__ import annotations

import pytest

from copejax.ops.kernels import carry_groups, padding, triton_params
from copejax.ops.kernels.lever import TracingLever


def test_settings_nest_none_inherits_and_each_exit_restores() -> None:
    lever = TracingLever(4)
    assert lever.value() == 4
    with lever.setting(8):
        assert lever.value() == 8
        with lever.setting(None):
            assert lever.value() == 8
        with lever.setting(2):
            assert lever.value() == 2
        assert lever.value() == 8
    assert lever.value() == 4
    with pytest.raises(RuntimeError), lever.setting(16):
        raise RuntimeError("an arm that fails")
    assert lever.value() == 4


def test_the_kernels_levers_read_their_settings() -> None:
    """Each lever's module reads its own setting: warps into the launch parameters, the scan
    choice, the carry groups (at most one per key tile) and the plans' full pairs."""
    assert triton_params.compiler_params(64).num_warps == 4
    with triton_params.warps_for_tracing(8):
        assert triton_params.compiler_params(64).num_warps == 8
    assert triton_params.gpu_scan()
    with triton_params.scan_for_tracing(False):
        assert not triton_params.gpu_scan()
    with carry_groups.carry_groups_for_tracing(3):
        assert carry_groups.auto_groups(count_k=10, head_dim=64, itemsize=2) == 3
        assert carry_groups.auto_groups(count_k=2, head_dim=64, itemsize=2) == 2
    fields = {"window": None, "sink_tokens": 0, "groups": 1, "biases": ()}
    plan = lambda: padding.tiled_plan(
        64, block_q=16, block_k=16, backend="gpu", interpret=True, **fields
    )
    assert plan().full_tiles
    with padding.full_tiles_for_tracing(False):
        assert not plan().full_tiles
