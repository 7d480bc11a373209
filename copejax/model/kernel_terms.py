"""Which position schemes the fused kernels run, and their in-kernel terms (issue 45).

``model.attention_impl = "kernel"`` runs every layer through
:func:`copejax.ops.kernels.attention.fused_attention`. A scheme is covered when each of its
parts (a composite's too) either leaves the logits to the content (its sites are among
``embed``, ``qk`` and ``output``: nope, learned, sinusoidal, randomized, rope, xpos), replaces
the softmax by a normalizer the kernels implement (stick-breaking, :data:`NORMALIZERS`), or has
a kernel term here, built from the same block term the engine runs
(:meth:`~copejax.positions.base.AttentionSite.block_terms`) and the scheme's own pure
functions, evaluated tile by tile in the kernels:

- alibi: ``-m_h (i - j)`` (``alibi_bias``), from one slope per head, a separable term
  (:mod:`copejax.model.kernel_alibi`);
- t5: ``table[bucket(j - i), h]`` (``t5_bucket``; :mod:`copejax.model.kernel_t5`);
- kerple: ``-r1 log(1 + r2 |i - j|)`` or ``-r1 |i - j|^r2`` (``kerple_bias``), r1 and r2 per head;
- fox: ``c_i - c_j``, the prefix sums of log forget gates (``fox_core.decay_BNTS``), a
  separable term (:mod:`copejax.model.kernel_fox`);
- fire: ``f(psi(|i - j|) / psi(max(i, L)))`` (``fire_normalized_distance``, the MLP's hidden
  units in a loop, its parameters pulled back by hand: :mod:`copejax.model.kernel_fire`),
  from c, L and the MLP as a row per head;
- stickbreaking: no term; its normalizer runs in the kernels (:mod:`copejax.ops.kernels.stick`),
  with or without the query's own key, and with ``remainder_bias``'s extra value channel;
- cope: its count carried across key tiles (:mod:`copejax.ops.kernels.cope`), every gate
  (content logits, sep-keys, values) and position term (interpolated, ALiBi, MLP) of the
  paper, with the softmax (:mod:`copejax.model.kernel_cope`: a table of more than 256 rows is
  refused by name);
- selective: the penalties ``-F`` accumulated from the selecting head's ReLU'd (or sigmoid)
  logits (:mod:`copejax.ops.kernels.selective`), with the softmax and the terms above;
  ``prune_threshold``, ``prune_budget`` and cope, Shaw's tables or stick-breaking beside it
  are refused by name;
- relative, relative_capped: Shaw's ``q_i . e[d_ij] / sqrt(H)``
  (:mod:`copejax.ops.kernels.relative`: a band of Q + K - 1 table rows per tile pair, any
  max_distance), with the softmax, without cope and with the terms above;
- path: the Householder-like products split at leaf chunks: within a leaf XLA
  (:mod:`copejax.model.kernel_path`), across leaves the kernels in levels of chunk pairs
  (:mod:`copejax.model.path_levels`), with the softmax and the terms above;
- transformer_xl: ``u . k_j + (q_i + v) . W_R r_{i-j}`` as wider queries and keys whose
  content matmul holds it (:mod:`copejax.model.kernel_xl`), without cope, selective or Shaw;
- tape: its qk site's q' and k' as the kernels' q and k, its carry's mixing (eq. 7) as float32
  value columns (:mod:`copejax.model.kernel_tape`), without cope, selective, Shaw, XL or PaTH.

On TPU the Mosaic TPU kernels (:mod:`copejax.ops.kernels.tpu_forward`) run every scheme
above: stickbreaking (:mod:`copejax.ops.kernels.tpu_stick`), cope
(:mod:`copejax.ops.kernels.tpu_cope`), selective (:mod:`copejax.ops.kernels.tpu_selective`)
and Shaw's tables (:mod:`copejax.ops.kernels.tpu_relative`) with kernels of their own.

Every other scheme is refused by name with the reason (:func:`kernel_refusal`); the
registry-wide test (``tests/ops/kernels/test_kernel_registry.py``) holds every registered
scheme to one of the two.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from copejax.model.kernel_alibi import AlibiTile
from copejax.model.kernel_cope import cope_refusal, cope_term
from copejax.model.kernel_fire import FireTile
from copejax.model.kernel_fox import FoxTile
from copejax.model.kernel_path import PATH, path_refusal
from copejax.model.kernel_t5 import T5Tile
from copejax.model.kernel_tape import TAPE, tape_refusal
from copejax.model.kernel_xl import XL, xl_refusal
from copejax.ops.engine_blocks import BlockTerm
from copejax.ops.kernels.cope import CopeTerm
from copejax.ops.kernels.relative import RelativeTerm
from copejax.ops.kernels.selective import SelectiveTerm
from copejax.ops.kernels.terms import (
    KernelTerm,
    TermTile,
    batch_rows,
    param_scalars,
    tile_shape,
)
from copejax.positions.alibi import alibi_slopes
from copejax.positions.base import Dims, PositionScheme
from copejax.positions.kerple import Kerple, kerple_bias
from copejax.positions.t5 import T5Bias

# Sites that leave the attention logits to q . k / sqrt(H) (and the softmax in place).
CONTENT_SITES = frozenset({"embed", "qk", "output"})
# Schemes whose normalizer site the kernels implement (copejax.ops.kernels.stick).
NORMALIZERS = frozenset({"stickbreaking"})

# Shaw's schemes, run by copejax.ops.kernels.relative (a band of its table per tile pair).
RELATIVE = ("relative", "relative_capped")
# Composites that the registry-wide kernel checks run beside the registered names (their parts'
# terms are summed in the kernels as the naive path sums biases): tests/ops/kernels/
# test_kernel_registry.py and experiments/kernel_tpu.py.
CHECKED_COMPOSITES = (
    "alibi+rope",
    "fox+t5",
    "kerple+xpos",
    "alibi+stickbreaking",
    "selective+rope",
    "selective+fox",
    "path+fox",
    "cope+fire",  # the terms pulled back by hand (kernel_fire) in CoPE's and selective's
    "selective+fire",  # backward kernels (pullbacks.terms_vjp)
)


# Why a scheme with other sites has no kernel term yet (the error message names it).
NOT_YET = {
    "dape": "its MLP reads each pair's content logits across heads",
}


def _alibi(scheme: PositionScheme, term: BlockTerm, dims: Dims) -> KernelTerm:
    slopes_N1 = jnp.asarray(alibi_slopes(dims.num_heads), jnp.float32)[:, None]
    return KernelTerm("alibi", AlibiTile(), params_NP=slopes_N1)


def _t5(scheme: T5Bias, term: BlockTerm, dims: Dims) -> KernelTerm:
    tile = T5Tile(scheme.bidirectional, scheme.num_buckets, scheme.max_distance)
    return KernelTerm("t5", tile, params_NP=jnp.transpose(term.params))


def _kerple_tile(r_P: jax.Array, tile: TermTile, *, variant: str) -> jax.Array:
    q_BT, k_BS = batch_rows(tile)
    r1, r2 = param_scalars(r_P)
    bias = kerple_bias(q_BT, k_BS, r1[None], r2[None], variant)
    return bias.reshape(tile_shape(tile))


def _kerple(scheme: Kerple, term: BlockTerm, dims: Dims) -> KernelTerm:
    r1_N, r2_N = scheme.positive(*term.params)
    tile = functools.partial(_kerple_tile, variant=scheme.variant)
    return KernelTerm("kerple", tile, params_NP=jnp.stack([r1_N, r2_N], axis=1))


def _fox(scheme: PositionScheme, term: BlockTerm, dims: Dims) -> KernelTerm:
    c_q, c_k = term.q_arrays["c"], term.k_arrays["c"]
    return KernelTerm("fox", FoxTile(), q_values_BTN=c_q, k_values_BSN=c_k)


def _fire(scheme: PositionScheme, term: BlockTerm, dims: Dims) -> KernelTerm:
    """One row per head: c, L, b2[h], w1 (F), b1 (F), w2[:, h] (F); the shared entries are
    broadcast to every head, and JAX sums their gradients back."""
    p, heads = term.params, dims.num_heads
    width = p["b1_F"].shape[0]

    def shared(x: jax.Array) -> jax.Array:
        return jnp.broadcast_to(jnp.reshape(x, (1, -1)).astype(jnp.float32), (heads, x.size))

    row_NP = jnp.concatenate(
        [
            shared(p["c"]),
            shared(p["threshold"]),
            p["b2_N"].astype(jnp.float32)[:, None],
            shared(p["w1_1F"]),
            shared(p["b1_F"]),
            jnp.transpose(p["w2_FN"]).astype(jnp.float32),
        ],
        axis=1,
    )
    return KernelTerm("fire", FireTile(width), params_NP=row_NP)


TermBuilder = Callable[[PositionScheme, BlockTerm, Dims], KernelTerm]
TERM_BUILDERS: dict[str, TermBuilder] = {
    "alibi": _alibi,
    "t5": _t5,
    "kerple": _kerple,
    "fox": _fox,
    "fire": _fire,
}


def parts(scheme: PositionScheme) -> tuple[PositionScheme, ...]:
    """A composite's parts in order, or the scheme itself."""
    return tuple(getattr(scheme, "parts", ())) or (scheme,)


