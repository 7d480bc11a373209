"""Llama-family checkpoints in the Hugging Face format, in and out of copejax.

    python -m copejax.interop.convert --from_hf=<hf_dir> --out=<dir>
    python -m copejax.interop.convert --to_hf=<dir or workdir> --out=<hf_dir>

``--from_hf`` reads ``config.json`` and every ``*.safetensors`` of a Llama checkpoint (with the
``safetensors`` package; no torch) and writes a converted checkpoint
(``copejax.training.pretrained``:
``model.json``, the copejax model block that reproduces the model, and ``params/``, an orbax
checkpoint). What copejax cannot reproduce (an unknown ``rope_type``, biases, another
activation, ...) is refused by name (``copejax.interop.hf_config``,
``copejax.interop.hf_weights``). Fine-tune
from it with ``configs/lm.py:init_from=<dir>`` (README, "Pretrained weights").

``--to_hf`` writes ``config.json`` and ``model.safetensors`` (float32) from a converted
checkpoint or a copejax run of ``block="llama"`` whose scheme HF's Llama computes (``rope``
with any HF ``rope_type``: none, linear, ntk as a change of base, dynamic, yarn with
``yarn_ramp="index"``, llama3, longrope); other schemes are refused with the reason.
Checkpoints stored in bfloat16 are read as float32 (exact).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from absl import app, flags
from flax import traverse_util

from copejax.config import command_line
from copejax.interop import hf_config, hf_weights
from copejax.model import checks
from copejax.model.config import ModelConfig
from copejax.training import pretrained

_FROM_HF = flags.DEFINE_string("from_hf", None, "A Hugging Face Llama checkpoint directory.")
_TO_HF = flags.DEFINE_string("to_hf", None, "A converted checkpoint or copejax workdir.")
_OUT = flags.DEFINE_string("out", None, "Directory to write.")


def _model_config(model: dict[str, Any], vocab_size: int) -> ModelConfig:
    return checks.validate(
        ModelConfig.from_config(model, vocab_size=vocab_size, default_max_len=int(model["max_len"]))
    )


def read_hf(hf_dir: str | os.PathLike) -> tuple[dict[str, Any], int, Any]:
    """(copejax model block, V, nested parameters) of a HF Llama checkpoint directory.

    Raises:
      ValueError: no config.json or safetensors file, or anything copejax cannot reproduce.
    """
    from safetensors import safe_open

    root = Path(hf_dir)
    if not (root / "config.json").exists():
        raise ValueError(f"{root} has no config.json: not a Hugging Face checkpoint directory")
    hf = json.loads((root / "config.json").read_text(encoding="utf-8"))
    model, vocab_size = hf_config.model_block_from_hf(hf)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{root} has no *.safetensors file (pytorch .bin files are not read)")
    tensors: dict[str, np.ndarray] = {}
    for path in files:
        # framework="flax" reads bfloat16 too (numpy has no bfloat16)
        with safe_open(str(path), framework="flax") as handle:
            for name in handle.keys():
                tensors[name] = np.asarray(handle.get_tensor(name), np.float32)
    cfg = _model_config(model, vocab_size)
    flat = hf_weights.params_from_hf(tensors, cfg)
    return model, vocab_size, traverse_util.unflatten_dict(flat)


def from_hf(hf_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Converts a HF Llama checkpoint into a copejax converted checkpoint at ``out_dir``."""
    model, vocab_size, params = read_hf(hf_dir)
    return pretrained.save(out_dir, model, vocab_size, params, f"{Path(hf_dir).absolute()} (HF)")


def to_hf(path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Writes ``config.json`` and ``model.safetensors`` for a converted checkpoint or workdir.

    Raises:
      ValueError: a model HF's Llama cannot express (named), or ``out_dir`` already holds a
        checkpoint.
    """
    from safetensors.numpy import save_file

    source = pretrained.load(path)
    hf = hf_config.hf_from_model_block(source.model, source.vocab_size)
    cfg = _model_config(source.model, source.vocab_size)
    tensors = hf_weights.params_to_hf(source.flat_params(), cfg)
    root = Path(out_dir)
    if (root / "config.json").exists():
        raise ValueError(f"{root} already holds a config.json; choose another --out")
    root.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: np.asarray(v, np.float32) for k, v in tensors.items()},
        str(root / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (root / "config.json").write_text(json.dumps(hf, indent=2) + "\n", encoding="utf-8")
    return root


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        command_line.fail(f"unexpected arguments: {argv[1:]} (flags are --name=value)")
    command_line.quiet_logging()
    if (_FROM_HF.value is None) == (_TO_HF.value is None) or _OUT.value is None:
        command_line.fail("give --out and one of --from_hf=<hf_dir> or --to_hf=<dir>")
    try:
        if _FROM_HF.value is not None:
            out = from_hf(_FROM_HF.value, _OUT.value)
            print(f"wrote {out / pretrained.MODEL_FILE} and {out / pretrained.PARAMS_DIR}")
        else:
            out = to_hf(_TO_HF.value, _OUT.value)
            print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'}")
    except ValueError as error:
        command_line.fail(str(error))


if __name__ == "__main__":
    app.run(main)
