"""Fused Pallas attention kernels for the engine's logit terms (issue 45).

:func:`~copejax.ops.kernels.attention.fused_attention` (FlashAttention-2 forward and backward)
with terms computed inside the kernels (:mod:`copejax.ops.kernels.terms`), and stick-breaking
in place of the softmax (:mod:`copejax.ops.kernels.stick`). Modules: the entry point and custom
VJP (``attention``), the forward (``forward``) and backward (``backward``) kernels, stick-
breaking's three (``stick``), CoPE's (``cope``, its GPU backward in ``cope_backward``; its
options, operands and position terms in ``cope_terms``), the carry groups whose entering
carries stick-breaking's and CoPE's GPU backward keep (``carry_groups``), what they share about
a tile pair (``tiles``), float32 matmuls of bfloat16 pieces (``exact_dots``), the terms'
operands (``operands``) and the GPU backend's parameters (``triton_params``: Triton on GPUs,
interpret mode elsewhere), the backward programs' pull-backs of dS through the terms
(``pullbacks``) and the dk / dv program of the softmax's, stick-breaking's and Shaw's kernels
(``key_tile``); selective attention's penalties have their own prefix and forward kernels
(``selective``), backward kernels (``selective_backward``) and custom VJP
(``selective_attention``), and on a TPU their Mosaic counterparts (``tpu_selective``,
``tpu_selective_backward``); Shaw's relative positions read a band of their table per tile pair
(``relative``: the band maths, ``relative_kernels``: the kernel bodies, ``relative_calls``:
their launches; the dk / dv launch both use is ``dkdv_launch``); GPT-OSS's attention sink is
folded into every softmax kernel's output and log-sum-exp, with its gradient (``sink``); a
later block of queries against an earlier block of keys (PaTH's levels) runs the same kernels
with a query offset (``offset``). A call's tiles, padding and Plan come from ``padding``. On a
TPU (``backend="tpu"``) the Mosaic TPU kernels run the softmax, stick-breaking, CoPE, selective
attention, Shaw's tables and the query offset with the same terms: the forward
(``tpu_forward``), the backward (``tpu_dq``, ``tpu_backward``), the online softmax the softmax
and selective forwards share (``tpu_softmax``), stick-breaking's, CoPE's and Shaw's parts
(``tpu_stick``, ``tpu_cope``, ``tpu_relative``), per-query rows (``tpu_rows``) and their
layouts, grid and VMEM budget (``tpu_params``). This package imports only ``copejax.ops`` and
JAX; the schemes' terms are built by the model layer (``copejax.model.kernel_terms``).
"""