def _has_term(part: PositionScheme) -> bool:
    """Whether the part adds a logit term (its bias site)."""
    return "bias" in part.sites


def _runs(part: PositionScheme) -> bool:
    """Whether the kernels run the part: content sites, a normalizer they implement, a
    bias with a kernel term (or CoPE's carried count), TAPE's carry (mixed as values)."""
    other = set(part.sites) - CONTENT_SITES - {"bias"}
    if part.name in NORMALIZERS:
        other -= {"normalizer"}
    if part.name == TAPE:
        other -= {"carry"}
    known = part.name in TERM_BUILDERS or part.name in ("cope", "selective", XL, PATH, *RELATIVE)
    return not other and (not _has_term(part) or known)


def _selective_refusal(part: PositionScheme, scheme: PositionScheme) -> str | None:
    """Why the kernels cannot run this selective attention (its options, or the parts it
    is combined with), or None."""
    if part.prune_threshold is not None:
        return (
            f"prune_threshold={part.prune_threshold} (the kernels subtract F; pruning's mask "
            "of the keys whose F passed the threshold is not in them)"
        )
    if part.prune_budget is not None:
        return (
            f"prune_budget={part.prune_budget} (its evictions are a sequential scan over the "
            "queries, outside the kernels)"
        )
    others = [
        p.name
        for p in parts(scheme)
        if p is not part and p.name not in TERM_BUILDERS and {"bias", "normalizer"} & set(p.sites)
    ]
    if others:
        return (
            f"its penalties with {others} (the selective kernels add the terms "
            f"{list(TERM_BUILDERS)}, with the softmax)"
        )
    return None


