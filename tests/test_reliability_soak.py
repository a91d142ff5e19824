"""The 10-minute soak (benchmarks/soak.py), kept out of the default run.

pytest -m soak tests/test_reliability_soak.py            # 10 minutes
SOAK_MINUTES=1 pytest -m soak tests/test_reliability_soak.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._reliability import ROOT, child_env


@pytest.mark.subprocess
@pytest.mark.soak
@pytest.mark.timeout(0)
def test_soak(tmp_path: Path) -> None:
    """A step every 10 ms with sub-phase spans and events, file + log backends: every step in
    the file once, no drops, no sequence gaps, RSS flat after warm-up."""
    minutes = os.environ.get("SOAK_MINUTES", "10")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--minutes", minutes, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=child_env(),
        check=False,
    )
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(summary, indent=2))
    assert summary["ok"], summary
    assert done.returncode == 0
