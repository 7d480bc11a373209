"""The peer of the length-generalisation study: x-transformers (lucidrains, PyTorch) trained on
the same generated data, with the same sizes, steps, schedule and seeds as a copejax run.

    python -m experiments.length_generalization_peer --arm=rope \
        --config=reverse_string,smoke --out=/tmp/peer_rope.json

Nobody here wrote x-transformers; it runs in a side venv this module creates
(``workdirs/.venv-xtransformers``: ``torch==2.13.0``, ``x-transformers==2.31.10`` and their
dependencies, pinned in ``PINS``), so the core package never depends on it. The copejax side
(this process) writes the exact batches copejax's trainer feeds
(``copejax.training.input_pipeline.train_dataset``, the seed's shuffle) and the evaluation batches
to
an ``.npz``; the worker (``--worker``, run by the side venv's Python) trains on them in order
and scores greedy predictions with the task's own ``metrics`` and ``summarize`` (NumPy only,
imported from ``copejax/data``).

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
import importlib
import json
import math
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import venv
from pathlib import Path
from typing import Any

import numpy as np

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
ARMS = ("nope", "sinusoidal", "learned", "rope", "alibi", "cope", "fox")
PARAMETRISATIONS = ("x-transformers", "copejax")
EVAL_SPLITS = ("test", "long")


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
        command = [str(python), str(Path(__file__).resolve()), "--worker", str(spec_path),
                   str(data), str(out)]  # fmt: skip
        subprocess.run(command, check=True, cwd=ROOT)
        return json.loads(out.read_text())


# ----- the worker: runs in the side venv (torch, x-transformers, numpy; no jax) -----


def learning_rate(train: dict[str, Any], step: int) -> float:
    """copejax.training.optim.learning_rate_schedule's value at ``step`` (warmup, then decay)."""
    peak, warmup = float(train["learning_rate"]), int(train["warmup_steps"])
    end = peak * float(train["end_learning_rate_fraction"])
    if step < warmup:
        return peak * step / warmup
    decay = max(int(train["steps"]) - warmup, 1)
    t = min(step - warmup, decay) / decay
    if train["schedule"] == "cosine":
        return end + (peak - end) * 0.5 * (1.0 + math.cos(math.pi * t))
    if train["schedule"] == "linear":
        return peak + (end - peak) * t
    return peak


def build_model(spec: dict[str, Any]) -> Any:
    """x-transformers' causal decoder for ``spec``'s arm and sizes."""
    from x_transformers import Decoder, TransformerWrapper

    arm = spec["arm"]
    layers: dict[str, Any] = {
        "dim": spec["d_model"],
        "depth": spec["num_layers"],
        "heads": spec["num_heads"],
        "attn_dim_head": spec["head_dim"],
        "use_rmsnorm": True,
        "ff_glu": True,
        "ff_swish": True,
        "ff_mult": spec["mlp_dim"] / spec["d_model"],
        "attn_dropout": spec["dropout"],
        "ff_dropout": spec["dropout"],
        "rotary_pos_emb": arm == "rope",
        "alibi_pos_bias": arm == "alibi",
    }
    if arm == "cope":
        layers.update(attn_use_cope=True, attn_cope_max_pos=spec["cope_p_max"])
    if arm == "fox":
        layers.update(attn_data_dependent_alibi=True)
    as_copejax = spec["parametrisation"] == "copejax"
    if as_copejax:
        layers.update(ff_no_bias=True)
        if arm == "rope":
            layers.update(rotary_emb_dim=spec["copejax_position"]["rotary_dim"])
    model = TransformerWrapper(
        num_tokens=spec["vocab_size"],
        max_seq_len=spec["max_len"],
        attn_layers=Decoder(**layers),
        use_abs_pos_emb=arm in ("learned", "sinusoidal"),
        scaled_sinu_pos_emb=arm == "sinusoidal",
        tie_embedding=True,
        tie_embedding_scale=1.0 if as_copejax else None,
        emb_dropout=spec["dropout"],
    )
    if as_copejax:
        _parametrise_as_copejax(model, spec)
    return model


