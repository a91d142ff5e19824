"""Which reader turns a job's JSON lines into the ``raw`` table: traintrace's own scanner, or DuckDB's read_json.

The scanner (``traintrace._scan``, C, built with the native core) parses only the fields the analyses
read and hands DuckDB their columns through the Arrow C stream interface; a line whose meaning it
cannot be sure of is left to DuckDB's reader, so the table holds the same rows either way
(docs/analysis.md, "The engine"). Without the extension, with ``TRAINTRACE_PURE=1`` or with
``TRAINTRACE_READER=duckdb``, DuckDB's ``read_json`` reads the files, as it always did; by default
(``auto``) it also reads a job under ``SCANNER_MIN_BYTES``, where the scanner saves nothing.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from .._format import SQL_COLUMNS
from .._names import RecordKind, SpanName

__all__ = ["READERS", "SCANNER_MIN_BYTES", "native_scanner", "reader_wanted", "scan_fields", "scanner"]

#: ``TRAINTRACE_READER``: ``auto`` (the default: the scanner when it is built and the job holds at least
#: ``SCANNER_MIN_BYTES``), ``native`` (the scanner whenever it is built) or ``duckdb``.
READERS = ("auto", "native", "duckdb")

#: Below this many bytes of files ``auto`` leaves a job to DuckDB's read_json: the Arrow scan needs DuckDB's
#: ``_sources`` modules (about 15 ms to import, ``_engine.enable_arrow_scan``), and below about 16 MB the two
#: readers take the same time (``summary``, medians of 7 on a 2-core VM: 10 MB 0.350 s with the scanner, 0.367
#: without; 15 MB 0.397 s, 0.391; 60 MB 0.482 s, 0.588).
SCANNER_MIN_BYTES = 16 << 20

_SCAN_TYPES = {"VARCHAR": "str", "BIGINT": "int", "JSON": "json"}

#: Names that make DuckDB read a file compressed: those the scanner leaves to it.
_COMPRESSED = (".gz", ".gzip", ".zst", ".zstd")


def scan_fields(core: Sequence[str]) -> list[tuple[str, str]]:
    """The scanner's field list: the core columns in table order, then the rare fields (packed as JSON)."""
    fields = [(name, _SCAN_TYPES[SQL_COLUMNS[name]]) for name in core]
    fields += [(name, "rare_" + _SCAN_TYPES[sql]) for name, sql in SQL_COLUMNS.items() if name not in core]
    return fields


def reader_wanted() -> str:
    """``TRAINTRACE_READER`` (``auto`` unless it says ``native`` or ``duckdb``); ``TRAINTRACE_PURE=1`` means
    ``duckdb``."""
    if os.environ.get("TRAINTRACE_PURE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "duckdb"
    wanted = os.environ.get("TRAINTRACE_READER", "auto").strip().lower()
    return wanted if wanted in READERS else "auto"


def native_scanner() -> ModuleType | None:
    """``traintrace._scan``, or None: not built, a stale build, or DuckDB's reader asked for."""
    if reader_wanted() == "duckdb":
        return None
    try:
        module = importlib.import_module("traintrace._scan")
    except ImportError:
        return None
    return module if hasattr(module, "Scanner") else None


def _total_bytes(paths: Sequence[Path]) -> int:
    total = 0
    for path in paths:
        try:
            total += Path(path).stat().st_size
        except OSError:
            return SCANNER_MIN_BYTES  # the scanner says what is wrong with it
    return total


def scanner(
    paths: Sequence[Path],
    core: Sequence[str],
    rare_kinds: Sequence[str],
    *,
    lean: bool,
    threads: int | None,
) -> Any | None:
    """A ``Scanner`` over ``paths``, or None where DuckDB's reader reads them (no scanner, a compressed file, a
    small job unless the scanner is asked for)."""
    module = native_scanner()
    if module is None or any(str(p).lower().endswith(_COMPRESSED) for p in paths):
        return None
    if reader_wanted() == "auto" and _total_bytes(paths) < SCANNER_MIN_BYTES:
        return None
    return module.Scanner(
        [str(p) for p in paths],
        scan_fields(core),
        str(RecordKind.SPAN),
        str(SpanName.ITERATION),
        ("step", "batch_size"),
        tuple(rare_kinds),
        lean=lean,
        threads=threads or os.cpu_count() or 1,
    )
