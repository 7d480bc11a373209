"""Fused Pallas attention kernels for the engine's logit terms (issue 45).

:func:`~copejax.ops.kernels.attention.fused_attention` (FlashAttention-2 forward and
backward) with terms computed inside the kernels (:mod:`copejax.ops.kernels.terms`).
Triton on GPUs, interpret mode elsewhere (:mod:`copejax.ops.kernels.triton_params`).
This package imports only ``copejax.ops`` and JAX; the schemes' terms are built by the
model layer (``copejax.model.transformer.kernel_terms``).
"""
