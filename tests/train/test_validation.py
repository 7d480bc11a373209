"""Bad configs fail in plan.validate, before any compute, with a ValueError naming the problem.

A hypothesis property test breaks a working config in one to three random ways (unknown
names, sizes that do not divide, mesh / device mismatches, tables too short, negative rates)
and checks that every one is refused with a message matching one of the breakages, raised by
copejax code rather than from deep inside JAX.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import hypothesis.strategies as st
import ml_collections
import pytest
from hypothesis import HealthCheck, given, settings

from copejax.data.base import task_names
from copejax.positions import registry
from copejax.training.plan import validate
from tests.train.tiny_task import tiny_config

DEVICES = 4
Mutation = tuple[Callable[[ml_collections.ConfigDict], None], str]
NAME = st.text("abcdefghijklmnopqrstuvwxyz_+", min_size=1, max_size=12)


def _set(key: str, value: object) -> Callable[[ml_collections.ConfigDict], None]:
    def apply(config: ml_collections.ConfigDict) -> None:
        *parents, leaf = key.split(".")
        node = config
        for parent in parents:
            node = node[parent]
        with config.unlocked():
            node[leaf] = value

    return apply


def _all(*steps: Callable[[ml_collections.ConfigDict], None]) -> Callable:
    def apply(config: ml_collections.ConfigDict) -> None:
        for step in steps:
            step(config)

    return apply


@st.composite
def mutations(draw: st.DrawFn) -> Mutation:
    """One way to break tiny_config, and a regex its error message must match."""
    kind = draw(st.sampled_from(sorted(_KINDS)))
    return _KINDS[kind](draw)


def _unknown_scheme(draw: st.DrawFn) -> Mutation:
    name = draw(NAME.filter(lambda n: all(p not in registry.names() for p in n.split("+"))))
    return _set("model.position", name), r"unknown position scheme .*known schemes: .*rope"


def _unknown_task(draw: st.DrawFn) -> Mutation:
    name = draw(NAME.filter(lambda n: n not in task_names()))
    return _set("task.name", name), r"unknown task .*known tasks: .*flipflop"


def _unknown_corpus(draw: st.DrawFn) -> Mutation:
    corpus = draw(NAME.filter(lambda n: n not in ("shakespeare", "stdlib")))
    options = ml_collections.ConfigDict({"corpus": corpus})
    return _all(_set("task.name", "lm"), _set("task.options", options)), r"unknown corpus"


def _heads_do_not_divide(draw: st.DrawFn) -> Mutation:
    heads = draw(st.sampled_from([3, 5, 6, 7, 9]))
    return _set("model.num_heads", heads), r"d_model=16 is not divisible by model\.num_heads"


def _odd_rope_head_dim(draw: st.DrawFn) -> Mutation:
    head_dim = draw(st.integers(1, 15).filter(lambda h: h % 2))
    return (
        _all(_set("model.position", "rope"), _set("model.head_dim", head_dim)),
        r"head_dim must be even|rotates no pair",
    )


def _mesh_product(draw: st.DrawFn) -> Mutation:
    data, fsdp, tensor = draw(
        st.tuples(st.integers(1, 5), st.integers(1, 5), st.integers(1, 5)).filter(
            lambda m: m[0] * m[1] * m[2] != DEVICES
        )
    )
    mesh = _all(_set("mesh.data", data), _set("mesh.fsdp", fsdp), _set("mesh.tensor", tensor))
    return mesh, r"mesh axes .* must equal the device count 4"


def _mesh_leftover(draw: st.DrawFn) -> Mutation:
    fsdp = draw(st.sampled_from([3, 5, 8]))
    return _all(_set("mesh.data", -1), _set("mesh.fsdp", fsdp)), r"does not divide the 4 devices"


def _batch_not_divisible(draw: st.DrawFn) -> Mutation:
    size = draw(st.integers(-3, 40).filter(lambda b: b <= 0 or b % DEVICES))
    key = draw(st.sampled_from(["train.batch_size", "eval.batch_size"]))
    return _set(key, size), rf"{re.escape(key)}=-?\d+ must be a positive|must be a positive integer"


def _vocab_over_tensor(draw: st.DrawFn) -> Mutation:
    vocab = draw(st.sampled_from([3, 5, 7, 9, 13]))
    mutation = _all(_set("task.options.vocab_size", vocab), _set("mesh.tensor", 2))
    return mutation, r"'vocab' dimension \d+, which the mesh axes tensor=2 .* do not divide"


def _learned_table(draw: st.DrawFn) -> Mutation:
    max_len = draw(st.integers(1, 10))  # training sequences have T = 11
    mutation = _all(_set("model.position", "learned"), _set("model.max_len", max_len))
    return mutation, r"exceeds table_size"


def _learned_eval_split(draw: st.DrawFn) -> Mutation:
    del draw  # the 'long' split (T = 17) outgrows a table of max_len = 11 rows
    return _set("model.position", "learned"), r"eval split 'long' .*exceeds table_size=11"


def _cope_p_max(draw: st.DrawFn) -> Mutation:
    p_max = draw(st.integers(-5, 0))
    options = ml_collections.ConfigDict({"p_max": p_max})
    mutation = _all(_set("model.position", "cope"), _set("model.position_options", options))
    return mutation, r"p_max must be a positive integer"


def _negative_rate(draw: st.DrawFn) -> Mutation:
    key = draw(
        st.sampled_from(
            ["train.learning_rate", "train.weight_decay", "train.grad_clip", "train.eps"]
        )
    )
    value = draw(st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=True) | st.just(-0.5))
    return _set(key, value), rf"{re.escape(key)} must be"


def _bad_dropout(draw: st.DrawFn) -> Mutation:
    value = draw(st.floats(max_value=-1e-6) | st.floats(min_value=1.0) | st.just(float("nan")))
    return _set("model.dropout", value), r"model\.dropout must be in \[0, 1\)"


def _negative_count(draw: st.DrawFn) -> Mutation:
    key = draw(st.sampled_from(["train.warmup_steps", "train.log_every", "train.checkpoint_every"]))
    return _set(key, draw(st.integers(-100, -1))), rf"{re.escape(key)} must be a non-negative"


def _unknown_eval_split(draw: st.DrawFn) -> Mutation:
    split = draw(NAME.filter(lambda n: n not in ("train", "test", "long")))
    return _set("eval.splits", (split,)), r"eval\.splits .* unknown to task 'tiny_copy'"


_KINDS: dict[str, Callable[[st.DrawFn], Mutation]] = {
    f.__name__.strip("_"): f
    for f in (
        _unknown_scheme, _unknown_task, _unknown_corpus, _heads_do_not_divide, _odd_rope_head_dim,
        _mesh_product, _mesh_leftover, _batch_not_divisible, _vocab_over_tensor, _learned_table,
        _learned_eval_split, _cope_p_max, _negative_rate, _bad_dropout, _negative_count,
        _unknown_eval_split,
    )
}  # fmt: skip


def test_the_unbroken_config_validates() -> None:
    plan = validate(tiny_config(), device_count=DEVICES)
    assert plan.mesh_shape == (DEVICES, 1, 1)
    assert plan.eval_splits == ("test", "long")


@pytest.mark.parametrize("kind", sorted(_KINDS))
def test_each_breakage_alone(kind: str) -> None:
    _check(st.data(), [kind])


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.lists(mutations(), min_size=1, max_size=3))
def test_random_broken_configs_get_clear_errors(broken: list[Mutation]) -> None:
    config = tiny_config()
    for apply, _ in broken:
        apply(config)
    with pytest.raises(ValueError) as caught:
        validate(config, device_count=DEVICES)
    message = str(caught.value)
    patterns = [pattern for _, pattern in broken]
    assert any(re.search(p, message, re.S) for p in patterns), (message, patterns)
    raiser = Path(str(caught.traceback[-1].path))
    assert "copejax" in raiser.parts and "site-packages" not in raiser.parts, (
        f"raised from {raiser}, not by copejax's validation: {message}"
    )


def _check(data: st.SearchStrategy, kinds: list[str]) -> None:
    @settings(max_examples=3, deadline=None, derandomize=True)
    @given(data)
    def inner(drawer: st.DataObject) -> None:
        apply, pattern = _KINDS[kinds[0]](drawer.draw)
        config = tiny_config()
        apply(config)
        with pytest.raises(ValueError, match=pattern) as caught:
            validate(config, device_count=DEVICES)
        assert "copejax" in Path(str(caught.traceback[-1].path)).parts

    inner()
