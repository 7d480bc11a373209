"""The fused kernels' TPU backend (copejax.ops.kernels.tpu_forward / tpu_backward), from the CPU.

Two tools, no TPU: TPU interpret mode (``pltpu.InterpretParams``: it simulates VMEM, the DMAs
and the grid order) runs the Mosaic kernels, whose values and gradients must equal the dense
references (NumPy float64 values, ``jax.grad`` of the dense float32 maths) with grouped KV
heads, packed segments, a window with sinks, three kinds of term (per-head parameters, a
one-hot table, per-token values) and several query and key tiles; and ``jax.export`` to
``platforms=["tpu"]`` runs Pallas's Mosaic lowering (block shapes, primitives) for every
scheme's term. At the model level a covered scheme on the TPU kernels equals the naive path,
and the schemes the TPU kernels do not run are refused by name. TPU interpret mode costs
seconds per kernel call, so the default set keeps the exports and the refusals.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model import attention_paths, kernel_terms
from copejax.ops.engine_blocks import BlockTerm
from copejax.ops.kernels import attend as kernels_attend
from copejax.ops.kernels.attention import fused_attention
from copejax.ops.kernels.terms import KernelTerm, TermTile
from copejax.ops.kernels.tpu_forward import tpu_forward_call
from copejax.positions import registry
from copejax.positions.t5 import t5_bucket
from tests.conftest import tiny_config
from tests.ops.kernels.every_term import every_term
from tests.ops.kernels.full_pairs import full_and_masked, total
from tests.ops.kernels.reference import (
    attention_jnp,
    attention_numpy,
    mask_BTS,
    stick_attention,
)
from tests.ops.kernels.test_fused_attention import _decay, _slope, _table
from tests.ops.kernels.tolerances import assert_close

# T: 2 key tiles of 128 (the TPU's smallest multi-tile key block) and 4 query tiles of 64,
# padded from 200 to 256.
B, T, N, G, H, P = 2, 200, 4, 2, 16, 8
SEGMENTS_BT = np.array([[0] * T, [0] * 90 + [1] * 70 + [2] * 40], np.int32)
POSITIONS_BT = np.array([np.arange(T), np.r_[np.arange(90), np.arange(70), np.arange(40)]])
RANK_BT = POSITIONS_BT.astype(np.int32)
WINDOW, SINKS = 100, 3  # the window spans tiles, sinks reach back past it
SLOW = pytest.mark.slow


def _inputs(dtype) -> dict:
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
    return {
        "q": normal(B, T, N, H),
        "k": normal(B, T, G, H),
        "v": normal(B, T, G, H),
        "slopes": jnp.asarray(rng.uniform(0.01, 0.1, (N, 1)), jnp.float32),
        "table": jnp.asarray(rng.normal(size=(N, P)), jnp.float32),
        "c": jnp.asarray(np.cumsum(-rng.uniform(0, 0.05, (B, T, N)), axis=1), jnp.float32),
    }


def _kernel(x: dict, *, window: int | None, sinks: int, stick: bool = False) -> jax.Array:
    terms = [
        KernelTerm("slope", _slope, params_NP=x["slopes"]),
        KernelTerm("table", _table, params_NP=x["table"]),
        KernelTerm("decay", _decay, q_values_BTN=x["c"], k_values_BSN=x["c"]),
    ]
    return fused_attention(
        x["q"],
        x["k"],
        x["v"],
        q_positions_BT=jnp.asarray(POSITIONS_BT),
        k_positions_BT=jnp.asarray(POSITIONS_BT),
        segment_ids_BT=jnp.asarray(SEGMENTS_BT),
        terms=terms,
        window=window,
        sink_tokens=sinks,
        k_rank_BT=jnp.asarray(RANK_BT),
        block_q=64,
        block_k=128,
        backend="tpu",
        normalizer="stickbreaking" if stick else "softmax",
        include_self=not stick,  # stick-breaking's default excludes the query's own key
    )


def _allowed(window: int | None, sinks: int, stick: bool) -> np.ndarray:
    allowed = mask_BTS(SEGMENTS_BT, window, sinks, RANK_BT)
    return allowed & ~np.eye(T, dtype=bool)[None] if stick else allowed


def _dense(stick: bool, x: dict, allowed: np.ndarray, xp=jnp):
    """The dense reference: softmax (float64 NumPy or float32 jnp), or stick-breaking."""
    bias_BNTS = _bias_BNTS(x, xp)
    if stick:
        return stick_attention(x["q"], x["k"], x["v"], bias_BNTS, allowed, xp=xp)
    reference = attention_numpy if xp is np else attention_jnp
    return reference(x["q"], x["k"], x["v"], bias_BNTS, allowed)


def _bias_BNTS(x: dict, xp=jnp):
    distance_BTS = POSITIONS_BT[:, :, None] - POSITIONS_BT[:, None, :]
    slopes, table, c = (xp.asarray(x[key], xp.float32) for key in ("slopes", "table", "c"))
    bias = -slopes[None, :, :1, None] * distance_BTS[:, None].astype(np.float32)
    bias = bias + xp.moveaxis(table[:, np.clip(distance_BTS, 0, P - 1)], 0, 1)
    c_BNT = xp.moveaxis(c, 2, 1)
    return bias + c_BNT[:, :, :, None] - c_BNT[:, :, None, :]


@SLOW
@pytest.mark.parametrize(
    ("window", "sinks", "stick"),
    [(None, 0, False), (WINDOW, 0, False), (WINDOW, SINKS, False), (WINDOW, SINKS, True)],
)
def test_values_equal_numpy(window: int | None, sinks: int, stick: bool) -> None:
    x = _inputs(jnp.float32)
    y = jax.jit(functools.partial(_kernel, window=window, sinks=sinks, stick=stick))(x)
    x64 = {key: np.asarray(value, np.float64) for key, value in x.items()}
    expected = _dense(stick, x64, _allowed(window, sinks, stick), np)
    assert_close(y, expected, dtype="float32", summands=T, roundings=0)


@SLOW
@pytest.mark.parametrize(
    ("dtype", "window", "sinks", "stick"),
    [
        ("float32", WINDOW, SINKS, False),
        ("bfloat16", WINDOW, SINKS, False),
        ("float32", None, 0, False),
        ("float32", WINDOW, SINKS, True),
        ("bfloat16", None, 0, True),
    ],
)
def test_gradients_equal_dense(dtype: str, window: int | None, sinks: int, stick: bool) -> None:
    x = _inputs(jnp.dtype(dtype))
    allowed = jnp.asarray(_allowed(window, sinks, stick))
    cot = jnp.asarray(np.random.default_rng(5).normal(size=(B, T, N, H)), jnp.float32)

    def kernel(x):
        return _kernel(x, window=window, sinks=sinks, stick=stick).astype(jnp.float32)

    def dense(x):  # the same inputs in float32: only the kernel's roundings differ
        x32 = {key: value.astype(jnp.float32) for key, value in x.items()}
        return _dense(stick, x32, allowed)

    y, pull = jax.vjp(jax.jit(kernel), x)
    y_ref, pull_ref = jax.vjp(dense, x)
    (grads,), (grads_ref,) = jax.jit(pull)(cot), pull_ref(cot)
    assert_close(y, y_ref, dtype=dtype, summands=T, roundings=2)
    pairs = B * T * T // 2  # what a parameter's gradient sums over
    for key, summands in [("q", T), ("k", T), ("v", T), ("c", T), ("slopes", pairs)]:
        assert grads[key].dtype == x[key].dtype
        assert_close(grads[key], grads_ref[key], dtype=dtype, summands=summands, roundings=4)
    assert_close(grads["table"], grads_ref["table"], dtype=dtype, summands=pairs, roundings=4)


def test_full_pairs_take_a_mask_free_body_on_a_tpu() -> None:
    """As on a GPU (``test_fused_attention``), the TPU softmax kernels run a full pair (every
    entry allowed: row 0's older key tile) in a second body without the mask: twice the
    matmuls in the kernels' jaxprs; masking every pair (the benchmark's lever) keeps one.
    The values of both bodies are the slow tests' (row 0 holds full pairs)."""
    x = _inputs(jnp.float32)
    run = functools.partial(_kernel, window=None, sinks=0)
    full, masked = full_and_masked(run, x, jnp.ones((B, T, N, H)), values=False)
    assert [total(full), total(masked)] == [18, 9]


