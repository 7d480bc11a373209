"""``attention_impl="auto"`` follows the measured fastest path (copejax.model.measured_paths).

A measurement applies from its length on, for its backend, dtype and scheme only, and only
where the measured path can run the call (the kernels: not decoding, not a configuration they
refuse, on a GPU not a head dim Triton cannot tile); elsewhere ``auto`` keeps its rules. The
committed table's entries name real schemes, paths and pages. A model on ``auto`` with a CPU
measurement that names the kernels calls them, and decoding does not.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from copejax.model import decode, measured_paths
from copejax.model.attention_paths import (
    choose_impl,
    rule_impl,
)
from copejax.model.config import ATTENTION_IMPLS
from copejax.model.measured_paths import MEASURED, Measurement, measured_impl
from copejax.model.transformer import Transformer
from copejax.positions import registry
from tests.conftest import tiny_config

ROOT = Path(__file__).resolve().parents[1]


def _entry(scheme: str, keys: int, impl: str, backend: str = "gpu", dtype: str = "bfloat16"):
    return Measurement(backend, dtype, scheme, keys, impl, 1.2, "a test")


@pytest.fixture
def table(monkeypatch: pytest.MonkeyPatch):
    """Installs a measurement table in the module ``choose_impl`` reads it from."""

    def install(*entries: Measurement) -> None:
        monkeypatch.setattr(measured_paths, "MEASURED", tuple(entries))

    return install


def test_the_largest_measured_length_at_or_below_the_call_applies() -> None:
    entries = (_entry("fox", 4096, "kernel"), _entry("fox", 16384, "blockwise"))
    assert measured_impl("gpu", "bfloat16", "fox", 4095, entries) is None
    assert measured_impl("gpu", "bfloat16", "fox", 4096, entries).impl == "kernel"
    assert measured_impl("gpu", "bfloat16", "fox", 16383, entries).impl == "kernel"
    assert measured_impl("gpu", "bfloat16", "fox", 65536, entries).impl == "blockwise"
    assert measured_impl("gpu", "float32", "fox", 65536, entries) is None
    assert measured_impl("tpu", "bfloat16", "fox", 65536, entries) is None
    assert measured_impl("gpu", "bfloat16", "alibi", 65536, entries) is None


def test_auto_takes_a_measured_kernel_where_it_can_run(table) -> None:
    table(_entry("fox", 4096, "kernel"), _entry("alibi", 4096, "kernel", dtype="float32"))
    fox = tiny_config("fox", dtype="bfloat16", max_len=8192)
    pairs = 8 * 4096 * 4096
    assert choose_impl(fox, 4096, False, "gpu", pairs) == "kernel"
    assert choose_impl(fox, 8192, False, "gpu", 4 * pairs) == "kernel"
    # Below the measured length, on another backend, while sowing, decoding: the rules.
    assert choose_impl(fox, 2048, False, "gpu", pairs // 4) == rule_impl(
        fox, 2048, "gpu", pairs // 4
    )
    assert choose_impl(fox, 4096, False, "cpu", pairs) == rule_impl(fox, 4096, "cpu", pairs)
    assert choose_impl(fox, 4096, True, "gpu", pairs) == "naive"
    decoding = choose_impl(fox, 4096, False, "gpu", pairs, decoding=True)
    assert decoding == rule_impl(fox, 4096, "gpu", pairs) != "kernel"
    # A block the kernels refuse (not a power of two), a head dim Triton cannot tile on a GPU.
    for overrides in ({"attention_block": 48}, {"head_dim": 24}):
        cfg = tiny_config("fox", dtype="bfloat16", max_len=8192, **overrides)
        assert choose_impl(cfg, 4096, False, "gpu", pairs) == rule_impl(cfg, 4096, "gpu", pairs)
    # The measurement is per dtype: ALiBi's float32 entry, not its bfloat16 calls.
    alibi32 = tiny_config("alibi", dtype="float32", max_len=8192)
    alibi16 = tiny_config("alibi", dtype="bfloat16", max_len=8192)
    assert choose_impl(alibi32, 4096, False, "gpu", pairs) == "kernel"
    assert choose_impl(alibi16, 4096, False, "gpu", pairs) == "dot_product_attention"


def test_a_measured_path_the_scheme_cannot_take_is_ignored(table) -> None:
    """cuDNN's kernel cannot express FoX's bias; the kernels refuse DAPE; the TPU kernels run
    FoX and Shaw's tables, so their TPU measurements are followed."""
    table(
        _entry("fox", 16, "dot_product_attention"),
        _entry("dape", 16, "kernel"),
        _entry("relative", 16, "kernel", backend="tpu"),
        _entry("fox", 16, "kernel", backend="tpu"),
    )
    for name in ("fox", "dape"):
        cfg = tiny_config(name, dtype="bfloat16", max_len=64)
        assert choose_impl(cfg, 64, False, "gpu", 64**2) == rule_impl(cfg, 64, "gpu", 64**2)
    relative = tiny_config("relative", dtype="bfloat16", max_len=64)
    assert choose_impl(relative, 64, False, "tpu") == "kernel" != rule_impl(relative, 64, "tpu")
    fox = tiny_config("fox", dtype="bfloat16", max_len=64)
    assert choose_impl(fox, 64, False, "tpu") == "kernel"


