"""The blockwise engine (``copejax.ops.engine``): O(T) memory, path choice, clear errors.

Values and gradients against the naive path, for every registered scheme, are in
``tests/test_blockwise_equivalence.py``; here: no (T, S)-sized array anywhere in the traced
forward and backward of a whole model, nor one that grows faster than T (traced at T and
2T), ``auto``'s choice, and refusals.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model import attention_paths
from copejax.model.transformer import Transformer
from copejax.ops import engine, engine_blocks
from tests.conftest import tiny_config
from tests.float_tolerance import assert_same_float32_sum
from tests.ops.memory_growth import producer_avals, superlinear_arrays

SCHEMES = [
    "nope",
    "rope",
    "alibi",
    "t5",
    "relative_capped",
    "kerple",
    "fire",
    "transformer_xl",
    "cope",
    "fox",
    "stickbreaking",
    "tape",
    "selective",
    "dape",
    "path",
]


def _avals(jaxpr: jax.extend.core.Jaxpr):
    """Every abstract value of a jaxpr, sub-jaxprs (scan, cond, custom_vjp, remat) included."""
    return (aval for _, aval in producer_avals(jaxpr))


def gradient_jaxpr(position: str, length: int, impl: str) -> jax.extend.core.Jaxpr:
    """The jaxpr of a one-layer model's loss gradient at ``length`` tokens, traced only."""
    cfg = tiny_config(
        position, num_layers=1, max_len=length, attention_impl=impl, attention_block=32
    )
    model = Transformer(cfg)
    tokens_BT = jnp.zeros((1, length), jnp.int32)
    positions_BT = jnp.arange(length)[None]
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens_BT, positions_BT))

    def loss(p: object) -> jax.Array:
        return jnp.sum(model.apply(p, tokens_BT, positions_BT))

    return jax.make_jaxpr(jax.grad(loss))(params).jaxpr


def length_squared_shapes(jaxpr: jax.extend.core.Jaxpr, length: int) -> list[tuple[int, ...]]:
    """The shapes in ``jaxpr`` (sub-jaxprs included) with two or more dimensions >= length."""
    shapes = [tuple(getattr(a, "shape", ())) for a in _avals(jaxpr)]
    return sorted({s for s in shapes if sum(d >= length for d in s) >= 2})


@pytest.mark.parametrize("position", SCHEMES)
def test_model_gradient_holds_no_length_squared_array(position: str) -> None:
    """Every array in the jaxpr of the loss gradient has at most one dimension >= T."""
    square = length_squared_shapes(gradient_jaxpr(position, 192, "blockwise"), 192)
    assert not square, f"{position}: (T, S)-sized arrays {square[:5]}"


SELECTIVE_PREFIX = "its per-(query block, key) prefix, (B, S, T / Q): O(T^2 / Q), as README says"


@pytest.mark.parametrize(
    "position",
    [
        pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=SELECTIVE_PREFIX))
        if n == "selective"
        else n
        for n in SCHEMES
    ],
)
def test_model_gradient_arrays_grow_linearly(position: str) -> None:
    """Traced at 512 and 1024 tokens (16 and 32 key blocks: above ``REMAT_WALKS_ABOVE``,
    below which the walks' residuals are kept, a bounded number of blocks), no array of the
    loss gradient grows faster than T: O(T) memory, not only no (T, S)-shaped array."""
    assert engine.REMAT_WALKS_ABOVE < 512 // 32
    grown = superlinear_arrays(functools.partial(gradient_jaxpr, position, impl="blockwise"), 512)
    assert not grown, f"{position}: arrays that grow faster than T: {grown[:5]}"


def test_auto_is_naive_while_short_or_sowing_and_blockwise_beyond() -> None:
    cfg = tiny_config("cope")
    side = attention_paths.AUTO_BLOCKWISE_FROM
    assert attention_paths.choose_impl(cfg, side - 1, sowing=False, backend="cpu") == "naive"
    assert attention_paths.choose_impl(cfg, side, sowing=False, backend="cpu") == "blockwise"
    assert attention_paths.choose_impl(cfg, side, sowing=True, backend="cpu") == "naive"
    forced = dataclasses.replace(cfg, attention_impl="blockwise")
    assert attention_paths.choose_impl(forced, 4, sowing=True) == "blockwise"


