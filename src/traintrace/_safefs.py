"""Files and folders created without following links someone else planted.

Every file traintrace creates is opened relative to a descriptor of its folder,
with ``O_NOFOLLOW`` (a symlink at the name is refused, never written through),
and temporary files with ``O_EXCL`` under an unpredictable name. Folders are
created one by one with the permissions asked for (``0o700``/``0o750`` by
default), never with the process's default ``0o777``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

__all__ = [
    "O_NOFOLLOW",
    "atomic_write_at",
    "dir_mode",
    "make_dirs",
    "open_dir",
    "open_nofollow",
    "write_new_file",
]

O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_HAVE_DIR_FD = os.open in os.supports_dir_fd


def dir_mode(file_mode: int) -> int:
    """Permissions for folders holding files of ``file_mode``: who may read a file may list its folder."""
    mode = 0o700
    if file_mode & 0o040:
        mode |= 0o050
    if file_mode & 0o004:
        mode |= 0o005
    return mode


def make_dirs(path: str | os.PathLike[str], mode: int) -> None:
    """Create ``path`` and every missing folder above it, each with ``mode`` (less the umask)."""
    missing: list[Path] = []
    current = Path(path)
    while not current.is_dir():
        missing.append(current)
        parent = current.parent
        if parent == current:
            break
        current = parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode)


def open_dir(path: str | os.PathLike[str], *, follow: bool = True) -> int:
    """A descriptor of the folder ``path``; with ``follow=False`` its last part may not be a link."""
    flags = os.O_RDONLY | O_DIRECTORY | O_CLOEXEC | (0 if follow else O_NOFOLLOW)
    return os.open(path, flags)


def open_nofollow(name: str, flags: int, mode: int, dir_fd: int | None) -> int:
    """``os.open`` of ``name`` in the folder ``dir_fd`` that refuses a symlink at ``name``."""
    flags |= O_NOFOLLOW | O_CLOEXEC
    if dir_fd is not None and _HAVE_DIR_FD:
        return os.open(name, flags, mode, dir_fd=dir_fd)
    return os.open(name, flags, mode)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def atomic_write_at(dir_fd: int, name: str, data: bytes, mode: int, *, once: bool) -> bool:
    """Write ``name`` in the folder ``dir_fd`` completely or not at all.

    The temporary file has an unpredictable name and is created with
    ``O_EXCL | O_NOFOLLOW``, so a file or link planted in the folder is never
    written to; the rename (or, with ``once``, the hard link that fails when
    ``name`` exists) replaces a link at ``name`` rather than following it.
    True if ``name`` now holds ``data``; False when ``once`` and it existed.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    for _ in range(16):
        tmp = f".{name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
        try:
            fd = open_nofollow(tmp, flags, mode, dir_fd)
        except FileExistsError:
            continue
        break
    else:
        raise FileExistsError(f"cannot create a temporary file for {name}")
    try:
        try:
            _write_all(fd, data)
        finally:
            os.close(fd)
        if once:
            try:
                os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
            except FileExistsError:
                return False
            return True
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return True
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)


def write_new_file(path: str | os.PathLike[str], data: bytes, mode: int = 0o644) -> None:
    """Write ``path`` through a temporary file and a rename: a link at ``path`` is replaced, not followed."""
    target = Path(path)
    fd = open_dir(target.parent)
    try:
        atomic_write_at(fd, target.name, data, mode, once=False)
    finally:
        os.close(fd)
