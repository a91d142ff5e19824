"""Plain-text tables for the terminal (no dependencies)."""

from __future__ import annotations

import datetime as _dt
from collections.abc import Sequence
from typing import Any

from ._analysis import CATEGORIES
from ._diagnosis import _error_line, node_phrase
from ._engine import compress_ranks

LABELS = {
    "productive": "productive training",
    "lost_progress": "progress lost (redone after failure)",
    "startup": "process start-up (to configure())",
    "initialization": "initialisation",
    "checkpoint_load": "checkpoint load",
    "checkpoint_save": "checkpoint save (exposed)",
    "validation": "validation",
    "test": "test",
    "data_loading": "data loading (outside steps)",
    "hang": "hang",
    "restart_idle": "restart / idle (no process)",
    "other": "other (uncovered)",
}


def seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0 s"
    if value >= 3600:
        return f"{value / 3600:.2f} h"
    if value >= 60:
        return f"{value / 60:.1f} min"
    if value >= 1:
        return f"{value:.2f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.1f} ms"
    return f"{value * 1e6:.0f} µs"


def number(value: float | int | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def when(ns: int | None) -> str:
    if ns is None:
        return "-"
    return _dt.datetime.fromtimestamp(ns / 1e9, tz=_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A left/right aligned text table; ``align`` is one of 'l'/'r' per column."""
    cells = [[str(c) for c in headers]] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    align = align or "l" + "r" * (len(headers) - 1)
    lines = []
    for n, row in enumerate(cells):
        parts = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(row, widths, align, strict=True)]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def notes(items: Sequence[str]) -> str:
    return "".join(f"note: {n}\n" for n in items)


def render_summary(s: dict[str, Any]) -> str:
    out = [f"VERDICT: {s['verdict']}", ""]
    title = s["job"] or "?"
    if s.get("job_name"):
        title += f" ({s['job_name']})"
    out.append(
        f"job {title}: {_n(s['ranks_seen'], 'rank')} on {_n(s['hosts'], 'host')}, {_n(s['streams'], 'stream')}, "
        f"{_n(s['restarts'], 'restart')}, {number(s['records'])} records in {_n(s['files'], 'file')}"
    )
    out.append(f"wall time {seconds(s['wall_s'])}  ({when(s['start_ns'])} to {when(s['end_ns'])})")
    out.append(f"GOODPUT {s['goodput'] * 100:.1f}%  (productive training time / job wall time)")
    out.append("")
    wall = s["wall_s"] or 1
    rows = [
        (LABELS[c], seconds(s["breakdown_s"][c]), f"{s['breakdown_s'][c] / wall * 100:.1f}%")
        for c in CATEGORIES
        if c == "productive" or s["breakdown_s"][c] > 0
    ]
    out.append(table(("time (mean over ranks)", "time", "share"), rows))
    out.append("")
    p = s["phases_s"]
    phase_rows = [
        ("process start-up", seconds(p["startup_s"])),
        ("initialisation", seconds(p["initialization_s"])),
        ("training (steps + data loading)", seconds(p["training_s"])),
        ("checkpoint save, exposed", seconds(p["checkpoint_save_exposed_s"])),
        ("checkpoint save, background", seconds(p["checkpoint_save_background_s"])),
        ("checkpoint load", seconds(p["checkpoint_load_s"])),
        ("validation", seconds(p["validation_s"])),
        ("test", seconds(p["test_s"])),
        # The launcher's rendezvous and its wait for the processes' exit are in it too: a job that never
        # restarted has some.
        ("no process (rendezvous, restarts)", seconds(p["idle_between_restarts_s"])),
    ]
    out.append(table(("phase", "time"), phase_rows))
    out.append("")
    progress = [
        ("steps completed (per rank)", number(s["steps_completed"])),
        ("iterations run (incl. redone)", number(s["iterations_run"])),
        ("steps lost to failures", number(s["steps_lost"])),
        ("failed streams", number(s["failed_streams"])),
    ]
    if s.get("last_step") is not None:
        progress.append(("last step reported", number(s["last_step"])))
    if s.get("samples") is not None:
        progress.append(("samples", number(s["samples"])))
    if s.get("tokens") is not None:
        progress.append(("tokens", number(s["tokens"])))
    if s.get("samples_per_second") is not None:
        progress.append(("samples/s", number(s["samples_per_second"])))
    if s.get("tokens_per_second") is not None:
        progress.append(("tokens/s", number(s["tokens_per_second"])))
    if s.get("mfu") is not None:
        mfu = s["mfu"]
        progress.append(("MFU", f"{mfu * 100:.1f}%" if mfu <= 1 else f"{mfu:.1f}%"))
    if s.get("tflops") is not None:
        progress.append(("TFLOPS", number(s["tflops"])))
    out.append(table(("progress", "value"), progress))
    st = s.get("step_time")
    if st:
        out.append("")
        out.append(
            table(
                ("step time", "count", "mean", "median", "p90", "p99", "min", "max"),
                [
                    (
                        "all ranks",
                        number(st["count"]),
                        seconds(st["mean_s"]),
                        seconds(st["median_s"]),
                        seconds(st["p90_s"]),
                        seconds(st["p99_s"]),
                        seconds(st["min_s"]),
                        seconds(st["max_s"]),
                    )
                ],
            )
        )
    device = s.get("device")
    if device:
        out.append("")
        out.append(f"DEVICE: {device['line']}")
        out.append(
            table(
                ("phase (mean per span)", "device", "CPU"),
                [(name, seconds(p["mean_s"]), seconds(p["cpu_mean_s"])) for name, p in device["phase_means_s"].items()],
            )
        )
    if s.get("ranks_missing"):
        out.append(f"\nranks missing: {s['ranks_missing']}")
    text = "\n".join(out) + "\n"
    return text + ("\n" + notes(s["notes"]) if s["notes"] else "")


def render_ranks(r: dict[str, Any], show_all: bool = False) -> str:
    if not r["ranks"]:
        return notes(r["notes"])
    out = [
        f"job median step time {seconds(r['job_median_s'])}; a rank is a straggler when a part of its time "
        f"(outside collectives, data loading, checkpoint saves) is >= {r['threshold']} x the other ranks' median"
    ]
    if r["stragglers"]:
        # "straggler: rank 0", not "stragglers: 0" (which reads as a count).
        ranks = r["stragglers"]
        listed = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        out.append(
            ("straggler: " if len(ranks) == 1 else "stragglers: ") + listed + node_phrase(r.get("straggler_node"))
        )
    else:
        out.append("no stragglers")
    out.append("")
    by_rank = {x["rank"]: x for x in r["ranks"]}
    chosen = r["ranks"] if show_all else [by_rank[k] for k in r["top"]]
    has_parts = any("compute_median_s" in x for x in chosen)
    headers = ["rank", "steps", "median", "p90", "p99", "score", "slow since"]
    if has_parts:
        headers[6:6] = ["data load", "outside coll.", "in coll.", "checkpoint", "slow in"]
    rows = []
    for x in chosen:
        since = "-"
        if "slow_until_step" in x:
            since = f"{x['slow_steps']} steps, {x['slow_since_step']} to {x['slow_until_step']}"
        elif "slow_since_step" in x:
            since = f"step {x['slow_since_step']} ({seconds(x['slow_since_s'])} in)"
        elif "slow_since_s" in x:
            since = f"{seconds(x['slow_since_s'])} in"
        row = [
            x["rank"],
            number(x["steps"]),
            seconds(x["median_s"]),
            seconds(x["p90_s"]),
            seconds(x["p99_s"]),
            f"{x['score']:.2f}" if x["score"] is not None else "-",
            since,
        ]
        if has_parts:
            row[6:6] = [
                seconds(x.get("data_loading_median_s")),
                seconds(x.get("compute_median_s")),
                seconds(x.get("collective_median_s")),
                seconds(x.get("checkpoint_save_median_s")),
                x.get("slow_in", "-"),
            ]
        rows.append(row)
    label = "all ranks" if show_all else f"top {len(chosen)} slowest ranks (--all for every rank)"
    out.append(label)
    out.append(table(headers, rows))
    text = "\n".join(out) + "\n"
    return text + ("\n" + notes(r["notes"]) if r["notes"] else "")


def render_verdict(e: dict[str, Any], show_stack: bool = True) -> list[str]:
    """The verdict sentence, the culprit, and what every rank was doing."""
    out = [f"VERDICT: {e['verdict']}"]
    culprit = e.get("culprit")
    if culprit is not None:
        out.append("")
        group = [culprit["rank"], *(culprit.get("stuck_with") or [])]
        who = f"rank {group[0]}" if len(group) == 1 else "ranks " + ", ".join(map(str, group))
        out.append(f"CULPRIT: {who}, restart {culprit['restart']}: {culprit['cause']}")
        out.append(
            f"  step {culprit['step'] if culprit['step'] is not None else '-'}, phase "
            f"{culprit['phase'] or '-'}{', inside a collective' if culprit['in_collective'] else ''}"
            f" (rule: {e.get('rule')}; from {', '.join(culprit['source']) or 'stream'})"
        )
        stack = (
            (culprit.get("error") or {}).get("stack")
            or (culprit.get("hang") or {}).get("stack")
            or culprit.get("fault_stacks")
        )
        if show_stack and stack:
            out.append("  " + "\n  ".join(stack.rstrip().splitlines()))
    if e.get("rank_states"):
        out.append("")
        rows = [
            (
                r["rank"],
                r["state"],
                r["step"],
                r["phase"],
                "yes" if r["in_collective"] else "-",
                "" if r["exit_code"] is None else r["exit_code"],
                _short(r["cause"], 70),
            )
            for r in e["rank_states"]
        ]
        out.append(table(("rank", "state", "step", "phase", "in collective", "exit", "cause"), rows, "rlrllrl"))
    return out


def render_errors(e: dict[str, Any], show_stack: bool = True) -> str:
    out = [*render_verdict(e, show_stack), ""]
    first = e["first_error"]
    if first is None:
        out.append("no errors recorded")
    else:
        who = "agent" if first["agent"] else f"rank {first['rank']}"
        label = "consequence" if first.get("consequence") else "likely root cause"
        out.append(f"FIRST ERROR ({label}): {who}, restart {first['restart']}, at {when(first['ts'])}")
        kind = first["error_type"] or first["name"]
        out.append(f"  {kind}: {first['message']}")
        if first.get("in_span"):
            step = f" (step {first['step']})" if first.get("step") is not None else ""
            out.append(f"  raised in span {first['in_span']}{step}")
        culprit_stack = ((e.get("culprit") or {}).get("error") or {}).get("stack")
        if show_stack and first.get("stack") and first["stack"] != culprit_stack:
            out.append("  " + "\n  ".join(first["stack"].rstrip().splitlines()))
        out.append("")
        out.append(
            table(
                ("error", "count", "ranks", "first at", "kind"),
                [
                    (
                        f"{g['error_type'] or g['name']}: {_short(_error_line(g['error_type'], g['message']))}",
                        g["count"],
                        g["ranks"],
                        when(g["first_ts"]),
                        "consequence" if g.get("consequence") else "cause",
                    )
                    for g in e["groups"]
                ],
                "lrlll",
            )
        )
    out.append("")
    grouped: dict[tuple[Any, ...], list[int]] = {}
    for r in e["ranks"]:
        last = r["last_record"] or {}
        opened = ", ".join(s["name"] for s in r["open_spans"]) or "-"
        key = (r["restart"], r["state"], f"{last.get('kind', '-')} {last.get('name') or ''}".strip(), opened)
        grouped.setdefault(key, []).append(r["rank"])
    rows = [(compress_ranks(ranks), *key) for key, ranks in sorted(grouped.items(), key=lambda kv: min(kv[1]))]
    out.append("each rank's last stream (ranks in the same state grouped)")
    out.append(table(("ranks", "restart", "ended", "last record", "open spans"), rows, "lrlll"))
    if e["hang_suspects"]:
        out.append(
            f"\nhang suspects (stopped writing >= {e['hang_after_s']:.0f} s before the end, "
            f"or hang_suspected): {', '.join(str(x) for x in e['hang_suspects'])}"
        )
    if e["ranks_missing"]:
        out.append(f"ranks missing entirely: {e['ranks_missing']}")
    if e["launcher_events"]:
        out.append("")
        out.append(
            table(("launcher event", "at"), [(x["name"], when(x["ts"])) for x in e["launcher_events"][:50]], "ll")
        )
    text = "\n".join(out) + "\n"
    return text + ("\n" + notes(e["notes"]) if e["notes"] else "")


def _short(text: str | None, limit: int = 80) -> str:
    if not text:
        return ""
    line = text.splitlines()[0] if text.splitlines() else text
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _n(count: int, noun: str) -> str:
    """``1 host``, ``4 hosts``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
