"""Helpers shared by the reliability tests: child processes and record checks."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_PATH = ROOT / "src" / "traintrace" / "schema" / "record-v1.schema.json"


def core_env() -> dict[str, str]:
    """``TRAINTRACE_PURE`` when this test run forces the pure-Python core, for a child's environment."""
    pure = os.environ.get("TRAINTRACE_PURE")
    return {} if pure is None else {"TRAINTRACE_PURE": pure}


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child Python: this checkout's sources, no TRAINTRACE_* leaking in
    (but ``TRAINTRACE_PURE``: the child runs the core this test run tests)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINTRACE_") or k == "TRAINTRACE_PURE"}
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("PYTHONFAULTHANDLER", None)
    env.update(extra)
    return env


def write_script(tmp: Path, name: str, code: str) -> Path:
    script = tmp / name
    script.write_text(textwrap.dedent(code))
    return script


def run_script(script: Path, *args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(**env),
        check=False,
    )


@functools.cache
def validator() -> Any:
    import jsonschema

    schema = json.loads(SCHEMA_PATH.read_text())
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema)


def schema_errors(records: list[dict[str, Any]]) -> list[str]:
    """Messages for every record that does not validate against record-v1.schema.json."""
    check = validator()
    out = []
    for record in records:
        for error in check.iter_errors(record):
            out.append(f"{record.get('kind')} seq={record.get('seq')}: {error.message[:200]}")
    return out


def can_unshare() -> str:
    if os.geteuid() != 0:
        return "needs root to mount a tmpfs in a private mount namespace"
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "needs unshare(1) and mount(8)"
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        return f"unshare -m is not allowed here: {probe.stderr.decode(errors='replace').strip()}"
    return ""


needs_namespace = pytest.mark.skipif(bool(can_unshare()), reason=can_unshare() or "ok")
