"""The GPU kernels' carry groups (copejax.ops.kernels.carry_groups): how the key tiles are cut,
how many groups a call keeps, and that stick-breaking's and CoPE's gradients do not depend on
the cut."""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.ops.kernels.carry_groups import (
    auto_groups,
    balanced_starts,
    carry_groups_for_tracing,
)
from copejax.ops.kernels.cope import CopeStatic, CopeTerm
from copejax.ops.kernels.gpu_lowering import lower_for_gpu
from tests.ops.kernels import (
    test_cope_kernel,
    test_cope_variants,
    test_kernel_registry,
    test_stick_kernel,
)
from tests.ops.kernels.test_fused_attention import _inputs, on_layout


def _sums(work: list[int], starts: tuple[int, ...]) -> list[int]:
    return [sum(work[a:b]) for a, b in itertools.pairwise(starts)]


def test_balanced_starts_cover_the_tiles_in_nonempty_runs() -> None:
    work = [9, 8, 7, 6, 5, 4, 3, 2, 1]
    for groups in range(1, len(work) + 1):
        starts = balanced_starts(work, groups)
        assert starts[0] == 0 and starts[-1] == len(work) and len(starts) == groups + 1
        assert all(a < b for a, b in itertools.pairwise(starts))
    assert balanced_starts(work, len(work)) == tuple(range(len(work) + 1))
    assert balanced_starts(work, 1) == (0, len(work))


def test_balanced_starts_even_out_causal_work() -> None:
    """Causal attention: key tile j is seen by count - j query tiles. The groups' pairs stay
    within 15% of an equal share, where equal numbers of tiles would give the oldest group
    15 times the newest's."""
    count, groups = 256, 32
    work = [count - j for j in range(count)]
    sums = _sums(work, balanced_starts(work, groups))
    share = sum(work) / groups
    assert max(sums) <= 1.15 * share and min(sums) >= 0.85 * share
    tiles = [b - a for a, b in itertools.pairwise(balanced_starts(work, groups))]
    assert tiles[0] < tiles[-1]  # old tiles are seen by more queries: fewer per group


@pytest.mark.parametrize("groups", [0, 4])
def test_balanced_starts_refuses_impossible_counts(groups: int) -> None:
    with pytest.raises(ValueError, match=rf"carry groups must be in \[1, 3\].*got {groups}"):
        balanced_starts([3, 2, 1], groups)


def test_auto_groups_keep_carries_within_twice_the_queries() -> None:
    # 8 bytes of carries per row and query, at most 2 x H x itemsize: the groups and a
    # spare row, a power of two
    assert auto_groups(256, 64, 2) == 31
    assert auto_groups(256, 128, 2) == 63
    assert auto_groups(256, 64, 4) == 63
    assert auto_groups(256, 48, 2) == 15  # 24 rows' budget: 16
    assert auto_groups(20, 64, 2) == 20  # fewer tiles than that: one group each
    with carry_groups_for_tracing(3):
        assert auto_groups(256, 64, 2) == 3
        assert auto_groups(2, 64, 2) == 2
    assert auto_groups(256, 64, 2) == 31


@pytest.mark.parametrize(
    ("groups", "window", "sinks", "include_self"),
    [
        (2, 20, 3, False),
        (3, 20, 0, False),  # a window without sinks: the walks skip the oldest groups
        pytest.param(1, None, 0, True, marks=pytest.mark.slow),
        pytest.param(3, None, 0, False, marks=pytest.mark.slow),
    ],
)
def test_gradients_do_not_depend_on_the_groups(
    groups: int, window: int | None, sinks: int, include_self: bool
) -> None:
    """Five key tiles in ``groups`` programs, each walking its tiles and updating the carries
    in place: the gradients of q, k, v and the terms equal the dense reference's (the stick
    kernel test, with grouped heads, packed segments and a window with sinks)."""
    with carry_groups_for_tracing(groups):
        test_stick_kernel.test_gradients_equal_dense("float32", window, sinks, include_self)


