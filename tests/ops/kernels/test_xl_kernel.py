"""Transformer-XL on the fused kernels (arXiv 1901.02860) as wider queries and keys.

Against the paper's score written per pair in NumPy (float64): ``q_i . k_j + q_i . W_R
r_{i-j} + u . k_j + v . W_R r_{i-j}`` over sqrt(H), with ``r_d = [sin(d w), cos(d w)]`` built
for each pair's distance (no angle-difference identity). The widened q' . k' / sqrt(H') equals
it for positions that jump and repeat; one small fused-kernel call (GQA, packed segments)
equals dense attention with it; combinations that read the widened logits are refused.
Gradients of every XL parameter through the kernels: the registry-wide model tests
(``test_kernel_registry.py``, slow-marked).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model.kernel_xl import xl_widened_qk
from copejax.ops.engine_blocks import BlockTerm
from copejax.ops.kernels.attention import fused_attention
from copejax.positions import registry
from tests.conftest import tiny_config
from tests.ops.kernels.reference import attention_numpy, mask_BTS
from tests.ops.kernels.tolerances import assert_close

B, T, N, G, H, R = 1, 32, 2, 1, 16, 12
BASE = 10000.0


def _inputs(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
    return {
        "q": normal(B, T, N, H),
        "k": normal(B, T, G, H),
        "v": normal(B, T, G, H),
        "w_r_RNH": normal(R, N, H),
        "u_NH": normal(N, H),
        "v_NH": normal(N, H),
    }


def _xl_scores_numpy(x: dict, positions_BT: np.ndarray) -> np.ndarray:
    """Eq. of section 3.3 per pair: (q + u) . k + (q + v) . W_R r_{i-j}, over sqrt(H)."""
    f64 = lambda a: np.asarray(a, np.float64)
    q, w_r, u, v = f64(x["q"]), f64(x["w_r_RNH"]), f64(x["u_NH"]), f64(x["v_NH"])
    k = np.repeat(f64(x["k"]), N // G, axis=2)
    inv_freq = BASE ** (-np.arange(0, R, 2) / R)
    distance = (positions_BT[:, :, None] - positions_BT[:, None, :]).astype(np.float64)
    angle = distance[..., None] * inv_freq  # B T S F
    r_BTSR = np.concatenate([np.sin(angle), np.cos(angle)], axis=-1)
    w_BTSNH = np.einsum("btsr,rnh->btsnh", r_BTSR, w_r)
    content = np.einsum("btnh,bsnh->bnts", q + u, k)
    position = np.einsum("btnh,btsnh->bnts", q + v, w_BTSNH)
    return (content + position) / np.sqrt(H)


def _widened(x: dict, positions_BT: np.ndarray) -> tuple[jax.Array, jax.Array]:
    params = {key: jnp.asarray(x[key]) for key in ("w_r_RNH", "u_NH", "v_NH")}
    scheme = registry.make_scheme("transformer_xl", {"base": BASE, "r_dim": R})
    positions = jnp.asarray(positions_BT)
    return xl_widened_qk(
        scheme,
        BlockTerm(None, params=params),
        jnp.asarray(x["q"]),
        jnp.asarray(x["k"]),
        q_positions_BT=positions,
        k_positions_BS=positions,
    )


def test_widened_logits_equal_the_papers_score() -> None:
    x = _inputs()
    positions_BT = np.random.default_rng(1).integers(0, 3000, (B, T))  # jumps and repeats
    q_wide, k_wide = _widened(x, positions_BT)
    width = q_wide.shape[-1]
    assert width == 32 and k_wide.shape == (B, T, G, width)  # H + R = 28, a power of two up
    k_rep = np.repeat(np.asarray(k_wide, np.float64), N // G, axis=2)
    got = np.einsum("btnh,bsnh->bnts", np.asarray(q_wide, np.float64), k_rep) / np.sqrt(width)
    expected = _xl_scores_numpy(x, positions_BT)
    # float32 features: angles i w of positions up to 3000 round to ~3000 eps32 radians
    assert_close(got, expected, dtype="float32", summands=3000 + H + R, roundings=0)


@pytest.mark.parametrize("backend", ["triton", "tpu"])
def test_kernels_equal_dense_attention(backend: str) -> None:
    x = _inputs(2)
    segments_BT = np.array([[0] * 20 + [1] * 12], np.int32)
    positions_BT = np.r_[np.arange(20), np.arange(12)][None]
    q_wide, k_wide = _widened(x, positions_BT)
    y = jax.jit(
        lambda q, k, v: fused_attention(
            q,
            k,
            v,
            q_positions_BT=jnp.asarray(positions_BT),
            k_positions_BT=jnp.asarray(positions_BT),
            segment_ids_BT=jnp.asarray(segments_BT),
            block_q=16,
            block_k=16,
            backend=backend,
        ),
        compiler_options={"xla_backend_optimization_level": 0},
    )(q_wide, k_wide, jnp.asarray(x["v"]))
    allowed = mask_BTS(segments_BT, None, 0, positions_BT)
    # attention_numpy adds q . k / sqrt(H) itself: the bias is the rest of XL's score
    k_rep = np.repeat(np.asarray(x["k"], np.float64), N // G, axis=2)
    content = np.einsum("btnh,bsnh->bnts", np.asarray(x["q"], np.float64), k_rep) / np.sqrt(H)
    bias = _xl_scores_numpy(x, positions_BT) - content
    expected = attention_numpy(x["q"], x["k"], x["v"], bias, allowed)
    assert_close(y, expected, dtype="float32", summands=T + H + R, roundings=0)


@pytest.mark.parametrize("position", ["cope+transformer_xl", "transformer_xl+relative"])
def test_refuses_what_reads_the_widened_logits(position: str) -> None:
    with pytest.raises(ValueError, match="no kernel for scheme 'transformer_xl': its widened"):
        tiny_config(position, attention_impl="kernel")
