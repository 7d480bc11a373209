"""The experiment config schema shared by every configs/<family>.py, and its argument parser.

Configs are plain Python ``get_config(arg)`` functions (big_vision's pattern): the argument
string after the colon in ``--config=configs/flipflop.py:smoke,position=cope`` picks a variant.
Sizes that default from the task use 0 (``model.head_dim``, ``model.mlp_dim``,
``model.max_len``) so that every key has a concrete type for ``--config.a.b=value`` overrides.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
from pathlib import Path

import ml_collections

from copejax.runtime.sharding import DEFAULT_RULES

SCHEDULES = ("cosine", "linear", "constant")
NONFINITE = ("stop", "skip")

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")


def base_config() -> ml_collections.ConfigDict:
    """Every key of the schema at its default (a small CPU-sized run)."""
    c = ml_collections.ConfigDict()
    c.seed = 0

    c.task = ml_collections.ConfigDict()
    c.task.name = "flipflop"
    c.task.options = ml_collections.ConfigDict()

    # copejax.model.config.ModelConfig fields except vocab_size (from the task's vocabulary).
    c.model = ml_collections.ConfigDict()
    c.model.d_model = 128
    c.model.num_heads = 4
    c.model.num_layers = 2
    c.model.head_dim = ml_collections.config_dict.placeholder(int)  # None: d_model // num_heads
    c.model.mlp_dim = ml_collections.config_dict.placeholder(int)  # None: the block's default
    c.model.block = "llama"
    c.model.tie_embeddings = True
    c.model.norm_eps = 1e-6  # RMSNorm / LayerNorm epsilon (HF Llama: rms_norm_eps)
    c.model.dropout = 0.0
    c.model.dtype = "float32"
    c.model.position = "rope"
    c.model.position_options = ml_collections.ConfigDict()
    c.model.max_len = ml_collections.config_dict.placeholder(int)  # None: the task's length
    c.model.init_std = 0.02
    c.model.dense_init = "normal"  # or "fan_in": haiku's Linear default (copejax.model.dense_init)
    c.model.scale_embeddings = False  # token embeddings times sqrt(width) (Vaswani et al.)
    # auto | naive | blockwise | dot_product_attention (copejax.model.config.ModelConfig).
    c.model.attention_impl = "auto"
    c.model.attention_block = ml_collections.config_dict.placeholder(int)  # None: default
    c.model.attention_backward = "auto"  # auto | flash | remat
    c.model.scan_impl = "auto"  # auto | associative_scan | cumsum
    c.model.window = ml_collections.config_dict.placeholder(int)  # sliding window W; None: full
    c.model.window_sink_tokens = 0  # StreamingLLM sinks kept beside the window
    c.model.window_decode_cache = "ring"  # ring | full (copejax.model.ring_decode)
    # per-layer kinds "scheme[:key=value,...]" (copejax/model/layouts.py)
    c.model.layer_pattern = ()
    c.model.layout = ml_collections.config_dict.placeholder(str)  # copejax.model.layouts.PRESETS
    # Attention layout (copejax.model.config.ModelConfig): grouped KV heads, GPT-OSS sink,
    # length scaling of the logits.
    c.model.num_kv_heads = ml_collections.config_dict.placeholder(int)  # None: num_heads; 1: MQA
    c.model.attention_sink = False
    c.model.logit_scaling = "none"  # none | ssmax | llama4
    c.model.ssmax_scale = 0.43
    c.model.ssmax_learned = True
    c.model.llama4_floor_scale = 8192.0
    c.model.llama4_attn_scale = 0.1

    c.train = ml_collections.ConfigDict()
    c.train.steps = 1000
    c.train.batch_size = 32
    c.train.learning_rate = 1e-3
    c.train.warmup_steps = 100
    c.train.schedule = "cosine"
    c.train.end_learning_rate_fraction = 0.1
    c.train.weight_decay = 0.1
    c.train.b1 = 0.9
    c.train.b2 = 0.98
    c.train.eps = 1e-9
    c.train.grad_clip = 1.0
    c.train.log_every = 50
    c.train.eval_every = 500
    c.train.checkpoint_every = 500
    c.train.keep_checkpoints = 3
    c.train.nonfinite = "stop"
    # Start from these weights (copejax.training.finetune): a converted checkpoint (python -m
    # copejax.interop.convert) or a copejax workdir; "" trains from scratch.
    c.train.init_from = ""

    c.eval = ml_collections.ConfigDict()
    c.eval.splits = ()  # empty: every split except "train"
    c.eval.batch_size = 64
    c.eval.max_examples = 512  # per split; 0 = all

    c.data = ml_collections.ConfigDict()
    c.data.worker_count = 0
    c.data.shuffle = True

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # -1: the devices left over by the other axes
    c.mesh.fsdp = 1
    c.mesh.tensor = 1

    c.axis_rules = DEFAULT_RULES
    return c


def _parse_value(text: str) -> bool | int | float | str:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return value if isinstance(value, int | float) else text


def parse_arg(arg: str | None) -> dict[str, bool | int | float | str]:
    """Parses a big_vision-style config argument.

    ``"cpu,position=cope,seed=1"`` -> ``{"cpu": True, "position": "cope", "seed": 1}``. A bare
    word is a flag set to True; values are parsed as bool, int, float or else kept as strings.

    Raises:
      ValueError: for an empty item, a key that is not an identifier, or a repeated key.
    """
    if arg is None or not arg.strip():
        return {}
    result: dict[str, bool | int | float | str] = {}
    for raw_item in arg.split(","):
        item = raw_item.strip()
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not item or not _KEY.match(key) or (sep and not raw.strip()):
            raise ValueError(
                f"malformed config argument {item!r} in {arg!r}: expected comma-separated "
                "'word' or 'key=value' items, e.g. 'smoke,position=cope,seed=1'"
            )
        if key in result:
            raise ValueError(f"config argument {key!r} given twice in {arg!r}")
        result[key] = _parse_value(raw.strip()) if sep else True
    return result


# Shortcuts every experiment config accepts (``configs/<family>.py:position=cope,seed=1``);
# each config adds its task's own.
COMMON_SHORTCUTS: dict[str, str] = {
    "position": "model.position",
    "seed": "seed",
    "steps": "train.steps",
    "batch_size": "train.batch_size",
    "lr": "train.learning_rate",
    "layers": "model.num_layers",
    "heads": "model.num_heads",
    "d_model": "model.d_model",
    # attention layouts (README, "Sliding windows, ..." and "Attention layout")
    "window": "model.window",
    "layout": "model.layout",
    "kv_heads": "model.num_kv_heads",
    "attention_sink": "model.attention_sink",
    "logit_scaling": "model.logit_scaling",
}
VARIANTS = ("smoke", "cpu", "paper")


def pop_variant(args: dict[str, bool | int | float | str], default: str = "cpu") -> str:
    """Removes the size switch (``smoke``, ``cpu`` or ``paper``) from ``args`` and returns it.

    At most one may be given; none means ``default``.
    """
    chosen = [v for v in VARIANTS if args.pop(v, False)]
    if len(chosen) > 1:
        raise ValueError(f"choose at most one of {VARIANTS}, got {chosen}")
    return chosen[0] if chosen else default


def load_config(path: str | os.PathLike, arg: str) -> ml_collections.ConfigDict:
    """``get_config(arg)`` of a config file, as ``--config=path:arg`` would load it."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def smoke(config: ml_collections.ConfigDict) -> None:
    """The one smoke switch every config shares (big_vision's ``runlocal``): a tiny model, 20
    steps with an eval and a checkpoint at 10, small eval sets. Each config applies it for its
    ``smoke`` variant and sets its task's own small sizes beside it."""
    config.model.update(d_model=32, num_heads=2, num_layers=2)
    config.train.update(
        steps=20, batch_size=8, learning_rate=3e-3, warmup_steps=2, log_every=5,
        eval_every=10, checkpoint_every=10,
    )  # fmt: skip
    config.eval.update(batch_size=16, max_examples=32)


