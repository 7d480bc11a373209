"""Part ``cli`` of :mod:`experiments.bench_kernels_gpu`: steady-state tokens/s of one
training run through the command line (``python -m copejax.main``), in a child process with
its own share of the GPU's memory; a scheme the kernels refuse is recorded with the refusal.
"""

from __future__ import annotations

import os
import re
import subprocess
import time

from experiments.bench import ROOT
from experiments.bench_measure import lm_command

TOKENS_PER_S = re.compile(r"\| ([\d,]+) tokens/s")
# JAX takes 75% of the GPU's memory when it starts: this process takes MEM_FRACTION (at most;
# it allocates as it needs, leaving the rest to bench_kernels_warm's workers) and each timed
# child (a command-line run or a layer group, one at a time) CLI_MEM_FRACTION from its start.
MEM_FRACTION, CLI_MEM_FRACTION = "0.45", "0.45"


def run_child(
    command: list[str], timeout_s: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess | None:
    """``command`` from the repository root with CLI_MEM_FRACTION of the GPU's memory (or
    as ``env`` says: it updates this process's environment), its output captured; None if
    it ran past ``timeout_s`` (then it is killed)."""
    env = {
        **os.environ,
        "XLA_PYTHON_CLIENT_MEM_FRACTION": CLI_MEM_FRACTION,
        "XLA_PYTHON_CLIENT_PREALLOCATE": "true",
        **(env or {}),
    }
    try:
        return subprocess.run(
            command,
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None


def refusal(scheme: str) -> str | None:
    """The kernels' refusal of ``scheme`` (copejax.model.kernel_terms), or None."""
    from copejax.model.kernel_terms import kernel_refusal
    from copejax.positions.registry import make_scheme

    return kernel_refusal(make_scheme(scheme))


def cli_run(
    scheme: str,
    impl: str,
    variant: str,
    steps: int,
    timeout_s: float,
    *,
    length: int = 2048,
    batch: int = 8,
    env: dict[str, str] | None = None,
) -> dict:
    """tokens/s of the last progress line of one training run through the command line; the
    ``paper`` variant at ``length`` tokens and ``batch`` rows (the row records them), the
    smoke variant at its own; ``env``: :func:`run_child`'s."""
    import tempfile

    row: dict = {"scheme": scheme, "attention_impl": impl}
    if variant == "paper":
        row |= {"T": length, "batch": batch}
    if impl == "kernel" and (why := refusal(scheme)) is not None:
        return {**row, "status": "refused", "reason": why}
    arg = f"{variant},position={scheme},steps={steps}"
    if variant == "paper":
        arg += f",corpus=stdlib,length={length},batch_size={batch}"
    with tempfile.TemporaryDirectory() as workdir:
        command = [
            *lm_command(arg, workdir),
            "--config.model.dtype=bfloat16",
            f"--config.model.attention_impl={impl}",
            f"--config.train.log_every={max(1, steps // 4)}",
            f"--config.train.eval_every={10 * steps}",
            f"--config.train.checkpoint_every={10 * steps}",
            "--config.eval.max_examples=1",
        ]
        row["command"] = " ".join(command[1:])
        start = time.perf_counter()
        done = run_child(command, timeout_s, env)
        if done is None:
            return {**row, "status": "timeout", "wall_s": timeout_s}
        row["wall_s"] = time.perf_counter() - start
    speeds = [float(m.replace(",", "")) for m in TOKENS_PER_S.findall(done.stdout)]
    if done.returncode != 0 or not speeds:
        return {**row, "status": "error", "stderr_tail": done.stderr[-800:]}
    return {**row, "status": "ok", "tokens_per_s": speeds[-1]}
