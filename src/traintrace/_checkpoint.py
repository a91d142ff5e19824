"""Checkpoint sizing: the bytes a saved checkpoint (file or folder) holds."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

_CHECKPOINT_SIZE_FILES: Final = 100_000


def measure_size(path: str | os.PathLike[str] | None) -> int | None:
    """Bytes in a file, or in all files under a folder (None when absent or unreadable)."""
    if path is None:
        return None
    try:
        root = Path(path)
        if root.is_file():
            return root.stat().st_size
        if not root.is_dir():
            return None
        total = 0
        for count, (folder, _, files) in enumerate(os.walk(root)):
            if count > _CHECKPOINT_SIZE_FILES:
                break
            for name in files:
                try:
                    total += (Path(folder) / name).stat().st_size
                except OSError:
                    continue
        return total
    except (OSError, TypeError, ValueError):
        return None


def checkpoint_path(values: Mapping[str, Any]) -> str | None:
    path = values.get("checkpoint_path") or values.get("path")
    if path:
        return str(os.fspath(path))
    directory = values.get("checkpoint_directory")
    filename = values.get("checkpoint_filename")
    if directory and filename:
        return str(Path(os.fspath(directory)) / os.fspath(filename))
    if directory:
        return str(os.fspath(directory))
    return None


def file_system_space(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """(free, total) bytes of the file system holding ``path``, or of its nearest existing parent (a save that
    failed may have left nothing); None when unreadable. Free is what an unprivileged writer may still use."""
    try:
        folder = Path(path)
        for _ in range(64):
            if folder.exists():
                break
            folder = folder.parent
        stat = os.statvfs(folder)
        return stat.f_bavail * stat.f_frsize, stat.f_blocks * stat.f_frsize
    except (OSError, TypeError, ValueError):
        return None
