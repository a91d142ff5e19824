"""Python stacks on a fatal signal, into a file next to the rank's stream.

A segmentation fault, abort or bus error kills the process before any Python
code runs, so the writer thread cannot record it. :mod:`faulthandler` can: it
writes every thread's stack with async-signal-safe calls to a file descriptor
opened in advance. traintrace opens ``<stream path>.faults.txt`` (the file
backend's path plus that suffix) at ``configure()`` and removes it again at a
clean close when nothing was written to it, so it exists after a run only when
the process crashed (or was killed, in which case it holds only the line below).
Each process first writes a line with its pid (``FAULTS_MARKER``): a job's
restarts append to one stream file, and so to one fault file; the analysis
reads the part of the process whose stream it reads.
:func:`traintrace.reader.read_file` reads the stacks into ``StreamFile.faults``.

If faulthandler was already enabled (``python -X faulthandler``,
``PYTHONFAULTHANDLER``, or the program's own call), it is left as it is.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
from pathlib import Path

from ._format import FAULTS_MARKER, FAULTS_SUFFIX
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
        # A restart's process appends to the file of the one before: its part begins at this line.
        start = os.fstat(fd).st_size
        os.write(fd, f"{FAULTS_MARKER}{os.getpid()}\n".encode())
        faulthandler.enable(file=fd, all_threads=True)
    except (OSError, RuntimeError, ValueError) as exc:
        os.close(fd)
        log.debug("traintrace: faulthandler not enabled: %s", exc)
        return
    _state.update(fd=fd, path=target, pid=os.getpid(), start=start, written=os.fstat(fd).st_size)


def release() -> None:
    """Stop writing fault stacks; take this process's part (its marker line) out of the fault file when it wrote
    no stacks, and remove the file when nothing is left."""
    fd = _state.pop("fd", None)
    path = _state.pop("path", None)
    pid = _state.pop("pid", None)
    start, written = _state.pop("start", None), _state.pop("written", None)
    if not isinstance(fd, int):
        return
    faulthandler.disable()
    unused = False
    if isinstance(start, int):
        with contextlib.suppress(OSError):
            unused = os.fstat(fd).st_size == written and pid == os.getpid()
    if unused and isinstance(start, int) and start:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, start)  # an earlier process's stacks stay
    with contextlib.suppress(OSError):
        os.close(fd)
    if unused and not start and isinstance(path, Path):
        with contextlib.suppress(OSError):
            path.unlink()


def after_fork_in_child() -> None:
    """A forked child writes its crashes to the parent's fault file until it configures its own."""
    pid = _state.get("pid")
    if pid is not None and pid != os.getpid():
        # Keep the inherited descriptor (faulthandler still uses it) but forget it is ours,
        # so the child never deletes the parent's file.
        _state["pid"] = -1
