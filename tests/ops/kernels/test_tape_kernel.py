"""TAPE on the fused kernels (arXiv 2501.00712; copejax.model.kernel_tape), interpret mode.

The operands: q' and k' padded to a power of two keep the logits, the values become
``[v, e, 0...]`` float32 per query head; the kernels with bfloat16 q, k and those float32
values mix e to float32 accuracy (values and gradients against dense float32 maths), which
bfloat16 high and low columns would not; the whole TAPE model on the kernels equals the naive
path (values and every gradient) in float32 and bfloat16, with GQA, packed segments, a window
with sink tokens, padded widths, the sink, stick-breaking, and on the TPU kernels
(slow-marked); combinations that read TAPE's padded queries are refused by name.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model.kernel_tape import kernel_operands, padded_qk, split_columns
from copejax.ops.kernels.attention import fused_attention
from copejax.ops.kernels.gpu_lowering import lower_for_gpu
from tests.conftest import tiny_config
from tests.ops.kernels.reference import mask_BTS
from tests.ops.kernels.tolerances import assert_close

B, T, N, H, C = 2, 40, 4, 16, 32  # C: TAPE's default K L R = 2 H position features per head
SEGMENTS_BT = np.array([[0] * T, [0] * 17 + [1] * 15 + [2] * 8], np.int32)
POSITIONS_BT = np.array([np.arange(T), np.r_[np.arange(17), np.arange(15), np.arange(8)]])
SLOW = pytest.mark.slow
QUICK = {"xla_backend_optimization_level": 0}  # interpret mode: compile time dominates


def test_operands_keep_the_logits_and_carry_the_positions_as_float32_columns() -> None:
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    q_BTNH, k_BSNH = normal(B, T, N, 24), normal(B, T, N, 24)  # K R = 8 x 3: no power of two
    q_pad, k_pad = padded_qk(q_BTNH, k_BSNH)
    assert q_pad.shape[-1] == k_pad.shape[-1] == 32
    logits = jnp.einsum("BTNH,BSNH->BNTS", q_BTNH, k_BSNH) / np.sqrt(24)
    logits_pad = jnp.einsum("BTNH,BSNH->BNTS", q_pad, k_pad) / np.sqrt(32)
    assert_close(logits_pad, logits, dtype="float32", summands=32, roundings=0)
    # bfloat16 values of G = 2 heads, TAPE's keys per query head, e per query head
    v_BSGH = normal(B, T, 2, H).astype(jnp.bfloat16)
    v_BSNH, e_BSNC = jnp.repeat(v_BSGH, 2, axis=2), normal(B, T, N, C)
    qkv = (q_pad, k_pad, v_BSGH)
    q, k, values = kernel_operands(qkv, v_BSNH, e_BSNC, head_dim=32)
    assert q is q_pad and k is k_pad
    assert values.dtype == jnp.float32 and values.shape == (B, T, N, 64)  # 16 + 32 + 16 zeros
    np.testing.assert_array_equal(values[..., :H], v_BSNH.astype(jnp.float32))
    np.testing.assert_array_equal(values[..., H : H + C], e_BSNC)
    assert not np.any(np.asarray(values[..., H + C :]))
    assert kernel_operands(qkv, v_BSNH, None, head_dim=32)[2] is v_BSNH  # per query head
    y_BTNH, mixed_BTNC = split_columns(values, H, e_BSNC, jnp.bfloat16)
    assert y_BTNH.dtype == jnp.bfloat16 and mixed_BTNC.dtype == jnp.float32
    np.testing.assert_array_equal(mixed_BTNC, e_BSNC)


def _attention(q_BTNH, k_BSNH, values_BSNW) -> jax.Array:
    return fused_attention(
        q_BTNH,
        k_BSNH,
        values_BSNW,
        q_positions_BT=jnp.asarray(POSITIONS_BT),
        k_positions_BT=jnp.asarray(POSITIONS_BT),
        segment_ids_BT=jnp.asarray(SEGMENTS_BT),
        block_q=16,
        block_k=16,
    )


def _dense(q_BTNH, k_BSNH, values_BSNW, allowed_BTS) -> jax.Array:
    """float32 weights of the (rounded) q and k times the values, in float32."""
    s = jnp.einsum("BTNH,BSNH->BNTS", q_BTNH.astype(jnp.float32), k_BSNH.astype(jnp.float32))
    s = jnp.where(allowed_BTS[:, None], s / np.sqrt(q_BTNH.shape[-1]), -1e30)
    w = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("BNTS,BSNW->BTNW", w, values_BSNW.astype(jnp.float32))


def test_float32_value_columns_mix_the_positions_to_float32_accuracy() -> None:
    """bfloat16 q and k, float32 values ``[v, e]``: the mixed e (and its gradient, the
    values') equal dense float32 maths within float32's bound, while q and k's gradients
    take bfloat16's (dS is rounded to them). bfloat16 high and low columns of e, whose P
    and output the kernels round to bfloat16, miss that bound."""
    rng = np.random.default_rng(1)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    q, k = normal(B, T, 2, H).astype(jnp.bfloat16), normal(B, T, 2, H).astype(jnp.bfloat16)
    e_BSNC = jnp.cos(normal(B, T, 2, C) * 30)  # TAPE's rotations: entries in [-1, 1]
    values = jnp.concatenate([normal(B, T, 2, H), e_BSNC], axis=-1)  # H + C = 48 -> 64
    values = jnp.pad(values, ((0, 0), (0, 0), (0, 0), (0, 16)))
    allowed = jnp.asarray(mask_BTS(SEGMENTS_BT, None, 0, POSITIONS_BT))
    cot = normal(B, T, 2, 64)

    @functools.partial(jax.jit, compiler_options=QUICK)
    def kernel(q, k, values, cot):
        y, pull = jax.vjp(_attention, q, k, values)
        return y, pull(cot)

    y, (dq, dk, dv) = kernel(q, k, values, cot)
    y_ref, pull_ref = jax.vjp(lambda *a: _dense(*a, allowed), q, k, values)
    assert y.dtype == jnp.float32
    assert_close(y, y_ref, dtype="float32", summands=T + H, roundings=0)
    dq_ref, dk_ref, dv_ref = pull_ref(cot)
    assert_close(dv, dv_ref, dtype="float32", summands=T, roundings=0)
    for got, want in ((dq, dq_ref), (dk, dk_ref)):
        assert_close(got, want, dtype="bfloat16", summands=T, roundings=4)

    hi = e_BSNC.astype(jnp.bfloat16)
    lo = (e_BSNC - hi.astype(jnp.float32)).astype(jnp.bfloat16)
    split = jax.jit(_attention, compiler_options=QUICK)(q, k, jnp.concatenate([hi, lo], -1))
    mixed_split = split[..., :C].astype(jnp.float32) + split[..., C:].astype(jnp.float32)
    error = float(jnp.max(jnp.abs(mixed_split - y_ref[..., H : H + C])))
    assert error > 100 * T * float(jnp.finfo(jnp.float32).eps)


def test_refuses_what_reads_tapes_padded_queries() -> None:
    for position, part in [("tape+cope", "cope"), ("tape+relative", "relative")]:
        with pytest.raises(ValueError, match=f"no kernel for scheme 'tape': .*'{part}'"):
            tiny_config(position, attention_impl="kernel")
    tiny_config("tape+alibi", attention_impl="kernel", attention_sink=True)


def _compare(position: str, dtype: str, window: int | None, **options) -> None:
    from tests.ops.kernels import test_kernel_registry

    test_kernel_registry._compare(position, dtype, window, 2 if window else 0, **options)


RANDOM = {"init": "random", "coords": 3}  # K R = 24 padded to 32; values 16 + 48 = 64


@SLOW
@pytest.mark.parametrize(
    ("position", "dtype", "window", "options"),
    [
        ("tape", "float32", 12, {}),
        ("tape", "bfloat16", None, {}),
        ("tape", "bfloat16", 12, {"position_options": RANDOM}),
        ("tape", "float32", None, {"position_options": {"tensorial": False}}),
        ("tape", "float32", 12, {"position_options": {"contextualize": "mlp"}}),
        ("tape+alibi", "bfloat16", 12, {"attention_sink": True}),
        ("tape+stickbreaking", "float32", 12, {}),
    ],
    ids=str,
)
def test_tape_model_on_the_kernels_equals_naive(
    position: str, dtype: str, window: int | None, options: dict
) -> None:
    """GQA (4 query heads, 2 key/value heads), packed segments, padding rows."""
    _compare(position, dtype, window, **options)


@SLOW
def test_tape_model_on_the_tpu_kernels_equals_naive(monkeypatch) -> None:
    from tests.ops.kernels.test_tpu_kernels import _on_tpu_kernels

    traced = _on_tpu_kernels(monkeypatch)
    _compare("tape", "bfloat16", 12, position_options=RANDOM)
    assert traced


@pytest.mark.parametrize("backend", ["triton", "tpu"])
def test_float32_values_beside_bfloat16_queries_lower(backend: str) -> None:
    """The forward and both backward kernels with bfloat16 q, k and float32 values of
    another width lower to Triton and export to Mosaic TPU, from the CPU."""
    length = 256
    q = jnp.ones((1, length, 2, 16), jnp.bfloat16)
    values = jnp.ones((1, length, 2, 64), jnp.float32)
    positions_BT = jnp.arange(length)[None]

    def loss(q: jax.Array, values: jax.Array) -> jax.Array:
        y = fused_attention(
            q,
            q,
            values,
            q_positions_BT=positions_BT,
            k_positions_BT=positions_BT,
            segment_ids_BT=jnp.zeros((1, length), jnp.int32),
            block_q=64,
            block_k=128,
            interpret=False,
            backend=backend,
        )
        return jnp.sum(y)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    if backend == "tpu":
        text = jax.export.export(grad, platforms=["tpu"])(q, values).mlir_module()
        assert text.count("tpu_custom_call") == 3
    else:
        text = lower_for_gpu(grad, q, values).as_text()
        assert "copejax_attention_dkdv" in text
