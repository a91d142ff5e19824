"""The record format in one place: the schema's name and version, and the fields readers rely on.

The writer (``_pipeline``) builds records with these fields; the reader
(:mod:`traintrace.reader`) checks their types; the command (``cli._engine``)
reads them into DuckDB columns of the SQL types given here. The full
description is ``schema/record-v1.schema.json`` and docs/format.md.
"""

from __future__ import annotations

from typing import Final, NamedTuple

#: The header's ``schema`` and ``schema_version``.
SCHEMA: Final = "traintrace"
SCHEMA_VERSION: Final = 1

#: Suffix added to a stream's path for its fault file (faulthandler's tracebacks of a fatal signal).
FAULTS_SUFFIX: Final = ".faults.txt"
#: The line a process writes to its fault file as it opens it, before any stacks of its own: processes of one
#: stream file (a job's restarts append to it) share its fault file, and the analysis reads each one's part.
FAULTS_MARKER: Final = "# traintrace: the fault stacks of process "
#: Suffix of a rank's progress file (``traintrace.progress``), beside the job's streams.
PROGRESS_SUFFIX: Final = ".progress"


class Field(NamedTuple):
    """A record field: its DuckDB column type, and the Python types a reader accepts (empty: unchecked)."""

    sql: str
    types: tuple[type, ...] = ()


#: Record fields the readers use, by name. Everything else a record holds is passed through.
FIELDS: Final[dict[str, Field]] = {
    "kind": Field("VARCHAR"),
    "ts": Field("BIGINT"),
    "seq": Field("BIGINT"),
    "name": Field("VARCHAR", (str,)),
    "id": Field("BIGINT", (int,)),
    "parent": Field("BIGINT", (int,)),
    "tid": Field("BIGINT"),
    "dur": Field("BIGINT", (int, float)),
    # Device (GPU) time of a span and the device's idle gap before it (device timing; optional).
    "gpu_dur": Field("BIGINT", (int,)),
    "gpu_idle": Field("BIGINT", (int,)),
    "status": Field("VARCHAR", (str,)),
    "span": Field("BIGINT", (int,)),
    "link": Field("BIGINT"),
    "attrs": Field("JSON", (dict,)),
    "error_type": Field("VARCHAR"),
    "message": Field("VARCHAR"),
    "stack": Field("VARCHAR"),
    "thread_name": Field("VARCHAR"),
    "count": Field("BIGINT"),
    "reason": Field("VARCHAR"),
    "schema": Field("VARCHAR"),
    "schema_version": Field("BIGINT"),
    "job": Field("VARCHAR"),
    "job_name": Field("VARCHAR"),
    "rank": Field("BIGINT"),
    "world_size": Field("BIGINT"),
    "restart": Field("BIGINT"),
    "host": Field("VARCHAR"),
    "pid": Field("BIGINT"),
    "source": Field("VARCHAR"),
    "role": Field("VARCHAR"),
}

#: Fields whose type a reader relies on, and the types they must have.
CHECKED_TYPES: Final[dict[str, tuple[type, ...]]] = {name: f.types for name, f in FIELDS.items() if f.types}

#: Record fields as DuckDB columns.
SQL_COLUMNS: Final[dict[str, str]] = {name: f.sql for name, f in FIELDS.items()}
