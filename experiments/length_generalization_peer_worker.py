"""The worker of the length-generalisation peer: runs in the side venv that
``length_generalization_peer`` creates (torch, x-transformers, numpy; no jax), as a script:

    <side venv>/bin/python experiments/length_generalization_peer_worker.py SPEC DATA OUT

It builds x-transformers' decoder for the spec's arm and parametrisation, trains it on the
batches copejax's trainer feeds (``DATA``, written by ``length_generalization_peer.write_data``)
with copejax's AdamW, schedule and clipping, scores the evaluation splits with the task's own
metrics and writes the results as JSON to ``OUT``.
"""

from __future__ import annotations

import importlib
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
EVAL_SPLITS = ("test", "long")


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


if __name__ == "__main__":
    worker(*sys.argv[1:4])
