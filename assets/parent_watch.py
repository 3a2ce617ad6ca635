"""Child processes that die with their parent: no engine or model build may outlive the gateway, even a SIGKILLed one.

Two lines of defence:
- `die_with_parent()` is a `preexec_fn` for whoever spawns the child. On Linux it asks the kernel to SIGKILL
  the child when its parent goes away (`PR_SET_PDEATHSIG`), which happens even when the parent is SIGKILLed.
  The kernel fires it when the *thread* that forked the child ends, not the process: spawn only from a
  thread that lives as long as its children should (the supervisor spawns from the event loop's thread,
  the gateway's main thread; the first-use builds from the thread that waits for each of them).
- `exit_when_orphaned()` runs inside the child: a daemon thread that ends the process once it has been
  re-parented (its parent pid changed). It covers platforms without the signal and a parent-death signal
  lost to a race.

The supervisor tells an engine that it is supervised (and so should watch its parent) with ENGINE_INSTANCE_ENV,
whose value is also the nonce the engine's /health reports as `instance`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

ENGINE_INSTANCE_ENV = "TIERGATE_ENGINE_INSTANCE"  # set by the supervisor: this start's nonce
PARENT_CHECK_EVERY_S = 0.5
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None  # loaded before any fork
log = logging.getLogger("tiergate.parent_watch")


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` that makes the child get SIGKILL when this process dies (None where Linux's prctl is absent).

    Call it in the parent, just before spawning: it records the parent's pid, so that a parent that died
    between the fork and the prctl (when the signal would never come) is noticed and the child ends at once.
    """
    if _libc is None:
        return None
    libc, parent = _libc, os.getpid()

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def exit_when_orphaned(every_s: float = PARENT_CHECK_EVERY_S) -> threading.Thread:
    """Start a daemon thread that exits this process as soon as its parent pid differs from the current one."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        log.error("parent process %d is gone; exiting", parent)
        os._exit(1)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread
