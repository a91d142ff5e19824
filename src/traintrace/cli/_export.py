"""Chrome / Perfetto Trace Event Format export.

The events are serialised by DuckDB (``to_json``) and written by its COPY,
so a multi-million-span job exports at the speed of the engine, not of a
Python loop. One process track per rank (``pid`` = rank), one thread track
per OS thread, spans as complete (``X``) events, events and errors as
instant (``i``) events, loss and progress rates as counter (``C``) tracks.
Times are microseconds from the job's first record, each host's on the reference
host's clock where the records prove hosts' clocks apart (``host_clocks``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._analysis import FIELD_ALIASES, job_bounds_on_one_clock, prepare
from ._diagnosis import host_clocks
from ._engine import (
    BEFORE_THE_LOOP,
    COLUMNS,
    CORE_COLUMNS,
    EXPORT_FORMAT,
    EXPORT_META,
    EXPORT_VERSION,
    RARE_FIELDS,
    Job,
    find_export,
    lived_until,
    sql_string,
)

#: pid of the launcher (agent) track: after every rank.
AGENT_PID = 1_000_000

# DuckDB's CSV writer with a delimiter JSON text never holds and no quote character writes each JSON line
# verbatim. (A quote character, however unlikely, is not enough: DuckDB 2.0 (not 1.3) quotes every value that
# holds its comment character, '#', which a stack trace or a message often does.)
_RAW_LINES = "FORMAT csv, HEADER false, DELIMITER '\x02', QUOTE '', ESCAPE ''"


def export_chrome(
    job: Job,
    out: str | os.PathLike[str],
    ranks: list[int] | None = None,
    start_s: float | None = None,
    end_s: float | None = None,
) -> dict[str, Any]:
    """Write the trace to ``out``; returns counts of what was written."""
    prepare(job)
    job_start, job_end = job_bounds_on_one_clock(job, _ends_of_open_spans(job))
    on_one_clock = _on_one_clock(job)
    spans_small, iterations, other, open_ends = (
        on_one_clock(t) for t in ("spans_small", "iterations", "other", "export_ends")
    )
    lo = job_start + int((start_s or 0) * 1e9)
    hi = job_end + 1 if end_s is None else job_start + int(end_s * 1e9)
    rank_filter = ""
    if ranks is not None:
        rank_filter = "AND rank IN (" + ",".join(str(int(r)) for r in ranks) + ")" if ranks else "AND false"
    pid = f"coalesce(rank, {AGENT_PID})"
    us = f"round((ts - {job_start}) / 1000.0, 3)"
    cond = f"ts + coalesce(dur, 0) >= {lo} AND ts <= {hi} {rank_filter}"
    sp = "s."
    span_cond = f"{sp}ts + coalesce({sp}dur, 0) >= {lo} AND {sp}ts <= {hi} {rank_filter.replace('rank', sp + 'rank')}"
    before = ", ".join(sql_string(name) for name in BEFORE_THE_LOOP)
    rate_fields = ("samples_per_second", "tokens_per_second", "mfu", "tflops")
    counter_args = ", ".join(
        f"'{key}', coalesce(" + ", ".join(f"try_cast(a.{a} AS DOUBLE)" for a in FIELD_ALIASES[key]) + ")"
        for key in rate_fields
    )
    parts = {
        "spans": f"""
            SELECT ',' || to_json({{'name': s.name, 'cat': 'span', 'ph': 'X', 'pid': coalesce(s.rank, {AGENT_PID}),
                'tid': coalesce(s.tid, 0), 'ts': round((s.ts - {job_start}) / 1000.0, 3),
                'dur': round(coalesce(s.dur, greatest(CASE WHEN f.first_ts IS NOT NULL AND s.name IN ({before})
                                                           THEN f.first_ts ELSE f.end_ts END - s.ts, 0)) / 1000.0, 3),
                'args': json_merge_patch(coalesce(s.attrs, '{{}}'::JSON),
                                         json_object('status', s.status, 'id', s.id))}})
            FROM {spans_small} s JOIN {open_ends} f USING (stream)
            WHERE s.name <> 'iteration' AND {span_cond}
        """,
        "iterations": f"""
            SELECT ',' || to_json({{'name': 'iteration', 'cat': 'step', 'ph': 'X', 'pid': rank,
                'tid': coalesce(tid, 0), 'ts': {us}, 'dur': round(dur / 1000.0, 3),
                'args': coalesce(attrs, '{{}}'::JSON)}})
            FROM {iterations} WHERE {cond}
        """,
        "loss": f"""
            SELECT ',' || to_json({{'name': 'loss', 'ph': 'C', 'pid': rank,
                'ts': round((ts + dur - {job_start}) / 1000.0, 3),
                'args': {{'loss': try_cast(attrs->>'loss' AS DOUBLE)}}}})
            FROM {iterations} WHERE {cond} AND isfinite(try_cast(attrs->>'loss' AS DOUBLE))
        """,
        "instants": f"""
            SELECT ',' || to_json({{'name': name, 'cat': kind, 'ph': 'i', 's': 't', 'pid': {pid},
                'tid': coalesce(tid, 0), 'ts': {us},
                'args': CASE WHEN kind = 'error' THEN json_merge_patch(coalesce(attrs, '{{}}'::JSON),
                    json_object('error_type', error_type, 'message', message, 'stack', stack))
                    ELSE coalesce(attrs, '{{}}'::JSON) END}})
            FROM (SELECT *, stream_rank AS rank FROM {other}) WHERE kind IN ('event', 'error') AND {cond}
        """,
        "rates": f"""
            SELECT ',' || to_json({{'name': 'progress', 'ph': 'C', 'pid': rank, 'ts': {us},
                'args': json_merge_patch('{{}}'::JSON, json_object({counter_args}))}})
            FROM (SELECT *, stream_rank AS rank, {job.attr_fields("attrs")} AS a FROM {other}
                  WHERE kind = 'event' AND name = 'training_iterations')
            WHERE {cond}
        """,
    }
    counts: dict[str, int] = {}
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="traintrace-export-", dir=job.scratch) as tmp:
        pieces = []
        for key, sql in parts.items():
            piece = Path(tmp) / f"{key}.txt"
            row = job.con.execute(f"COPY ({sql}) TO {sql_string(str(piece))} ({_RAW_LINES})").fetchone()
            counts[key] = int(row[0]) if row else 0
            pieces.append(piece)
        meta = _metadata(job, ranks)
        with out_path.open("wb") as handle:
            other_data: dict[str, Any] = {
                "job": _job_name(job),
                "start_ns": job_start,
                "source": "traintrace export --format chrome",
            }
            offsets = host_clocks(job)
            if offsets["offsets_ns"]:  # the times are on this host's clock, each other host's moved by this much
                other_data["clock_offsets"] = {
                    "reference": offsets["reference"],
                    "offsets_s": {h: ns / 1e9 for h, ns in offsets["offsets_ns"].items()},
                }
            head = {"displayTimeUnit": "ms", "otherData": other_data}
            handle.write(json.dumps(head)[:-1].encode() + b', "traceEvents": [\n')
            handle.write(",\n".join(json.dumps(m) for m in meta).encode())
            handle.write(b"\n")
            for piece in pieces:
                if piece.exists():
                    with piece.open("rb") as src:
                        shutil.copyfileobj(src, handle, 1 << 20)
            handle.write(b"]}\n")
    counts["metadata"] = len(meta)
    counts["total"] = sum(counts.values())
    return {"path": str(out_path), "events": counts, "start_ns": job_start}


def _ends_of_open_spans(job: Job) -> dict[str, int]:
    """Make ``export_ends``: per stream, where the spans it left open end (``end_ts``: its last record, or, for a
    stream that ended without its close record, when its rank last showed life; ``first_ts``: where a phase before
    the loop left open ended, its first iteration's start past the stream's end, else NULL), on its host's clock,
    as ``summary`` reads them. Before, a rank aborted after waiting 3 s in a collective was drawn gone from its last
    record on. Returns host -> the latest such end on its clock (the timeline reaches it)."""
    attempts = job.progress_of_attempts()
    later: dict[int, tuple[int, int | None]] = {}
    hosts: dict[str, int] = {}
    if attempts:
        rows = job.rows(
            "SELECT f.stream, f.rank, f.restart, f.end_ts, h.host, h.pid FROM stream_facts f "
            "JOIN streams h ON h.stream = f.stream WHERE NOT f.closed AND NOT f.is_agent"
        )
        for stream, rank, restart, end, host, pid in rows:
            until, first = lived_until(attempts.get((int(rank), int(restart))), int(end), pid)
            if until > int(end):
                later[int(stream)] = (until, first)
                hosts[host] = max(hosts.get(host, 0), until)
    whens = " ".join(f"WHEN {stream} THEN {until}" for stream, (until, _) in later.items())
    firsts = " ".join(f"WHEN {stream} THEN {first}" for stream, (_, first) in later.items() if first is not None)
    job.con.execute(
        "CREATE OR REPLACE TEMP TABLE export_ends AS SELECT stream, "
        + (f"CASE stream {whens} ELSE end_ts END" if whens else "end_ts")
        + " AS end_ts, "
        + (f"CASE stream {firsts} END" if firsts else "NULL::BIGINT")
        + " AS first_ts FROM stream_facts"
    )
    return hosts


def _on_one_clock(job: Job) -> Callable[[str], str]:
    """A function from a table's name to the relation the export reads: the table itself, or, where hosts'
    clocks differ, the table with each stream's times moved onto the reference host's clock (a Perfetto
    timeline of a host 2 s ahead showed its ranks' steps 2 s after the others' they ran with)."""
    offsets = host_clocks(job)["offsets_ns"]
    if not offsets:
        return lambda table: table
    by_host = " ".join(f"WHEN {sql_string(host)} THEN {int(ns)}" for host, ns in offsets.items())
    job.con.execute(
        f"CREATE OR REPLACE TEMP TABLE export_clock AS SELECT stream, CASE host {by_host} ELSE 0 END AS ahead "
        "FROM streams"
    )
    moved = {"export_ends": "t.end_ts - c.ahead AS end_ts, t.first_ts - c.ahead AS first_ts"}

    def relation(table: str) -> str:
        return (
            f"(SELECT t.* REPLACE ({moved.get(table, 't.ts - c.ahead AS ts')}) "
            f"FROM {table} t JOIN export_clock c USING (stream))"
        )

    return relation


def _job_name(job: Job) -> str | None:
    row = job.one("SELECT any_value(job) FROM streams")
    return row[0] if row else None


def _metadata(job: Job, ranks: list[int] | None) -> list[dict[str, Any]]:
    meta: list[dict[str, Any]] = []
    seen = job.rows("SELECT DISTINCT rank, any_value(host) FROM streams WHERE NOT is_agent GROUP BY rank ORDER BY 1")
    for rank, host in seen:
        if ranks is not None and rank not in ranks:
            continue
        meta.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank} ({host})"}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
    if ranks is None and job.one("SELECT count(*) FROM streams WHERE is_agent")[0]:
        meta.append({"name": "process_name", "ph": "M", "pid": AGENT_PID, "args": {"name": "launcher"}})
    for rank, tid, name in job.rows(
        "SELECT DISTINCT stream_rank, tid, thread_name FROM other WHERE kind = 'thread' AND thread_name IS NOT NULL"
    ):
        if ranks is not None and rank not in ranks:
            continue
        pid = AGENT_PID if rank is None else rank
        meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid or 0, "args": {"name": name}})
    return meta


#: The Parquet export's columns besides the partition ``rank``, in order (docs/format.md, "Parquet export").
PARQUET_COLUMNS = (
    "file",
    *(f for f in CORE_COLUMNS if f != "attrs"),
    "attrs",
    "step",
    "batch_size",
    *(f for f in RARE_FIELDS if f != "rank"),
)


def export_parquet(job: Job, out: str | os.PathLike[str]) -> dict[str, Any]:
    """Write the job's records as Parquet under the folder ``out``, one ``rank=N`` folder per rank.

    Every command reads the folder as it reads the JSON-lines files, with the same answers. A previous
    export there is replaced; any other non-empty folder is refused (nothing of the user's is deleted).
    """
    out_path = Path(out)
    if out_path.exists() and (not out_path.is_dir() or (any(out_path.iterdir()) and find_export([out_path]) is None)):
        raise ValueError(f"{out_path}: exists and is not a traintrace Parquet export; choose a new folder")
    spec = "{" + ", ".join(f'"{k}":"{COLUMNS[k]}"' for k in RARE_FIELDS) + "}"
    core = ", ".join(f'r."{k}"' for k in CORE_COLUMNS if k != "attrs")
    rare = ", ".join(f'x."{k}" AS "{k}"' for k in RARE_FIELDS if k != "rank")
    sql = f"""
        SELECT r.file, h.rank, {core}, r.attrs::VARCHAR AS attrs, r.step, r.batch_size, {rare}
        FROM (SELECT *, json_transform(rare, '{spec}') AS x FROM raw) r
        LEFT JOIN all_headers h ON r.file = h.file AND r.ts >= h.lo AND r.ts < h.hi  -- every run's records
    """
    with tempfile.TemporaryDirectory(prefix="traintrace-parquet-", dir=job.scratch) as tmp:
        staged = Path(tmp) / "export"
        row = job.con.execute(
            f"COPY ({sql}) TO {sql_string(str(staged))} (FORMAT parquet, COMPRESSION zstd, PARTITION_BY (rank))"
        ).fetchone()
        records = int(row[0]) if row else 0
        meta = {
            "format": EXPORT_FORMAT,
            "version": EXPORT_VERSION,
            "records": records,
            "world_size": job.manifest_world_size,
            "ignored_spans": job.ignored_spans,
            "files": [
                {"path": f.path, "size": f.size, "truncated_last_line": f.truncated_last_line} for f in job.files
            ],
            "columns": {"rank": "BIGINT (partition)", **_parquet_types()},
        }
        (staged / EXPORT_META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        if out_path.exists():
            shutil.rmtree(out_path)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staged), str(out_path))
    ranks = sorted(p.name for p in out_path.iterdir() if p.is_dir() and p.name.startswith("rank="))
    return {"path": str(out_path), "format": "parquet", "records": records, "partitions": len(ranks)}


def _parquet_types() -> dict[str, str]:
    extra = {"file": "BIGINT", "attrs": "VARCHAR (JSON text)", "step": "BIGINT", "batch_size": "BIGINT"}
    return {name: extra.get(name) or COLUMNS[name] for name in PARQUET_COLUMNS}
