"""copejax's weights in the peer: does x-transformers, in copejax's parametrisation, compute
the same function as copejax's model for each study arm?

    python -m experiments.length_generalization_peer_weights --config=reverse_string,cpu

initialises copejax's model for the config and each arm (``length_generalization_peer.ARMS``),
copies every parameter into the x-transformers network that the parametrisation probe trains
(``length_generalization_peer_worker.build_model`` with ``parametrisation="copejax"``), runs both on
one batch of random tokens, then trains both from those weights for ``STEPS`` steps on the
study's first batches (copejax with its trainer's own jitted step, ``make_steps``: optax's
AdamW, clipping and schedule; the peer with the worker's torch loop), and prints the largest
logit difference and both loss curves' largest gap per arm. Equal logits and equal losses
mean that the two implementations build and train the same function; a gap that remains
between their trained accuracies is then the random initialisation (torch's generator against
JAX's) and the seed spread, not the code.

The map, copejax name -> x-transformers name (layer i; ``Decoder``'s layers alternate
attention ``2i`` and feed-forward ``2i + 1``):

- ``token_embed/embedding`` -> ``token_emb.emb.weight``;
- ``block_i/attention_norm/scale`` -> ``layers.2i.0.0.g`` less 1 (x-transformers' RMSNorm
  multiplies by g + 1, ``unit_offset``), ``mlp_norm`` and ``final_norm`` alike;
- ``query``/``key``/``value`` kernels (D, N, H) -> ``to_q``/``to_k``/``to_v`` weights
  (N H, D); ``out`` (N, H, D) -> ``to_out`` (D, N H);
- ``mlp/wi_up`` and ``wi_gate`` -> the two halves of ``ff.0.proj`` (up first, as its ``GLU``
  splits them); ``mlp/wo`` -> ``ff.2``;
- ``learned/table`` -> ``pos_emb.emb.weight`` (``learned``); ``attention/cope/pos_emb`` ->
  ``attend.cope.pos_emb`` (``cope``); ``attention/fox/forget_w`` and ``forget_b`` ->
  ``data_dependent_alibi.to_forget_gates.0`` (``fox``).

Two layouts differ and are matched by a permutation that leaves the function unchanged:
copejax's RoPE rotates feature pairs (f, f + H/2) (``layout = "half"``) and x-transformers'
pairs (2f, 2f + 1), so the query and key features are permuted (every score q . k is kept);
copejax's sinusoid puts sin and cos at features 2i and 2i + 1 and x-transformers' all sines
first, so every parameter's residual-stream axis is permuted (``RESIDUAL_AXIS``). Adam acts
per weight and the clipping on the global norm, so a permuted network also trains the same.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

try:
    from experiments import length_generalization_peer as peer
    from experiments import length_generalization_peer_worker as peer_worker
except ImportError:  # the side venv's Python runs this file beside the peer's worker; there only
    # the worker half below runs, which needs nothing of the copejax side (``peer``)
    import length_generalization_peer_worker as peer_worker  # type: ignore[no-redef]

BATCH, LENGTH = 2, 48  # the random-token batch both models read
NOISE = 0.1  # std of the noise added to every initial weight
STEPS = 20  # training steps compared
# The residual-stream axis of each copejax parameter, by the end of its name.
RESIDUAL_AXIS = {"embedding": 1, "scale": 0, "query/kernel": 0, "key/kernel": 0,
                 "value/kernel": 0, "out/kernel": 2, "wi_gate/kernel": 0, "wi_up/kernel": 0,
                 "wo/kernel": 1, "forget_w": 0, "table": 1}  # fmt: skip


def copejax_logits(
    config_arg: str, arm: str, tokens_BT: np.ndarray
) -> tuple[dict[str, np.ndarray], np.ndarray, Callable[[int], list[float]]]:
    """copejax's model of ``config_arg`` with ``position=arm``, initialised from the config's
    seed plus N(0, NOISE²) on every weight (so that the weights that start at zero, CoPE's
    table and FoX's gate bias, take part): its parameters ('/'-joined names, float32), its
    float32 logits (B, T, V) on ``tokens_BT`` at positions 0 to T - 1, and a function that
    trains those parameters for ``steps`` steps and returns each step's loss. It trains with
    the study's own jitted step (``train_step.make_steps``) on the study's own batches
    (``input_pipeline.train_dataset``), i.e. with the trainer's code, not a copy of it."""
    import jax
    import jax.numpy as jnp
    from flax import linen as nn

    from copejax.config.base import load_config
    from copejax.model.transformer import Transformer
    from copejax.runtime import sharding
    from copejax.training import input_pipeline
    from copejax.training.train import validate
    from copejax.training.train_step import TrainState, make_steps

    config = load_config(peer.CONFIG, f"{config_arg},position={arm}")
    plan = validate(config, device_count=1)
    model = Transformer(plan.model_config)
    tokens = jnp.asarray(tokens_BT, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    boxed = model.init(jax.random.key(int(config.seed)), tokens, positions)["params"]
    leaves, tree = jax.tree.flatten(nn.unbox(boxed))
    keys = jax.random.split(jax.random.key(int(config.seed) + 1), len(leaves))
    noisy = [
        w + NOISE * jax.random.normal(k, w.shape, w.dtype)
        for w, k in zip(leaves, keys, strict=True)
    ]
    params = jax.tree.unflatten(tree, noisy)
    logits = model.apply({"params": params}, tokens, positions)
    flat = {
        "/".join(k.key for k in path): np.asarray(leaf, np.float32)
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }

    def train(steps: int) -> list[float]:
        mesh = sharding.make_mesh(*plan.mesh_shape)
        rules = sharding.rules_tuple(config.axis_rules)
        stream = input_pipeline.train_dataset(plan.task, config.seed, config.train.batch_size)
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            run = make_steps(model, config.train, config.seed, tokens.shape, mesh=mesh, rules=rules)
            # Two zeros, not one shared: the step donates every buffer of the state.
            state = TrainState(step=jnp.zeros((), jnp.int32), params=params,
                               opt_state=run.tx.init(params),
                               nonfinite_count=jnp.zeros((), jnp.int32))  # fmt: skip
            state = jax.device_put(state, run.state_shardings)
            losses = []
            for i in range(steps):
                batch = jax.device_put(dict(stream[i]), run.batch_sharding)
                state, metrics = run.train(state, batch)
                losses.append(float(metrics["loss"]))
        return losses

    return flat, np.asarray(logits, np.float32), train


def compare(config_arg: str, arm: str, steps: int = STEPS) -> dict[str, Any]:
    """copejax and x-transformers (copejax's parametrisation) from the same weights: the
    largest logit difference on a batch of random tokens (with the largest logit, for scale),
    and each one's loss over the first ``steps`` training steps (at most the config's) on the
    study's batches."""
    spec = peer.spec_of(config_arg, arm, "copejax")
    steps = min(steps, spec["train"]["steps"])
    shape = (BATCH, min(LENGTH, spec["max_len"]))  # a learned table's rows bound T
    tokens = np.random.default_rng(0).integers(0, spec["vocab_size"], shape)
    params, ours, train = copejax_logits(config_arg, arm, tokens)
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, batches = Path(tmp, "spec.json"), Path(tmp, "batches.npz")
        weights, out = Path(tmp, "weights.npz"), Path(tmp, "out.npz")
        # The worker keeps the full spec (its schedule spans the config's steps) and reads
        # only the first ``steps`` batches, so only those are written.
        spec_path.write_text(json.dumps({**spec, "check_steps": steps}))
        peer.write_data({**spec, "train": {**spec["train"], "steps": steps}}, batches)
        np.savez(weights, tokens=tokens, **{f"param:{k}": v for k, v in params.items()})
        command = [str(peer.ensure_venv()), str(Path(__file__).resolve()), "--worker",
                   str(spec_path), str(batches), str(weights), str(out)]  # fmt: skip
        subprocess.run(command, check=True, cwd=peer.ROOT)
        theirs = np.load(out)
        our_losses = train(steps)
    return {
        "max_abs_difference": float(np.abs(ours - theirs["logits"]).max()),
        "max_abs_logit": float(np.abs(ours).max()),
        "losses": our_losses,
        "peer_losses": theirs["losses"].tolist(),
        "max_loss_difference": float(np.abs(np.asarray(our_losses) - theirs["losses"]).max()),
    }


# ----- the worker: runs in the side venv (torch, x-transformers, numpy; no jax) -----


def _interleave_rotary(kernel_DNH: np.ndarray, rotated: int) -> np.ndarray:
    """Query or key features reordered from rotating pairs (f, f + R/2) to pairs (2f, 2f + 1)
    over the first ``rotated`` = R features of each head; the rest keep their place."""
    half = rotated // 2
    order = np.arange(kernel_DNH.shape[-1])
    order[:rotated] = np.stack([np.arange(half), np.arange(half) + half], axis=-1).reshape(-1)
    return kernel_DNH[..., order]


def _sinusoid_halves(params: Mapping[str, np.ndarray], d_model: int) -> dict[str, np.ndarray]:
    """copejax's parameters with the residual stream's features reordered from sin/cos pairs
    (sin at 2i, cos at 2i + 1) to x-transformers' halves (all sines, then all cosines)."""
    order = np.concatenate([np.arange(0, d_model, 2), np.arange(1, d_model, 2)])
    out = {}
    for name, value in params.items():
        axis = [a for end, a in RESIDUAL_AXIS.items() if name.endswith(end)]
        if len(axis) != 1 or value.shape[axis[0]] != d_model:
            raise ValueError(f"{name}: no residual axis of width {d_model} known for it")
        out[name] = np.take(value, order, axis=axis[0])
    return out


def load_copejax_params(model: Any, params: Mapping[str, np.ndarray], spec: dict[str, Any]) -> None:
    """Copies copejax's ``params`` into ``model`` (``build_model(spec)`` with
    ``parametrisation="copejax"``) by the module docstring's map; a parameter of either side
    left without its counterpart is an error that names it."""
    import torch

    if spec["parametrisation"] != "copejax":
        raise ValueError("copejax's weights load only into the peer in copejax's parametrisation")
    read: set[str] = set()

    def take(name: str) -> np.ndarray:
        read.add(name)
        return params[name]

    if spec["arm"] == "sinusoidal":
        params = _sinusoid_halves(params, spec["d_model"])
    rotated = spec["copejax_position"].get("rotary_dim", 0) if spec["arm"] == "rope" else 0
    mapped = {
        "token_emb.emb.weight": take("token_embed/embedding"),
        "attn_layers.final_norm.g": take("final_norm/scale"),
    }
    if "learned/table" in params:
        mapped["pos_emb.emb.weight"] = take("learned/table")
    for i in range(spec["num_layers"]):
        ours, attn, ff = (
            f"block_{i}/",
            f"attn_layers.layers.{2 * i}.",
            f"attn_layers.layers.{2 * i + 1}.",
        )
        mapped[attn + "0.0.g"] = take(ours + "attention_norm/scale")
        for name, theirs in (("query", "to_q"), ("key", "to_k"), ("value", "to_v")):
            kernel = take(f"{ours}attention/{name}/kernel")
            if rotated and name != "value":
                kernel = _interleave_rotary(kernel, rotated)
            mapped[f"{attn}1.{theirs}.weight"] = kernel.reshape(kernel.shape[0], -1).T
        out = take(ours + "attention/out/kernel")
        mapped[attn + "1.to_out.weight"] = out.reshape(-1, out.shape[-1]).T
        cope, fox = ours + "attention/cope/", ours + "attention/fox/"
        if cope + "pos_emb" in params:
            mapped[attn + "1.attend.cope.pos_emb"] = take(cope + "pos_emb")
        if fox + "forget_w" in params:
            gate = attn + "1.data_dependent_alibi.to_forget_gates.0."
            mapped[gate + "weight"] = take(fox + "forget_w").T
            mapped[gate + "bias"] = take(fox + "forget_b")
        mapped[ff + "0.0.g"] = take(ours + "mlp_norm/scale")
        up_gate = [take(f"{ours}mlp/wi_{half}/kernel").T for half in ("up", "gate")]
        mapped[ff + "1.ff.0.proj.weight"] = np.concatenate(up_gate, axis=0)
        mapped[ff + "1.ff.2.weight"] = take(ours + "mlp/wo/kernel").T
    # Trainable only: the sinusoid's scale is held at copejax's 1 by the parametrisation.
    target = {n: w for n, w in model.named_parameters() if w.requires_grad}
    missing, unknown = sorted(set(target) - set(mapped)), sorted(set(mapped) - set(target))
    unread = sorted(set(params) - read)
    if missing or unknown or unread:
        raise ValueError(
            f"weight map incomplete: peer parameters without a copejax value {missing}, "
            f"mapped names the peer lacks {unknown}, copejax parameters not read {unread}"
        )
    for name, value in mapped.items():  # x-transformers' RMSNorm multiplies by g + 1
        if name.endswith(".g"):
            mapped[name] = value - float(model.get_submodule(name[:-2]).unit_offset)
    with torch.no_grad():
        for name, value in mapped.items():
            if tuple(target[name].shape) != value.shape:
                raise ValueError(
                    f"{name}: peer shape {tuple(target[name].shape)}, copejax's {value.shape}"
                )
            target[name].copy_(torch.from_numpy(np.ascontiguousarray(value)))


def worker(spec_path: str, batches_path: str, weights_path: str, out_path: str) -> None:
    import torch

    spec = json.loads(Path(spec_path).read_text())
    weights = np.load(weights_path)
    params = {k.removeprefix("param:"): weights[k] for k in weights.files if k != "tokens"}
    model = peer_worker.build_model(spec)
    load_copejax_params(model, params, spec)
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(weights["tokens"].astype(np.int64)))
    losses, _ = peer_worker.train_steps(model, spec, np.load(batches_path), spec["check_steps"])
    np.savez(out_path, logits=logits.float().numpy(), losses=np.asarray(losses))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.length_generalization_peer_weights"
    )
    parser.add_argument("--worker", nargs=4, metavar=("SPEC", "BATCHES", "WEIGHTS", "OUT"))
    parser.add_argument("--config", default="reverse_string,cpu", help="config argument")
    parser.add_argument("--arms", default="", help="comma-separated peer arms (default: all)")
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return
    print(
        f"| arm | max abs logit difference | max abs logit | loss at steps 1 / {STEPS}: "
        f"copejax | x-transformers | max abs loss difference over {STEPS} steps |\n"
        "|---|---|---|---|---|---|"
    )
    for arm in args.arms.split(",") if args.arms else peer.ARMS:
        found = compare(args.config, arm.strip())
        ours, theirs, gap = found["losses"], found["peer_losses"], found["max_loss_difference"]
        print(
            f"| `{arm}` | {found['max_abs_difference']:.2e} | {found['max_abs_logit']:.3g} | "
            f"{ours[0]:.4f} / {ours[-1]:.4f} | {theirs[0]:.4f} / {theirs[-1]:.4f} | {gap:.2e} |"
        )


if __name__ == "__main__":
    main()
