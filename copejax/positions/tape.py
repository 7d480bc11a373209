"""TAPE: contextualized equivariant position embedding (Zhu et al. 2025, arXiv 2501.00712).

Each token carries a tensor of position embeddings ``e_BTMLR``: M blocks per token (the
N heads' features cut into blocks of L features, grouped by head), each an L x R matrix
(R is the paper's D, the coordinate dimension that O(R) acts on; renamed so that D keeps
meaning model width). The tensor is created at the embed site and carried across layers:

- attention (eq. 6, phi the identity, L = B): ``alpha_ij = sum_m q_im^T e_im e_jm^T k_jm``,
  factorised at the qk site as ``q'_im = e_im^T q_im``, ``k'_jm = e_jm^T k_jm`` (R-vectors);
- position mixing (eq. 7): ``e~_jm = sum_i w_ji e_im`` with the head's own attention map
  (``tape_mix``; in the model the attention mixes e like extra value features, so the
  blockwise engine computes it too without the map);
- position MLP (eq. 8): ``e_out = e + W2 diag(psi(x~_jm)) W1 e~_jm``, with ``x~`` the block's
  slice of the attention output and psi an MLP R^L -> R^F; W1 (F x L) and W2 (L x F) act on
  the left, so the update is O(R)-equivariant (eq. 5) and the logits O(R)-invariant (eq. 4).

Orientation of ``e``: the paper's eq. 6 writes ``e_j^T e_i`` for the L x L Gram matrix and its
section 3.3 initialises ``e_i`` as the rotation ``[[cos, -sin], [sin, cos]]``; that is the
R x L orientation. We store ``e`` as L x R (rows l, coordinates r; O(R) acts on the right, as
in eq. 5's ``E R``), so the Gram matrix is ``e_i e_j^T`` and the RoPE initialisation stores the
transposed rotation, ``e_i[l, r] = Rot(theta_m i)[r, l]``. Then ``q'_i = Rot(theta_m i) q_i``
is exactly RoPE's rotated query (eq. 2) and the logits equal the ``rope`` scheme's.

Block layout inside a head follows ``rope``: ``layout="half"`` puts features (k, k + H / L, ...)
in block k (so with L = 2 block k is RoPE's rotate-half pair k, frequency theta_k),
``"interleaved"`` puts features (k L, ..., k L + L - 1) in block k.

Extra shape letters here: M blocks per token (N * K), K blocks per head (H / L), L rows per
block (= block features), R coordinates, F hidden units of psi (the paper's B').

Sizes: two readings of the paper. Its eq. 6 text takes L = B (block features = rows) with
phi the identity, and section 3.3 makes RoPE the case L = R = 2 with one frequency theta_m per
block, so a block is a RoPE pair: B = 2, psi: R^2 -> R^F (``psi_input="block"``). Its
appendix (answer to reviewers, "Hyperparameters in TAPE") gives M = 12, B = 64 ("their product
defining the hidden size as 768"), L = D = 2 and B' = 48. Taken literally (12 blocks of 64
features, one 2 x 2 matrix each) eq. 6 would need a phi from R^{2 x 2} to R^{64 x 64} that
the paper does not give, and the RoPE initialisation would keep one frequency per head
instead of RoPE's 32. We read M x B as heads x head features: the position tensor keeps one
2 x 2 matrix per RoPE pair (K = 32 per head, so the RoPE initialisation is exact), and psi
reads the head's B = H features and gives B' gates that all the head's K matrices share
(``psi_input="head"``, ``hidden=48``: :data:`PAPER_OPTIONS`, used by the ``paper`` variants
of ``configs/addition.py`` and ``configs/passkey.py``, whose 64-feature heads match B = 64).
The default stays ``psi_input="block"`` with F = 16: it is eq. 6's own reading and what the
project's studies have used; the appendix reading is one option away.

What psi reads: eq. 8's x~_jm is "the output of attention used for token mixing". The carry
site of copejax's engine receives the block's attention output after the output projection
(``carry_after_mlp``'s ``attn_out_BTD``, D = N H features), not each head's output before it,
so psi reads that D-vector cut into heads (``"head"``) or blocks (``"block"``) by the head
layout. After the learned projection those slices are not head m's features but fixed linear
mixtures of all heads; since W_O is learned, any fixed slicing is as expressive as any other.
The head-aligned reading (y_BTNH before W_O) needs the engine to hand the per-head output to
the carry site; it is not offered here.

The tensor maths (eq. 6-8 and the initial tensors) is in :mod:`copejax.positions.tape_core`;
this module is the scheme and its Linen sites.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from copejax.positions.base import (
    AttentionContext,
    AttentionSite,
    Carry,
    Dims,
    EmbedOutput,
    EmbedSite,
    PositionScheme,
    check_choice,
    check_positive,
)
from copejax.positions.context import repeat_kv_heads
from copejax.positions.registry import register
from copejax.positions.rope import rope_inv_freq
from copejax.positions.tape_core import (
    random_tape_embeddings,
    rope_tape_embeddings,
    tape_qk,
    tape_update,
    to_blocks,
)
from copejax.runtime import sharding as ax

LAYOUTS = ("half", "interleaved")
INITS = ("rope", "random")
CONTEXTUALIZE = ("both", "attention", "mlp")
PSI_INPUTS = ("block", "head")
# The appendix's sizes (M = 12 heads of B = 64 features, L = D = 2, B' = 48) for a model with
# 64-feature heads; see the module docstring for the reading.
PAPER_OPTIONS = {"block": 2, "coords": 2, "hidden": 48, "psi_input": "head"}


@struct.dataclass
class TapeCarry:
    """TAPE's layer-to-layer state.

    Attributes:
      e_BTMLR: the position tensor entering (or leaving) a block, float32.
      mixed_BTMLR: eq. 7's attention-mixed positions, set between attention and MLP only.
    """

    e_BTMLR: jax.Array
    mixed_BTMLR: jax.Array | None = None


# ----------------------------------------------------------------------------- scheme


@register
@dataclasses.dataclass(frozen=True)
class Tape(PositionScheme):
    """TAPE: tensorial positions contextualised by attention (eq. 7) and an MLP (eq. 8).

    Options:
      init: "rope" (section 3.3: L = R = 2 rotations; with W2 = 0 the model equals ``rope``)
        or "random" (learned random Fourier features of size L x R).
      block: L, features per block (= rows of each position matrix); divides head_dim.
      coords: R, the coordinate dimension (the paper's D) on which O(R) acts.
      hidden: F, psi's output width (the paper's B'; 48 in its appendix).
      psi_input: what psi reads (eq. 8's x~): "block" (default; each block's L features of the
        attention output, one gate vector per block) or "head" (the head's H features, one
        gate vector per head shared by its H / L blocks: the appendix's B = 64 -> B' = 48).
      base: RoPE frequency base for init="rope" (and the frequency scale of "random").
      layout: "half" (rope's default pairing) or "interleaved" grouping of features into blocks.
      contextualize: Table 6's switch: "both" (default; ``e + W2 diag(psi(x~)) W1 e~``),
        "attention" (only the attention map contextualises: ``e + W2 W1 e~``, no psi) or
        "mlp" (only the token features: ``e + W2 diag(psi(x~)) W1 e``, no mixing).
      equivariant: False is Table 6's "without rotation equivariance": W1 (F x L R) and
        W2 (L R x F) act on the flattened L x R matrix, mixing coordinates, so eq. 5 fails.
      tensorial: False is Table 6's vector ablation: the L x R matrix flattened into one row
        of L R coordinates; the block's logit is (q_m . k_m)(e_im . e_jm).
    """

    name = "tape"
    sites = ("embed", "qk", "carry")
    cache_in_key_order = True
    paper = "Zhu et al. 2025, arXiv 2501.00712"
    # "auto" keeps the naive path below 8192 keys: at T = 4096 (B x N = 8, 2-core CPU) it
    # measured faster than the engine, whose value blocks carry TAPE's position tensors as
    # extra features (side-by-side rounds: 1259 against 1391 ms, and 1.04x in an earlier
    # run; experiments/results/bench.md), while its float32 logits take 1.6 GiB of buffers.
    auto_blockwise_from = 8192

    init: str = "rope"
    block: int = 2
    coords: int = 2
    hidden: int = 16
    base: float = 10000.0
    layout: str = "half"
    contextualize: str = "both"
    equivariant: bool = True
    tensorial: bool = True
    psi_input: str = "block"

    @property
    def rows(self) -> int:
        """L of the stored tensor: ``block``, or 1 for vector embeddings."""
        return self.block if self.tensorial else 1

    @property
    def cols(self) -> int:
        """R of the stored tensor: ``coords``, or ``block * coords`` for vector embeddings."""
        return self.coords if self.tensorial else self.block * self.coords

    def num_blocks(self, dims: Dims) -> int:
        """M = N * H / L."""
        return dims.num_heads * dims.head_dim // self.block

    def validate(self, dims: Dims) -> None:
        check_choice(self.name, "init", self.init, INITS)
        check_choice(self.name, "layout", self.layout, LAYOUTS)
        check_choice(self.name, "contextualize", self.contextualize, CONTEXTUALIZE)
        check_choice(self.name, "equivariant", self.equivariant, (True, False))
        check_choice(self.name, "tensorial", self.tensorial, (True, False))
        check_choice(self.name, "psi_input", self.psi_input, PSI_INPUTS)
        for key in ("block", "coords", "hidden"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{self.name}: {key} must be a positive integer, got {value!r}")
        check_positive(self.name, base=self.base)
        if dims.head_dim % self.block:
            raise ValueError(
                f"{self.name}: head_dim={dims.head_dim} is not divisible by block={self.block}; "
                "allowed: a block size that divides head_dim"
            )
        if self.init == "rope" and (self.block, self.coords) != (2, 2):
            raise ValueError(
                f"{self.name}: init='rope' needs block=2 and coords=2 (L = R = 2), got "
                f"block={self.block}, coords={self.coords}; use init='random' otherwise"
            )
        if self.contextualize != "attention" and dims.d_model != dims.num_heads * dims.head_dim:
            raise ValueError(
                f"{self.name}: psi reads the attention output in blocks of the heads' features, "
                f"so d_model={dims.d_model} must equal num_heads * head_dim = "
                f"{dims.num_heads * dims.head_dim} (or use contextualize='attention')"
            )

    def embed_module(self, dims: Dims) -> EmbedSite:
        return _TapeEmbed(dims=dims, scheme=self, name=self.name)

    def attention_module(self, dims: Dims) -> AttentionSite:
        return _TapeSite(dims=dims, scheme=self, name=self.name)


class _TapeEmbed(EmbedSite):
    """Creates the initial position tensor (the carry) from the positions."""

    scheme: Tape = Tape()

    def setup(self) -> None:
        s, dims = self.scheme, self.dims
        if s.init != "random":
            return
        shape = (s.num_blocks(dims), s.rows, s.cols)
        heads_blocks = dims.head_dim // s.block
        inv_freq_M = jnp.tile(rope_inv_freq(2 * heads_blocks, s.base), dims.num_heads)

        def freq_init(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
            return jax.random.normal(key, shape) * inv_freq_M[:, None, None]

        def phase_init(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
            return jax.random.uniform(key, shape, minval=-math.pi, maxval=math.pi)

        axes = (ax.HEADS, ax.POS_EMBED, ax.POS_EMBED)
        self.freq = self.param("freq", nn.with_logical_partitioning(freq_init, axes), shape)
        self.phase = self.param("phase", nn.with_logical_partitioning(phase_init, axes), shape)

    def __call__(
        self, x_BTD: jax.Array, positions_BT: jax.Array, deterministic: bool = True
    ) -> EmbedOutput:
        s, dims = self.scheme, self.dims
        if s.init == "rope":
            e_BTMLR = rope_tape_embeddings(
                positions_BT, dims.num_heads, dims.head_dim, s.base, s.tensorial
            )
        else:
            e_BTMLR = random_tape_embeddings(positions_BT, self.freq, self.phase)
        return EmbedOutput(x_BTD=x_BTD, positions_BT=positions_BT, carry=TapeCarry(e_BTMLR))


class _TapeSite(AttentionSite):
    """Per-layer TAPE: the qk transform (eq. 6), mixing (eq. 7) and the position MLP (eq. 8)."""

    scheme: Tape = Tape()

    def setup(self) -> None:
        s = self.scheme
        width = s.rows if s.equivariant else s.rows * s.cols
        self.w1 = self.param(
            "w1",
            nn.with_logical_partitioning(
                nn.initializers.normal(1.0 / math.sqrt(width)), (ax.POS_MLP, ax.POS_EMBED)
            ),
            (s.hidden, width),
        )
        # Zero W2: every position update vanishes at initialisation (section 3.3).
        self.w2 = self.param(
            "w2",
            nn.with_logical_partitioning(nn.initializers.zeros, (ax.POS_EMBED, ax.POS_MLP)),
            (width, s.hidden),
        )
        if s.contextualize != "attention":

            def dense(axes: tuple[str, str | None], name: str) -> nn.Dense:
                return nn.Dense(
                    s.hidden,
                    dtype=jnp.float32,
                    kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), axes),
                    bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes[1:]),
                    name=name,
                )

            self.psi_in = dense((ax.POS_EMBED, ax.POS_MLP), "psi_in")
            # Flax refuses a logical name twice in one array: the output axis is unnamed.
            self.psi_out = dense((ax.POS_MLP, None), "psi_out")

    def psi(self, x_tilde_BTMC: jax.Array) -> jax.Array:
        """psi: R^C -> R^F (C = L per block, or H per head), a two-layer GELU MLP, float32."""
        return self.psi_out(nn.gelu(self.psi_in(x_tilde_BTMC.astype(jnp.float32))))

    def qk(
        self, q_BTNH: jax.Array, k_BSNH: jax.Array, v_BSNH: jax.Array, ctx: AttentionContext
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        s = self.scheme
        e_BTMLR = ctx.carry.e_BTMLR
        head_dim = q_BTNH.shape[-1]
        # Grouped-query attention: each query head's key is its group's key seen through the
        # head's own position tensor, so the keys become per query head (and so does the
        # decode cache of this scheme's keys; the values keep K heads).
        k_BSNH = repeat_kv_heads(k_BSNH, self.dims.num_heads)
        q2 = tape_qk(q_BTNH, e_BTMLR, s.layout, s.tensorial)
        k2 = tape_qk(k_BSNH, e_BTMLR, s.layout, s.tensorial)
        if q2.shape[-1] != head_dim:
            # attention.py scales by 1/sqrt(width of q); keep the model's 1/sqrt(H).
            q2 = q2 * jnp.asarray(math.sqrt(q2.shape[-1] / head_dim), q2.dtype)
        return q2, k2, v_BSNH

    def cache_state(
        self, k_BTNH: jax.Array, v_BTNH: jax.Array, ctx: AttentionContext
    ) -> dict[str, jax.Array]:
        """Decode mode: each key's position tensor e_j entering this layer, for eq. 7."""
        if self.scheme.contextualize == "mlp":
            return {}
        return {"tape_e": ctx.carry.e_BTMLR}

    def mixed_values(self, ctx: AttentionContext) -> jax.Array | None:
        """Eq. 7 on every attention path: each key's position tensor, grouped by head
        (B, S, N, K L R), mixed by the head's attention like extra value features."""
        if self.scheme.contextualize == "mlp":
            return None
        e_BSMLR = ctx.key_state["tape_e"] if ctx.decode else ctx.carry.e_BTMLR
        batch, length = e_BSMLR.shape[:2]
        return e_BSMLR.astype(jnp.float32).reshape(batch, length, self.dims.num_heads, -1)

    def carry_after_attention(
        self, carry: Carry, mixed_BTNC: jax.Array | None, ctx: AttentionContext
    ) -> Carry:
        if self.scheme.contextualize == "mlp":
            return carry
        mixed_BTMLR = mixed_BTNC.reshape(*mixed_BTNC.shape[:2], *carry.e_BTMLR.shape[2:])
        return carry.replace(mixed_BTMLR=mixed_BTMLR)

    def carry_after_mlp(self, carry: Carry, attn_out_BTD: jax.Array, x_BTD: jax.Array) -> Carry:
        s = self.scheme
        source_BTMLR = carry.e_BTMLR if s.contextualize == "mlp" else carry.mixed_BTMLR
        gates_BTMF = None
        if s.contextualize != "attention":
            batch, length = attn_out_BTD.shape[:2]
            heads, head_dim = self.dims.num_heads, self.dims.head_dim
            x_BTNH = attn_out_BTD.reshape(batch, length, heads, head_dim)
            if s.psi_input == "head":
                gates_BTNF = self.psi(x_BTNH)
                gates_BTMF = jnp.repeat(gates_BTNF, head_dim // s.block, axis=2)
            else:
                x_BTNKL = to_blocks(x_BTNH, head_dim // s.block, s.layout)
                gates_BTMF = self.psi(x_BTNKL.reshape(batch, length, -1, s.block))
        update_BTMLR = tape_update(source_BTMLR, gates_BTMF, self.w1, self.w2, s.equivariant)
        return TapeCarry(e_BTMLR=carry.e_BTMLR + update_BTMLR)