def test_auto_takes_the_fused_kernel_on_gpu_in_bfloat16_where_it_applies() -> None:
    rope16 = tiny_config("rope", dtype="bfloat16")
    assert attention_paths.choose_impl(rope16, 64, sowing=False, backend="gpu") == (
        "dot_product_attention"
    )
    alibi16 = tiny_config("alibi", dtype="bfloat16")
    assert attention_paths.choose_impl(alibi16, 64, sowing=False, backend="gpu") == (
        "dot_product_attention"
    )
    cope16 = tiny_config("cope", dtype="bfloat16")
    assert attention_paths.choose_impl(cope16, 64, sowing=False, backend="gpu") == "naive"
    rope32 = tiny_config("rope")
    assert attention_paths.choose_impl(rope32, 64, sowing=False, backend="gpu") == "naive"


def test_auto_on_gpu_keeps_the_naive_and_biased_fused_paths_while_their_pairs_fit() -> None:
    """auto's rules, which apply where no measurement does (``measured_paths.MEASURED`` sends
    bfloat16 ALiBi to the kernels from 4096 keys: tests/test_measured_paths.py)."""
    budget = attention_paths.GPU_NAIVE_MAX_BYTES
    choose = lambda cfg, pairs: attention_paths.rule_impl(cfg, 1 << 14, "gpu", pairs)
    rope32, alibi32 = tiny_config("rope"), tiny_config("alibi")
    for cfg in (rope32, alibi32):
        assert choose(cfg, budget // 4) == "naive"  # float32 logits of exactly the budget
        assert choose(cfg, budget // 4 + 1) == "blockwise"
    for contextual in ("cope", "fox", "path"):  # naive paths with several (T, S) arrays
        assert choose(tiny_config(contextual, dtype="bfloat16"), 1 << 10) == "blockwise"
    alibi16 = tiny_config("alibi", dtype="bfloat16")
    assert choose(alibi16, budget // 2) == "dot_product_attention"  # a bf16 bias of the budget
    assert choose(alibi16, budget // 2 + 1) == "blockwise"  # its bias would not fit
    rope16 = tiny_config("rope", dtype="bfloat16")
    assert choose(rope16, 1 << 40) == "dot_product_attention"  # no bias: cuDNN is O(T)
    # Elsewhere the length rule holds whatever the pairs.
    assert attention_paths.choose_impl(rope32, 64, False, backend="cpu", pairs=1 << 40) == "naive"


def _engine_inputs(length: int = 6) -> dict:
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, length, 2, 4)), jnp.float32) for _ in range(3))
    ids = jnp.zeros((1, length), jnp.int32)
    positions = jnp.arange(length)[None]
    return dict(
        q_BTNH=q,
        k_BSNH=k,
        v_BSNW=v,
        q_positions_BT=positions,
        k_positions_BS=positions,
        q_segment_ids_BT=ids,
        k_segment_ids_BS=ids,
    )


def test_engine_without_terms_is_causal_softmax_attention() -> None:
    """A NumPy reference: y_i = sum_{j <= i} softmax_j(q_i . k_j / sqrt(H)) v_j."""
    inputs = _engine_inputs()
    y, _ = engine.blockwise_attention(**inputs, block=4)
    q, k, v = (np.asarray(inputs[n], np.float64) for n in ("q_BTNH", "k_BSNH", "v_BSNW"))
    expected = np.zeros_like(q)
    for i in range(q.shape[1]):
        for n in range(2):
            s = q[0, i, n] @ k[0, : i + 1, n].T / 2.0
            w = np.exp(s - s.max())
            expected[0, i, n] = (w / w.sum()) @ v[0, : i + 1, n]
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)


def test_flash_backward_of_a_carry_is_refused_in_a_window() -> None:
    """A window's band walk gathers key blocks out of order, so a carry's pass cannot replay
    the forward's: flash is refused there (remat is the backward)."""
    term = engine_blocks.BlockTerm(
        bias=lambda p, pair, prep, carry: (jnp.zeros_like(pair.logits_BNQK), carry),
        init=lambda b, n, q: jnp.zeros((b, n, q)),
    )
    with pytest.raises(ValueError, match="needs a walk over every older key block in order"):
        engine.blockwise_attention(**_engine_inputs(), terms=[term], backward="flash", window=2)