@pytest.mark.parametrize(
    ("groups", "dtype", "window", "sinks"),
    [
        (2, "float32", 20, 3),
        pytest.param(3, "float32", 20, 0, marks=pytest.mark.slow),
        pytest.param(1, "float32", None, 0, marks=pytest.mark.slow),
        pytest.param(3, "bfloat16", None, 0, marks=pytest.mark.slow),
    ],
)
def test_cope_gradients_do_not_depend_on_the_groups(
    groups: int, dtype: str, window: int | None, sinks: int
) -> None:
    """CoPE's counts and their cotangents' running sums per carry group (five key tiles):
    the gradients of q, k, v, the table and another term equal the dense reference's."""
    with carry_groups_for_tracing(groups):
        test_cope_kernel.test_gradients_equal_dense(dtype, window, sinks)


@pytest.mark.parametrize(
    ("gates", "term", "window"),
    [
        ("sep_keys", "mlp", test_cope_variants.WINDOW),
        pytest.param("values", "interpolate", None, marks=pytest.mark.slow),
        pytest.param("keys", "alibi", test_cope_variants.WINDOW, marks=pytest.mark.slow),
    ],
)
def test_cope_gate_keys_and_terms_in_one_group(gates: str, term: str, window: int | None):
    """Both key tiles in one program: CoPE's gate keys' gradient and its other position terms
    equal the reference's."""
    with carry_groups_for_tracing(1):
        test_cope_variants._check(
            gates, term, "float32", test_cope_variants.SMALL, backend="triton", window=window
        )


@pytest.mark.parametrize("position", ["stickbreaking", "cope", "alibi+stickbreaking"])
def test_model_on_one_carry_group_equals_naive(position: str) -> None:
    """The whole model (every parameter's gradient) with the kernels' three key tiles in one
    carry group equals the naive path: grouped KV heads, packed segments, a window with
    sinks (the kernel registry test's setup)."""
    with carry_groups_for_tracing(1):
        test_kernel_registry._compare(position, "float32", window=9, sinks=2)


@pytest.mark.parametrize("scheme", ["stickbreaking", "cope"])
def test_backward_keeps_carries_per_group_not_per_key_tile(scheme: str) -> None:
    """The lowered backward holds the carries as (B, N, rows, T) with rows the groups plus a
    spare, padded to a power of two, not one row per key tile (five here, eight rows), and
    CoPE's table gradient once per batch row and head."""
    x = _inputs(jnp.bfloat16)
    table = jnp.asarray(np.random.default_rng(3).normal(size=(8, x["q"].shape[-1])), jnp.float32)
    options = {"normalizer": "stickbreaking", "include_self": False}
    if scheme == "cope":
        options = {"cope": CopeTerm(table, CopeStatic(8))}

    def loss(x: dict) -> jax.Array:
        y = on_layout(
            x,
            block_q=16,
            block_k=16,
            interpret=False,
            **options,
        )
        return jnp.sum(y.astype(jnp.float32))

    batch, _, heads, dim = x["q"].shape
    for groups, rows in ((1, 2), (3, 4), (5, 8)):
        with carry_groups_for_tracing(groups):
            text = lower_for_gpu(jax.jit(jax.grad(loss)), x).as_text()
        assert f"tensor<{batch}x{heads}x{rows}x80xf32>" in text, groups
        assert groups == 5 or f"tensor<{batch}x{heads}x8x80xf32>" not in text, groups
        if scheme == "cope":  # the (padded) table's gradient: one sum per batch row and head
            # (the dq kernel's atomic adds), no partial sum per group or query tile
            assert re.search(rf"tensor<{batch}x{heads}x\d+x{dim}xf32>", text), groups
            assert not re.search(rf"tensor<{batch}x{heads}x\d+x\d+x{dim}xf32>", text), groups
