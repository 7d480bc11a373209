"""Every in-kernel term at once (``kernel_terms.TERM_BUILDERS``, Kerple in both variants),
from small fixed block terms: what the kernels' lowering tests sum in one kernel."""

from __future__ import annotations

import jax.numpy as jnp

from copejax.model import kernel_terms
from copejax.ops.engine_blocks import BlockTerm
from copejax.ops.kernels.terms import KernelTerm
from copejax.positions import registry
from tests.conftest import tiny_config


def every_term(heads: int, length: int) -> list[KernelTerm]:
    """Every scheme's kernel term (kernel_terms.TERM_BUILDERS, Kerple in both variants)."""
    width = 8
    dims = tiny_config("nope", num_heads=heads).dims
    ones_N = jnp.ones((heads,), jnp.float32)
    c_BTN = jnp.zeros((1, length, heads), jnp.float32)
    fire = {
        "c": jnp.asarray(0.1),
        "threshold": jnp.asarray(32.0),
        "w1_1F": jnp.ones((1, width)),
        "b1_F": jnp.zeros((width,)),
        "w2_FN": jnp.ones((width, heads)),
        "b2_N": ones_N,
    }
    block_terms = {
        "alibi": BlockTerm(None),
        "t5": BlockTerm(None, params=jnp.ones((32, heads))),
        "kerple": BlockTerm(None, params=(ones_N, ones_N)),
        "fox": BlockTerm(None, q_arrays={"c": c_BTN}, k_arrays={"c": c_BTN}),
        "fire": BlockTerm(None, params=fire),
    }
    assert set(block_terms) == set(kernel_terms.TERM_BUILDERS)
    terms = [
        kernel_terms.TERM_BUILDERS[name](registry.make_scheme(name), term, dims)
        for name, term in block_terms.items()
    ]
    kerple_power = registry.make_scheme("kerple", {"variant": "power"})
    return [*terms, kernel_terms._kerple(kerple_power, block_terms["kerple"], dims)]