def test_bad_engine_options_are_named() -> None:
    with pytest.raises(ValueError, match="backward must be one of"):
        engine.blockwise_attention(**_engine_inputs(), backward="fast")
    with pytest.raises(ValueError, match="block size must be a positive integer"):
        engine.blockwise_attention(**_engine_inputs(), block=0)
    with pytest.raises(ValueError, match="attention_block must be a positive integer"):
        tiny_config("nope", attention_block=0)
    with pytest.raises(ValueError, match="attention_backward must be one of"):
        tiny_config("nope", attention_backward="fast")


def test_a_bias_site_without_block_terms_is_refused() -> None:
    from copejax.positions.base import AttentionSite, Dims, check_block_terms

    class BiasOnly(AttentionSite):
        def bias(self, q, k, v, logits, ctx):
            return logits

    with pytest.raises(NotImplementedError, match="BiasOnly defines a bias site but no"):
        check_block_terms(BiasOnly(Dims(8, 2, 4, 1, 8)))


def test_auto_backward_is_flash_wherever_it_applies_and_remat_for_carries() -> None:
    """Two key blocks: auto traces the same program as "flash" (the stat is None), and, with a
    term that carries across key blocks, the same as "remat", unless the term has an
    ``advance`` of its own (then "flash")."""
    inputs = _engine_inputs()

    def jaxpr(**kwargs: object) -> str:
        return str(
            jax.make_jaxpr(
                lambda q: engine.blockwise_attention(**{**inputs, "q_BTNH": q}, block=3, **kwargs)[
                    0
                ]
            )(inputs["q_BTNH"])
        )

    assert engine.blockwise_attention(**inputs, block=3)[1] is None
    assert jaxpr(backward="auto") == jaxpr(backward="flash") != jaxpr(backward="remat")
    term = engine_blocks.BlockTerm(
        bias=lambda p, pair, prep, carry: (jnp.zeros_like(pair.logits_BNQK), carry),
        init=lambda b, n, q: jnp.zeros((b, n, q), jnp.float32),
    )
    assert jaxpr(backward="auto", terms=[term]) == jaxpr(backward="remat", terms=[term])
    # A carry with its own advance (CoPE's count): auto takes flash.
    counted = dataclasses.replace(term, advance=lambda p, pair, prep, carry: carry + 1.0)
    assert jaxpr(backward="auto", terms=[counted]) == jaxpr(backward="flash", terms=[counted])
    assert jaxpr(backward="flash", terms=[counted]) != jaxpr(backward="remat", terms=[counted])


