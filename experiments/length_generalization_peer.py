"""The peer of the length-generalisation study: x-transformers (lucidrains, PyTorch) trained on
the same generated data, with the same sizes, steps, schedule and seeds as a copejax run.

    python -m experiments.length_generalization_peer --arm=rope \
        --config=reverse_string,smoke --out=/tmp/peer_rope.json

Nobody here wrote x-transformers; it runs in a side venv this module creates
(``workdirs/.venv-xtransformers``: ``torch==2.13.0``, ``x-transformers==2.31.10`` and their
dependencies, pinned in ``PINS``), so the core package never depends on it. The copejax side
(this process) writes the exact batches copejax's trainer feeds
(``copejax.training.input_pipeline.train_dataset``, the seed's shuffle) and the evaluation batches
to an ``.npz``; the worker (``length_generalization_peer_worker.py``, run by the side venv's
Python) trains on them in order and scores greedy predictions with the task's own ``metrics``
and ``summarize`` (NumPy only, imported from ``copejax/data``).

Arms (``--arm``, copejax's scheme names) and the x-transformers switches they set:
``nope`` (no absolute embedding), ``sinusoidal`` (``scaled_sinu_pos_emb``: sinusoidal with one
learned scale), ``learned`` (its absolute embedding table), ``rope`` (``rotary_pos_emb``;
it rotates ``dim_head // 2`` features by default, copejax all),
``alibi`` (``alibi_pos_bias``), ``cope`` (``attn_use_cope``, ``cope_max_pos`` = copejax's
p_max), ``fox`` (``attn_data_dependent_alibi``, its forgetting-transformer gate, bias started
at 5 where copejax starts at 0). The block
is pre-norm RMSNorm with a SwiGLU MLP of copejax's width and tied embeddings, as copejax's
``llama`` block; everything else is x-transformers' default.

``parametrisation="copejax"`` (``--parametrisation``, every arm) starts and parametrises the
same x-transformers network as copejax's study config does, to tell a difference of
parametrisation from one of implementation: token embeddings N(0, init_std²) multiplied by
sqrt(D) on the way in and tied logits without x-transformers' D^-1/2 (its default:
Kaiming-normal embeddings, std sqrt(2 / D), logits times D^-1/2; the same function at init,
but Adam's steps are 8 times larger relative to copejax's 0.02-scale table); every linear
kernel of the blocks at haiku's truncated normal, std 1 / sqrt(fan_in) (``model.dense_init =
"fan_in"``; torch's default is uniform, std 1 / sqrt(3 fan_in)); no MLP biases
(x-transformers' SwiGLU has them). Each arm's own weights then start as copejax's scheme
starts them (``copejax_position`` in the spec, read from the config's scheme):
``sinusoidal`` at a fixed scale 1, as copejax adds it (x-transformers learns one scale,
initialised to D^-1/2); ``learned`` a table N(0, init_std²) added at scale 1 (x-transformers':
N(0, 1) times D^-1/2); ``rope`` rotating copejax's ``rotary_dim(head_dim, fraction)``
features (all of them at ``fraction = 1``); ``fox`` the forget gate's kernel N(0, 0.02²) and
its bias at ``forget_bias_init`` (x-transformers: torch's uniform kernel, bias 5). ``nope``,
``alibi`` (no weights of its own) and ``cope`` (its position table starts at zero in both)
need nothing beyond the shared changes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import threading
import venv
from pathlib import Path
from typing import Any

import numpy as np

from experiments import length_generalization_peer_worker as peer_worker
from experiments.length_generalization_peer_worker import EVAL_SPLITS

ROOT = Path(__file__).resolve().parents[1]
PEER_VENV = ROOT / "workdirs" / ".venv-xtransformers"
PINS = (
    "torch==2.13.0",
    "x-transformers==2.31.10",
    "einops==0.8.2",
    "einx==0.4.3",
    "loguru==0.7.3",
    "torch-einops-utils==0.2.0",
    "numpy==2.4.6",
)
CONFIG = ROOT / "configs" / "length_generalization.py"
# The side venv's Python runs this file on the batches written here (torch, x-transformers).
WORKER = Path(peer_worker.__file__).resolve()
ARMS = ("nope", "sinusoidal", "learned", "rope", "alibi", "cope", "fox")
PARAMETRISATIONS = ("x-transformers", "copejax")


_VENV_LOCK = threading.Lock()  # run_peer's threads: one creates and installs, the rest wait


def ensure_venv() -> Path:
    """The side venv's Python, created on first use and (re)installed whenever ``PINS``
    differ from the ones it was installed with (``pins.txt`` in the venv). A venv without
    ``pins.txt`` (new, or an install that did not finish) is created afresh; callers in
    several threads wait for the one that builds it."""
    python, marker = PEER_VENV / "bin" / "python", PEER_VENV / "pins.txt"
    with _VENV_LOCK:
        if not marker.exists():
            venv.EnvBuilder(with_pip=True, clear=True).create(PEER_VENV)
        if not marker.exists() or marker.read_text().split() != list(PINS):
            install = [str(python), "-m", "pip", "install", "--quiet", *PINS]
            subprocess.run(install, check=True)
            marker.write_text("\n".join(PINS) + "\n")
    return python


def copejax_position(arm: str, scheme: Any, head_dim: int) -> dict[str, Any]:
    """How copejax's ``scheme`` (the config's, for ``arm``) starts its own weights, for the
    peer in copejax's parametrisation; an error for a scheme option the peer cannot build
    (it has RoPE at base 10000 without scaling and FoX's basic gate only)."""
    if arm == "rope":
        from copejax.positions.rope import rotary_dim

        if scheme.base != 10000.0 or scheme.scaling != "none" or scheme.p != 1.0:
            raise ValueError(
                f"the peer's RoPE has base 10000, no scaling and p = 1; got base={scheme.base}, "
                f"scaling={scheme.scaling!r}, p={scheme.p}"
            )
        return {"rotary_dim": rotary_dim(head_dim, scheme.fraction)}
    if arm == "fox":
        from copejax.positions.fox import GATE_INIT_STD

        extras = ("output_gate", "output_norm", "qk_norm", "key_shift", "value_shift")
        on = [name for name in (*extras, "unit_forget_gate") if getattr(scheme, name)]
        if on:
            raise ValueError(f"the peer's FoX is the basic forget gate; the config turns on {on}")
        return {"gate_std": GATE_INIT_STD, "bias_init": float(scheme.forget_bias_init)}
    if arm == "learned":
        return {"init_std": float(scheme.init_std)}
    return {}


def spec_of(config_arg: str, arm: str, parametrisation: str = "x-transformers") -> dict[str, Any]:
    """Everything the worker needs from the copejax config of ``config_arg`` with ``arm``,
    for the peer started as ``parametrisation`` says (see the module docstring)."""
    from copejax.config.base import load_config
    from copejax.training.train import validate

    if arm not in ARMS:
        raise ValueError(f"unknown peer arm {arm!r}; allowed: {ARMS}")
    if parametrisation not in PARAMETRISATIONS:
        raise ValueError(
            f"unknown peer parametrisation {parametrisation!r}; allowed: {PARAMETRISATIONS}"
        )
    config = load_config(CONFIG, f"{config_arg},position={arm}")
    model = validate(config, device_count=1).model_config
    train = config.train
    return {
        "task": config.task.name,
        "task_options": config.task.options.to_dict(),
        "arm": arm,
        "parametrisation": parametrisation,
        "seed": int(config.seed),
        "vocab_size": model.vocab_size,
        "max_len": model.max_len,
        "d_model": model.d_model,
        "num_layers": model.num_layers,
        "num_heads": model.num_heads,
        "head_dim": model.resolved_head_dim,
        "mlp_dim": model.resolved_mlp_dim,
        "dropout": model.dropout,
        "init_std": model.init_std,
        "cope_p_max": int(model.scheme.p_max) if arm == "cope" else 0,
        "copejax_position": copejax_position(arm, model.scheme, model.resolved_head_dim),
        "train": {k: train[k] for k in ("steps", "batch_size", "learning_rate", "warmup_steps",
                                        "schedule", "end_learning_rate_fraction",
                                        "weight_decay", "b1", "b2", "eps", "grad_clip")},
        "eval": {"batch_size": config.eval.batch_size, "max_examples": config.eval.max_examples},
    }  # fmt: skip


def write_data(spec: dict[str, Any], path: Path) -> None:
    """The training batches copejax feeds, in order, and the evaluation batches, as uint8/int16
    arrays: ``train_<key>`` (steps, B, T) and ``<split>_<key>`` (batches, B, T_split)."""
    from copejax.data.base import make_task
    from copejax.training import input_pipeline

    task = make_task(spec["task"], spec["task_options"])
    train = spec["train"]
    stream = input_pipeline.train_dataset(task, spec["seed"], train["batch_size"])
    batches = [stream[i] for i in range(train["steps"])]
    arrays = {}
    for key in ("inputs", "targets", "loss_mask"):
        arrays[f"train_{key}"] = np.stack([b[key] for b in batches]).astype(np.int16)
    for split in EVAL_SPLITS:
        found = list(
            input_pipeline.eval_batches(
                task,
                split,
                spec["seed"],
                spec["eval"]["batch_size"],
                max_examples=spec["eval"]["max_examples"],
            )
        )
        for key in ("inputs", "targets", "loss_mask"):
            arrays[f"{split}_{key}"] = np.stack([b[key] for b, _ in found]).astype(np.int16)
    np.savez_compressed(path, **arrays)


def run(
    config_arg: str, arm: str, threads: int = 0, parametrisation: str = "x-transformers"
) -> dict[str, Any]:
    """Trains and evaluates the peer for one copejax config and arm; returns its results.

    ``threads``: torch's intra-op threads (0: torch's default, all cores, as XLA's CPU client
    uses). On a loaded machine the default spin-waits: a 2-layer D = 32 step measured 73 to
    1,150 ms with 2 threads and 5 to 38 ms with 1 at a load average of 13 on 2 cores."""
    python = ensure_venv()
    spec = {**spec_of(config_arg, arm, parametrisation), "threads": threads}
    with tempfile.TemporaryDirectory() as tmp:
        data, spec_path, out = Path(tmp, "data.npz"), Path(tmp, "spec.json"), Path(tmp, "out.json")
        write_data(spec, data)
        spec_path.write_text(json.dumps(spec))
        command = [str(python), str(WORKER), str(spec_path), str(data), str(out)]
        subprocess.run(command, check=True, cwd=ROOT)
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.length_generalization_peer")
    parser.add_argument("--arm", choices=ARMS, default="rope")
    parser.add_argument("--config", default="reverse_string,smoke", help="config argument")
    parser.add_argument("--out", default="", help="JSON file for the results (else stdout)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--parametrisation", choices=PARAMETRISATIONS, default=PARAMETRISATIONS[0])
    args = parser.parse_args(argv)
    results = run(args.config, args.arm, args.threads, args.parametrisation)
    text = json.dumps(results, indent=1)
    Path(args.out).write_text(text) if args.out else print(text)


if __name__ == "__main__":
    main()