def _relative_refusal(part: PositionScheme, names: list[str]) -> str | None:
    """Why the kernels cannot run Shaw's table with the other parts ``names``, or None."""
    others = sorted({"cope", *NORMALIZERS, *RELATIVE} & set(names) - {part.name})
    if others or names.count(part.name) > 1:
        return (
            f"its table with {others or [part.name]} (the kernels run one Shaw table, with "
            "the softmax and without cope)"
        )
    return None


def relative_term(
    scheme: PositionScheme, block_terms: tuple[BlockTerm, ...]
) -> RelativeTerm | None:
    """Shaw's table and cap for the kernels, if a part of ``scheme`` (block terms as
    :func:`kernel_terms` takes them)."""
    with_terms = [part for part in parts(scheme) if _has_term(part)]
    for part, term in zip(with_terms, block_terms, strict=True):
        if part.name in RELATIVE:
            return RelativeTerm(term.params, part.capped)
    return None


def part_term(
    scheme: PositionScheme, block_terms: tuple[BlockTerm, ...], name: str
) -> tuple[PositionScheme, BlockTerm] | None:
    """The part of ``scheme`` named ``name`` and its block term, if any: Transformer-XL's
    (wider queries and keys, :func:`copejax.model.kernel_xl.xl_widened_qk`) and PaTH's
    (:func:`copejax.model.kernel_path.path_attention`) are taken outside the kernel terms."""
    with_terms = [part for part in parts(scheme) if _has_term(part)]
    for part, term in zip(with_terms, block_terms, strict=True):
        if part.name == name:
            return part, term
    return None


