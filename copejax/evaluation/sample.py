"""Text from a trained LM checkpoint, so a person can read what a model writes.

    python -m copejax.evaluation.sample --workdir=workdirs/lm_cope --prompt="ROMEO." \
        [--max_new_tokens=300] [--temperature=0.8] [--seed=0] [--context=0]

Greedy at ``--temperature=0``, else sampling from softmax(logits / temperature), through
``copejax.model.decode.generate``: the KV cache while the prompt and the new tokens fit in
``--context`` tokens (default: the training length T), past that a sliding window of the last
``--context`` tokens re-run for every new token.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from copejax.config import command_line
from copejax.data import _tokenizers as tok
from copejax.model import decode
from copejax.model.config import ModelConfig


def continue_text(
    model_config: ModelConfig,
    params: Any,
    prompt_ids: np.ndarray,
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    context: int,
) -> np.ndarray:
    """``decode.generate`` of one prompt (starting with ``<bos>``), cut after ``<eos>``.

    Returns the new token ids, int32 [<= max_new_tokens].
    """
    if max_new_tokens < 1:
        return np.zeros((0,), np.int32)
    new = np.asarray(
        decode.generate(
            model_config,
            params,
            jnp.asarray(prompt_ids, jnp.int32)[None],
            max_new_tokens,
            temperature=temperature,
            key=jax.random.key(seed),
            context=context,
        )[0]
    )
    eos = np.flatnonzero(new == tok.EOS_ID)
    return (new[: eos[0] + 1] if eos.size else new).astype(np.int32)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from copejax.training.trained_run import load_run

    run = load_run(flags.FLAGS.workdir, flags.FLAGS.step)
    if not hasattr(run.task, "text_tokenizer"):
        raise ValueError(
            f"{flags.FLAGS.workdir} trained task {run.task.name!r}, which has no text to sample; "
            "copejax.evaluation.sample needs an 'lm' run (configs/lm.py)"
        )
    tokenizer = run.task.text_tokenizer()
    prompt_ids = np.concatenate([[tok.BOS_ID], tokenizer.encode(flags.FLAGS.prompt)]).astype(
        np.int32
    )
    new = continue_text(
        run.model_config,
        run.params,
        prompt_ids,
        max_new_tokens=flags.FLAGS.max_new_tokens,
        temperature=flags.FLAGS.temperature,
        seed=flags.FLAGS.seed,
        context=flags.FLAGS.context or run.task.seq_len,
    )
    print(flags.FLAGS.prompt + tokenizer.decode(new), flush=True)


def define_flags() -> None:
    """The command line's flags (defined only when run as a program, so that importing this
    module next to other tools defines no clashing flags)."""
    flags.DEFINE_string("workdir", None, "Workdir of an lm training run.")
    flags.DEFINE_string("prompt", "", "Text to continue.")
    flags.DEFINE_integer("max_new_tokens", 300, "Tokens to generate.")
    flags.DEFINE_float("temperature", 0.8, "0 = greedy.")
    flags.DEFINE_integer("seed", 0, "Sampling seed.")
    flags.DEFINE_integer("context", 0, "Context length (0 = the training length).")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")
    flags.mark_flags_as_required(["workdir"])


if __name__ == "__main__":
    define_flags()
    app.run(command_line.one_line_errors(main))
