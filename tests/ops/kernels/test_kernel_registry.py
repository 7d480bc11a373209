"""``model.attention_impl="kernel"`` for every registered scheme: covered, or refused by name.

A covered scheme's whole model (values and gradients of every parameter) on the fused kernels
(Pallas interpret mode on the CPU) equals the naive path, with grouped KV heads, a window
with sink tokens, packed segments and a length of several tiles; in float32 and bfloat16.
A scheme the kernels cannot run is refused by ``copejax.model.checks.validate`` with a
ValueError that names it. A new scheme falls in one of the two automatically (the registry is
iterated).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model import decode
from copejax.model.attention_paths import choose_impl
from copejax.model.kernel_terms import CHECKED_COMPOSITES, kernel_refusal
from copejax.model.measured_paths import MEASURED
from copejax.model.transformer import Transformer
from copejax.ops.kernels.gpu_lowering import lower_for_gpu
from copejax.positions import registry
from tests.conftest import perturbed, tiny_config
from tests.ops.kernels.every_term import every_term
from tests.ops.kernels.tolerances import assert_close

LENGTH, BLOCK = 40, 16  # three key tiles, the last one padded
SEGMENTS_BT = np.array([[0] * LENGTH, [0] * 17 + [1] * 15 + [2] * 8], np.int32)
POSITIONS_BT = np.array([np.arange(LENGTH), np.r_[np.arange(17), np.arange(15), np.arange(8)]])
SCHEMES = registry.names()
COVERED = [name for name in SCHEMES if kernel_refusal(registry.make_scheme(name)) is None]
REFUSED = [name for name in SCHEMES if name not in COVERED]
COMPOSITES = list(CHECKED_COMPOSITES)
SLOW = pytest.mark.slow


def _config(position: str, impl: str, dtype: str, window: int | None, sinks: int, **options):
    scheme = registry.make_scheme(position)
    layers = 2 if scheme.share_across_layers else 1
    return tiny_config(
        position,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        d_model=64,
        max_len=LENGTH,
        attention_impl=impl,
        attention_block=BLOCK,
        window=window,
        window_sink_tokens=sinks if scheme.window_sinks else 0,  # PaTH refuses sinks
        dtype=dtype,
        **options,
    )


def _compare(position: str, dtype: str, window: int | None, sinks: int, **options) -> None:
    """The model on the kernels against the naive path; ``options``: more ModelConfig
    fields (``attention_sink``, ...), the same for both."""
    tokens_BT = jnp.asarray(np.random.default_rng(0).integers(0, 13, (2, LENGTH)), jnp.int32)
    positions_BT, ids_BT = jnp.asarray(POSITIONS_BT), jnp.asarray(SEGMENTS_BT)
    naive = Transformer(_config(position, "naive", dtype, window, sinks, **options))
    kernel = Transformer(_config(position, "kernel", dtype, window, sinks, **options))
    params = perturbed(jax.jit(naive.init)(jax.random.key(0), tokens_BT, positions_BT)["params"])

    def loss(model: Transformer, p: object) -> tuple[jax.Array, jax.Array]:
        logits_BTV = model.apply({"params": p}, tokens_BT, positions_BT, ids_BT)
        return jnp.mean(jnp.sin(logits_BTV.astype(jnp.float32))), logits_BTV

    grad = lambda m: jax.jit(jax.value_and_grad(lambda p: loss(m, p), has_aux=True))
    (_, logits_n), grads_n = grad(naive)(params)
    (_, logits_k), grads_k = grad(kernel)(params)
    # A layer's output sums LENGTH keys (float32 reordering); bfloat16 rounds the weights and
    # the output on each path (2 roundings) in each of the layers, and the logits once.
    layers = naive.cfg.num_layers
    assert_close(logits_k, logits_n, dtype=dtype, summands=LENGTH, roundings=2 * layers + 1)
    # A gradient that cancels to about 0 (FIRE's output bias: the softmax ignores a constant
    # per head) is compared at the scale of the whole gradient, what its terms are made of.
    # A parameter's gradient sums over every (query, key) pair, LENGTH^2 of a row (a weight's
    # over the tokens' dq / dk, each a sum over LENGTH pairs). With LENGTH summands, FIRE's c
    # in selective+fire missed on jax 0.11.2: 1.5e-6 off, 1.6x that bound (5.4e-7 before its
    # pull-back by hand, kernel_fire).
    leaves_n = jax.tree_util.tree_leaves_with_path(grads_n)
    scale = max(float(jnp.max(jnp.abs(g.astype(jnp.float32)))) for _, g in leaves_n)
    flat_k = dict(jax.tree_util.tree_leaves_with_path(grads_k))
    for path, grad_n in leaves_n:
        assert_close(
            flat_k[path],
            grad_n,
            dtype=dtype,
            summands=LENGTH * LENGTH,
            roundings=4 * layers + 2,
            scale=scale,
            err_msg=jax.tree_util.keystr(path),
        )


@pytest.mark.parametrize(
    "position",
    [pytest.param(p, marks=SLOW) for p in COVERED]
    + [pytest.param(p, marks=SLOW) for p in COMPOSITES],
)
def test_kernel_equals_naive_float32_window_sinks_gqa_packed(position: str) -> None:
    _compare(position, "float32", window=12, sinks=2)


@pytest.mark.parametrize("position", [pytest.param(p, marks=SLOW) for p in COVERED])
def test_kernel_equals_naive_bfloat16_full_causal(position: str) -> None:
    _compare(position, "bfloat16", window=None, sinks=0)


@SLOW
@pytest.mark.parametrize("position", COVERED)
def test_kernel_equals_naive_float32_full_causal(position: str) -> None:
    _compare(position, "float32", window=None, sinks=0)


@SLOW
@pytest.mark.parametrize("position", COVERED)
def test_kernel_equals_naive_bfloat16_window_sinks(position: str) -> None:
    _compare(position, "bfloat16", window=12, sinks=2)


@pytest.mark.parametrize("position", [*REFUSED, "dape+rope", "tape+dape"])
def test_refused_by_name(position: str) -> None:
    part = next(p for p in position.split("+") if p in REFUSED)
    with pytest.raises(ValueError, match=f"no kernel for scheme '{part}'"):
        tiny_config(position, attention_impl="kernel")


@pytest.mark.parametrize(
    ("position", "options", "named"),
    [
        ("cope+stickbreaking", {}, "another normalizer"),
        ("cope", {"p_max": None}, "p_max=512 table rows"),
        ("cope", {"p_max": None, "gates": "values"}, "p_max=512 table rows"),
    ],
)
def test_refuses_cope_variants_by_name(position: str, options: dict, named: str) -> None:
    """What CoPE's kernels refuse; every gate and position term runs
    (tests/ops/kernels/test_cope_variants.py)."""
    with pytest.raises(ValueError, match=f"no kernel for scheme 'cope': .*{named}"):
        tiny_config(position, attention_impl="kernel", position_options=options, max_len=512)


def test_refuses_a_tile_that_is_no_power_of_two() -> None:
    with pytest.raises(ValueError, match="attention_block=48: the fused kernels' tiles"):
        tiny_config("rope", attention_impl="kernel", attention_block=48)


def test_takes_the_attention_sink() -> None:
    """The sink runs on the kernels (tests/ops/kernels/test_sink_kernel.py checks it)."""
    assert tiny_config("rope", attention_impl="kernel", attention_sink=True).attention_sink


def test_refuses_decoding() -> None:
    """Decoding reads a KV cache; the refusal comes when the decode path is first traced."""
    cfg = tiny_config("alibi", attention_impl="kernel")
    with pytest.raises(ValueError, match="decoding reads a KV cache"):
        decode.init_cache(cfg, 1, 8)


def test_auto_takes_the_kernels_only_where_a_gpu_measured_them() -> None:
    """``auto`` takes the kernels exactly where ``measured_paths.MEASURED`` names them: on a
    GPU, in bfloat16, from the measured length on, for the measured schemes; never on the
    CPU or a TPU, in float32, below that length, or for another scheme."""
    kernel_from = {m.scheme: m.keys for m in MEASURED if m.impl == "kernel"}
    assert {m.backend for m in MEASURED if m.impl == "kernel"} <= {"gpu"}
    assert set(kernel_from) <= set(COVERED)
    for name in COVERED:
        for dtype in ("float32", "bfloat16"):
            cfg = tiny_config(name, dtype=dtype, d_model=64)  # head dim 32: Triton tiles it
            for backend in ("cpu", "gpu", "tpu"):
                for length in (16, 4096, 65536):
                    pairs = 8 * length * length
                    takes = choose_impl(cfg, length, False, backend, pairs) == "kernel"
                    measured = (backend, dtype) == ("gpu", "bfloat16") and name in kernel_from
                    assert takes == (measured and length >= kernel_from[name]), (
                        name,
                        dtype,
                        backend,
                        length,
                    )


def test_every_term_lowers_to_triton() -> None:
    """Every scheme's tile function (kernel_terms.TERM_BUILDERS, Kerple in both variants)
    lowers to Triton, all of them summed in one kernel, checked from the CPU."""
    from copejax.ops.kernels.attention import fused_attention

    heads, length = 2, 32
    terms = every_term(heads, length)
    q_BTNH = jnp.ones((1, length, heads, 16), jnp.bfloat16)
    positions_BT = jnp.arange(length)[None]

    def loss(q_BTNH: jax.Array) -> jax.Array:
        y = fused_attention(
            q_BTNH,
            q_BTNH,
            q_BTNH,
            q_positions_BT=positions_BT,
            k_positions_BT=positions_BT,
            segment_ids_BT=jnp.zeros((1, length), jnp.int32),
            terms=terms,
            interpret=False,
        )
        return jnp.sum(y.astype(jnp.float32))

    lowered = lower_for_gpu(jax.jit(jax.grad(loss)), q_BTNH)
    assert "copejax_attention_dkdv" in lowered.as_text()
