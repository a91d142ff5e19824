"""Python stacks on a fatal signal, into a file next to the rank's stream.

A segmentation fault, abort or bus error kills the process before any Python
code runs, so the writer thread cannot record it. :mod:`faulthandler` can: it
writes every thread's stack with async-signal-safe calls to a file descriptor
opened in advance. traintrace opens ``<stream path>.faults.txt`` (the file
backend's path plus that suffix) at ``configure()`` and removes it again at a
clean close when nothing was written to it, so it exists after a run only when
the process crashed (or was killed, in which case it is empty).
:func:`traintrace.reader.read_file` reads it into ``StreamFile.faults``.

If faulthandler was already enabled (``python -X faulthandler``,
``PYTHONFAULTHANDLER``, or the program's own call), it is left as it is.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
from pathlib import Path

from ._format import FAULTS_SUFFIX
from ._safefs import open_dir, open_nofollow

log = logging.getLogger("traintrace.lib")


_state: dict[str, object] = {}


def faults_path(stream_path: str | os.PathLike[str]) -> Path:
    """Where the fault stacks of the stream at ``stream_path`` go."""
    path = Path(stream_path)
    return path.with_name(path.name + FAULTS_SUFFIX)


def enable(stream_path: Path, file_mode: int) -> None:
    """Send fatal-signal stacks to the stream's fault file (unless someone else already does)."""
    ours = _state.get("fd")
    if faulthandler.is_enabled() and ours is None:
        return
    release()
    target = faults_path(stream_path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
    try:
        # Next to the stream, never through a link planted at its name.
        folder = open_dir(target.parent)
        try:
            fd = open_nofollow(target.name, flags, file_mode, folder)
        finally:
            os.close(folder)
    except OSError as exc:
        log.debug("traintrace: no fault file %s: %s", target, exc)
        return
    try:
        faulthandler.enable(file=fd, all_threads=True)
    except (OSError, RuntimeError, ValueError) as exc:
        os.close(fd)
        log.debug("traintrace: faulthandler not enabled: %s", exc)
        return
    _state.update(fd=fd, path=target, pid=os.getpid())


def release() -> None:
    """Stop writing fault stacks; remove the fault file when it is empty."""
    fd = _state.pop("fd", None)
    path = _state.pop("path", None)
    pid = _state.pop("pid", None)
    if not isinstance(fd, int):
        return
    faulthandler.disable()
    empty = False
    with contextlib.suppress(OSError):
        empty = os.fstat(fd).st_size == 0
    with contextlib.suppress(OSError):
        os.close(fd)
    if empty and pid == os.getpid() and isinstance(path, Path):
        with contextlib.suppress(OSError):
            path.unlink()


def after_fork_in_child() -> None:
    """A forked child writes its crashes to the parent's fault file until it configures its own."""
    pid = _state.get("pid")
    if pid is not None and pid != os.getpid():
        # Keep the inherited descriptor (faulthandler still uses it) but forget it is ours,
        # so the child never deletes the parent's file.
        _state["pid"] = -1
