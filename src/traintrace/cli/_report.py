"""``traintrace report``: one self-contained HTML file (no network, no CDN).

The data are embedded as JSON inside ``<script type="application/json">``
with ``<``, ``>``, ``&`` and the JavaScript line separators escaped, and the
page's own script (report.html, next to this module) draws the charts: the
step, loss, learning-rate and throughput charts with uPlot (MIT, vendored
unmodified with its licence as uplot.min.js / uplot.min.css and inlined into
the page, so the Content-Security-Policy still forbids every load), the rest as
inline SVG through DOM calls. Text from records only ever reaches the page
through ``textContent`` (uPlot sets its legend labels that way too), so a span
name holding ``<script>`` is shown, not run.
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
#: At most this many points per step-axis line (steps are binned beyond it).
MAX_STEP_POINTS = 1500
#: Up to this many ranks, the step-time chart draws every rank; above it, the spread over ranks and the stragglers.
MAX_RANK_SERIES = 16
_VAL_LOSS_KEYS = ("loss", "val_loss", "eval_loss", "validation_loss", "val/loss")
_VAL_STEP_KEYS = ("current_iteration", "global_step", "step")
_LR_KEYS = ("learning_rate", "lr")


def _safe_json(data: Any) -> str:
    text = json.dumps(data, separators=(",", ":"), allow_nan=False, default=str)
    return (
        text.replace("&", "\\u0026")
        .replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _coalesce_attr(keys: tuple[str, ...], kind: str, source: str = "attrs") -> str:
    return "coalesce(" + ", ".join(f"try_cast({source}->>'{k}' AS {kind})" for k in keys) + ")"


def _by_step(job: Job, lowest_rank: int | None, stragglers: list[int]) -> dict[str, Any]:
    """Step-axis series: step time per rank (or its spread over ranks), loss, validation loss, learning rate.

    The step is the iteration's ``step`` attribute (its order within the stream when absent); steps are binned
    so that no line has more than MAX_STEP_POINTS points, and each point sits at the first step of its bin.
    """
    job.con.execute(
        f"""CREATE OR REPLACE TEMP TABLE report_steps AS
            SELECT rank, stream, ts, dur,
                   coalesce(try_cast(attrs->>'step' AS BIGINT),
                            row_number() OVER (PARTITION BY stream ORDER BY ts) - 1) AS step,
                   try_cast(attrs->>'loss' AS DOUBLE) AS loss, {_coalesce_attr(_LR_KEYS, "DOUBLE")} AS lr
            FROM iterations WHERE status = 'ok'"""
    )
    bounds = job.one("SELECT min(step), max(step), count(DISTINCT rank) FROM report_steps")
    empty: dict[str, Any] = {"x": [], "ranks": 0}
    if bounds is None or bounds[0] is None:
        return empty
    lo, hi, n_ranks = int(bounds[0]), int(bounds[1]), int(bounds[2])
    validations: list[tuple[int, float]] = []
    if lowest_rank is not None:
        vloss = _coalesce_attr(_VAL_LOSS_KEYS, "DOUBLE", "v.attrs")
        vstep = _coalesce_attr(_VAL_STEP_KEYS, "BIGINT", "v.attrs")
        validations = [
            (int(step), float(value))
            for step, value in job.rows(
                f"""SELECT coalesce({vstep}, (SELECT max(s.step) FROM report_steps s
                                              WHERE s.rank = v.rank AND s.ts + s.dur <= v.ts)) AS step, {vloss}
                    FROM spans_small v
                    WHERE v.name = 'validation_loop' AND NOT v.is_agent AND v.rank = ? AND NOT v.open
                      AND {vloss} IS NOT NULL
                      AND coalesce(try_cast(v.attrs->>'sanity_check' AS BOOLEAN), false) = false
                    ORDER BY v.ts""",
                [lowest_rank],
            )
            if step is not None and value is not None and math.isfinite(value)
        ]
    # A validation after the last step (its current_iteration is the count of steps done) widens the axis.
    lo = min([lo, *(st for st, _ in validations)])
    hi = max([hi, *(st for st, _ in validations)])
    bw = max(1, -(-(hi - lo + 1) // MAX_STEP_POINTS))
    bins = (hi - lo) // bw + 1
    binx = f"(step - {lo}) // {bw}"
    x = [lo + b * bw for b in range(bins)]

    def column(rows: list[tuple[Any, ...]], idx: int = 1) -> list[float | None]:
        out: list[float | None] = [None] * bins
        for row in rows:
            out[int(row[0])] = row[idx]
        return out

    lines: list[dict[str, Any]] = []
    if n_ranks <= MAX_RANK_SERIES:
        grid: dict[int, list[tuple[Any, ...]]] = {}
        for rank, b, value in job.rows(
            f"SELECT rank, {binx} AS b, median(dur) / 1e9 FROM report_steps GROUP BY ALL ORDER BY 1, 2"
        ):
            grid.setdefault(int(rank), []).append((b, value))
        lines = [{"name": f"rank {k}", "rank": k, "values": column(v)} for k, v in sorted(grid.items())]
    else:
        spread = job.rows(
            f"""SELECT b, min(m), median(m), max(m) FROM (
                    SELECT rank, {binx} AS b, median(dur) / 1e9 AS m FROM report_steps GROUP BY ALL
                ) GROUP BY b ORDER BY b"""
        )
        lines = [
            {"name": "slowest rank", "kind": "max", "values": column(spread, 3)},
            {"name": "median over ranks", "kind": "median", "values": column(spread, 2)},
            {"name": "fastest rank", "kind": "min", "values": column(spread, 1)},
        ]
        for rank in stragglers[:8]:
            rows = job.rows(
                f"SELECT {binx} AS b, median(dur) / 1e9 FROM report_steps WHERE rank = ? GROUP BY ALL", [rank]
            )
            lines.append({"name": f"rank {rank} (straggler)", "rank": rank, "values": column(rows)})
    loss: list[float | None] = [None] * bins
    lr: list[float | None] = [None] * bins
    val: list[float | None] = [None] * bins
    if lowest_rank is not None:
        rows = job.rows(
            f"""SELECT {binx} AS b, avg(loss), avg(lr) FROM report_steps WHERE rank = ? GROUP BY ALL""",
            [lowest_rank],
        )
        loss, lr = column(rows, 1), column(rows, 2)
        for step, value in validations:
            val[(step - lo) // bw] = value  # the last one in a bin
    job.con.execute("DROP TABLE IF EXISTS report_steps")
    return {"x": x, "bin": bw, "ranks": n_ranks, "lines": lines, "loss": loss, "val_loss": val, "lr": lr}


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
            FROM (SELECT ts, {job.attr_fields("attrs")} AS a FROM other
                  WHERE kind = 'event' AND name = 'training_iterations'
                    AND stream_rank = (SELECT min(stream_rank) FROM other WHERE kind = 'event'
                                       AND name = 'training_iterations'))
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
    result: dict[str, Any] = _finite(
        {
            "title": f"traintrace report: {s['job'] or '?'}",
            "summary": s,
            "ranks": {k: v for k, v in r.items() if k != "windows"},
            "heat": r["windows"],
            "heat_window_s": r.get("window_s"),
            "errors": {
                k: v
                for k, v in e.items()
                if k
                in (
                    "first_error",
                    "groups",
                    "hang_suspects",
                    "ranks_missing",
                    "verdict",
                    "status",
                    "culprit",
                    "rank_states",
                    "rule",
                    "restart",
                    "failed_restarts",
                )
            },
            "window_s": width / 1e9,
            "windows": windows,
            "step_lines": [{"rank": k, "values": per_rank[k]} for k in sorted(slow_first)],
            "series": sorted(by_w.values(), key=lambda x: x["w"]),
            "series_rank": lowest_rank,
            "by_step": _by_step(job, lowest_rank, list(r.get("stragglers") or [])),
            "n_ranks": len(r.get("ranks") or []),
            "timeline": timeline,
            "streams": streams,
        }
    )
    return result


def _vendored(name: str) -> str:
    """A vendored file (uPlot, MIT licence kept in its header), checked safe to inline in a <script>/<style>."""
    text = resources.files("traintrace.cli").joinpath(name).read_text(encoding="utf-8")
    lowered = text.lower()
    if any(bad in lowered for bad in ("</script", "</style", "<!--", "__data__", "__title__")):
        raise RuntimeError(f"{name} cannot be inlined safely")
    return text


def write_report(job: Job, out: str | os.PathLike[str], windows: int = 60) -> Path:
    data = report_data(job, windows)
    template = resources.files("traintrace.cli").joinpath("report.html").read_text(encoding="utf-8")
    head, tail = template.split("__DATA__", 1)
    # The library first (it holds no placeholder, checked), the title last: a job named like a placeholder stays text.
    head = head.replace("__UPLOT_CSS__", _vendored("uplot.min.css")).replace("__TITLE__", html.escape(data["title"]))
    tail = tail.replace("__UPLOT_JS__", _vendored("uplot.min.js"))
    page = head + _safe_json(data) + tail
    path = Path(out)
    from .._safefs import make_dirs, write_new_file

    make_dirs(path.parent, 0o750)
    # Through a new file and a rename: a link at ``out`` is replaced, never written through.
    write_new_file(path, page.encode("utf-8"), 0o640)
    return path