@pytest.mark.parametrize("backward", ["flash", pytest.param("remat", marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "position_term", ["interpolate", pytest.param("mlp", marks=pytest.mark.slow)]
)
def test_settled_cope_pairs_give_the_values_and_gradients_of_counting_them(
    backward: str, position_term: str
) -> None:
    """CoPE's key blocks whose every query has counted p_max - 1 gates take the term's row
    constant (BlockTerm.settled) in the forward and in the flash backward; values and
    gradients equal those of counting every block (skip_saturated=False). p_max = 3 with blocks
    of 4 over 24 keys: the NumPy count below shows that settled pairs occur."""
    from copejax.ops.cope_block import cope_block_term

    inputs = _engine_inputs(length=24)
    rng = np.random.default_rng(1)
    pos_emb = jnp.asarray(rng.normal(size=(3, 4)), jnp.float32)
    mlp = tuple(jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((5,), (5,), (5, 4)))
    params = {"pos_emb": pos_emb} if position_term == "interpolate" else {"mlp_params": mlp}

    q, k = (np.asarray(inputs[n], np.float64) for n in ("q_BTNH", "k_BSNH"))
    gates = 1.0 / (1.0 + np.exp(-np.einsum("bqnh,bknh->bnqk", q, k) / 2.0))
    gates = gates * np.tril(np.ones((24, 24)))
    newer = np.cumsum(gates[..., ::-1], axis=-1)[..., ::-1]  # sum_{k >= j} g_ik
    entering = [newer[..., 4 * (b + 1)] for b in range(5)]  # count before key block b
    settled_pairs = sum(
        bool(np.all(entering[b][..., 4 * qb : 4 * qb + 4] >= 2.0))
        for qb in range(6)
        for b in range(qb - 1)
    )
    assert settled_pairs >= 5

    def loss(q_BTNH, k_BSNH, v_BSNW, params, skip: bool):
        term = cope_block_term(p_max=3, position_term=position_term, skip_saturated=skip, **params)
        y, _ = engine.blockwise_attention(
            **{**inputs, "q_BTNH": q_BTNH, "k_BSNH": k_BSNH, "v_BSNW": v_BSNW},
            terms=[term],
            block=4,
            backward=backward,
        )
        return jnp.sum(y * jnp.sin(jnp.arange(y.size).reshape(y.shape))), y

    args = (inputs["q_BTNH"], inputs["k_BSNH"], inputs["v_BSNW"], params)
    grad = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
    (g_skip, y_skip), (g_all, y_all) = grad(*args, True), grad(*args, False)
    np.testing.assert_allclose(y_skip, y_all, rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(g_skip), jax.tree.leaves(g_all), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("skip_saturated", [True, False])
def test_replaying_cope_counts_oldest_first_gives_the_gradients_of_the_carry_pass(
    skip_saturated: bool,
) -> None:
    """With ``retreat`` the flash backward rebuilds CoPE's counts oldest first from the
    forward's last count (count minus the block's gates); without it, a newest-first pass
    replays them. Both give the same gradients, with and without settled pairs."""
    from copejax.ops.cope_block import cope_block_term

    inputs = _engine_inputs(length=24)
    pos_emb = jnp.asarray(np.random.default_rng(3).normal(size=(3, 4)), jnp.float32)

    def loss(q_BTNH, k_BSNH, pos_emb, replay: bool):
        term = cope_block_term(p_max=3, pos_emb=pos_emb, skip_saturated=skip_saturated)
        term = term if replay else dataclasses.replace(term, retreat=None)
        y, _ = engine.blockwise_attention(
            **{**inputs, "q_BTNH": q_BTNH, "k_BSNH": k_BSNH},
            terms=[term],
            block=4,
            backward="flash",
        )
        return jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape)))

    args = (inputs["q_BTNH"], inputs["k_BSNH"], pos_emb)
    replayed = jax.grad(loss, argnums=(0, 1, 2))(*args, True)
    passed = jax.grad(loss, argnums=(0, 1, 2))(*args, False)
    # The two passes sum the same pair gradients in different orders: each entry of a
    # gradient is a float32 sum over at most every (batch, head, query, key) pair.
    batch, length, heads, _ = inputs["q_BTNH"].shape
    for a, b in zip(replayed, passed, strict=True):
        assert_same_float32_sum(a, b, summands=batch * heads * length * length)


def test_block_length_follows_the_length_rule_capped_by_the_scheme() -> None:
    """Blocks of 128 below 4096 keys and 256 from there, at most the scheme's
    max_engine_block (PaTH: 128, its per-block UT transforms), alone or in a composite;
    model.attention_block overrides both."""
    assert tiny_config("nope").attention_block_for(4095) == 128
    assert tiny_config("nope").attention_block_for(4096) == 256
    assert tiny_config("path").attention_block_for(16384) == 128
    assert tiny_config("path+fox").attention_block_for(16384) == 128
    assert tiny_config("path", attention_block=512).attention_block_for(16384) == 512


def test_a_scheme_may_start_the_blockwise_path_later() -> None:
    """TAPE's auto_blockwise_from (8192: its naive path measured faster at 4096 on a CPU)
    replaces AUTO_BLOCKWISE_FROM for it; other schemes keep it."""
    start = attention_paths.AUTO_BLOCKWISE_FROM
    assert attention_paths.choose_impl(tiny_config("nope"), start, False, backend="cpu") == (
        "blockwise"
    )
    tape = tiny_config("tape")
    assert attention_paths.choose_impl(tape, 4096, False, backend="cpu") == "naive"
    assert attention_paths.choose_impl(tape, 8192, False, backend="cpu") == "blockwise"