def test_tile_functions_agree_across_layouts() -> None:
    """Every scheme's tile function gives one (Q, K) bias from the GPU kernels' operands
    ((Q,) and (K,) positions and values, a (P,) row padded as the kernels pad it) and from the
    TPU kernels' ((Q, 1), (1, K), a (1, P) row); T5's equals its table read at
    ``t5_bucket`` of the distances, with a bucket count that is no power of two."""
    heads, length = 2, 16
    rng = np.random.default_rng(3)
    q_pos, k_pos = jnp.arange(8, 8 + length), jnp.arange(length)
    values = jnp.asarray(rng.normal(size=(2, length)), jnp.float32)
    t5 = registry.make_scheme("t5", {"num_buckets": 12, "max_distance": 20})
    table_PN = jnp.asarray(rng.normal(size=(12, heads)), jnp.float32)
    dims = tiny_config("nope", num_heads=heads).dims
    terms = [*every_term(heads, length), kernel_terms._t5(t5, BlockTerm(None, table_PN), dims)]
    gpu_tile = TermTile(q_pos, k_pos, values[0], values[1])
    tpu_tile = TermTile(q_pos[:, None], k_pos[None], values[0][:, None], values[1][None])

    rows = [None if p is None else p[-1] for p in map(_term_params, terms)]  # the last head

    @jax.jit
    def both(rows: list) -> list[tuple[jax.Array, jax.Array]]:
        return [
            (t.bias(row, gpu_tile), t.bias(None if row is None else row[None], tpu_tile))
            for t, row in zip(terms, rows, strict=True)
        ]

    for term, (gpu, tpu) in zip(terms, both(rows), strict=True):
        np.testing.assert_allclose(tpu, gpu, rtol=1e-6, atol=1e-6, err_msg=term.name)
    buckets = t5_bucket(k_pos[None, :] - q_pos[:, None], False, 12, 20)
    np.testing.assert_allclose(gpu, table_PN[buckets, heads - 1], rtol=1e-6)


