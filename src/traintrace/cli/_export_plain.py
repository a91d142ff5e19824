"""``export --format chrome`` without DuckDB: the same Trace Event Format from the plain reader.

Used when the ``analysis`` extra is not installed. It reads each file whole
with :mod:`traintrace.reader` (memory grows with the job), where the DuckDB
path streams; the events and their fields are the same (docs/analysis.md).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..reader import StreamFile, read_file
from ._engine import BEFORE_THE_LOOP, discover, last_run_start, lived_until, read_attempts

#: pid of the launcher (agent) track: after every rank (as in the DuckDB export).
AGENT_PID = 1_000_000
_RATES = ("samples_per_second", "tokens_per_second", "mfu", "tflops")


def _stream_end(records: list[dict[str, Any]], header: dict[str, Any]) -> int:
    end = int(header.get("ts") or 0)
    for record in records:
        ts = record.get("ts")
        if isinstance(ts, int):
            dur = record.get("dur") if record.get("kind") == "span" else 0
            end = max(end, ts + (dur if isinstance(dur, int) else 0))
    return end


def export_chrome_plain(
    paths: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    ranks: list[int] | None = None,
    start_s: float | None = None,
    end_s: float | None = None,
) -> dict[str, Any]:
    """Write the trace to ``out`` from ``paths`` (files or job folders); returns counts."""
    found = discover(paths)
    files: list[StreamFile] = [read_file(p) for p in found]
    of_file = [(str(p), s) for p, f in zip(found, files, strict=True) for s in f.streams]
    of_file = [(p, s) for p, s in of_file if isinstance(s.header.get("ts"), int)]
    if not of_file:
        raise ValueError("no traintrace streams found in " + ", ".join(str(p) for p in paths))
    # The last run of the job, as the DuckDB export reads it (``last_run_start``).
    since = last_run_start(
        (p, s.header["ts"], s.header.get("restart"), s.header.get("pid"), _stream_end(s.records, s.header))
        for p, s in of_file
    )
    streams = [s for _, s in of_file if since is None or s.header["ts"] >= since]
    attempts = read_attempts(p.parent for p in found)
    # Where each stream's open spans end (as the DuckDB export's ``export_ends``): its last record, or when its rank,
    # dead without closing it, last showed life; and where a phase before the loop it left open ended.
    ends: dict[int, tuple[int, int | None]] = {}
    for stream in streams:
        end, header = _stream_end(stream.records, stream.header), stream.header
        rank = header.get("rank")
        closed = any(r.get("kind") == "close" for r in stream.records)
        if isinstance(rank, int) and header.get("role") != "agent" and not closed:
            progress = attempts.get((rank, int(header.get("restart") or 0)))
            ends[id(stream)] = lived_until(progress, end, header.get("pid"))
        else:
            ends[id(stream)] = (end, None)
    job_start = min(int(s.header["ts"]) for s in streams)
    job_end = max(end for end, _ in ends.values())
    lo = job_start + int((start_s or 0) * 1e9)
    hi = job_end + 1 if end_s is None else job_start + int(end_s * 1e9)

    def us(ts: int) -> float:
        return round((ts - job_start) / 1000.0, 3)

    counts = dict.fromkeys(("spans", "iterations", "loss", "instants", "rates", "metadata"), 0)
    events: list[dict[str, Any]] = []
    hosts: dict[int, str] = {}
    threads: set[tuple[int, int, str]] = set()
    agent = False
    for stream in streams:
        header = stream.header
        is_agent = header.get("role") == "agent"
        rank = header.get("rank")
        if not is_agent and not isinstance(rank, int):
            continue
        pid = AGENT_PID if is_agent else int(rank)  # type: ignore[arg-type]
        if ranks is not None and (is_agent or pid not in ranks):
            continue
        if is_agent:
            agent = True
        else:
            hosts.setdefault(pid, str(header.get("host")))
        end, first = ends[id(stream)]
        for record in stream.records:
            if record.get("kind") == "thread" and record.get("thread_name") is not None:
                threads.add((pid, int(record.get("tid") or 0), str(record["thread_name"])))
        for span in stream.spans():
            ts, dur = span.get("ts"), span.get("dur")
            if not isinstance(ts, int):
                continue
            if not isinstance(dur, int):
                dur = max((first if first is not None and span.get("name") in BEFORE_THE_LOOP else end) - ts, 0)
            if ts + dur < lo or ts > hi:
                continue
            attrs = dict(span.get("attrs") or {})
            tid = span.get("tid") or 0
            if span.get("name") == "iteration" and not is_agent:
                if span.get("status") == "open":
                    continue  # as in the DuckDB export: a step that never ended is not a step
                events.append(
                    {
                        "name": "iteration",
                        "cat": "step",
                        "ph": "X",
                        "pid": pid,
                        "tid": tid,
                        "ts": us(ts),
                        "dur": round(dur / 1000.0, 3),
                        "args": attrs,
                    }
                )
                counts["iterations"] += 1
                loss = attrs.get("loss")
                if isinstance(loss, int | float) and not isinstance(loss, bool) and math.isfinite(loss):
                    events.append(
                        {"name": "loss", "ph": "C", "pid": pid, "ts": us(ts + dur), "args": {"loss": float(loss)}}
                    )
                    counts["loss"] += 1
                continue
            args = {**attrs, "status": span.get("status"), "id": span.get("id")}
            events.append(
                {
                    "name": span.get("name"),
                    "cat": "span",
                    "ph": "X",
                    "pid": pid,
                    "tid": tid,
                    "ts": us(ts),
                    "dur": round(dur / 1000.0, 3),
                    "args": args,
                }
            )
            counts["spans"] += 1
        for record in stream.records:
            kind, ts = record.get("kind"), record.get("ts")
            if kind not in ("event", "error") or not isinstance(ts, int) or ts < lo or ts > hi:
                continue
            args = dict(record.get("attrs") or {})
            if kind == "error":
                args.update(
                    error_type=record.get("error_type"), message=record.get("message"), stack=record.get("stack")
                )
            events.append(
                {
                    "name": record.get("name"),
                    "cat": kind,
                    "ph": "i",
                    "s": "t",
                    "pid": pid,
                    "tid": record.get("tid") or 0,
                    "ts": us(ts),
                    "args": args,
                }
            )
            counts["instants"] += 1
            if kind == "event" and record.get("name") == "training_iterations":
                rates = {k: args.get(k) for k in _RATES}
                events.append({"name": "progress", "ph": "C", "pid": pid, "ts": us(ts), "args": rates})
                counts["rates"] += 1
    meta: list[dict[str, Any]] = []
    for rank, host in sorted(hosts.items()):
        meta.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank} ({host})"}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
    if agent:
        meta.append({"name": "process_name", "ph": "M", "pid": AGENT_PID, "args": {"name": "launcher"}})
    for pid, tid, name in sorted(threads):
        meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
    counts["metadata"] = len(meta)
    counts["total"] = sum(counts.values())
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    job = next((s.header.get("job") for s in streams), None)
    head = {
        "displayTimeUnit": "ms",
        "otherData": {"job": job, "start_ns": job_start, "source": "traintrace export --format chrome"},
    }
    with out_path.open("w", encoding="utf-8") as handle:
        handle.write(json.dumps(head)[:-1] + ', "traceEvents": [\n')
        handle.write(",\n".join(json.dumps(e, default=str) for e in [*meta, *events]))
        handle.write("\n]}\n")
    return {"path": str(out_path), "events": counts, "start_ns": job_start}
