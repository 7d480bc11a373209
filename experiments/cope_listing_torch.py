"""copejax's CoPE against the CoPE paper's Listing 1 in PyTorch, at the same shapes on this CPU.

Listing 1 of Golovneva et al. 2024 (arXiv 2405.18719, Appendix B; the seed text) is reproduced
verbatim below as ``LISTING``: single-head attention over (batch, T, H) tensors with the CoPE
term, built on full (T, T) gates, positions and gathers. Both sides run forward+backward of
attention alone (no projections) on the same random q, k, v with batch x heads = 8 rows of
H = 64 and p_max = 64:

- PyTorch: the listing, in a side venv this script creates (``.venv-torch``, ``torch``
  installed from PyPI by name; not a dependency of copejax). Its process runs under an address
  space limit of 24 GiB (``RLIMIT_AS``), so a length whose tensors do not fit fails with an
  allocation error instead of swapping; that is what "exhausts 24 GiB" means on the page.
- JAX: copejax's CoPE on the path ``model.attention_impl="auto"`` takes at that length (the
  naive (B, N, T, S) path below ``copejax.model.attention_paths.AUTO_BLOCKWISE_FROM``, the blockwise
  engine from there), jitted, compile time excluded.

Each length runs ``--rounds`` rounds; a round runs the PyTorch worker, then the JAX worker, each
in its own process (warm-up, then the median of 2 timed runs), and the ratio is taken within the
round. The two cannot share a process, so this is the closest to side by side there is.

    .venv/bin/python experiments/cope_listing_torch.py   # writes results/cope_listing_torch.*
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH_VENV = ROOT / ".venv-torch"
TORCH_VERSION = "2.14.1"
ROWS, HEAD_DIM, P_MAX = 8, 64, 64  # batch x heads, H, p_max
LENGTHS = (1024, 2048, 4096, 8192, 16384)
ADDRESS_LIMIT = 24 * 2**30

LISTING = """
import math
import torch
import torch.nn as nn


class CoPE(nn.Module):
    def __init__(self, npos_max, head_dim):
        super().__init__()
        self.npos_max = npos_max
        self.pos_emb = nn.parameter.Parameter(torch.zeros(1, head_dim, npos_max))

    def forward(self, query, attn_logits):
        # compute positions
        gates = torch.sigmoid(attn_logits)
        pos = gates.flip(-1).cumsum(dim=-1).flip(-1)
        pos = pos.clamp(max=self.npos_max - 1)
        # interpolate from integer positions
        pos_ceil = pos.ceil().long()
        pos_floor = pos.floor().long()
        logits_int = torch.matmul(query, self.pos_emb)
        logits_ceil = logits_int.gather(-1, pos_ceil)
        logits_floor = logits_int.gather(-1, pos_floor)
        w = pos - pos_floor
        return logits_ceil * w + logits_floor * (1 - w)


class SelfAttn(nn.Module):
    def __init__(self, npos_max, head_dim):
        super().__init__()
        self.cope = CoPE(npos_max, head_dim)
        self.head_dim = head_dim

    def forward(self, query, key, val, mask):
        # q, k, v have dimensions batch x seq_len x head_dim
        attn_logits = torch.bmm(query, key.transpose(-1, -2))
        attn_logits = attn_logits / math.sqrt(self.head_dim)
        attn_logits += mask.log()
        attn_logits += self.cope(query, attn_logits)
        attn = torch.softmax(attn_logits, dim=-1)
        out = torch.bmm(attn, val)
        return out