def test_measured_kernels_are_taken_at_any_length(table) -> None:
    """Every kernel keeps O(T) memory on both backends (stick-breaking's, CoPE's and
    selective attention's carries per carry group on a GPU, in VMEM or not at all on a TPU):
    auto follows a measured kernel at any length, whatever the call's B N T S."""
    names = ("selective", "stickbreaking", "cope", "fox")
    table(*(_entry(n, 4096, "kernel", backend=b) for n in names for b in ("gpu", "tpu")))
    for name in names:
        cfg = tiny_config(name, dtype="bfloat16", max_len=65536)
        for length, batch_heads in ((16384, 96), (65536, 96)):
            pairs = batch_heads * length * length
            for backend in ("gpu", "tpu"):
                assert choose_impl(cfg, length, False, backend, pairs) == "kernel"


def test_the_committed_measurements_name_real_schemes_paths_and_pages() -> None:
    explicit = set(ATTENTION_IMPLS) - {"auto"}
    for m in MEASURED:
        registry.make_scheme(m.scheme)  # raises for an unknown name
        assert m.backend in ("gpu", "tpu", "cpu"), m
        assert m.dtype in ("bfloat16", "float32"), m
        assert m.impl in explicit and m.keys > 0 and m.ratio > 0, m
        assert (ROOT / m.source.split()[0]).is_file(), m


class _TookTheKernel(Exception):
    pass


def test_a_model_on_auto_reaches_the_measured_kernel_but_not_to_decode(table, monkeypatch) -> None:
    """With a CPU measurement that names the kernels, a forward pass on ``auto`` calls them
    (their values equal the naive path's: tests/ops/kernels/test_kernel_registry.py); a
    decoding step does not."""

    def took(*args: object, **kwargs: object) -> None:
        raise _TookTheKernel

    monkeypatch.setattr("copejax.model.attention.kernel_attention", took)
    tokens_BT = jnp.zeros((1, 16), jnp.int32)
    positions_BT = jnp.arange(16)[None]
    cfg = tiny_config("fox", num_layers=1)
    model = Transformer(cfg)
    # Traced, not run: the path is chosen while tracing.
    params = jax.eval_shape(model.init, jax.random.key(0), tokens_BT, positions_BT)["params"]
    forward = lambda p: model.apply({"params": p}, tokens_BT, positions_BT)
    table(_entry("fox", 16, "kernel", backend="cpu", dtype="float32"))
    with pytest.raises(_TookTheKernel):
        jax.eval_shape(forward, params)
    cache = jax.eval_shape(lambda: decode.init_cache(cfg, 1, 16))
    step = lambda p, c: model.apply(
        {"params": p, "cache": c}, tokens_BT, positions_BT, decode=True, mutable=["cache"]
    )
    assert jax.eval_shape(step, params, cache)[0].shape[:2] == (1, 16)
    table()
    assert jax.eval_shape(forward, params).shape[:2] == (1, 16)  # no measurement: the rules
