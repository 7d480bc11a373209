"""Joining a multi-process run: say who is waited for, give up after a timeout in one line.

``jax.distributed.initialize`` waits for every process to register with the coordinator
(process 0) and, past its timeout, aborts the process from C++ with a stack trace that blames
"another task". A watchdog thread here ends the wait first, with one ``error:`` line naming the
processes that did not come.
"""

from __future__ import annotations

import os
import sys
import threading

import jax

# jax's own deadline sits past ours, so that ours is the one that fires.
_JAX_MARGIN_S = 60


def _waited_for(process_id: int | None, count: int | None, address: str | None) -> str:
    if process_id is None or count is None:
        return f"the other processes of the run (coordinator {address or 'from the environment'})"
    if process_id == 0:
        others = ", ".join(str(i) for i in range(1, count))
        return f"process{'es' if count > 2 else ''} {others} of {count} to join at {address}"
    return f"the coordinator (process 0 of {count}) at {address}"


def join(address: str | None, count: int | None, process_id: int | None, timeout_s: int) -> None:
    """Calls ``jax.distributed.initialize``; after ``timeout_s`` seconds without every process,
    prints one ``error:`` line and exits with status 1.

    With ``address`` None, jax reads the cluster from the environment (``--distributed``).
    """
    who = _waited_for(process_id, count, address)
    me = f"process {process_id}" if process_id is not None else "this process"
    print(f"{me}: waiting up to {timeout_s} s for {who}", file=sys.stderr, flush=True)
    joined = threading.Event()

    def give_up() -> None:
        if not joined.wait(timeout_s):
            print(
                f"error: {me}: gave up after {timeout_s} s waiting for {who}; start every process "
                "with the same --coordinator_address and --num_processes (process ids 0 to "
                "N-1), or raise --peer_timeout",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)  # jax's C++ wait cannot be interrupted from Python

    threading.Thread(target=give_up, daemon=True, name="copejax-peer-timeout").start()
    kwargs = {"initialization_timeout": timeout_s + _JAX_MARGIN_S}
    if address is None:
        jax.distributed.initialize(**kwargs)
    else:
        jax.distributed.initialize(
            coordinator_address=address, num_processes=count, process_id=process_id, **kwargs
        )
    joined.set()
