"""Device (GPU) time in the analyses: phase means, the share of the step the device was busy, and
whether the job is CPU-bound, GPU-bound or waiting for data / communication (docs/analysis.md).

Only jobs whose spans carry ``gpu_dur`` (device timing, docs/configuration.md) get a ``device``
section; for the others every answer stays as it was.
"""

from __future__ import annotations

from typing import Any, Final

from .._names import SpanName
from ._engine import Job

#: Phases inside a step that are work for the device.
COMPUTE_PHASES: Final = (SpanName.FORWARD, SpanName.BACKWARD, SpanName.ZERO_GRAD, SpanName.OPTIMIZER_STEP)
#: Phases inside a step that wait for something other than this device.
WAIT_PHASES: Final = (SpanName.DATA_LOADING, SpanName.COLLECTIVE)
#: The share of the step spent waiting for data or other ranks from which that is the verdict.
WAIT_SHARE: Final = 0.25
#: GPU-bound: the device is busy at least this share of the step...
BUSY_SHARE: Final = 0.7
#: ...and the CPU launched the compute phases in at most this share of the device's time for them.
LAUNCH_RATIO: Final = 0.7
NS: Final = 1e9


def _names(values: tuple[str, ...]) -> str:
    return ", ".join("'" + v.replace("'", "''") + "'" for v in values)


def has_device_time(job: Job) -> bool:
    row = job.one("SELECT count(*) FROM spans_small WHERE gpu_dur IS NOT NULL AND NOT is_agent")
    return bool(row and row[0])


def compute_time_sql() -> str:
    """Per step (stream, iteration id): the device time of its compute phases, where it was measured."""
    return f"""
        SELECT stream, parent AS id, sum(gpu_dur) AS gpu_compute
        FROM spans_small
        WHERE name IN ({_names(COMPUTE_PHASES)}) AND gpu_dur IS NOT NULL AND NOT is_agent AND NOT open
        GROUP BY ALL
    """


def device_summary(job: Job) -> dict[str, Any] | None:
    """The ``device`` section of ``summary``: None when no span has device time."""
    if not has_device_time(job):
        return None
    phases = (*COMPUTE_PHASES, *WAIT_PHASES)
    # Phases inside completed steps only: a validation forward is not part of the step.
    rows = job.rows(
        f"""
        WITH steps AS (SELECT stream, rank, id, dur FROM iterations WHERE status = 'ok')
        SELECT s.rank, s.name, count(*), sum(s.dur), sum(coalesce(s.gpu_dur, s.dur)), count(s.gpu_dur),
               sum(s.gpu_idle)
        FROM spans_small s JOIN steps i ON s.stream = i.stream AND s.parent = i.id
        WHERE s.name IN ({_names(phases)}) AND NOT s.open AND s.dur IS NOT NULL
        GROUP BY ALL ORDER BY 1, 2
        """
    )
    steps = {
        int(rank): (int(n), float(total))
        for rank, n, total in job.rows(
            "SELECT rank, count(*), sum(dur) FROM iterations WHERE status = 'ok' GROUP BY rank ORDER BY rank"
        )
    }
    per_rank: dict[int, dict[str, Any]] = {}
    for rank, name, count, cpu, device, timed, idle in rows:
        entry = per_rank.setdefault(int(rank), {"phases": {}, "idle": 0.0})
        entry["phases"][name] = {
            "count": int(count),
            "cpu_mean_s": float(cpu) / count / NS,
            "mean_s": float(device) / count / NS,
            "device_timed": int(timed),
        }
        entry["idle"] += float(idle or 0)
    ranks_out: list[dict[str, Any]] = []
    totals = {"step": 0.0, "busy": 0.0, "launch": 0.0, "wait": 0.0, "data": 0.0, "comm": 0.0, "idle": 0.0}
    for rank in sorted(per_rank):
        entry = per_rank[rank]
        n_steps, step_ns = steps.get(rank, (0, 0.0))
        if not n_steps or step_ns <= 0:
            continue
        ph = entry["phases"]
        busy = sum(ph[p]["mean_s"] * ph[p]["count"] for p in COMPUTE_PHASES if p in ph and ph[p]["device_timed"])
        launch = sum(ph[p]["cpu_mean_s"] * ph[p]["count"] for p in COMPUTE_PHASES if p in ph and ph[p]["device_timed"])
        data = (
            ph[SpanName.DATA_LOADING]["mean_s"] * ph[SpanName.DATA_LOADING]["count"]
            if SpanName.DATA_LOADING in ph
            else 0.0
        )
        comm = (
            ph[SpanName.COLLECTIVE]["mean_s"] * ph[SpanName.COLLECTIVE]["count"] if SpanName.COLLECTIVE in ph else 0.0
        )
        step_s = step_ns / NS
        ranks_out.append(
            {
                "rank": rank,
                "steps": n_steps,
                "step_mean_s": step_s / n_steps,
                "busy_share": min(busy / step_s, 1.0),
                "wait_share": min((data + comm) / step_s, 1.0),
                "idle_between_phases_s": entry["idle"] / NS / n_steps,
                "phases": ph,
            }
        )
        for key, value in (
            ("step", step_s),
            ("busy", busy),
            ("launch", launch),
            ("wait", data + comm),
            ("data", data),
            ("comm", comm),
            ("idle", entry["idle"] / NS),
        ):
            totals[key] += value
    if not ranks_out or totals["step"] <= 0:
        return None
    busy_share = min(totals["busy"] / totals["step"], 1.0)
    wait_share = min(totals["wait"] / totals["step"], 1.0)
    launch_ratio = totals["launch"] / totals["busy"] if totals["busy"] > 0 else None
    bound, line = _bound(busy_share, wait_share, launch_ratio, totals)
    return {
        "bound": bound,
        "line": line,
        "busy_share": busy_share,
        "wait_share": wait_share,
        "launch_ratio": launch_ratio,
        "phase_means_s": _job_phase_means(ranks_out),
        "ranks": ranks_out,
    }