def _term_params(term: KernelTerm) -> jax.Array | None:
    """The parameter rows as the kernels read them (attention._term_arrays' padding)."""
    if term.params_NP is None:
        return None
    size = term.params_NP.shape[1]
    return jnp.pad(term.params_NP, ((0, 0), (0, (1 << (size - 1).bit_length()) - size)))


@pytest.mark.parametrize(
    ("with_terms", "stick"),
    [(True, False), (False, False), (False, True)],
    ids=["every_term", "content_only", "stickbreaking"],
)
def test_lowers_to_mosaic_tpu(with_terms: bool, stick: bool) -> None:
    """The forward and both backward kernels pass Pallas's Mosaic TPU lowering (block shapes
    against the (8, 128) tiling, every primitive has a Mosaic rule), with every scheme's term
    summed in one kernel, and with none; exported from the CPU. Mosaic's layout passes run
    only on a TPU (see copejax.ops.kernels.tpu_params)."""
    text = exported_to_tpu(
        heads=2,
        kv_heads=1,
        with_terms=with_terms,
        normalizer="stickbreaking" if stick else "softmax",
        include_self=not stick,
    )
    assert text.count("tpu_custom_call") == 3
    for name in ("forward", "dq", "dkdv"):
        assert f"copejax_attention_{name}_tpu" in text
    if stick:  # its carries stay in VMEM: no float32 per (key tile, query) in HBM
        assert not re.search(r"tensor<(\d+x){6,}f32>", text)  # (B, N, count_k, count_q, 1, Q)


