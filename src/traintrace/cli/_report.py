"""``traintrace report``: one self-contained HTML file (no network, no CDN).

The data are embedded as JSON inside ``<script type="application/json">``
with ``<``, ``>``, ``&`` and the JavaScript line separators escaped, and the
page's own script (report.html, next to this module) draws every chart as
inline SVG through DOM calls; text from records only ever reaches the page
through ``textContent``, so a span name holding ``<script>`` is shown, not run.
"""

from __future__ import annotations

import html
import json
import math
import os
from importlib import resources
from pathlib import Path
from typing import Any

from ._analysis import errors, job_bounds, ranks, summary
from ._engine import Job

MAX_ERRORS = 2000
MAX_RANK_LINES = 4096


def _safe_json(data: Any) -> str:
    text = json.dumps(data, separators=(",", ":"), allow_nan=False, default=str)
    return (
        text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
        .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    )


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def report_data(job: Job, windows: int = 60) -> dict[str, Any]:
    """Everything the page draws, small enough to embed (buckets, not raw records)."""
    s = summary(job)
    r = ranks(job, top=10, windows=windows)
    e = errors(job)
    start, end = job_bounds(job)
    width = max((end - start) // max(windows, 1), 1)
    bucket = f"least((ts + dur - {start}) // {width}, {windows - 1})"
    step_grid = job.rows(
        f"SELECT rank, {bucket} AS w, median(dur) / 1e9 FROM iterations WHERE status = 'ok' GROUP BY ALL"
    )
    per_rank: dict[int, list[float | None]] = {}
    for rank, w, value in step_grid:
        per_rank.setdefault(int(rank), [None] * windows)[int(w)] = value
    lowest = job.one("SELECT min(rank) FROM iterations")
    lowest_rank = lowest[0] if lowest else None
    series: list[dict[str, Any]] = []
    if lowest_rank is not None:
        for w, steps, loss in job.rows(
            f"""SELECT {bucket} AS w, count(*), avg(try_cast(attrs->>'loss' AS DOUBLE))
                FROM iterations WHERE rank = ? AND status = 'ok' GROUP BY ALL ORDER BY 1""",
            [lowest_rank],
        ):
            series.append({"w": int(w), "steps_per_s": steps / (width / 1e9), "loss": loss})
    rates = job.rows(
        f"""SELECT least((ts - {start}) // {width}, {windows - 1}) AS w,
                   avg(coalesce(try_cast(a.samples_per_second AS DOUBLE), try_cast(a.samples_per_sec AS DOUBLE))),
                   avg(coalesce(try_cast(a.tokens_per_second AS DOUBLE), try_cast(a.tokens_per_sec AS DOUBLE)))
            FROM other WHERE kind = 'event' AND name = 'training_iterations'
              AND stream_rank = (SELECT min(stream_rank) FROM other WHERE kind = 'event'
                                 AND name = 'training_iterations')
            GROUP BY ALL ORDER BY 1"""
    )
    by_w = {x["w"]: x for x in series}
    for w, sps, tps in rates:
        entry = by_w.setdefault(int(w), {"w": int(w)})
        entry["samples_per_s"] = sps
        entry["tokens_per_s"] = tps
    timeline = job.dicts(
        f"""SELECT stream_rank AS rank, is_agent AS agent, name, error_type, message,
                   (ts - {start}) / 1e9 AS t
            FROM other WHERE kind = 'error' ORDER BY ts LIMIT {MAX_ERRORS}"""
    )
    streams = job.dicts(
        f"""SELECT rank, restart, is_agent AS agent, closed, (start_ts - {start}) / 1e9 AS t0,
                   (end_ts - {start}) / 1e9 AS t1 FROM streams ORDER BY rank, start_ts"""
    )
    slow_first = sorted(per_rank, key=lambda k: -max((v or 0) for v in per_rank[k]))[:MAX_RANK_LINES]
    result: dict[str, Any] = _finite({
        "title": f"traintrace report: {s['job'] or '?'}",
        "summary": s,
        "ranks": {k: v for k, v in r.items() if k != "windows"},
        "heat": r["windows"],
        "heat_window_s": r.get("window_s"),
        "errors": {k: v for k, v in e.items() if k in ("first_error", "groups", "hang_suspects", "ranks_missing",
                                                        "verdict", "status", "culprit", "rank_states", "rule")},
        "window_s": width / 1e9,
        "windows": windows,
        "step_lines": [{"rank": k, "values": per_rank[k]} for k in sorted(slow_first)],
        "series": sorted(by_w.values(), key=lambda x: x["w"]),
        "series_rank": lowest_rank,
        "timeline": timeline,
        "streams": streams,
    })
    return result


def write_report(job: Job, out: str | os.PathLike[str], windows: int = 60) -> Path:
    data = report_data(job, windows)
    template = resources.files("traintrace.cli").joinpath("report.html").read_text(encoding="utf-8")
    head, tail = template.split("__DATA__", 1)
    page = head.replace("__TITLE__", html.escape(data["title"])) + _safe_json(data) + tail
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path
