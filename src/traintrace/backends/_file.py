"""JSON-lines files: one stream per process, appended, written in batches."""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .._names import RecordKind, Verbosity
from .._safefs import dir_mode, make_dirs, open_dir, open_nofollow
from .._serialize import dumps, dumps_lines
from ._base import Record

__all__ = ["FileBackend", "dir_mode", "seq_range"]

log = logging.getLogger("traintrace.lib")


#: Bytes a stream keeps aside for when its file system fills up (``FileBackendConfig.reserve_bytes``): room for
#: the records that follow, an exception's with its stack (a few KiB) among them.
RESERVE_BYTES = 128 * 1024
#: The errors of a file system (or a quota) with no room left.
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


def seq_range(records: Sequence[Record]) -> tuple[int | None, int | None]:
    """The first and last integer ``seq`` of ``records`` (None, None when none has one)."""
    seqs = [r.get("seq") for r in records if isinstance(r.get("seq"), int)]
    return (seqs[0], seqs[-1]) if seqs else (None, None)


class FileBackend:
    """Appends each batch of records to ``path`` with one ``write`` call.

    No Python-level buffer: what a batch wrote is in the kernel's page cache,
    so it survives the process being killed, and a forked child has nothing
    buffered to write twice. A failed write (disk full, file gone) drops that
    batch, warns once, and once writing works again a ``dropped`` record says
    how many records were lost and their sequence numbers. A file deleted or
    renamed (log rotation) while open is noticed at the next write: the path is
    reopened and the header written again.

    Where the disk fills up (a checkpoint and the telemetry on one file
    system), the records that say why the job failed come after it is full:
    the stream keeps ``reserve_bytes`` aside in a hidden sibling file
    (``.<name>.reserve``, allocated when the stream starts, removed at close),
    which the first write that finds no space deletes before it tries again.

    The file is never opened through a symlink: its folder is resolved when
    the stream starts, and a link planted later at the stream's name or in
    place of that folder is refused (those writes fail and are counted, as on
    a full disk). Folders it creates get :func:`dir_mode` of ``file_mode``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        verbosity: int = Verbosity.PROFILING,
        file_mode: int = 0o640,
        fsync_on_close: bool = True,
        reserve_bytes: int = RESERVE_BYTES,
    ) -> None:
        self.path = Path(path)
        self.verbosity = int(verbosity)
        self.file_mode = file_mode
        self.fsync_on_close = fsync_on_close
        self.reserve_bytes = reserve_bytes
        #: The reserve file's name in the stream's folder while it holds space; None once released (or never made).
        self._reserve: str | None = None
        self._reserve_tried = False
        self._fd = -1
        self._folder: Path | None = None
        self._header: Record | None = None
        self._need_newline = False
        self._lost = 0
        self._lost_first: int | None = None
        self._lost_last: int | None = None
        self._lost_error = ""
        self._failing = False
        self._reopened = False
        self._identity: tuple[int, int] = (-1, -1)
        #: Look for a moved or deleted file before the next write (once per write cycle: see ``flush``).
        self._check_due = True
        self.bytes_written = 0

    def open(self, header: Record) -> None:
        self._header = header
        self._open_file()
        if not self._write_bytes(dumps(dict(header)) + b"\n"):
            # Disk full at the start: the next write that works starts with the header,
            # so the records after it are not orphans.
            self._reopened = True

    def _open_file(self) -> None:
        if self._folder is None:
            make_dirs(self.path.parent, dir_mode(self.file_mode))
            # The operator's path may pass through links; what it leads to now is fixed for the run.
            self._folder = Path(os.path.realpath(self.path.parent))
        else:
            make_dirs(self._folder, dir_mode(self.file_mode))
        # A folder swapped for a link since the start is refused (ELOOP), never entered.
        folder = open_dir(self._folder, follow=False)
        try:
            name = self.path.name
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
            self._fd = open_nofollow(name, flags, self.file_mode, folder)
            info = os.fstat(self._fd)
            if not self._reserve_tried:
                self._reserve_tried = True
                if stat.S_ISREG(info.st_mode):  # (not beside a device or a pipe)
                    self._make_reserve(folder)
            self._identity = (info.st_dev, info.st_ino)
            size = info.st_size
            if size > 0:
                # A process killed mid-line left no newline; start ours on a fresh line.
                reader = open_nofollow(name, os.O_RDONLY, 0, folder)
                try:
                    self._need_newline = os.pread(reader, 1, size - 1) != b"\n"
                finally:
                    os.close(reader)
        finally:
            os.close(folder)

    def _make_reserve(self, folder: int) -> None:
        """Set ``reserve_bytes`` of the file system aside in ``.<name>.reserve``; none where that fails (no room
        already: nothing to keep)."""
        if self.reserve_bytes <= 0:
            return
        name = f".{self.path.name}.reserve"
        try:
            fd = open_nofollow(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, self.file_mode, folder)
        except OSError:
            return
        try:
            try:
                os.posix_fallocate(fd, 0, self.reserve_bytes)
            except (AttributeError, OSError) as exc:
                # No fallocate here (macOS; ZFS says EOPNOTSUPP): blocks written hold the space as well.
                if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
                    raise
                chunk = bytes(min(self.reserve_bytes, 64 * 1024))
                left = self.reserve_bytes
                while left > 0:
                    left -= os.write(fd, chunk[:left])
            self._reserve = name
        except OSError:
            _unlink_quietly(name, folder)
        finally:
            os.close(fd)

    def _drop_reserve(self) -> bool:
        """Remove the reserve file (once): True when there was one and it is gone."""
        name = self._reserve
        if name is None or self._folder is None:
            return False
        self._reserve = None
        try:
            folder = open_dir(self._folder, follow=False)
        except OSError:
            return False
        try:
            return _unlink_quietly(name, folder)
        finally:
            os.close(folder)

    def _release_reserve(self) -> bool:
        """Give the reserve's space back to the file system (once): True when there was one."""
        released = self._drop_reserve()
        if released:
            log.warning(
                "traintrace: %s: the file system is full; its %d KiB reserve is released for the records that follow",
                self.path,
                self.reserve_bytes // 1024,
            )
        return released

    def _check_replaced(self) -> None:
        """Reopen when the file was deleted, renamed (log rotation) or replaced.

        A new file starts with the stream's header again, so it reads on its own.
        """
        if self._fd < 0:
            return
        try:
            folder = self._folder or self.path.parent
            if not stat.S_ISDIR(folder.lstat().st_mode):
                raise NotADirectoryError(str(folder))
            info = (folder / self.path.name).lstat()
            same = (info.st_dev, info.st_ino) == self._identity
        except OSError:
            same = False
        if same:
            return
        try:
            os.close(self._fd)
        except OSError:
            pass
        self._fd = -1
        self._need_newline = False
        self._reopened = True
        log.info("traintrace: %s was moved or deleted; writing a new file there", self.path)

    def write(self, records: Sequence[Record]) -> None:
        if not records:
            return
        first, last = seq_range(records)
        self.write_lines(dumps_lines(records), len(records), first, last)

    def write_lines(
        self,
        payload: bytes,
        count: int,
        first_seq: int | None,
        last_seq: int | None,
        write: Callable[[int, memoryview], int] | None = None,
    ) -> None:
        """Append ``count`` records already encoded as JSON lines (the writer's native encoder).

        ``first_seq``/``last_seq``: their sequence numbers, for the note if the write fails.
        ``write``: makes the first ``os.write`` call instead of it (the writer's, which also
        lets the training thread take the GIL: ``_pipeline.Pipeline._yield``).
        """
        if not count:
            return
        if self._check_due:
            # Once per write cycle: each look is two system calls, and each lets go of the GIL.
            self._check_due = False
            self._check_replaced()
        if self._lost and not self._failing:
            payload = self._lost_note() + payload
        if self._write_bytes(payload, write):
            if self._lost and self._failing:
                self._failing = False
                self._write_bytes(self._lost_note())
        else:
            self._lost += count
            if last_seq is not None:
                if self._lost_first is None:
                    self._lost_first = first_seq
                self._lost_last = last_seq

    def _lost_note(self) -> bytes:
        note: dict[str, Any] = {
            "seq": None,
            "kind": RecordKind.DROPPED,
            "ts": time.time_ns(),
            "count": self._lost,
            "reason": "write_error",
            "error": self._lost_error,
        }
        if self._lost_first is not None:
            note["first_seq"] = self._lost_first
            note["last_seq"] = self._lost_last
        self._lost, self._lost_first, self._lost_last = 0, None, None
        return dumps(note) + b"\n"

    def _write_bytes(self, data: bytes, write: Callable[[int, memoryview], int] | None = None) -> bool:
        if self._fd < 0:
            try:
                self._open_file()
            except OSError as exc:
                self._note_failure(exc)
                return False
        with_header = self._reopened and self._header is not None
        if with_header:
            # A new file (after rotation or deletion) starts with the header again.
            data = dumps(dict(self._header or {})) + b"\n" + data
        if self._need_newline:
            data = b"\n" + data
        view = memoryview(data)
        written = 0
        while True:
            try:
                if write is not None:
                    first, write = write, None
                    written = first(self._fd, view)
                while written < len(view):
                    written += os.write(self._fd, view[written:])
                break
            except OSError as exc:
                if exc.errno in _NO_SPACE and self._release_reserve():
                    continue  # the rest of the batch, into the space set aside
                # Whatever part of the line went out is cut; the next write starts a new line.
                if written > 0:
                    self._need_newline = not data[:written].endswith(b"\n")
                self._note_failure(exc)
                if exc.errno in (errno.EBADF, errno.ESTALE):
                    self._fd = -1
                return False
        self._reopened = False
        self._need_newline = False
        self.bytes_written += written
        return True

    def _note_failure(self, exc: OSError) -> None:
        self._lost_error = f"{type(exc).__name__}: {exc.strerror or exc}"
        if not self._failing:
            self._failing = True
            log.warning(
                "traintrace: cannot write %s (%s); records are dropped and counted until it works",
                self.path,
                self._lost_error,
            )

    def flush(self) -> None:
        # The end of a write cycle: the next cycle's first write looks for a moved file.
        self._check_due = True

    def close(self) -> None:
        self._drop_reserve()
        if self._fd < 0:
            return
        try:
            if self.fsync_on_close:
                os.fsync(self._fd)
        except OSError:
            pass
        finally:
            os.close(self._fd)
            self._fd = -1


def _unlink_quietly(name: str, folder: int) -> bool:
    try:
        os.unlink(name, dir_fd=folder)
    except OSError:
        return False
    return True