def _job_phase_means(ranks: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each phase's mean over all its spans (device time where measured, else CPU time), and its CPU mean."""
    sums: dict[str, list[float]] = {}
    for r in ranks:
        for name, p in r["phases"].items():
            acc = sums.setdefault(name, [0.0, 0.0, 0.0])
            acc[0] += p["mean_s"] * p["count"]
            acc[1] += p["cpu_mean_s"] * p["count"]
            acc[2] += p["count"]
    return {name: {"mean_s": a / n, "cpu_mean_s": c / n} for name, (a, c, n) in sums.items() if n}


def _bound(busy: float, wait: float, launch_ratio: float | None, totals: dict[str, float]) -> tuple[str, str]:
    """The verdict and its sentence (thresholds above; docs/analysis.md, "Device time")."""
    if wait >= WAIT_SHARE:
        data = totals["data"] / totals["step"]
        comm = totals["comm"] / totals["step"]
        parts = []
        if data:
            parts.append(f"data loading {data * 100:.0f}%")
        if comm:
            parts.append(f"collectives {comm * 100:.0f}%")
        return (
            "waiting",
            f"waiting for data / communication: {wait * 100:.0f}% of the step ({', '.join(parts)}); "
            f"the device computes {busy * 100:.0f}% of it",
        )
    if busy >= BUSY_SHARE and launch_ratio is not None and launch_ratio <= LAUNCH_RATIO:
        return (
            "gpu",
            f"GPU-bound: the device computes {busy * 100:.0f}% of the step; the CPU queues that work in "
            f"{launch_ratio * 100:.0f}% of the time the device takes to run it",
        )
    if busy >= BUSY_SHARE and launch_ratio is not None:
        return (
            "cpu",
            f"CPU-bound: the device waits for the CPU's launches (the CPU takes {launch_ratio * 100:.0f}% of the "
            f"device's time to queue its work; device busy {busy * 100:.0f}% of the step)",
        )
    return "cpu", f"CPU-bound: the device computes only {busy * 100:.0f}% of the step"
