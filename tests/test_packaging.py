"""What `pip install .` installs: the traintrace package (with its native core where it builds), nothing else."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Building wheels does not depend on the core the suite records with.
pytestmark = [pytest.mark.subprocess, pytest.mark.once]


def _build_wheel(tmp_path: Path, **env: str) -> zipfile.ZipFile:
    # A copy of the tracked sources, as a fresh clone has them (no build products from this checkout).
    files = (
        subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    )
    source = tmp_path / "source"
    for name in filter(None, files):
        target = source / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    out = tmp_path / "wheels"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        capture_output=True,
        check=False,
        text=True,
        env={**os.environ, **env},
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = out.glob("traintrace-*.whl")
    return zipfile.ZipFile(wheel)


def test_the_wheel_holds_the_package_and_its_native_core_only(tmp_path: Path) -> None:
    """The C sources (src/native) are built into traintrace._span/_encode, not installed as a package."""
    names = _build_wheel(tmp_path).namelist()
    top = {name.split("/")[0] for name in names}
    assert top == {"traintrace", next(t for t in top if t.endswith(".dist-info"))}
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    if importlib.util.find_spec("traintrace._span") is not None:  # this machine builds the native core
        assert {f"traintrace/_span{suffix}", f"traintrace/_encode{suffix}"} <= set(names)
    assert "traintrace/py.typed" in names


def test_a_wheel_without_the_native_core_still_builds(tmp_path: Path) -> None:
    """TRAINTRACE_PURE_BUILD=1 (as where no compiler exists): a pure-Python wheel, never a failed install."""
    names = _build_wheel(tmp_path, TRAINTRACE_PURE_BUILD="1").namelist()
    assert not [name for name in names if name.endswith((".so", ".pyd"))]
    assert "traintrace/__init__.py" in names
