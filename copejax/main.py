"""The training program: flags only (a config file, a workdir), then ``copejax.training.train.run``.

    python -m copejax.main --config=configs/flipflop.py:smoke --workdir=/tmp/ff \
        [--config.train.steps=50] [--restart]

Several processes (one per host, or several on one machine) join with
``--coordinator_address=host:port --num_processes=N --process_id=i``; on a managed cluster
``--distributed`` lets ``jax.distributed.initialize`` read them from the environment;
``--peer_timeout`` is how long a process waits for the others.

SIGTERM (a preemption) or Ctrl-C saves a checkpoint at the current step and exits with status
143 or 130 (128 + the signal, so that scripts do not take the run as finished); running the
same command resumes. Mistakes on the command line end in one ``error:`` line.
"""

from __future__ import annotations

import sys

from absl import app, flags
from ml_collections import config_flags

from copejax.config import command_line, config_flag

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/x.py:smoke")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics.")
_RESTART = flags.DEFINE_bool(
    "restart", False, "Delete the workdir's previous run (checkpoints, metrics) and start over."
)
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0, for multi-process runs."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Call jax.distributed.initialize() with cluster auto-detection."
)
_PEER_TIMEOUT = flags.DEFINE_integer(
    "peer_timeout", 300, "Seconds to wait for the other processes of a multi-process run."
)
flags.mark_flags_as_required(["config", "workdir"])


def initialize_distributed() -> None:
    """Joins a multi-process run when the flags (or --distributed) ask for one."""
    import jax

    from copejax.runtime import peers

    if _COORDINATOR.value is None and not _DISTRIBUTED.value:
        return
    if jax.config.jax_platforms in (None, "", "cpu") or "cpu" in str(jax.config.jax_platforms):
        # CPU processes exchange collectives over gloo (measured with jax 0.10.2).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if _COORDINATOR.value is not None and (
        _NUM_PROCESSES.value is None or _PROCESS_ID.value is None
    ):
        command_line.fail("--coordinator_address needs --num_processes and --process_id")
    peers.join(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, _PEER_TIMEOUT.value)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        command_line.fail(f"unexpected arguments: {argv[1:]} (flags are --name=value)")
    command_line.quiet_logging()
    initialize_distributed()
    from copejax.runtime.preemption import Preempted
    from copejax.training import train

    try:
        train.run(_CONFIG.value, _WORKDIR.value, restart=_RESTART.value)
    except (ValueError, train.NonFiniteLossError) as error:
        command_line.fail(str(error))
    except Preempted as stopped:
        print(stopped, file=sys.stderr, flush=True)
        sys.exit(stopped.exit_code)
    except KeyboardInterrupt:
        command_line.fail("interrupted twice: stopped without saving (the last checkpoint stays)",
                          130)  # fmt: skip


if __name__ == "__main__":
    app.run(main, flags_parser=config_flag.parse_flags)
