"""Fields of a Linux ``/proc/<pid>/stat`` (or ``/proc/self/task/<tid>/stat``) line, per proc(5)."""

from __future__ import annotations

import os


def stat_fields(path: str) -> list[bytes]:
    """The fields after the command name, field 3 (the state) first: field N is ``[N - 3]``.

    The name (field 2) is in parentheses and may hold spaces and parentheses: the fields are counted from
    the last closing one. Raises ``OSError`` when the file cannot be read.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        line = os.read(fd, 4096)
    finally:
        os.close(fd)
    return line.rsplit(b")", 1)[1].split()
