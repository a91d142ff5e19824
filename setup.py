"""Optional C extensions: the native recording core.

Every ``src/native/<name>.c`` builds ``traintrace._<name>``. A failed build (no
compiler, no Python headers) is reported and skipped: the package then runs on
its pure-Python core, which is always present. ``TRAINTRACE_PURE_BUILD=1``
skips the build on purpose; ``TRAINTRACE_NATIVE_CFLAGS`` adds compiler flags
(``-fsanitize=address`` for the sanitizer run).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent


class OptionalBuildExt(build_ext):
    """Build each extension if possible; never fail the install for want of a compiler."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - the extension is optional by design
            self._skipped(exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            self._skipped(exc, ext.name)

    @staticmethod
    def _skipped(exc: BaseException, name: str = "the native core") -> None:
        print(
            f"traintrace: could not build {name} ({exc}); using the pure-Python core",
            file=sys.stderr,
        )


def native_extensions() -> list[Extension]:
    if os.environ.get("TRAINTRACE_PURE_BUILD") == "1":
        return []
    extra = shlex.split(os.environ.get("TRAINTRACE_NATIVE_CFLAGS", ""))
    sources = sorted((HERE / "src" / "native").glob("*.c"))
    headers = [str(h.relative_to(HERE)) for h in sorted((HERE / "src" / "native").glob("*.h"))]
    return [
        Extension(
            f"traintrace._{source.stem}",
            [str(source.relative_to(HERE))],
            depends=headers,  # rebuilt when a header changes; shipped in the sdist
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-missing-field-initializers", *extra],
            extra_link_args=extra,
        )
        for source in sources
    ]


setup(ext_modules=native_extensions(), cmdclass={"build_ext": OptionalBuildExt})
