"""CoPE on the fused kernels (Golovneva et al. 2024, arXiv 2405.18719; issue 45): which of
its variants they run, and its kernel term from the engine's block term.

Every variant of the paper runs (:mod:`copejax.ops.kernels.cope`, GPU and TPU):

- gates: on the content logits ("keys", the default), or on a second key operand, sep-keys'
  ``k' = W x`` or val-gates' ``v``, one per key/value head. The naive path pairs them with the
  query its bias site sees: in ``cope+rope`` the rotated q against the unrotated k' or v
  (:class:`copejax.positions.cope.CoPE`'s docstring). The kernels' q is that rotated q and
  their gate keys are the block term's own unrotated arrays, so the gates are the same.
- position terms: the interpolated ``q . e[p]`` (the table read by an unrolled loop over its
  rows: at most :data:`MAX_COPE_ROWS`), ALiBi's ``m_h p_ij`` (learned or fixed slopes), and
  CoPE-MLP's ``q . MLP(p_ij)``, exact at every pair's fractional p (F hidden units, F
  elementwise passes per pair: :mod:`copejax.ops.kernels.cope_terms` says why no cheaper
  exact form exists).

Refused (:func:`cope_refusal`): an interpolation table of more than :data:`MAX_COPE_ROWS`
rows; :mod:`copejax.model.kernel_terms` also refuses CoPE beside another normalizer than the
softmax. Shape letters: B batch, S keys, N query heads, G key/value heads, H head dim.
"""

from __future__ import annotations

from copejax.ops.engine_blocks import BlockTerm
from copejax.ops.kernels.cope import CopeStatic, CopeTerm
from copejax.positions.base import Dims, PositionScheme

COPE = "cope"
# CoPE's table rows the kernels take: they interpolate by an unrolled loop over the rows.
MAX_COPE_ROWS = 256


def cope_refusal(part: PositionScheme, dims: Dims | None) -> str | None:
    """Why the kernels cannot run this CoPE variant (its options), or None; ``dims``
    resolves ``p_max=None`` (the model's length)."""
    rows = part.p_max if dims is None else part.num_positions(dims)
    if part.position_term == "interpolate" and rows is not None and rows > MAX_COPE_ROWS:
        return (
            f"p_max={rows} table rows (the kernels read the table by a loop over its rows, "
            f"unrolled: at most {MAX_COPE_ROWS}; position_term='alibi' or 'mlp' take any "
            "p_max)"
        )
    return None


def cope_term(part: PositionScheme, term: BlockTerm, dims: Dims) -> CopeTerm:
    """The kernels' CoPE term from the scheme and its block term
    (:func:`copejax.ops.cope_block.cope_block_term`): its parameters (the table, the signed
    slopes or the MLP) and its gate keys, taken back from the N query heads the block term
    holds to the G key/value heads (``repeat_kv_heads`` repeats each group-major)."""
    positions = part.num_positions(dims)
    static = CopeStatic(
        positions,
        scale_term=part.scale_position_term,
        unit_gates=part.force_unit_gates,
        position_term=part.position_term,
        mlp_units=part.mlp_hidden,
        mlp_scale=1.0 / positions,
    )
    gate_k_BSNH = term.k_arrays.get("gate_k")
    gate_k_BSGH = None
    if gate_k_BSNH is not None:
        gate_k_BSGH = gate_k_BSNH[:, :, :: dims.num_heads // dims.kv_heads]
    return CopeTerm(term.params, static, gate_k_BSGH)