def _parametrise_as_copejax(model: Any, spec: dict[str, Any]) -> None:
    """Re-starts ``model`` (built with ``ff_no_bias`` and ``tie_embedding_scale=1``) as
    copejax's study config starts its network; see the module docstring."""
    import torch

    token_emb = model.token_emb
    token_emb.forward = _scaled_lookup(token_emb, math.sqrt(spec["d_model"]))
    position = spec["copejax_position"]
    gates = [
        module.to_forget_gates[0]
        for module in model.attn_layers.modules()
        if type(module).__name__ == "DataDependentAlibi"
    ]
    with torch.no_grad():
        torch.nn.init.normal_(token_emb.emb.weight, std=spec["init_std"])
        for module in model.attn_layers.modules():
            if isinstance(module, torch.nn.Linear) and not any(module is g for g in gates):
                std = 1.0 / math.sqrt(module.in_features)
                torch.nn.init.trunc_normal_(module.weight, std=std, a=-2 * std, b=2 * std)
                if module.bias is not None:  # the SwiGLU input's, which ff_no_bias keeps
                    module.register_parameter("bias", None)
        for gate in gates:  # copejax's forget_w and forget_b
            torch.nn.init.normal_(gate.weight, std=position["gate_std"])
            gate.bias.fill_(position["bias_init"])
        if spec["arm"] == "sinusoidal":
            model.pos_emb.scale.fill_(1.0)
            model.pos_emb.scale.requires_grad_(False)
        if spec["arm"] == "learned":
            torch.nn.init.normal_(model.pos_emb.emb.weight, std=position["init_std"])
            model.pos_emb.scale = 1.0


def _scaled_lookup(token_emb: Any, factor: float) -> Any:
    """``token_emb``'s lookup times ``factor`` (copejax's ``model.scale_embeddings``)."""
    lookup = token_emb.forward

    def forward(tokens: Any) -> Any:
        return lookup(tokens) * factor

    return forward


def _task(spec: dict[str, Any]) -> Any:
    """The copejax task object, importing only its own module (NumPy only)."""
    sys.path.insert(0, str(ROOT))
    base = importlib.import_module("copejax.data.base")
    importlib.import_module(f"copejax.data.{spec['task']}")
    return base._TASKS[spec["task"]](**spec["task_options"])


def train_steps(
    model: Any, spec: dict[str, Any], data: Any, steps: int
) -> tuple[list[float], list[float]]:
    """Trains ``model`` on the first ``steps`` of ``data``'s training batches, in order, with
    the AdamW, schedule and clipping of copejax's trainer (``spec["train"]``); returns each
    step's loss and seconds."""
    import torch

    train = spec["train"]
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=learning_rate(train, 0),
        betas=(train["b1"], train["b2"]),
        eps=train["eps"],
        weight_decay=train["weight_decay"],
    )
    step_seconds, losses = [], []
    model.train()
    for step in range(steps):
        start = time.perf_counter()
        inputs, targets, mask = (
            torch.from_numpy(data[f"train_{key}"][step].astype(np.int64))
            for key in ("inputs", "targets", "loss_mask")
        )
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(train, step)
        logits = model(inputs)
        token_loss = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2).float(), targets, reduction="none"
        )
        loss = (token_loss * mask).sum() / mask.sum().clamp(min=1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train["grad_clip"])
        optimizer.step()
        step_seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
    return losses, step_seconds


def worker(spec_path: str, data_path: str, out_path: str) -> None:
    import torch

    spec = json.loads(Path(spec_path).read_text())
    data = np.load(data_path)
    torch.manual_seed(spec["seed"])
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    model = build_model(spec)
    losses, step_seconds = train_steps(model, spec, data, spec["train"]["steps"])
    task, results = _task(spec), {}
    model.eval()
    with torch.no_grad():
        for split in EVAL_SPLITS:
            totals: dict[str, float] = {}
            arrays = {k: data[f"{split}_{k}"] for k in ("inputs", "targets", "loss_mask")}
            for index in range(len(arrays["inputs"])):
                batch = {k: v[index].astype(np.int32) for k, v in arrays.items()}
                logits = model(torch.from_numpy(batch["inputs"].astype(np.int64)))
                predictions = logits.argmax(-1).numpy().astype(np.int32)
                for key, value in task.metrics(batch, predictions).items():
                    totals[key] = totals.get(key, 0.0) + value
            for key, value in task.summarize(totals).items():
                results[f"{split}/{key}"] = value
    timed = step_seconds[min(5, len(step_seconds) - 1) :]
    results["step_ms"] = 1000.0 * statistics.median(timed)
    results["final_loss"] = losses[-1]
    results["threads"] = torch.get_num_threads()
    Path(out_path).write_text(json.dumps(results))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.length_generalization_peer")
    parser.add_argument("--worker", nargs=3, metavar=("SPEC", "DATA", "OUT"))
    parser.add_argument("--arm", choices=ARMS, default="rope")
    parser.add_argument("--config", default="reverse_string,smoke", help="config argument")
    parser.add_argument("--out", default="", help="JSON file for the results (else stdout)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--parametrisation", choices=PARAMETRISATIONS, default=PARAMETRISATIONS[0])
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return
    results = run(args.config, args.arm, args.threads, args.parametrisation)
    text = json.dumps(results, indent=1)
    Path(args.out).write_text(text) if args.out else print(text)


if __name__ == "__main__":
    main()