def selective_term(scheme: PositionScheme) -> SelectiveTerm | None:
    """Selective attention's static options for the kernels, if a part of ``scheme``."""
    for part in parts(scheme):
        if part.name == "selective":
            return SelectiveTerm(part.head, part.nonlinearity)
    return None


def kernel_refusal(scheme: PositionScheme, dims: Dims | None = None) -> str | None:
    """Why ``scheme`` cannot run on the fused kernels (naming the part), or None; ``dims``
    resolves sizes that default to the model's (CoPE's p_max = None)."""
    names = [part.name for part in parts(scheme)]
    for part in parts(scheme):
        reason = None
        if not _runs(part):
            reason = NOT_YET.get(part.name, f"it acts at sites {part.sites}")
        elif part.name == "cope":
            reason = cope_refusal(part, dims)
            if reason is None and NORMALIZERS & set(names):
                reason = "its count with another normalizer than the softmax"
        elif part.name == "selective":
            reason = _selective_refusal(part, scheme)
        elif part.name in RELATIVE:
            reason = _relative_refusal(part, names)
        elif part.name == XL:
            reason = xl_refusal(names)
        elif part.name == PATH:
            reason = path_refusal(names)
        elif part.name == TAPE:
            reason = tape_refusal(names)
        if reason is not None:
            return (
                f"model.attention_impl='kernel' has no kernel for scheme {part.name!r}: "
                f"{reason}. Kernels cover schemes whose sites are among "
                f"{sorted(CONTENT_SITES)}, {sorted(NORMALIZERS)}, cope, selective, "
                f"{list(RELATIVE)}, {XL}, {PATH}, {TAPE} and "
                f"{list(TERM_BUILDERS)}; "
                "use attention_impl="
                "'auto', 'blockwise' or 'naive'"
            )
    return None


def kernel_terms(
    scheme: PositionScheme, block_terms: tuple[BlockTerm, ...], dims: Dims
) -> tuple[tuple[KernelTerm, ...], CopeTerm | None]:
    """The kernel terms of a covered scheme from its block terms (one per part that adds a
    term, in the parts' order, as composites return them), and CoPE's carried term."""
    refusal = kernel_refusal(scheme, dims)
    if refusal is not None:
        raise ValueError(refusal)
    with_terms = [part for part in parts(scheme) if _has_term(part)]
    if len(with_terms) != len(block_terms):
        raise ValueError(
            f"kernel: scheme {scheme.name!r} gave {len(block_terms)} block terms for the "
            f"{len(with_terms)} parts with a term ({[p.name for p in with_terms]})"
        )
    terms, cope = [], None
    for part, term in zip(with_terms, block_terms, strict=True):
        if part.name in ("selective", XL, PATH, *RELATIVE):  # by their own arguments
            continue
        if part.name == "cope":  # its parameters and gate keys
            cope = cope_term(part, term, dims)
        else:
            terms.append(TERM_BUILDERS[part.name](part, term, dims))
    return tuple(terms), cope
