"""Reading /proc stat lines: the fields after a command name that may hold spaces and parentheses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from traintrace._procstat import stat_fields

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux /proc")


def test_own_process_fields() -> None:
    fields = stat_fields(f"/proc/{os.getpid()}/stat")
    assert fields[0] in (b"R", b"S")  # field 3, the state: this process is running or about to
    assert int(fields[4 - 3]) == os.getppid()  # field 4


@pytest.mark.subprocess
def test_a_command_name_with_spaces_and_parentheses(tmp_path: Path) -> None:
    """A program whose name is ``a) b (c``: the fields still start after the name's own closing parenthesis."""
    odd = tmp_path / "a) b (c"
    odd.symlink_to(sys.executable)
    child = subprocess.Popen([str(odd), "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        name = Path(f"/proc/{child.pid}/comm").read_text().strip()
        assert name == "a) b (c"
        fields = stat_fields(f"/proc/{child.pid}/stat")
        assert int(fields[4 - 3]) == os.getpid()
    finally:
        child.communicate(b"")


def test_a_missing_process_raises_oserror() -> None:
    with pytest.raises(OSError):
        stat_fields("/proc/0/stat")
