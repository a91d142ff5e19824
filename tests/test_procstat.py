"""Reading /proc stat lines: the fields after a command name that may hold spaces and parentheses."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from traintrace._procstat import stat_fields

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux /proc")


def test_own_process_fields() -> None:
    fields = stat_fields(f"/proc/{os.getpid()}/stat")
    assert fields[0] in (b"R", b"S")  # field 3, the state: this process is running or about to
    assert int(fields[4 - 3]) == os.getppid()  # field 4


def test_a_command_name_with_spaces_and_parentheses() -> None:
    """A thread named ``a) b (c``: the fields still start after the name's own closing parenthesis."""
    import threading

    comm = Path(f"/proc/self/task/{threading.get_native_id()}/comm")
    before = comm.read_text().strip()
    comm.write_text("a) b (c")
    try:
        assert comm.read_text().strip() == "a) b (c"
        fields = stat_fields(f"/proc/self/task/{threading.get_native_id()}/stat")
        assert fields[0] == b"R" and int(fields[4 - 3]) == os.getppid()
    finally:
        comm.write_text(before)


def test_a_missing_process_raises_oserror() -> None:
    with pytest.raises(OSError):
        stat_fields("/proc/0/stat")
