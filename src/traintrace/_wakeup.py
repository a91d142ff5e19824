"""A wake-up for the writer thread that the waker can ring without taking a lock.

``threading.Event.set()`` takes the event's condition lock. A signal handler
runs in the main thread between two bytecodes, possibly while that thread holds
the very lock (inside ``Event.set()`` on a full queue): calling ``set()`` there
deadlocks. Writing one byte to a non-blocking pipe takes no Python lock, so the
handler, the training thread and the writer can never wait on each other here.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import weakref


def _close(fds: tuple[int, int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class Wakeup:
    """``set()`` from any thread or a signal handler; ``wait(timeout)`` and ``clear()`` from one thread."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._pending = False
        # The descriptors live as long as this object: nobody can ring a reused number.
        weakref.finalize(self, _close, (self._read, self._write))

    def set(self) -> None:
        if self._pending:
            return
        self._pending = True
        try:
            os.write(self._write, b"\0")
        except OSError:  # full (already rung) or, after a fork, not ours to ring
            pass

    def is_set(self) -> bool:
        return self._pending

    def wait(self, timeout: float) -> bool:
        if self._pending:
            return True
        try:
            ready, _, _ = select.select([self._read], [], [], timeout)
        except (OSError, ValueError):
            # No select here (or the descriptor is gone): sleep the interval instead.
            threading.Event().wait(timeout)
            return self._pending
        return bool(ready) or self._pending

    def clear(self) -> None:
        self._pending = False
        with contextlib.suppress(OSError):
            while os.read(self._read, 4096):
                pass

    def fileno(self) -> int:
        """The descriptor that becomes readable when rung (for a waiter of one's own)."""
        return self._read