"""


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _time(step, repeats: int = 2) -> float:
    step()  # warm-up (and compile, for JAX)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def torch_worker(length: int) -> dict:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_LIMIT, ADDRESS_LIMIT))
    namespace: dict = {}
    exec(LISTING, namespace)  # the paper's listing, verbatim
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    attn = namespace["SelfAttn"](P_MAX, HEAD_DIM)
    with torch.no_grad():
        attn.cope.pos_emb.normal_(0.0, 0.1)
    q, k, v = (torch.randn(ROWS, length, HEAD_DIM, requires_grad=True) for _ in range(3))
    mask = torch.tril(torch.ones(length, length))[None]
    cotangent = torch.randn(ROWS, length, HEAD_DIM)

    def step() -> None:
        for tensor in (q, k, v, attn.cope.pos_emb):
            tensor.grad = None
        (attn(q, k, v, mask) * cotangent).sum().backward()

    try:
        seconds = _time(step)
    except (RuntimeError, MemoryError) as error:
        return {"status": "out_of_memory", "error": str(error)[:200], "peak_rss_bytes": _peak_rss()}
    return {"status": "ok", "time_s": seconds, "peak_rss_bytes": _peak_rss()}


def jax_worker(length: int) -> dict:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp

    from copejax.model.attention_paths import AUTO_BLOCKWISE_FROM
    from copejax.ops import cope as cope_ops
    from copejax.ops import engine, engine_blocks
    from copejax.ops.cope_block import cope_block_term
    from copejax.positions.base import masked_softmax_BNTS

    impl = "naive" if length < AUTO_BLOCKWISE_FROM else "blockwise"
    keys = jax.random.split(jax.random.key(0), 5)
    q, k, v = (jax.random.normal(key, (ROWS, length, 1, HEAD_DIM)) for key in keys[:3])
    pos_emb = 0.1 * jax.random.normal(keys[3], (P_MAX, HEAD_DIM))
    cotangent = jax.random.normal(keys[4], (ROWS, length, 1, HEAD_DIM))
    positions = jnp.broadcast_to(jnp.arange(length), (ROWS, length))
    ids = jnp.zeros((ROWS, length), jnp.int32)

    def attention(q, k, v, pos_emb):
        if impl == "blockwise":
            term = cope_block_term(p_max=P_MAX, pos_emb=pos_emb)
            y, _ = engine.blockwise_attention(
                q, k, v, q_positions_BT=positions, k_positions_BS=positions,
                q_segment_ids_BT=ids, k_segment_ids_BS=ids, terms=[term], block=256,
            )  # fmt: skip
            return y
        mask_BTS = jnp.broadcast_to(
            jnp.tril(jnp.ones((length, length), bool)), (ROWS, length, length)
        )
        logits = engine_blocks.content_logits_BNQK(q, k)
        positions_BNTS = cope_ops.cope_positions(cope_ops.cope_gates(logits, mask_BTS), P_MAX)
        term = cope_ops.cope_interpolated_term(q, pos_emb, positions_BNTS)
        weights = masked_softmax_BNTS(logits + term, mask_BTS)
        return jnp.einsum("BNTS,BSNH->BTNH", weights, v)

    grad = jax.jit(jax.grad(lambda *a: jnp.sum(attention(*a) * cotangent), argnums=(0, 1, 2, 3)))
    seconds = _time(lambda: jax.block_until_ready(grad(q, k, v, pos_emb)))
    return {"status": "ok", "time_s": seconds, "peak_rss_bytes": _peak_rss(), "impl": impl}


def ensure_torch() -> Path:
    python = TORCH_VENV / "bin" / "python"
    if not python.exists():
        venv.EnvBuilder(with_pip=True).create(TORCH_VENV)
    check = subprocess.run([python, "-c", "import torch"], capture_output=True, check=False)
    if check.returncode != 0:
        subprocess.run(
            [python, "-m", "pip", "install", "--quiet", f"torch=={TORCH_VERSION}", "numpy"],
            check=True,
        )
    return python


def _run(python: Path | str, role: str, length: int) -> dict:
    command = [
        str(python),
        str(Path(__file__).resolve()),
        "--worker",
        role,
        "--length",
        str(length),
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    status = "out_of_memory" if done.returncode < 0 else "error"
    return {"status": status, "returncode": done.returncode, "stderr": done.stderr[-400:]}


def markdown(result: dict) -> str:
    lines = [
        "# CoPE: copejax against the paper's Listing 1 (PyTorch), forward+backward",
        "",
        f"Command: `{result['command']}` (torch {result['torch']}, {result['cpu_count']} CPUs). "
        f"Attention alone on q, k, v of {ROWS} rows x T x H = {HEAD_DIM}, p_max = {P_MAX}. "
        "Listing 1 verbatim (Appendix B of arXiv 2405.18719) under a 24 GiB address-space "
        "limit; copejax on the path `model.attention_impl='auto'` takes. Rounds alternate "
        "the two workers (separate processes); ratios within rounds.",
        *(["", f"Note: {result['note']}"] if "note" in result else []),
        "",
        "| T | Listing 1 (ms) | copejax (ms) | copejax path | listing / copejax per round | "
        "peak RSS listing / copejax (GiB; listing: at its failed allocation) |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        torch_runs, jax_runs = row["torch"], row["jax"]
        t_ok = [r for r in torch_runs if r["status"] == "ok"]
        j_ok = [r for r in jax_runs if r["status"] == "ok"]
        t_cell = (
            f"{1e3 * statistics.median(r['time_s'] for r in t_ok):.0f}"
            if t_ok
            else torch_runs[0]["status"].replace("_", " ")
        )
        j_cell = (
            f"{1e3 * statistics.median(r['time_s'] for r in j_ok):.0f}"
            if j_ok
            else jax_runs[0]["status"]
        )
        ratios = [
            a["time_s"] / b["time_s"]
            for a, b in zip(torch_runs, jax_runs, strict=True)
            if a["status"] == b["status"] == "ok"
        ]
        ratio = (
            f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
            if ratios
            else "-"
        )
        rss = [  # failed runs too: how far the listing got before its allocation failed
            f"{max(r['peak_rss_bytes'] for r in runs) / 2**30:.2f}" if runs else "-"
            for runs in (
                [r for r in torch_runs if "peak_rss_bytes" in r],
                [r for r in jax_runs if "peak_rss_bytes" in r],
            )
        ]
        path = j_ok[0]["impl"] if j_ok else "-"
        lines.append(
            f"| {row['T']} | {t_cell} | {j_cell} | {path} | {ratio} | {rss[0]} / {rss[1]} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=("torch", "jax"), default=None)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out_dir", default=str(ROOT / "experiments/results"))
    parser.add_argument("--render", default=None, help="rewrite the page from a JSON")
    args = parser.parse_args()
    if args.render is not None:
        result = json.loads(Path(args.render).read_text())
        (Path(args.out_dir) / "cope_listing_torch.md").write_text(markdown(result))
        return
    if args.worker is not None:
        worker = torch_worker if args.worker == "torch" else jax_worker
        print(json.dumps(worker(args.length)), flush=True)
        return
    torch_python = ensure_torch()
    version = subprocess.run(
        [torch_python, "-c", "import torch; print(torch.__version__)"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        row = {"T": length, "torch": [], "jax": []}
        for _ in range(args.rounds):
            for role, python in (("torch", torch_python), ("jax", sys.executable)):
                result = _run(python, role, length)
                row[role].append(result)
                print(length, role, result, flush=True)
            if row["torch"][-1]["status"] != "ok":  # out of memory: one round says it
                break
        rows.append(row)
    result = {
        "command": "python experiments/cope_listing_torch.py",
        "torch": version,
        "cpu_count": os.cpu_count(),
        "rows": rows,
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cope_listing_torch.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / "cope_listing_torch.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