def apply_shortcuts(
    config: ml_collections.ConfigDict,
    args: dict[str, bool | int | float | str],
    shortcuts: dict[str, str],
) -> None:
    """Sets ``config`` keys from ``key=value`` arguments through a shortcut table.

    ``shortcuts`` maps an argument name to a dotted config path (``{"position":
    "model.position", "seed": "seed"}``). Any other name that is an option of the chosen
    position scheme goes to ``model.position_options`` (``cope,p_max=8``); anything else raises
    a ValueError listing the shortcuts, the size variants and the scheme's options. Boolean
    switches such as ``smoke`` are the caller's to consume before calling this.
    """
    from copejax.config import scheme_options  # imports the scheme registry, so only when needed
    from copejax.config.command_line import did_you_mean

    options = {}
    for key, value in args.items():
        if key not in shortcuts:
            options[key] = value
            continue
        *parents, leaf = shortcuts[key].split(".")
        node = config
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    for key, value in options.items():  # after the shortcuts: position=... may come later
        try:
            scheme_options.set_option(config, key, value)
        except ValueError as error:
            known = sorted(shortcuts)
            hint = did_you_mean(key, [*known, *VARIANTS])
            raise ValueError(
                f"unknown config argument {key!r}{hint or '.'} Known: the variants "
                f"{', '.join(VARIANTS)}; the shortcuts {', '.join(known)}; and the options of "
                f"the position scheme ({error})"
            ) from None
