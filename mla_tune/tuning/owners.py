"""Who holds a sweep's claims, whether that holder is still alive, and the signal guard
that keeps a stop from landing between storing a result and telling it to Optuna."""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()[:8]
    except OSError:
        return "-"


def owner_id() -> str:
    """Who holds a claim: host, boot and process, so a sweep on the same machine can tell
    that the holder is dead without waiting for its heartbeats to go stale."""
    return f"{socket.gethostname()}/{_boot_id()}/{os.getpid()}"


def owner_is_dead(owner: str) -> bool:
    """True only when `owner` ran on this machine (same host, same boot) and its process
    is gone; a holder elsewhere is judged by its heartbeats alone."""
    host, boot, pid = (owner.rsplit("/", 2) + ["", "", ""])[:3]
    if host != socket.gethostname() or boot != _boot_id() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def _signals_held() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM while a result is stored and told to Optuna, so a stop never
    lands between the two (the study would be a trial short); a signal that came meanwhile
    is handled on leaving, as it would have been. Handlers, not a signal mask: any thread
    may receive a process's signal, and Python runs its handlers in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    before = {sig: signal.signal(sig, lambda signum, _frame: caught.append(signum))
              for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        if caught:
            handler = before[caught[0]]
            if callable(handler):
                handler(caught[0], None)
            elif handler in (signal.SIG_DFL, None):
                signal.raise_signal(caught[0])
