"""Golden-number cases: for every registered scheme, its pure-function core on a fixed input.

Each case returns ``{label: (copejax value, float64 reference value)}``: the first from the
scheme's pure core (arrays in, arrays out, no Flax, so an engine rewrite leaves them alone),
the second written here from the paper's formula for that one entry. ``test_golden.py`` pins
both to literals; its message says what to do when they change.

Inputs are fixed formulas (no random generator): ``_fixed`` rounds a sine to 2 decimals.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from copejax.ops import cope as cope_ops
from copejax.ops.fox_core import fox_decay_bias
from copejax.ops.selective import (
    NEVER,
    accumulated_penalty_BTS,
    budget_eviction_times,
    penalty_bias,
    selection_BTS,
)
from copejax.positions.alibi import alibi_bias, alibi_slopes
from copejax.positions.base import masked_softmax_BNTS
from copejax.positions.dape import dape_mlp
from copejax.positions.fire import fire_bias
from copejax.positions.kerple import kerple_bias
from copejax.positions.learned import lookup_rows_BTD
from copejax.positions.path import path_logits_BNQK
from copejax.positions.randomized import relabel_positions
from copejax.positions.relative import relative_logits
from copejax.positions.rope import apply_rope, rope_inv_freq
from copejax.positions.rope_frequencies import scaled_inv_freq
from copejax.positions.sinusoidal import sinusoidal_encoding
from copejax.positions.stickbreaking import stickbreaking_allowed_BTS, stickbreaking_weights
from copejax.positions.t5 import t5_bias
from copejax.positions.tape_core import rope_tape_embeddings, tape_mix, tape_qk, tape_update
from copejax.positions.transformer_xl import xl_bias, xl_inv_freq
from copejax.positions.xpos import apply_xpos

Case = dict[str, tuple[float, float]]
T, N, H = 4, 2, 4
POS_BT = jnp.arange(T, dtype=jnp.int32)[None]
CAUSAL_BTS = jnp.tril(jnp.ones((T, T), bool))[None]


def _fixed(shape: tuple[int, ...], phase: float = 0.0) -> np.ndarray:
    """A fixed, platform-independent input: sin(1.3 n + phase) rounded to 2 decimals."""
    return np.round(np.sin(np.arange(math.prod(shape)) * 1.3 + phase), 2).reshape(shape)


Q_BTNH = _fixed((1, T, N, H))
K_BTNH = _fixed((1, T, N, H), 0.7)


def _f(x: object) -> float:
    return float(np.asarray(x))


def alibi() -> Case:
    slopes = alibi_slopes(N)  # N = 2: m_h = 2^(-8h/2) = 1/16, 1/256
    bias = alibi_bias(POS_BT, POS_BT, jnp.asarray(slopes))
    return {
        "h0_i3_j0": (_f(bias[0, 0, 3, 0]), -(2.0**-4) * 3),  # -m_0 (i - j)
        "h1_i3_j1": (_f(bias[0, 1, 3, 1]), -(2.0**-8) * 2),
    }


def cope() -> Case:
    # Gates sigmoid(z) from fixed logits, p_ij = sum_{k=j..i} g_ik, z_i[p] = q_i . e[p]
    # interpolated (eq. 3-9; Appendix B listing), p_max = 3.
    logits = jnp.asarray(_fixed((1, N, T, T), 0.3))
    gates = cope_ops.cope_gates(logits, CAUSAL_BTS)
    positions = cope_ops.cope_positions(gates, 3)
    emb_PH = jnp.asarray(_fixed((3, H), 1.1))
    term = cope_ops.cope_interpolated_term(jnp.asarray(Q_BTNH), emb_PH, positions)
    g = 1.0 / (1.0 + np.exp(-np.asarray(logits, np.float64)))
    p_3_2 = g[0, 0, 3, 2] + g[0, 0, 3, 3]  # keys 2..3 of query 3, head 0
    p_3_0 = min(g[0, 0, 3, :].sum(), 2.0)  # capped at p_max - 1 = 2
    z = np.asarray(emb_PH, np.float64) @ Q_BTNH[0, 3, 0]  # z_3[p], p = 0, 1, 2

    def interp(p: float) -> float:
        lo, hi = math.floor(p), math.ceil(p)
        return (p - lo) * z[hi] + (1 - p + lo) * z[lo]

    return {
        "gate_h0_i3_j2": (_f(gates[0, 0, 3, 2]), g[0, 0, 3, 2]),
        "pos_h0_i3_j2": (_f(positions[0, 0, 3, 2]), p_3_2),
        "term_h0_i3_j2": (_f(term[0, 0, 3, 2]), interp(p_3_2)),
        "term_h0_i3_j0": (_f(term[0, 0, 3, 0]), interp(p_3_0)),
    }


def fire() -> Case:
    # b(i, j) = f(psi(i - j) / psi(max(i, L))), psi(x) = log(c x + 1), f a ReLU MLP (eq. in 3.2).
    params = {
        "c": jnp.asarray(0.5),
        "threshold": jnp.asarray(2.0),
        "w1_1F": jnp.asarray([[1.0, -2.0, 3.0]]),
        "b1_F": jnp.asarray([0.1, 0.5, -0.2]),
        "w2_FN": jnp.asarray([[1.0, 0.5], [-1.0, 2.0], [0.25, -1.0]]),
        "b2_N": jnp.asarray([0.0, 0.3]),
    }
    bias = fire_bias(POS_BT, POS_BT, params)
    x = math.log(0.5 * 2 + 1) / math.log(0.5 * 3 + 1)  # i = 3, j = 1: psi(2) / psi(max(3, 2))
    hidden = np.maximum(np.array([1.0, -2.0, 3.0]) * x + np.array([0.1, 0.5, -0.2]), 0.0)
    want = hidden @ np.array([[1.0, 0.5], [-1.0, 2.0], [0.25, -1.0]]) + np.array([0.0, 0.3])
    return {
        "h0_i3_j1": (_f(bias[0, 0, 3, 1]), want[0]),
        "h1_i3_j1": (_f(bias[0, 1, 3, 1]), want[1]),
    }


def dape() -> Case:
    # A + B + f(A, B), f(x) = leaky_relu(x W_in + b_in) W_out + b_out over x = [A_h, B_h]
    # (section 3; the authors' ParallelKerpleLog_C); here the term B + f(A, B) with ALiBi's B.
    logits = jnp.asarray(_fixed((1, N, T, T), 0.4))
    static = alibi_bias(POS_BT, POS_BT, jnp.asarray(alibi_slopes(N)))
    w_in = _fixed((2 * N, 3), 0.9)
    b_in = np.array([0.1, -0.2, 0.05])
    w_out = _fixed((3, N), 1.7)
    b_out = np.array([0.3, -0.1])
    mlp = {"w_in": w_in, "b_in": b_in, "w_out": w_out, "b_out": b_out}
    mlp = {k: jnp.asarray(v, jnp.float32) for k, v in mlp.items()}
    term = dape_mlp(logits, static, mlp, 0.01) + static
    a = np.asarray(logits, np.float64)[0, :, 3, 1]  # query 3, key 1, both heads
    b = np.array([-(2.0**-4) * 2, -(2.0**-8) * 2])
    hidden = np.array([w_in[:, u] @ np.concatenate([a, b]) + b_in[u] for u in range(3)])
    hidden = np.where(hidden > 0, hidden, 0.01 * hidden)
    want = b + np.array([hidden @ w_out[:, n] + b_out[n] for n in range(N)])
    return {
        "h0_i3_j1": (_f(term[0, 0, 3, 1]), want[0]),
        "h1_i3_j1": (_f(term[0, 1, 3, 1]), want[1]),
    }


def fox() -> Case:
    # D_ij = sum_{l=j+1..i} log f_l (eq. 4-6), f fixed per token and head.
    f_BTN = np.array([[[0.9, 0.5], [0.8, 0.6], [0.7, 0.95], [0.6, 0.3]]])
    bias = fox_decay_bias(jnp.log(jnp.asarray(f_BTN, jnp.float32)), CAUSAL_BTS)
    return {
        "h0_i3_j0": (_f(bias[0, 0, 3, 0]), math.log(0.8 * 0.7 * 0.6)),
        "h1_i2_j1": (_f(bias[0, 1, 2, 1]), math.log(0.95)),
        "h1_i3_j3": (_f(bias[0, 1, 3, 3]), 0.0),
    }


def kerple() -> Case:
    # log: -r1 log(1 + r2 |i - j|); power: -r1 |i - j|^r2 (KERPLE eq. for the two kernels).
    r1, r2 = jnp.asarray([1.5, 0.5]), jnp.asarray([0.5, 2.0])
    log_bias = kerple_bias(POS_BT, POS_BT, r1, r2, "log")
    power_bias = kerple_bias(POS_BT, POS_BT, r1, r2, "power")
    return {
        "log_h0_i3_j0": (_f(log_bias[0, 0, 3, 0]), -1.5 * math.log(1 + 0.5 * 3)),
        "power_h0_i3_j1": (_f(power_bias[0, 0, 3, 1]), -1.5 * 2**0.5),
        "power_h1_i2_j0": (_f(power_bias[0, 1, 2, 0]), -0.5 * 2**2.0),
    }


def learned() -> Case:
    table_PD = jnp.asarray(_fixed((5, 3), 0.2))
    rows = lookup_rows_BTD(table_PD, jnp.asarray([[4, 0, 2]]))
    return {
        "pos4_d1": (_f(rows[0, 0, 1]), float(_fixed((5, 3), 0.2)[4, 1])),
        "pos2_d2": (_f(rows[0, 2, 2]), float(_fixed((5, 3), 0.2)[2, 2])),
    }


def nope() -> Case:
    # No position term: the masked softmax of the content logits alone.
    logits = jnp.asarray(_fixed((1, 1, T, T), 0.5))
    weights = masked_softmax_BNTS(logits, CAUSAL_BTS)
    row = np.exp(_fixed((1, 1, T, T), 0.5)[0, 0, 2, :3])
    return {
        "i2_j0": (_f(weights[0, 0, 2, 0]), row[0] / row.sum()),
        "i2_j3": (_f(weights[0, 0, 2, 3]), 0.0),
    }


def randomized() -> Case:
    # Ruoss et al.: position p of a row is relabelled as the p-th of sorted sampled positions,
    # then encoded (sinusoidal here): PE(sample[p], 2i) = sin(sample[p] / 10000^(2i/d)).
    sample_BT = jnp.asarray([[3, 17, 40, 41]])
    new_BT = relabel_positions(POS_BT, sample_BT)
    pe = sinusoidal_encoding(new_BT, 4)
    return {
        "pos2_label": (_f(new_BT[0, 2]), 40.0),
        "pos1_sin0": (_f(pe[0, 1, 0]), math.sin(17.0)),
        "pos3_cos1": (_f(pe[0, 3, 3]), math.cos(41.0 / 100.0)),
    }


def _relative(capped: bool) -> Case:
    # Shaw et al. as in the CoPE paper's eq. 1: q_i . e[i - j] / sqrt(H); a table of 3 rows.
    table_PH = jnp.asarray(_fixed((3, H), 0.9))
    bias = relative_logits(jnp.asarray(Q_BTNH), POS_BT, POS_BT, table_PH, capped)
    q = Q_BTNH[0, 3, 1]
    e = _fixed((3, H), 0.9)
    far = float(q @ e[2]) / 2.0 if capped else 0.0  # distance 3 > last row 2
    return {
        "h1_i3_j2": (_f(bias[0, 1, 3, 2]), float(q @ e[1]) / 2.0),
        "h1_i3_j0": (_f(bias[0, 1, 3, 0]), far),
    }


def relative() -> Case:
    return _relative(capped=False)


def relative_capped() -> Case:
    return _relative(capped=True)


def rope() -> Case:
    # RoFormer eq. 15, rotate-half pairs (x_k, x_{k+2}) with theta_k = 10000^(-2k/4).
    x = apply_rope(jnp.asarray(Q_BTNH), POS_BT, rope_inv_freq(H, 10000.0), "half")
    q = Q_BTNH[0, 3, 0]
    theta1 = 10000.0 ** (-2 / 4)
    return {
        "t3_f0": (_f(x[0, 3, 0, 0]), q[0] * math.cos(3.0) - q[2] * math.sin(3.0)),
        "t3_f3": (_f(x[0, 3, 0, 3]), q[3] * math.cos(3 * theta1) + q[1] * math.sin(3 * theta1)),
        **_rope_scalings(),
    }


def _rope_scalings() -> Case:
    # d = 16, base 10^4, s = 8, L = 64; theta_i = 10^(-i/2), wavelength_i = 2 pi 10^(i/2).
    # Llama 3.1 (low 1, high 4): pair 2 (wavelength 62.8 in (16, 64)) blends with
    # g = (64 / wavelength_2 - 1) / 3. YaRN's index ramp: the pair indices where
    # L / wavelength = 32 and 1 are -0.99 and 2.02, rounded out to 0 and 3, so pair 1 keeps
    # 2/3 of theta_1 and takes 1/3 of theta_1 / 8 (the paper's ramp gives it 0.072 / 0.928).
    kwargs = {"factor": 8.0, "original_max_len": 64}
    llama3 = scaled_inv_freq(16, 1e4, scaling="llama3", **kwargs)
    yarn = scaled_inv_freq(16, 1e4, scaling="yarn", yarn_ramp="index", **kwargs)
    g = (64 / (2 * math.pi * 10.0) - 1) / 3
    theta1 = 10.0**-0.5
    return {
        "llama3_theta2": (_f(llama3[2]), (1 - g) * 0.1 / 8 + g * 0.1),
        "yarn_index_theta1": (_f(yarn[1]), 2 / 3 * theta1 + 1 / 3 * theta1 / 8),
    }


def selective() -> Case:
    # S_kj = relu(l_kj) of head 0 off the diagonal, the first key and the future (Figure 2);
    # F_ij = sum_{k < i} S_kj, subtracted; T = 5 so that F_41 = S_21 + S_31 has two terms.
    length = 5
    logits = _fixed((1, length, length), 0.2)
    allowed = jnp.tril(jnp.ones((length, length), bool))[None]
    index = jnp.arange(length)
    first = index[None] == 0
    s_relu = selection_BTS(jnp.asarray(logits), allowed, first, index, index)
    s_sig = selection_BTS(jnp.asarray(logits), allowed, first, index, index, nonlinearity="sigmoid")
    f_relu = accumulated_penalty_BTS(s_relu)
    bias_pruned = penalty_bias(f_relu, 0.5)
    z = logits[0]
    times, _ = budget_eviction_times(
        jnp.ones((1, length, 4)),
        jnp.full((1, length, 4), 0.5),
        q_ids_BT=jnp.zeros((1, length), jnp.int32),
        k_ids_BS=jnp.zeros((1, length), jnp.int32),
        first_BS=first,
        offset=0,
        budget=2,
        nonlinearity="relu",
    )
    return {
        "relu_i4_j1": (_f(f_relu[0, 4, 1]), max(z[2, 1], 0.0) + max(z[3, 1], 0.0)),
        "relu_i4_j0": (_f(f_relu[0, 4, 0]), 0.0),
        "sigmoid_i4_j2": (
            _f(accumulated_penalty_BTS(s_sig)[0, 4, 2]),
            1.0 / (1.0 + math.exp(-z[3, 2])),
        ),
        "pruned_i4_j1": (_f(bias_pruned[0, 4, 1]), -1e30),
        # Budget 2 with every selection logit 1 (q = 1, k = 1/2, H = 4): F_ij = i - j - 1 off
        # the first key; query 2 overfills {0, 1, 2}, all F = 0, evicts the oldest (0); query
        # 3 evicts key 1 (F_31 = 1), query 4 key 2 (F_42 = 1); keys 3, 4 stay.
        "budget_evicts_j0_at": (_f(times[0, 0]), 2.0),
        "budget_evicts_j1_at": (_f(times[0, 1]), 3.0),
        "budget_evicts_j2_at": (_f(times[0, 2]), 4.0),
        "budget_keeps_j3": (_f(times[0, 3]), NEVER),
    }


def sinusoidal() -> Case:
    # PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...), d = 4.
    pe = sinusoidal_encoding(POS_BT, 4)
    return {
        "pos3_d0": (_f(pe[0, 3, 0]), math.sin(3.0)),
        "pos2_d3": (_f(pe[0, 2, 3]), math.cos(2.0 / 100.0)),
    }


def stickbreaking() -> Case:
    # A_ij = beta_ij prod_{j<k<i} (1 - beta_ik), beta = sigmoid(z), keys j < i.
    z = _fixed((1, 1, T, T), 0.4)
    allowed = stickbreaking_allowed_BTS(CAUSAL_BTS, include_self=False)
    weights, leftover = stickbreaking_weights(jnp.asarray(z), allowed)
    beta = 1.0 / (1.0 + np.exp(-z[0, 0, 3]))
    return {
        "i3_j2": (_f(weights[0, 0, 3, 2]), beta[2]),
        "i3_j0": (_f(weights[0, 0, 3, 0]), beta[0] * (1 - beta[1]) * (1 - beta[2])),
        "leftover_i3": (_f(leftover[0, 0, 3]), (1 - beta[0]) * (1 - beta[1]) * (1 - beta[2])),
    }


def t5() -> Case:
    # Causal buckets, 8 buckets, max_distance 16: distances 0..3 exact, 4..15 log-spaced.
    table_PN = jnp.asarray(np.arange(16.0).reshape(8, 2))
    far_BT = jnp.asarray([[0, 5, 9, 20]])
    bias = t5_bias(far_BT, jnp.zeros((1, 1), jnp.int32), table_PN, False, 16)

    def bucket(d: int) -> int:  # T5's _relative_position_bucket, causal half of 8 buckets
        exact = 4
        if d < exact:
            return d
        return min(exact + int(math.log(d / exact) / math.log(16 / exact) * (8 - exact)), 7)

    return {
        "h0_d5": (_f(bias[0, 0, 1, 0]), 2.0 * bucket(5)),
        "h1_d9": (_f(bias[0, 1, 2, 0]), 2.0 * bucket(9) + 1),
        "h0_d20": (_f(bias[0, 0, 3, 0]), 2.0 * bucket(20)),
    }


def tape() -> Case:
    # Eq. 6 with the RoPE initialisation (section 3.3), eq. 7 and eq. 8 on one block.
    e = rope_tape_embeddings(POS_BT, N, H, 10000.0)
    q2 = tape_qk(jnp.asarray(Q_BTNH), e, "half", True)
    weights = masked_softmax_BNTS(jnp.asarray(_fixed((1, N, T, T), 0.6)), CAUSAL_BTS)
    mixed = tape_mix(e, weights)
    w1, w2 = jnp.asarray(_fixed((3, 2), 0.1)), jnp.asarray(_fixed((2, 3), 0.2))
    gates = jnp.asarray(_fixed((1, T, N * H // 2, 3), 0.3))
    update = tape_update(mixed, gates, w1, w2)
    q = Q_BTNH[0, 3, 0]
    w = np.asarray(weights, np.float64)[0, 0, 2]  # head 0, query 2
    e_np = np.asarray(e, np.float64)
    mixed_2 = sum(w[s] * e_np[0, s, 0] for s in range(3))  # block 0 of head 0
    middle = _fixed((2, 3), 0.2) @ np.diag(_fixed((1, T, N * H // 2, 3), 0.3)[0, 2, 0])
    update_2 = middle @ _fixed((3, 2), 0.1) @ mixed_2
    return {
        "qk_t3_f0": (_f(q2[0, 3, 0, 0]), q[0] * math.cos(3.0) - q[2] * math.sin(3.0)),
        "mix_t2_m0_l0_r1": (_f(mixed[0, 2, 0, 0, 1]), mixed_2[0, 1]),
        "update_t2_m0_l1_r0": (_f(update[0, 2, 0, 1, 0]), update_2[1, 0]),
    }


def transformer_xl() -> Case:
    # Dai et al. eq. for A^rel: (b) q_i W_R r_{i-j}, (c) u . k_j, (d) v W_R r_{i-j}; over sqrt(H).
    r_dim = 4
    params = {
        "w_r_RNH": jnp.asarray(_fixed((r_dim, N, H), 0.8)),
        "u_NH": jnp.asarray(_fixed((N, H), 1.2)),
        "v_NH": jnp.asarray(_fixed((N, H), 1.7)),
    }
    inv_freq = xl_inv_freq(r_dim, 10000.0)
    bias = xl_bias(
        jnp.asarray(Q_BTNH), jnp.asarray(K_BTNH), POS_BT, POS_BT, params, inv_freq_F=inv_freq
    )
    d = 3 - 1  # i = 3, j = 1
    freq = 10000.0 ** (-np.arange(0, r_dim, 2) / r_dim)
    r = np.concatenate([np.sin(d * freq), np.cos(d * freq)])  # F sines, then F cosines
    w_r = _fixed((r_dim, N, H), 0.8)[:, 1]  # head 1: (R, H)
    q, k = Q_BTNH[0, 3, 1], K_BTNH[0, 1, 1]
    u, v = _fixed((N, H), 1.2)[1], _fixed((N, H), 1.7)[1]
    want = ((q + v) @ (r @ w_r) + u @ k) / 2.0
    return {"h1_i3_j1": (_f(bias[0, 1, 3, 1]), want)}


def xpos() -> Case:
    # Sun et al.: RoPE rotation, q pair k scaled by zeta_k^(i / scale_base), k by zeta^(-j / ...),
    # zeta_k = (2k/d + gamma) / (1 + gamma); gamma 0.4, scale_base 4.
    q2, k2 = apply_xpos(
        jnp.asarray(Q_BTNH), jnp.asarray(K_BTNH), POS_BT, POS_BT, gamma=0.4, scale_base=4.0
    )
    zeta0 = 0.4 / 1.4
    q, k = Q_BTNH[0, 3, 0], K_BTNH[0, 2, 0]
    return {
        "q_t3_f0": (_f(q2[0, 3, 0, 0]), (q[0] * math.cos(3) - q[2] * math.sin(3)) * zeta0**0.75),
        "k_t2_f2": (_f(k2[0, 2, 0, 2]), (k[2] * math.cos(2) + k[0] * math.sin(2)) * zeta0**-0.5),
    }


def path() -> Case:
    # w_t: fixed unit vectors per token and head; beta_t = 2 sigmoid(z) for fixed z.
    w = _fixed((1, T, N, H), 1.9)
    w = w / np.linalg.norm(w, axis=-1, keepdims=True)
    beta = 2.0 / (1.0 + np.exp(-_fixed((1, T, N), 2.3)))
    logits, _ = path_logits_BNQK(
        jnp.asarray(Q_BTNH, jnp.float32),
        jnp.asarray(K_BTNH, jnp.float32),
        jnp.asarray(w, jnp.float32),
        jnp.asarray(beta, jnp.float32),
        q_index_Q=jnp.arange(T),
        k_index_K=jnp.arange(T),
    )

    def reference(i: int, j: int, h: int) -> float:  # q_i^T H_i H_{i-1} ... H_{j+1} k_j
        product = np.eye(H)
        for s in range(i, j, -1):
            product = product @ (np.eye(H) - beta[0, s, h] * np.outer(w[0, s, h], w[0, s, h]))
        return float(Q_BTNH[0, i, h] @ product @ K_BTNH[0, j, h])

    return {
        "h0_i3_j0": (_f(logits[0, 0, 3, 0]), reference(3, 0, 0)),
        "h1_i2_j1": (_f(logits[0, 1, 2, 1]), reference(2, 1, 1)),
        "h1_i3_j3": (_f(logits[0, 1, 3, 3]), reference(3, 3, 1)),
    }


CASES: dict[str, Callable[[], Case]] = {
    "alibi": alibi,
    "cope": cope,
    "dape": dape,
    "fire": fire,
    "fox": fox,
    "kerple": kerple,
    "learned": learned,
    "nope": nope,
    "path": path,
    "randomized": randomized,
    "relative": relative,
    "relative_capped": relative_capped,
    "rope": rope,
    "selective": selective,
    "sinusoidal": sinusoidal,
    "stickbreaking": stickbreaking,
    "t5": t5,
    "tape": tape,
    "transformer_xl": transformer_xl,
    "xpos": xpos,
}