def exported_to_tpu(*, heads: int, kv_heads: int, with_terms: bool, **options: object) -> str:
    """The MLIR of the gradient of a bfloat16 call of 256 tokens (two key tiles of 128, query
    tiles of 64, H = 16, a window of 100 with 2 sinks, every scheme's term or none,
    ``options`` for fused_attention) exported to ``platforms=["tpu"]`` from the CPU."""
    length = 256
    terms = every_term(heads, length) if with_terms else []
    q_BTNH = jnp.ones((1, length, heads, 16), jnp.bfloat16)
    positions_BT = jnp.arange(length)[None]

    def loss(q_BTNH: jax.Array) -> jax.Array:
        y = fused_attention(
            q_BTNH,
            q_BTNH[:, :, :kv_heads],
            q_BTNH[:, :, :kv_heads],
            q_positions_BT=positions_BT,
            k_positions_BT=positions_BT,
            segment_ids_BT=jnp.zeros((1, length), jnp.int32),
            terms=terms,
            window=100,
            sink_tokens=2,
            k_rank_BT=positions_BT,
            block_q=64,
            block_k=128,
            interpret=False,
            backend="tpu",
            **options,
        )
        return jnp.sum(y.astype(jnp.float32))

    return jax.export.export(jax.jit(jax.grad(loss)), platforms=["tpu"])(q_BTNH).mlir_module()


def _on_tpu_kernels(monkeypatch: pytest.MonkeyPatch) -> list:
    """The model's kernel path as on a TPU: the TPU kernels, in interpret mode on the CPU.
    Returns a list that gets an entry per trace of the TPU forward kernel."""
    monkeypatch.setattr(attention_paths, "kernel_backend", lambda backend=None: "tpu")
    traced = []

    def forward_call(*args, **kwargs):
        traced.append(True)
        return tpu_forward_call(*args, **kwargs)

    monkeypatch.setattr(kernels_attend, "tpu_forward_call", forward_call)
    return traced


@pytest.mark.parametrize(
    "position",
    # FoX in the default suite (4 s), so that the model's route to the TPU kernels (and
    # this test's patch of it) is checked on every run; the rest slow
    ["fox"]
    + [
        pytest.param(p, marks=SLOW)
        for p in [
            "alibi",
            "t5",
            "kerple",
            "fire",
            "rope",
            "fox+t5",
            "alibi+rope",
            "stickbreaking",
            "alibi+stickbreaking",
            "transformer_xl",
            "relative",
            "alibi+relative_capped",
            "cope+fire",  # FIRE's custom VJP inside CoPE's kernels
        ]
    ],
)
def test_model_on_tpu_kernels_equals_naive(position: str, monkeypatch) -> None:
    """A covered scheme's whole model on the TPU kernels equals the naive path (values and
    every parameter's gradient), float32, GQA, window with sinks, packed segments."""
    from tests.ops.kernels import test_kernel_registry

    traced = _on_tpu_kernels(monkeypatch)
    test_kernel_registry._compare(position, "float32", window=12, sinks=2)
    assert traced


@SLOW
@pytest.mark.parametrize("position", ["alibi", "fox"])
def test_model_on_tpu_kernels_equals_naive_bfloat16(position: str, monkeypatch) -> None:
    from tests.ops.kernels import test_kernel_registry

    traced = _on_tpu_kernels(monkeypatch)
    test_kernel_registry._compare(position, "bfloat16", window=None, sinks=0)
    assert traced


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backend": "mosaic"}, "backend must be one of"),
    ],
)
def test_fused_attention_refuses_on_tpu(kwargs: dict, message: str) -> None:
    x = jnp.zeros((1, 16, 2, 8), jnp.float32)
    positions_BT = jnp.arange(16)[None]
    with pytest.raises(ValueError, match=message):
        fused_attention(
            x,
            x,
            x,
            q_positions_BT=positions_BT,
            k_positions_BT=positions_BT,
            segment_ids_BT=jnp.zeros((1, 16), jnp.int32),
            **{"backend": "tpu", **kwargs},
        )
