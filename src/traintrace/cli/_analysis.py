"""The analyses behind the subcommands; each returns plain, JSON-able data.

Definitions are in docs/analysis.md; keep the two in step.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, NamedTuple

from .._lifecycle import EventType  # not ..events: it would import the recorder
from .._names import EventName, SpanName, SpanStatus
from ._device import compute_time_sql, device_summary
from ._diagnosis import HANG_ERRORS, _secondary, _terminated_by, diagnose, host_clocks, shared_node
from ._engine import BEFORE_THE_LOOP, ITERATION, Job, compress_ranks, own_progress, sql_string

NS = 1e9

INIT_SPANS = (
    SpanName.DISTRIBUTED_INIT,
    SpanName.DATA_LOADER_INIT,
    SpanName.MODEL_INIT,
    SpanName.OPTIMIZER_INIT,
)
#: Span name -> time category. Iterations, hangs and idle time are derived separately.
CATEGORY_OF: dict[str, str] = {
    **dict.fromkeys(INIT_SPANS, "initialization"),
    SpanName.CHECKPOINT_LOAD: "checkpoint_load",
    SpanName.CHECKPOINT_SAVE_SYNC: "checkpoint_save",
    SpanName.CHECKPOINT_SAVE_ASYNC: "checkpoint_save",
    SpanName.VALIDATION: "validation",
    SpanName.TEST: "test",
    SpanName.DATA_LOADING: "data_loading",
}
#: Order of categories in tables; ``productive`` first, then badput.
CATEGORIES = (
    "productive",
    "lost_progress",
    "startup",
    "initialization",
    "checkpoint_load",
    "checkpoint_save",
    "validation",
    "test",
    "data_loading",
    "hang",
    "restart_idle",
    "other",
)
HANG_NAMES = (EventName.HANG_SUSPECTED,)
PROGRESS_EVENTS = (EventName.TRAINING_ITERATIONS,)
#: The compute phases of a step (beside the wait for data).
#: Aliases accepted for progress fields in ``training_iterations`` events.
FIELD_ALIASES: dict[str, tuple[str, ...]] = {
    "consumed_samples": ("consumed_samples", "samples", "total_samples"),
    "consumed_tokens": ("consumed_tokens", "tokens", "total_tokens"),
    "samples_per_second": ("samples_per_second", "samples_per_sec", "throughput_samples"),
    "tokens_per_second": ("tokens_per_second", "tokens_per_sec"),
    "mfu": ("mfu",),
    "tflops": ("tflops", "tflops_per_gpu"),
    "last_step": ("last_step", "last_completed_step", "current_iteration", "step"),
}


def _names(values: tuple[str, ...]) -> str:
    return ", ".join("'" + v.replace("'", "''") + "'" for v in values)


def _category_case(column: str = "name") -> str:
    whens = " ".join(f"WHEN {column} = '{name}' THEN '{cat}'" for name, cat in CATEGORY_OF.items())
    return f"CASE {whens} END"


def prepare(job: Job) -> None:
    """Kept for callers: the engine builds every shared table when it loads."""


def job_bounds(job: Job) -> tuple[int, int]:
    row = job.one("SELECT min(start_ts), max(end_ts) FROM streams")
    return int(row[0]), int(row[1])


def job_bounds_on_one_clock(job: Job, lived_until: dict[str, int] | None = None) -> tuple[int, int]:
    """``job_bounds`` with each host's times on the reference host's clock, where the records prove the hosts'
    clocks apart (``host_clocks``): by the raw times, a host 2 s ahead or behind adds 2 s to the job's wall time
    and as much idle time to every rank. ``lived_until``: host -> a time on its clock a rank of it lived until
    past its stream's last record (``_ended_before_the_first_step``)."""
    offsets = host_clocks(job)["offsets_ns"]
    if not offsets and not lived_until:
        return job_bounds(job)
    rows = job.rows("SELECT host, min(start_ts), max(end_ts) FROM streams GROUP BY host")
    later = lived_until or {}
    starts = [int(lo) - offsets.get(host, 0) for host, lo, _ in rows]
    ends = [max(int(hi), later.get(host, 0)) - offsets.get(host, 0) for host, _, hi in rows]
    return min(starts), max(ends)


def summary(job: Job) -> dict[str, Any]:
    prepare(job)
    verdict = diagnose(job)
    # A killed rank's phases its stream left open that its progress file shows ended (its first iteration began):
    # their time up to then, and the rank's, beyond its stream's last record.
    ended = _ended_before_the_first_step(job, verdict)
    hung = _hung_unreported(job, verdict)
    hang_from = _hang_from_sql(hung)
    start, end = job_bounds_on_one_clock(job, ended.lived_until)
    wall = max(end - start, 1)
    ranks = [int(r[0]) for r in job.rows("SELECT DISTINCT rank FROM streams WHERE NOT is_agent ORDER BY 1")]
    n_ranks = max(len(ranks), 1)
    meta = job.one(
        # The ranks' streams; the job's name from a launcher's where no rank started (a failed rendezvous).
        # CASE, not FILTER: the Spark engine runs the same statement.
        "SELECT coalesce(max(CASE WHEN NOT is_agent THEN job END), max(job)), "
        "coalesce(max(CASE WHEN NOT is_agent THEN job_name END), max(job_name)), "
        "max(CASE WHEN NOT is_agent THEN world_size END), count(CASE WHEN NOT is_agent THEN 1 END), "
        "max(CASE WHEN NOT is_agent THEN restart END), count(DISTINCT CASE WHEN NOT is_agent THEN host END) "
        "FROM streams"
    )
    # Per-rank seconds by category, then the job figure is the mean over ranks (ranks run in lockstep).
    per_rank: dict[int, dict[str, float]] = {r: dict.fromkeys(CATEGORIES, 0.0) for r in ranks}
    step_counts: dict[int, dict[bool, int]] = {}
    # Time after a hang began is hang time, never also lost progress: iterations are clipped there.
    # The median of a rank's productive steps, in the same pass: what its steps that waited for another rank's
    # phase ran over (_waits_for_other_ranks).
    typical: dict[int, int] = {}
    # ...and of its steps however few (its lost ones where none was productive): how far around another rank's
    # phase its own steps are read (_waits_between_steps). Without it a job of four steps saw no step near the end
    # of a save rank 0 made at its last step, and no wait for it.
    step_medians: dict[int, int] = {}
    for rank, lost, seconds, count, median in job.rows(
        f"""
        SELECT i.rank, i.lost, sum({_clipped("i.ts", "i.dur", hang_from)}) / 1e9, count(*), median(i.dur)
        FROM iterations i JOIN stream_facts f USING (stream) GROUP BY ALL
        """
    ):
        per_rank.setdefault(rank, dict.fromkeys(CATEGORIES, 0.0))
        per_rank[rank]["lost_progress" if lost else "productive"] += seconds
        step_counts.setdefault(rank, {True: 0, False: 0})[bool(lost)] += int(count)
        if not lost and median is not None and count >= WAIT_MIN_STEPS:
            typical[int(rank)] = int(median)
        if median is not None and (not lost or int(rank) not in step_medians):
            step_medians[int(rank)] = int(median)
    # A step a failed rank was still in when it stopped (its start written, never its end) was lost too, with the
    # time from its start to the end of the stream (a rank that hung in it until it was terminated).
    # A rank dead without closing its stream was in it until it last showed life (``_lived_past_the_stream``).
    open_end = ended.open_end()
    for rank, seconds, count in job.rows(
        f"""
        SELECT f.rank, sum({_clipped("s.ts", f"greatest({open_end} - s.ts, 0)", hang_from)}) / 1e9, count(*)
        FROM spans_small s JOIN stream_facts f USING (stream)
        WHERE s.name = '{SpanName.ITERATION}' AND s.open AND f.failed AND NOT f.running AND NOT f.is_agent
        GROUP BY ALL
        """
    ):
        per_rank.setdefault(rank, dict.fromkeys(CATEGORIES, 0.0))
        per_rank[rank]["lost_progress"] += seconds
        step_counts.setdefault(rank, {True: 0, False: 0})[True] += int(count)
    case = _category_case("s.name")
    spans_sql = f"""
        SELECT s.rank, {case} AS cat,
               sum({_clipped("s.ts", f"coalesce(s.dur, greatest({open_end} - s.ts, 0))", hang_from)}) / 1e9
        FROM spans_small s JOIN stream_facts f USING (stream)
        WHERE NOT s.is_agent AND {case} IS NOT NULL AND {NOT_INTERRUPTED}
          AND NOT (s.name = '{SpanName.DATA_LOADING}' AND EXISTS (
              SELECT 1 FROM iterations i WHERE i.stream = s.stream AND i.id = s.parent))
        GROUP BY ALL
    """
    for rank, cat, seconds in job.rows(spans_sql):
        per_rank.setdefault(rank, dict.fromkeys(CATEGORIES, 0.0))
        per_rank[rank][cat] += seconds
    for rank, seconds in job.rows(
        f"SELECT f.rank, sum(greatest({open_end} - {hang_from}, 0)) / 1e9 FROM stream_facts f "
        f"WHERE {hang_from} IS NOT NULL AND NOT f.is_agent GROUP BY ALL"
    ):
        per_rank[rank]["hang"] += seconds
    # A job of one rank has no other rank to wait for: both looks for waits are left out (13 ms of a small job).
    alone = len(ranks) < 2
    for rank, cat, seconds in [] if alone else _waits_for_other_ranks(job, typical, hang_from):
        moved = min(seconds, per_rank[rank]["productive"])
        per_rank[rank]["productive"] -= moved
        per_rank[rank][cat] += moved
    covered = dict(
        job.rows("SELECT rank, sum(end_ts - start_ts) / 1e9 FROM stream_facts WHERE NOT is_agent GROUP BY ALL")
    )
    for rank, cat, seconds in ended.phases:
        per_rank.setdefault(rank, dict.fromkeys(CATEGORIES, 0.0))
        per_rank[rank][cat] += seconds
    beyond = ended.beyond
    for rank, seconds in beyond.items():
        covered[rank] = covered.get(rank, 0.0) + seconds
    for rank, seconds in _started_up(job).items():
        per_rank.setdefault(rank, dict.fromkeys(CATEGORIES, 0.0))
        per_rank[rank]["startup"] += seconds
        covered[rank] = covered.get(rank, 0.0) + seconds
    # (From the stream's end: the part the first iteration's start accounts for is not also the freeze's.)
    stopped = {rank: max(s - beyond.get(rank, 0.0), 0.0) for rank, s in _stopped_responding(job, verdict).items()}
    overlap_note = False
    for rank, cats in per_rank.items():
        inside = covered.get(rank, 0.0)
        cats["restart_idle"] = max(wall / NS - inside, 0.0)
        # A process that stopped responding (SIGSTOP, native code holding the GIL) wrote nothing from its stream's
        # end until the launcher killed it: it was there, hung, not between restarts.
        frozen = min(stopped.get(rank, 0.0), cats["restart_idle"])
        cats["restart_idle"] -= frozen
        cats["hang"] += frozen
        inside += frozen
        used = sum(v for k, v in cats.items() if k not in ("restart_idle", "other"))
        if used > inside * 1.001 + 1e-3:
            overlap_note = True
        cats["other"] = max(inside - used, 0.0)
    # Time outside the steps and phases that waited for another rank's phase (after `other` is known: it is taken
    # from there).
    idle = {rank: cats["other"] for rank, cats in per_rank.items()}
    for rank, cat, seconds in [] if alone else _waits_between_steps(job, step_medians, idle, hung):
        moved = min(seconds, per_rank[rank]["other"])
        per_rank[rank]["other"] -= moved
        per_rank[rank][cat] += moved
    breakdown = {cat: sum(c[cat] for c in per_rank.values()) / n_ranks for cat in CATEGORIES}
    goodput = breakdown["productive"] / (wall / NS)

    # The completed steps' statistics and their samples, in one pass over the iterations.
    stats = job.one(
        """
        SELECT count(*), avg(dur), quantile_cont(dur, [0.5, 0.9, 0.99]), min(dur), max(dur), stddev_samp(dur),
               sum(batch_size)
        FROM iterations WHERE status = 'ok'
        """
    )
    if stats:  # the three quantiles come as one list (one sort of the step times, not three)
        stats = (*stats[:2], *(stats[2] or (None, None, None)), *stats[3:])
    step_stats = None
    if stats and stats[0]:
        keys = ("count", "mean_s", "median_s", "p90_s", "p99_s", "min_s", "max_s", "stddev_s")
        step_stats = {
            k: (int(v) if k == "count" else (None if v is None else v / NS))
            for k, v in zip(keys, stats[: len(keys)], strict=True)
        }
    counts = _count_medians(step_counts)
    progress = _progress_fields(job)
    steps_completed = int(counts[1]) if counts and counts[1] is not None else 0
    samples = progress.get("consumed_samples")
    samples_source = "training_iterations events" if samples is not None else None
    if samples is None and stats and stats[8] is not None:
        samples = int(stats[8])
        samples_source = "sum of iteration batch_size over all ranks (includes redone steps)"
    productive_s = breakdown["productive"]
    failures = job.one(
        "SELECT count(*) FILTER (failed AND NOT is_agent), count(DISTINCT restart), "
        "count(*) FILTER (running AND NOT is_agent) FROM stream_facts"
    )
    phases = {
        "initialization_s": breakdown["initialization"],
        "training_s": breakdown["productive"] + breakdown["lost_progress"] + breakdown["data_loading"],
        "checkpoint_save_exposed_s": breakdown["checkpoint_save"],
        "checkpoint_save_background_s": _mean_per_rank(
            job,
            f"SELECT rank, sum(dur) / 1e9 FROM spans_small WHERE name = '{SpanName.CHECKPOINT_SAVE_FINALIZATION}' "
            "AND NOT is_agent GROUP BY ALL",
            n_ranks,
        ),
        "checkpoint_load_s": breakdown["checkpoint_load"],
        "validation_s": breakdown["validation"],
        "test_s": breakdown["test"],
        "idle_between_restarts_s": breakdown["restart_idle"],
        "startup_s": breakdown["startup"],
    }
    result: dict[str, Any] = {
        "verdict": verdict["verdict"],
        "status": verdict["status"],
        "job": meta[0] if meta else None,
        "job_name": meta[1] if meta else None,
        "files": len(job.files),
        "records": job.record_count,
        "ranks_seen": len(ranks),
        "world_size": int(meta[2]) if meta and meta[2] is not None else None,
        "ranks_missing": compress_ranks(job.missing_ranks()),
        "hosts": int(meta[5]) if meta and meta[5] is not None else 0,
        "streams": int(meta[3]) if meta and meta[3] is not None else 0,
        "restarts": int(meta[4]) if meta and meta[4] is not None else 0,
        "failed_streams": int(failures[0]) if failures else 0,
        "running_streams": int(failures[2]) if failures else 0,
        "start_ns": start,
        "end_ns": end,
        "wall_s": wall / NS,
        "goodput": goodput,
        "breakdown_s": breakdown,
        "phases_s": phases,
        "iterations_run": int(counts[0]) if counts and counts[0] is not None else 0,
        "steps_completed": steps_completed,
        "steps_lost": int(counts[3]) if counts and counts[3] is not None else 0,
        "last_step": progress.get("last_step"),
        "samples": samples,
        "samples_source": samples_source,
        "tokens": progress.get("consumed_tokens"),
        "step_time": step_stats,
        "samples_per_second": progress.get("samples_per_second") or _rate(samples, productive_s, samples_source),
        "tokens_per_second": progress.get("tokens_per_second"),
        "mfu": progress.get("mfu"),
        "tflops": progress.get("tflops"),
        "notes": list(job.notes),
    }
    if overlap_note:
        result["notes"].append("some phase spans overlap (nested or concurrent); 'other' is clamped at 0")
    device = device_summary(job)
    if device is not None:
        result["device"] = device
    return result


def _stopped_responding(job: Job, verdict: dict[str, Any]) -> dict[int, float]:
    """rank -> seconds from the end of its stream to when the launcher saw its process end, for the ranks whose
    process stopped responding until killed (the diagnosis's ``unresponsive_ns``: its writer thread stamped nothing
    for that long). The stream's end is its last record; the launcher's time of the death is in whole seconds."""
    gone = {
        int(st["stream"]): (int(st["rank"]), int(st["launcher_seen_ns"]))
        for st in verdict.get("ranks") or ()
        if st.get("unresponsive_ns") and st.get("launcher_seen_ns") and st.get("stream") is not None
    }
    if not gone:
        return {}
    listed = ", ".join(str(stream) for stream in gone)
    ends = dict(job.rows(f"SELECT stream, end_ts FROM stream_facts WHERE stream IN ({listed})"))
    return {
        rank: max(seen - int(ends[stream]), 0) / NS
        for stream, (rank, seen) in gone.items()
        if ends.get(stream) is not None
    }


class _EndedBeforeTheLoop(NamedTuple):
    #: (rank, category, seconds) to add to what the stream's end gave the open phases.
    phases: list[tuple[int, str, float]]
    #: rank -> seconds it lived past its stream's last record.
    beyond: dict[int, float]
    #: host -> the latest such time on its clock (the job's wall time reaches it).
    lived_until: dict[str, int]
    #: stream -> when its rank, dead without closing it, last showed life (its own clock): its open spans end there.
    streams_until: dict[int, int]

    def open_end(self) -> str:
        """The SQL end of what was left open in stream ``f``: the stream's end, or when its rank last showed life
        past it (``_lived_past_the_stream``)."""
        if not self.streams_until:
            return "f.end_ts"
        # A CASE, not a join on a VALUES list: Spark's planner fails such a join on the checkpointed tables.
        whens = " ".join(f"WHEN {number} THEN {until}" for number, until in self.streams_until.items())
        return f"greatest(f.end_ts, CASE f.stream {whens} ELSE f.end_ts END)"


def _ended_before_the_first_step(job: Job, verdict: dict[str, Any]) -> _EndedBeforeTheLoop:
    """The phases before the loop (initialisation, a checkpoint's load) that a killed rank's stream left open,
    their end in the records the rank lost (its last flush interval), where the rank's progress file says its
    first iteration began after the stream's last record: the phase ended by then. Counted up to the stream's
    end already; here the rest, up to the first iteration's start, and that stretch beyond the stream's end,
    which the rank lived through. Without it a rank killed within a flush interval of its first steps read as
    initialising for a part of its initialisation only, and as idle (no process) for the rest."""
    ended = _EndedBeforeTheLoop([], {}, {}, {})
    offsets = host_clocks(job)["offsets_ns"]
    firsts = {  # on the host's own clock, as its stream's times (the verdict's are on the reference host's)
        int(st["stream"]): (int(st["rank"]), int(st["first_step_ns"]) + offsets.get(st.get("host") or "", 0))
        for st in verdict.get("ranks") or ()
        if st.get("first_step_ns") and st.get("stream") is not None and st.get("state") in ("killed", "exited", "ended")
    }
    _lived_past_the_stream(job, firsts, ended)
    if not firsts:
        return ended
    pairs = ", ".join(f"({stream}, {first})" for stream, (_, first) in firsts.items())
    rows = job.rows(
        f"""
        SELECT s.stream, {_category_case("s.name")}, s.ts, f.end_ts, h.host
        FROM spans_small s JOIN stream_facts f USING (stream) JOIN streams h ON h.stream = s.stream
        JOIN (VALUES {pairs}) AS q(first_stream, first_ns) ON s.stream = q.first_stream
        WHERE s.open AND NOT f.closed AND NOT f.running AND f.hang_from IS NULL AND f.end_ts < q.first_ns
          AND s.ts < q.first_ns AND s.name IN ({_names(BEFORE_THE_LOOP)})
        """
    )
    for stream, cat, ts, end, _ in rows:
        rank, first = firsts[int(stream)]
        ended.phases.append((rank, cat, (first - max(int(end), int(ts))) / NS))
    return ended


def _started_up(job: Job) -> dict[int, float]:
    """rank -> seconds its processes took to start (the interpreter, the imports, the script's code up to
    ``configure()``): from the launcher's ``worker_start`` event for the rank and attempt to the header of the
    rank's stream of that attempt, on the same host (one clock). Before, that time counted as ``restart_idle``, no
    process: a 3-rank Lightning job whose workers took 9.5 s to import on a busy machine read 91% of its wall time
    idle. Without a launcher of traintrace's the job's wall time begins at the first header: nothing to count."""
    starts: dict[tuple[int, int, str], int] = {}
    for attrs_text, ts, host in job.rows(
        f"SELECT o.attrs, o.ts, h.host FROM other o JOIN streams h ON h.stream = o.stream "
        f"WHERE o.is_agent AND o.kind = 'event' AND o.name = '{EventType.WORKER_START.value}'"
    ):
        try:
            attrs = json.loads(attrs_text) if isinstance(attrs_text, str) else dict(attrs_text or {})
            key = (int(attrs["rank"]), int(attrs.get("restart") or 0), str(host))
        except (ValueError, TypeError, KeyError):
            continue  # a hostile or foreign event: no start-up read from it
        starts[key] = min(starts.get(key, int(ts)), int(ts))
    if not starts:
        return {}
    firsts: dict[tuple[int, int, str], int] = {}
    for rank, restart, start, host in job.rows(
        "SELECT f.rank, f.restart, f.start_ts, h.host FROM stream_facts f JOIN streams h ON h.stream = f.stream "
        "WHERE NOT f.is_agent"
    ):
        key = (int(rank), int(restart), str(host))
        firsts[key] = min(firsts.get(key, int(start)), int(start))
    took: dict[int, float] = {}
    for key, header in firsts.items():
        spawned = starts.get(key)
        if spawned is not None and spawned < header:
            took[key[0]] = took.get(key[0], 0.0) + (header - spawned) / NS
    return took


def _lived_past_the_stream(job: Job, firsts: dict[int, tuple[int, int]], ended: Any) -> None:
    """A rank that ended without closing its stream (killed, aborted, ``os._exit``) lived until its process last
    stamped its progress file (the writer does so every flush interval, records or not), or until its first
    iteration began where that was later: that stretch beyond its stream's last record is the rank's, its spans
    left open end there (a step it was in, lost; a hang it was in), and the job's wall time reaches it. Without it
    a rank that waited in a collective until a watchdog aborted it, writing nothing, read as gone from its last
    record on, and the job as shorter."""
    files = job.progress_of_attempts()
    rows = job.rows(
        "SELECT f.stream, f.rank, f.restart, f.end_ts, h.host, h.pid FROM stream_facts f "
        "JOIN streams h ON h.stream = f.stream WHERE NOT f.closed AND NOT f.running AND NOT f.is_agent"
    )
    for stream, rank, restart, end, host, pid in rows:
        # The host's own clock, as the stream's times; the file of the stream's own process only.
        progress = own_progress(files.get((int(rank), int(restart))), pid)
        alive = int(getattr(progress, "alive_ns", None) or 0)
        first = firsts.get(int(stream), (0, 0))[1]
        last = max(alive, first)
        if last <= int(end):
            continue
        ended.beyond[int(rank)] = ended.beyond.get(int(rank), 0.0) + (last - int(end)) / NS
        ended.lived_until[host] = max(ended.lived_until.get(host, 0), last)
        if first <= int(end):  # else a pre-loop phase left open ends at the first iteration (``phases``)
            ended.streams_until[int(stream)] = last


#: Phases one rank may run while the others go on training: rank 0 saving the replicated model, validating alone,
#: or slower than the others at a phase they all run. The others then wait for it in their next step's collective.
WAITED_FOR: dict[str, str] = {
    name: CATEGORY_OF[name]
    for name in (
        SpanName.CHECKPOINT_SAVE_SYNC,
        SpanName.CHECKPOINT_SAVE_ASYNC,
        SpanName.CHECKPOINT_LOAD,
        SpanName.VALIDATION,
        SpanName.TEST,
    )
}
#: A step may have waited for another rank's phase when it ran this much over its rank's median productive step.
WAIT_MARGIN = 0.1
#: ...of a rank with at least this many productive steps: the median of fewer is not its usual step (of two, one
#: stalled for 5 s: a median of 2.6 s, which let another rank's save that ended in the stall pass for a wait).
WAIT_MIN_STEPS = 5


def _waits_for_other_ranks(
    job: Job, typical: dict[int, int], hang_from: str = "f.hang_from"
) -> list[tuple[int, str, float]]:
    """(rank, category, seconds): the time a rank's productive steps waited for another rank's checkpoint save
    or load, validation or test (docs/analysis.md, "Waiting for another rank's phase"). A step that ran over
    its rank's median productive step (``typical``) by more than ``WAIT_MARGIN`` of it, while another rank of its
    attempt was in such a phase that ended before the step did (the step was held until it ended), waited for it
    by the lesser of the two: the overlap and the excess (shared between the phases it overlapped in proportion);
    each host's times on the reference host's clock. The phase began within a median step of the step's start,
    and the step ended within two after the phase did: the waiting rank was held at its step's collective until
    the other rank, out of its phase, did its own work of the step and joined it. A phase that began further
    into the step (the other rank had ended its step while this one was still busy: a stall, slow work after
    the all-reduce), or a step that went on long after the phase ended (it was slow for its own reasons; the
    phase ended early in it), was no wait for it."""
    if not typical:
        return []
    medians = ", ".join(f"({rank}, {ns})" for rank, ns in typical.items())
    ahead = _clock_ahead(job, "host")
    names = ", ".join(f"'{name}'" for name in WAITED_FOR)
    case = _category_case("s.name")
    clipped = _clipped("i.ts", "i.dur", hang_from)
    # The slow steps, stored once: the query below reads them twice (the waiting ranks' steps, and the steps of the
    # ranks in the phases).
    job.con.execute(
        f"""
        CREATE TEMP TABLE IF NOT EXISTS slow_steps AS
        WITH clock AS (SELECT stream, {ahead} AS ahead FROM streams),
        typical AS (SELECT * FROM (VALUES {medians}) AS t(rank, median))
        SELECT i.stream, i.rank, i.restart, i.ts - c.ahead AS t0, i.ts - c.ahead + {clipped} AS t1,
               {clipped} - m.median AS excess, m.median
        FROM iterations i JOIN typical m USING (rank) JOIN stream_facts f USING (stream)
        JOIN clock c USING (stream)
        -- the first test, on the records alone, leaves few rows for the joins
        WHERE i.dur > {int(min(typical.values()) * (1 + WAIT_MARGIN))}
          AND i.dur > m.median * {1 + WAIT_MARGIN} AND NOT i.lost
        """
    )
    return [
        (int(rank), str(cat), float(seconds))
        for rank, cat, seconds in job.rows(
            f"""
            WITH clock AS (SELECT stream, {ahead} AS ahead FROM streams),
            phases AS (
                SELECT s.rank, s.restart, {case} AS cat, s.ts - c.ahead AS p0,
                       s.ts - c.ahead + coalesce(s.dur, greatest(f.end_ts - s.ts, 0)) AS p1
                FROM spans_small s JOIN stream_facts f USING (stream) JOIN clock c USING (stream)
                WHERE NOT s.is_agent AND s.name IN ({names})
            ),
            candidates AS (
                SELECT w.stream, w.restart, w.t0, w.t1, w.rank, w.excess, w.median, p.cat, p.rank AS prank, p.p1,
                       least(w.t1, p.p1) - greatest(w.t0, p.p0) AS o
                FROM slow_steps w JOIN phases p ON p.p0 < w.t1 AND w.t0 < p.p1
                WHERE p.p1 < w.t1 AND p.p0 - w.t0 <= w.median AND p.rank <> w.rank AND p.restart = w.restart
            ),
            waits AS (
                -- Where the step went on more than two of its medians after the phase ended: whether it ended with
                -- the phase's rank's first step ending after the phase (that rank, out of its phase, then stalled in
                -- its own work, and this one waited on for it: lockstep), within half its median (a quarter missed
                -- a step of a busy host's, 0.3 of its median after that rank's).
                SELECT stream, t0, rank, excess, cat, max(o) AS o FROM (
                    SELECT c.stream, c.t0, c.rank, c.excess, c.cat, c.o FROM candidates c
                    WHERE c.t1 - c.p1 <= 2 * c.median
                    UNION ALL
                    SELECT c.stream, c.t0, c.rank, c.excess, c.cat, c.o FROM candidates c
                    JOIN (SELECT rank AS jrank, restart AS jrestart, t0 AS j0, t1 AS j1 FROM slow_steps) j
                      ON j.jrank = c.prank AND j.jrestart = c.restart
                    WHERE c.t1 - c.p1 > 2 * c.median AND j.j1 > c.p1 AND j.j0 <= c.p1 + c.median
                      AND abs(j.j1 - c.t1) * 2 <= c.median
                ) GROUP BY stream, t0, rank, excess, cat
            )
            SELECT rank, cat, sum(o * least(1.0, greatest(excess, 0) / total)) / 1e9
            FROM (SELECT *, sum(o) OVER (PARTITION BY stream, t0) AS total FROM waits)
            WHERE total > 0
            GROUP BY rank, cat
            """
        )
    ]


#: A rank with less time outside its steps and phases than this cannot have waited there for another rank.
GAP_FLOOR_S = 1e-3
#: How far around another rank's phase a rank's steps are read to find where it waited and its usual gap: this
#: many of its median steps on each side.
GAP_CONTEXT_STEPS = 4


def _waits_between_steps(
    job: Job, step_medians: dict[int, int], idle: dict[int, float], hung: dict[int, int] | None = None
) -> list[tuple[int, str, float]]:
    """(rank, category, seconds): the time a rank waited for another rank's checkpoint save or load, validation
    or test *between* its steps, outside its spans (so far counted as ``other``): at a barrier after rank 0's
    save, as Lightning's ``Trainer.save_checkpoint`` does on every rank (docs/analysis.md, "Waiting for another
    rank's phase"). A rank was waiting between two of its steps (or phases) when another rank of its attempt
    ended such a phase in that gap; it waited the lesser of the gap's overlap with the phase and what the gap
    ran over the rank's usual gap between steps there (the median of its other gaps within
    ``GAP_CONTEXT_STEPS`` steps), shared between phases of different categories that ended in the same gap in
    proportion to their overlaps. Each host's times on the reference host's clock. Reads only the steps around
    the phases (a keyed filter, not a pass that orders every step)."""
    waiting = {rank for rank, seconds in idle.items() if seconds >= GAP_FLOOR_S}
    if not waiting:
        return []
    offsets = host_clocks(job)["offsets_ns"]
    names = ", ".join(f"'{name}'" for name in WAITED_FOR)
    # Each stream: its rank, attempt, how far its host's clock runs ahead, and when it can have waited.
    streams: dict[int, tuple[int, int, int, int, int]] = {}
    files: dict[int, int] = {}
    for stream, file, rank, restart, host, start, end, hang_from in job.rows(
        "SELECT f.stream, f.file, f.rank, f.restart, s.host, f.start_ts, f.end_ts, f.hang_from "
        "FROM stream_facts f JOIN streams s USING (stream) WHERE NOT f.is_agent"
    ):
        ahead = int(offsets.get(host, 0)) if offsets else 0
        began = hang_from if hang_from is not None else (hung or {}).get(int(stream))
        stop = int(end) if began is None else min(int(end), int(began))
        streams[int(stream)] = (int(rank), int(restart), ahead, int(start) - ahead, stop - ahead)
        files[int(stream)] = int(file)
    case = _category_case("s.name")
    phases: list[tuple[int, str, int, int]] = []  # (stream, category, start, end) on one clock
    for stream, cat, p0, p1 in job.rows(
        f"""
        SELECT s.stream, {case}, s.ts, s.ts + coalesce(s.dur, greatest(f.end_ts - s.ts, 0))
        FROM spans_small s JOIN stream_facts f USING (stream)
        WHERE NOT s.is_agent AND s.name IN ({names})
        """
    ):
        if int(stream) in streams:
            ahead = streams[int(stream)][2]
            phases.append((int(stream), str(cat), int(p0) - ahead, int(p1) - ahead))
    if not phases:
        return []
    own: dict[int, list[tuple[int, int]]] = {}
    for stream, _, p0, p1 in phases:
        own.setdefault(stream, []).append((p0, p1))
    # Which streams may have waited for which phase end, and the time around it to read.
    windows: list[tuple[int, str, int, int, int, int]] = []  # (stream, category, p0, p1, w0, w1)
    for phase_stream, cat, p0, p1 in phases:
        q_rank, q_restart = streams[phase_stream][:2]
        for stream, (rank, restart, _, start, stop) in streams.items():
            if rank == q_rank or restart != q_restart or rank not in waiting or not start < p1 < stop:
                continue
            if any(a < p1 <= b for a, b in own.get(stream, ())):
                continue  # in a phase of its own when this one ended (its own save, say): not between steps
            # Its median step (``step_medians``), else the phase's own length, on each side.
            context = GAP_CONTEXT_STEPS * (step_medians.get(rank) or (p1 - p0))
            windows.append((stream, cat, p0, p1, p0 - context, p1 + context))
    if not windows:
        return []
    # The steps and phases near each window: those that start or end in one of the time buckets it covers, by file
    # and time on the file's own clock: keyed joins that the engine runs below the iterations' join with the
    # streams (a filter on the streams' times or a range join read every step: 0.15 to 0.3 s at 835,000). Buckets
    # of half the shortest window, or a 32nd of the longest: few keys, few steps outside the windows.
    lengths = [w1 - w0 for *_, w0, w1 in windows]
    width = max(min(lengths) // 2, max(lengths) // 32, 1)
    keys: set[tuple[int, int]] = set()
    for stream, *_, w0, w1 in windows:
        ahead, file = streams[stream][2], files[stream]
        keys.update((file, b) for b in range((w0 + ahead) // width, (w1 + ahead) // width + 1))
    values = ", ".join(f"({file}, {b})" for file, b in sorted(keys))
    categorised = ", ".join(f"'{name}'" for name in CATEGORY_OF)
    near: dict[int, set[tuple[int, int]]] = {}
    parents: set[tuple[int, int]] = set()  # (stream, id) of the steps that hold a phase found (gradient accumulation)
    phase_end = "s.ts + coalesce(s.dur, greatest(f.end_ts - s.ts, 0))"
    spans = (
        "spans_small s JOIN stream_facts f USING (stream) JOIN keys k ON k.file = s.file AND k.b = ({}) // {} "
        f"WHERE NOT s.is_agent AND (s.name IN ({categorised}) OR (s.name = '{ITERATION}' AND s.open)) "
        f"AND {NOT_INTERRUPTED}"
    )
    for stream, t0, t1, parent in job.rows(
        # Four keyed joins, not one over a shared CTE: the engine would read every step into the CTE first.
        f"""
        WITH keys AS (SELECT * FROM (VALUES {values}) AS k(file, b))
        SELECT i.stream, i.ts, i.ts + i.dur, NULL FROM iterations i
        JOIN keys k ON k.file = i.file AND k.b = i.ts // {width}
        UNION ALL
        SELECT i.stream, i.ts, i.ts + i.dur, NULL FROM iterations i
        JOIN keys k ON k.file = i.file AND k.b = (i.ts + i.dur) // {width}
        UNION ALL
        SELECT s.stream, s.ts, {phase_end}, s.parent FROM {spans.format("s.ts", width)}
        UNION ALL
        SELECT s.stream, s.ts, {phase_end}, s.parent FROM {spans.format(phase_end, width)}
        """
    ):
        if int(stream) in streams:
            ahead = streams[int(stream)][2]
            near.setdefault(int(stream), set()).add((int(t0) - ahead, int(t1) - ahead))
            if parent is not None:
                parents.add((int(stream), int(parent)))
    if parents:
        # A phase inside a step that began before the window and ended after it: that step, which no bucket
        # found, covers the window (the rank was in it, not between steps).
        in_files = ", ".join(sorted({str(files[stream]) for stream, _ in parents}))
        with_ids = ", ".join(sorted({str(span) for _, span in parents}))
        for stream, span, t0, t1 in job.rows(
            f"SELECT stream, id, ts, ts + dur FROM iterations WHERE file IN ({in_files}) AND id IN ({with_ids})"
        ):
            if (int(stream), int(span)) in parents:
                ahead = streams[int(stream)][2]
                near.setdefault(int(stream), set()).add((int(t0) - ahead, int(t1) - ahead))
    # Per gap (stream, its start): its excess over the usual gap, and per category the longest overlap.
    gaps: dict[tuple[int, int], tuple[int, dict[str, int]]] = {}
    for stream, cat, p0, p1, w0, w1 in windows:
        merged: list[list[int]] = []
        for t0, t1 in sorted(i for i in near.get(stream, ()) if i[1] >= w0 and i[0] <= w1):
            if merged and t0 <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], t1)
            else:
                merged.append([t0, t1])
        if not merged or any(t0 < p1 < t1 for t0, t1 in merged):
            continue  # nothing of the rank's near the phase's end, or it was in a step then
        before = [t1 for _, t1 in merged if t1 <= p1]
        after = [t0 for t0, _ in merged if t0 >= p1]
        g0 = max(before) if before else min(w0, p0)
        g1 = min(after) if after else streams[stream][4]
        usual = [b[0] - a[1] for a, b in itertools.pairwise(merged) if not a[1] <= p1 <= b[0]]
        excess = (g1 - g0) - (_median([float(u) for u in usual]) if usual else 0.0)
        overlap = p1 - max(g0, p0)
        if overlap <= 0 or excess <= 0:
            continue
        _, by_cat = gaps.setdefault((stream, g0), (int(excess), {}))
        by_cat[cat] = max(by_cat.get(cat, 0), overlap)
    waits: dict[tuple[int, str], float] = {}
    for (stream, _), (excess, by_cat) in gaps.items():
        share = min(1.0, excess / sum(by_cat.values()))
        for cat, overlap in by_cat.items():
            key = (streams[stream][0], cat)
            waits[key] = waits.get(key, 0.0) + overlap * share / NS
    return [(rank, cat, seconds) for (rank, cat), seconds in sorted(waits.items())]


#: A span that something else cut short (``SpanStatus.INTERRUPTED``) is no part of its phase's time.
NOT_INTERRUPTED = f"coalesce(s.status, '') <> '{SpanStatus.INTERRUPTED}'"


def _clipped(ts: str, dur: str, hang_from: str = "f.hang_from") -> str:
    """A duration cut where the stream's hang began (``f`` is the stream's row of stream_facts; ``hang_from``,
    ``_hang_from_sql``'s)."""
    return (
        f"CASE WHEN {hang_from} IS NOT NULL AND {ts} + {dur} > {hang_from} THEN greatest({hang_from} - {ts}, 0) "
        f"ELSE {dur} END"
    )


def _hang_from_sql(hung: dict[int, int]) -> str:
    """When stream ``f``'s hang began: its own hang report's reading (stream_facts), or ``_hung_unreported``'s."""
    if not hung:
        return "f.hang_from"
    # A CASE, not a join on a VALUES list: Spark's planner fails such a join on the checkpointed tables.
    whens = " ".join(f"WHEN {stream} THEN {ns}" for stream, ns in hung.items())
    return f"coalesce(f.hang_from, CASE f.stream {whens} END)"


def _hung_unreported(job: Job, verdict: dict[str, Any]) -> dict[int, int]:
    """stream -> when its rank's hang began, for each rank the diagnosis names hung whose stream has no hang report
    of its own (hang detection off, or a long phase's limit of 30 minutes not reached: a model initialisation or
    a checkpoint save that never returned; it may live on for as long as its launcher lets it, 30 s after its
    SIGTERM under torchrun). No record says when it stopped working; from when its peers (the other ranks of its
    attempt) were left waiting for it (the earliest collective they were left in), else from their first
    failure (their collective's timeout where no span shows the collective), its time is the hang's, not the
    phase's (a hung save read as 23% of the job in checkpoint saves before)."""
    states = [st for st in verdict.get("ranks") or () if st.get("stream") is not None]
    hung = [st for st in states if str(st.get("cause") or "").startswith("hang")]
    if not hung:
        return {}
    listed = ", ".join(str(int(st["stream"])) for st in hung)
    reported = {
        int(r[0])
        for r in job.rows(f"SELECT stream FROM stream_facts WHERE stream IN ({listed}) AND hang_from IS NOT NULL")
    }
    hung = [st for st in hung if int(st["stream"]) not in reported]
    if not hung:
        return {}
    # The diagnosis's times are on the reference host's clock; each stream's records on its own host's.
    offsets = host_clocks(job)["offsets_ns"]

    def ahead(st: dict[str, Any]) -> int:
        return int(offsets.get(st.get("host") or "", 0) or 0)

    alone = {int(st["stream"]) for st in hung}
    # Each waiting peer's collective it was left in: the last one it began before it stopped (one query for all).
    stops = {
        int(st["stream"]): int(st["stopped_ns"]) + ahead(st)
        for st in states
        if int(st["stream"]) not in alone and st.get("in_collective") and st.get("stopped_ns")
    }
    left_in: dict[int, int] = {}
    if stops:
        whens = " ".join(f"WHEN {stream} THEN {ns}" for stream, ns in stops.items())
        left_in = {
            int(stream): int(ts)
            for stream, ts in job.rows(
                f"SELECT stream, max(ts) FROM spans_small WHERE name = '{SpanName.COLLECTIVE}' "
                f"AND stream IN ({', '.join(map(str, stops))}) AND ts <= CASE stream {whens} END GROUP BY stream"
            )
            if ts is not None
        }
    out: dict[int, int] = {}
    for restart in {st.get("restart") for st in hung}:
        peers = [st for st in states if st.get("restart") == restart and int(st["stream"]) not in alone]
        waiting = [left_in[int(st["stream"])] - ahead(st) for st in peers if int(st["stream"]) in left_in]
        failed = [int(st["stopped_ns"]) for st in peers if st.get("state") == "error" and st.get("stopped_ns")]
        marks = waiting or failed
        if not marks:
            continue
        for st in hung:
            if st.get("restart") == restart:
                out[int(st["stream"])] = max(min(marks), int(st.get("since_ns") or 0)) + ahead(st)
    return out


def _count_medians(step_counts: dict[int, dict[bool, int]]) -> tuple[Any, ...]:
    """(median iterations, median productive, median lost, max lost) over ranks, as DuckDB's median would."""
    if not step_counts:
        return (None, None, None, None)

    def median(values: list[int]) -> float:
        values = sorted(values)
        mid = len(values) // 2
        return float(values[mid]) if len(values) % 2 else (values[mid - 1] + values[mid]) / 2

    runs = [c[True] + c[False] for c in step_counts.values()]
    ok = [c[False] for c in step_counts.values()]
    lost = [c[True] for c in step_counts.values()]
    # Ranks of one job run the same steps: the job completed a step when a rank did (a rank killed mid-step
    # has one fewer iteration record, which is not a step fewer for the job).
    return (max(runs), max(ok), median(lost), max(lost))


def _rate(samples: int | None, seconds: float, source: str | None) -> float | None:
    """Samples per productive second, when the sample count is a job total (from progress events)."""
    if samples and seconds and source and "events" in source:
        return samples / seconds
    return None


def _mean_per_rank(job: Job, sql: str, n_ranks: int) -> float:
    return sum(float(v) for _, v in job.rows(sql)) / n_ranks


def _progress_fields(job: Job) -> dict[str, Any]:
    """Last counters and mean rates from ``training_iterations`` events, whatever helper wrote them."""
    names = _names(PROGRESS_EVENTS)
    counters = ("consumed_samples", "consumed_tokens", "last_step")
    figures = []
    for key, aliases in FIELD_ALIASES.items():
        expr = "coalesce(" + ", ".join(f"try_cast(e.a.{a} AS DOUBLE)" for a in aliases) + ")"
        # Rates are per rank or per job depending on the writer: take rank 0's (or the lowest rank's).
        figures.append(f"max({expr})" if key in counters else f"avg(CASE WHEN e.stream_rank = l.r THEN {expr} END)")
    # A job may have none (one that records iterations alone): a count first (0.4 ms on a small job) spares
    # the query below, forty-two extractions and casts, which took 8 ms to plan and run on such a job.
    found = job.one(f"SELECT count(*) FROM other WHERE kind = 'event' AND name IN ({names})")
    if not found or not found[0]:
        return {}
    # Every field in one statement (a small job's cost is mostly statements); the attributes of these events
    # only, parsed once each (``a``), not of every record other than an iteration.
    row = job.one(
        f"""SELECT {", ".join(figures)}
            FROM (SELECT stream_rank, {job.attr_fields("attrs")} AS a FROM other
                  WHERE kind = 'event' AND name IN ({names})) e
            CROSS JOIN (SELECT min(stream_rank) AS r FROM other WHERE kind = 'event' AND name IN ({names})) l"""
    )
    out: dict[str, Any] = {}
    for key, value in zip(FIELD_ALIASES, row or (None,) * len(FIELD_ALIASES), strict=True):
        if value is not None:
            out[key] = int(value) if key in counters else float(value)
    return out


# ---------------------------------------------------------------- ranks


def ranks(job: Job, top: int = 5, windows: int = 10, threshold: float = 1.1) -> dict[str, Any]:
    """Per-rank step-time statistics, stragglers, and when each became slow."""
    prepare(job)
    start, end = job_bounds(job)
    width = max((end - start) // max(windows, 1), 1)
    rows = job.dicts(
        """
        SELECT rank, count(*) AS steps, quantile_cont(dur, [0.5, 0.9, 0.99]) AS q,
               avg(dur) / 1e9 AS mean_s, max(dur) / 1e9 AS max_s, min(ts) AS lo, max(ts + dur) AS hi,
               sum(dur) / 1e9 AS busy_s
        FROM iterations WHERE status = 'ok' GROUP BY rank ORDER BY rank
        """
    )
    # The three quantiles come as one list (one sort of each rank's step times, not three).
    bounds = {r["rank"]: (int(r["lo"]), int(r["hi"]), float(r["busy_s"] or 0.0)) for r in rows if r["lo"] is not None}
    rows = [
        {
            "rank": r["rank"],
            "steps": r["steps"],
            **dict(zip(("median_s", "p90_s", "p99_s"), (v / 1e9 for v in r["q"]), strict=True)),
            "mean_s": r["mean_s"],
            "max_s": r["max_s"],
        }
        for r in rows
    ]
    if not rows:
        return {
            "ranks": [],
            "top": [],
            "stragglers": [],
            "straggler_node": None,
            "job_median_s": None,
            "windows": [],
            "notes": [*job.notes, "no iteration spans: nothing to compare"],
        }
    job_median = _median([r["median_s"] for r in rows])
    steps = {r["rank"]: r["median_s"] for r in rows}
    for r in rows:
        ref = _reference(steps, r["rank"])
        r["score"] = r["median_s"] / ref if ref else None
    # The parts of a rank's time that are its own work (docs/analysis.md, "ranks"): collectives equalise step
    # times in data-parallel jobs, so the slow rank is the one with the most time outside them.
    _step_parts(job)
    notes = list(job.notes)
    counted = job.one("SELECT count(*) FILTER (outside_backward), count(*) FROM step_parts")
    if counted and counted[0]:
        share = "every step" if counted[0] == counted[1] else f"{counted[0]} of {counted[1]} steps"
        notes.append(
            f"no collective recorded in the backward phase of {share}: a step's own work is its time outside "
            "backward, where DDP's gradient all-reduce waits for the slowest rank, and outside recorded collectives "
            "(record_collectives records the all-reduce)"
        )
    parts: dict[int, dict[str, float]] = {}
    # What a rank's part sums to above its median times its steps: stalls at some steps only (see below).
    above_median = 0.0
    # The mean time a rank's steps waited for other ranks (see _onset): in backward and collectives, and in
    # collectives inside its waits for batches.
    waits: dict[int, float] = {}
    # Each rank's slowest and quickest batch: another rank's compute may have waited for its late batch (a forward
    # whose collective, DDP's broadcast of the model's buffers, needs every rank's batch).
    batches: dict[int, tuple[float, float]] = {}
    for rank, part, value, spread, waited, slowest, quickest in job.rows(
        """
        SELECT rank, 'compute', median(comp) / 1e9, (sum(comp) - median(comp) * count(comp)) / 1e9,
               avg(dur - comp) / 1e9, 0, 0
        FROM step_parts GROUP BY rank
        UNION ALL SELECT rank, 'collective', median(coll) / 1e9, 0, 0, 0, 0 FROM step_parts WHERE coll IS NOT NULL
        GROUP BY rank
        UNION ALL SELECT rank, 'data_loading', median(dur) / 1e9, (sum(dur) - median(dur) * count(dur)) / 1e9,
               avg(whole - dur) / 1e9, max(dur) / 1e9, min(dur) / 1e9
        FROM loading_parts GROUP BY rank
        """
    ):
        parts.setdefault(int(rank), {})[part] = float(value)
        above_median = max(above_median, float(spread or 0.0))
        waits[int(rank)] = waits.get(int(rank), 0.0) + float(waited or 0.0)
        if part == "data_loading":
            batches[int(rank)] = (float(slowest or 0.0), float(quickest or 0.0))
    least_wait = min(waits.values(), default=0.0)
    saves: dict[int, list[float]] = {}
    # Ranks whose saves do not write the model (``checkpoint_writer`` false: the Trainer's ranks other than process
    # zero under DDP save their RNG state alone): their saves are compared among themselves, the writers' among the
    # writers (rank 0's saves, the only ones with the model, read as slow on any disk).
    not_writers: set[int] = set()
    # The passes that stop training between steps: blocking saves and validation (an asynchronous save's span
    # runs beside the steps).
    pauses: dict[int, list[tuple[int, int]]] = {}
    for rank, name, ts, dur, writer in job.rows(
        f"""
        SELECT rank, name, ts, dur, attrs->>'checkpoint_writer' FROM spans_small
        WHERE name IN ('{SpanName.CHECKPOINT_SAVE_SYNC}', '{SpanName.CHECKPOINT_SAVE_ASYNC}', '{SpanName.VALIDATION}')
          AND dur IS NOT NULL AND NOT is_agent
        """
    ):
        if name != SpanName.VALIDATION:
            saves.setdefault(int(rank), []).append(int(dur) / NS)
            if writer == "false":
                not_writers.add(int(rank))
        if name != SpanName.CHECKPOINT_SAVE_ASYNC:
            pauses.setdefault(int(rank), []).append((int(ts), int(ts) + int(dur)))
    paused = {rank: _paused(bounds[rank], pauses.get(rank, [])) for rank in bounds}
    for rank, durations in saves.items():
        # The lower median: a rank is slow in its saves only when at least half of them are slow. A rank
        # with few saves (one that failed early) is not a straggler for one save a busy disk delayed.
        durations.sort()
        parts.setdefault(rank, {})["checkpoint_save"] = durations[(len(durations) - 1) // 2]
    # A part is slow when it is `threshold` times the other ranks' median and the excess matters: at least
    # MIN_EXCESS of the job's median step time (a 10 us zero_grad twice as slow is not a straggler), and
    # never less than MIN_EXCESS_S: scheduling noise on a busy host moves a healthy rank's medians by that much.
    floor = max(MIN_EXCESS * (job_median or 0.0), MIN_EXCESS_S)
    # A save is I/O: a busy disk moves it by milliseconds. Slower by less than one median step is not a straggler
    # (a real job's healthy rank read 7.3 ms against the others' 5.1 under load).
    floors = dict.fromkeys(SLOW_PARTS, floor) | {"checkpoint_save": max(floor, job_median or 0.0)}
    partial: set[int] = set()  # stragglers by their medians whose slow-down is stalls at some steps (_onset)
    # A rank slow by its medians but not from some step on: slow at more than half its steps, not in a row (the
    # median is then its slow steps', so its sum is not above it), which the step-by-step pass tells.
    unsettled: set[int] = set()
    # Ranks slower from some step on by less than they then waited for another rank: (rank, part, step, excess).
    hidden: list[tuple[int, str, int, float]] = []
    for r in rows:
        mine = parts.get(r["rank"], {})
        excess: dict[str, float] = {}
        for part in SLOW_PARTS:
            values = {k: v[part] for k, v in parts.items() if part in v}
            if part == "checkpoint_save":
                values = {k: v for k, v in values.items() if (k in not_writers) == (r["rank"] in not_writers)}
            ref = _reference(values, r["rank"]) if part in mine else None
            r[f"{part}_median_s"] = mine.get(part)
            r[f"{part}_score"] = mine[part] / ref if ref else None
            if ref and mine[part] / ref >= threshold and mine[part] - ref >= floors[part]:
                excess[part] = mine[part] - ref
        if "collective" in mine:
            r["collective_median_s"] = mine["collective"]
        # Medians over the whole run compare different periods when ranks ran for different lengths (a rank
        # that failed early saw only the busy start): a slow step-aligned part must also be slow step by step.
        for part in sorted(excess, key=lambda k: -excess[k]):
            # Whether it may have waited for another rank at its slow steps longer than it was slow: on average
            # it waited more than half its excess beyond the rank that waited least (else, surely not: one pass
            # fewer over every rank's steps).
            waited = waits.get(r["rank"], 0.0) - least_wait > excess[part] / 2
            # ...or, in compute, may have waited for another rank's batch, later than its own by half its excess or
            # more at some step (_onset reads each step).
            waited = waited or (
                part == "compute"
                and r["rank"] in batches
                and max((v[0] for k, v in batches.items() if k != r["rank"]), default=0.0) - batches[r["rank"]][1]
                >= excess[part] / 2
            )
            onset = _onset(job, r["rank"], part, threshold, floor, waits=waited)
            if onset.pop("_waited", False):
                hidden.append((r["rank"], part, onset["slow_since_step"], excess[part]))
                continue
            if onset or part not in ALIGNED_PARTS:
                r["slow_in"] = part
                r["excess_s"] = excess[part]
                if onset.pop("_partial", False):
                    partial.add(r["rank"])
                r.update(onset)
                break
        r["straggler"] = "slow_in" in r
        if excess and not r["straggler"] and not any(h[0] == r["rank"] for h in hidden):
            unsettled.add(r["rank"])
    named = {r["rank"] for r in rows if r["straggler"]}
    for rank, part, since, extra in hidden:
        if rank not in named:
            notes.append(
                f"rank {rank} was slower in {part} from step {since} on ({extra * 1e3:.3g} ms a step above the others' "
                "median), but at most of those steps it then waited longer for another rank: it held the job up "
                "for nothing, and is not named"
            )
    # A rank slow at some steps only (a stall every few steps, a few slow minutes) leaves its medians as the
    # others': it is a straggler when the steps it held up cost the job a share of its training time.
    by_rank = {r["rank"]: r for r in rows}
    # The job's training time: the ranks' median from their first step's start to their last step's end, less the
    # longest that a rank paused training in between (_paused: in data-parallel training the others wait for it at
    # their next collective, as Lightning's ranks wait for rank 0's saves, with no save of their own); the steps'
    # own time at least.
    training_time = max(
        _median([(hi - lo) / NS for lo, hi, _ in bounds.values()]) - max(paused.values(), default=0.0),
        _median([busy for _, _, busy in bounds.values()]),
    )
    # Stalls that held the job up make the stalled rank's compute or waits sum well above its median's times its
    # steps. Without that, the step-by-step pass is skipped (a pass over every rank's steps: 0.1 s at 16 ranks of
    # 50,000 steps).
    held_up = (
        _intermittent(
            job, ranks=list(by_rank), threshold=threshold, floor=floor, training_time=training_time, start=start
        )
        if above_median >= INTERMITTENT_SHARE / 2 * training_time or partial or unsettled
        else []
    )
    for found in held_up:
        r = by_rank.get(found["rank"], {})
        # A straggler by its medians whose slow-down is stalls at some steps: its stalls are the answer (a real
        # Lightning job's rank, slow every other step, read "slow since step 6" on a busy host, its other steps
        # 2 ms slower than the other rank's).
        also = r.get("straggler") and r["rank"] in partial and r["slow_in"] == found["slow_in"]
        # ...or, named by its medians in another part, its stalls held the job up more than twice that part's
        # excess at every step could have (a real Lightning job's rank, 60 ms slower in its training step every
        # other step, read "slow in data_loading since step 11" on a busy host: 3.3 ms above the other rank's median).
        instead = (
            r.get("straggler")
            and not also
            and found["lost_s"] >= 2 * (r.get("excess_s") or 0.0) * max(r.get("steps") or 0, 1)
            and r.get("slow_in")
        )
        if not r or (r["straggler"] and not also and not instead):
            continue
        r.update({k: v for k, v in found.items() if k != "rank"})
        if not also:
            r["excess_s"] = found["lost_s"] / max(r["steps"], 1)
        r["straggler"] = True
        every = f", every {_ordinal(found['slow_every'])} step" if found.get("slow_every") else ""
        medians = (
            f"its median {instead} is slower too, by far less"
            if instead
            else "its medians are slower too"
            if also
            else "its median is its slow steps', but they are not every step from one on"
            if r["rank"] in unsettled
            else "its medians are the others'"
        )
        notes.append(
            f"rank {r['rank']} was slow in {found['slow_in']} at {found['slow_steps']} of its {r['steps']} steps "
            f"only (steps {found['slow_since_step']} to {found['slow_until_step']}{every}), which held the job up "
            f"{found['lost_s']:.3g} s, {found['lost_s'] / training_time:.0%} of its training time: {medians}"
        )
    # Windows: each rank's median step time outside collectives per time window, relative to the other
    # ranks' median in that window.
    grid = job.rows(
        f"""
        SELECT rank, least((ts - {start}) // {width}, {windows - 1}) AS w, quantile_cont(comp, 0.5) / 1e9
        FROM step_parts GROUP BY ALL
        """
    )
    by_window: dict[int, dict[int, float]] = {}
    for rank, w, value in grid:
        by_window.setdefault(int(w), {})[int(rank)] = float(value)
    heat: dict[int, dict[int, float]] = {}
    for w, values in by_window.items():
        for rank, value in values.items():
            base = _reference(values, rank)
            heat.setdefault(rank, {})[w] = value / base if base else 1.0
    for r in rows:
        cells = heat.get(r["rank"], {})
        slow_windows = [w for w in sorted(cells) if cells[w] >= threshold]
        if slow_windows and r["straggler"]:
            r["slow_since_window"] = slow_windows[0]
            r.setdefault("slow_since_s", slow_windows[0] * width / NS)
            r["slow_windows"] = len(slow_windows)

    def badness(r: dict[str, Any]) -> tuple[float, float]:
        return (r.get("excess_s") or 0.0, max([r["score"] or 0.0, *(r.get(f"{p}_score") or 0.0 for p in SLOW_PARTS)]))

    ordered = sorted(rows, key=badness, reverse=True)
    stragglers = [r["rank"] for r in ordered if r["straggler"]][:top]
    return {
        "job_median_s": job_median,
        "threshold": threshold,
        "ranks": rows,
        "top": [r["rank"] for r in ordered[:top]],
        "stragglers": stragglers,
        # Every straggler on one host of several: a slow node (throttled, a noisy neighbour, a slow disk).
        "straggler_node": shared_node(stragglers, _rank_hosts(job)) if len(stragglers) > 1 else None,
        "window_s": width / NS,
        "windows": [
            {"rank": rank, "scores": [cells.get(w) for w in range(windows)]} for rank, cells in sorted(heat.items())
        ],
        "notes": notes,
    }


def _rank_hosts(job: Job) -> dict[int, str | None]:
    """rank -> the host its streams name (None when they name none, or several: a rank moved by a restart)."""
    hosts: dict[int, set[Any]] = {}
    for rank, host in job.rows("SELECT DISTINCT rank, host FROM streams WHERE NOT is_agent"):
        hosts.setdefault(int(rank), set()).add(host or None)
    return {rank: next(iter(names)) if len(names) == 1 else None for rank, names in hosts.items()}


#: The parts of a rank's time compared across ranks; ``compute`` is the step's time outside collectives.
SLOW_PARTS = ("compute", "data_loading", "checkpoint_save")
#: The parts compared step by step too (``_onset``): their slowness must hold from some step on.
ALIGNED_PARTS = ("compute", "data_loading")
#: A slow part must exceed the other ranks' median by at least this share of the job's median step time.
MIN_EXCESS = 0.05
#: ...and by at least this many seconds, whatever the step time.
MIN_EXCESS_S = 0.002
#: The share of the steps from the onset on that must be slow.
ONSET_SHARE = 0.7
#: ...and how many steps there must be from the onset on: a slow-down is sustained, and the last two steps of a
#: rank that stopped early, slowed by a busy host, are not one.
ONSET_MIN_STEPS = 5


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    if not n:
        return 0.0
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def _reference(values: dict[int, float], rank: int) -> float | None:
    """The median of the other ranks' values: with two ranks, the other rank (no upper-median trap)."""
    others = [v for k, v in values.items() if k != rank]
    return _median(others) if others else None


#: Spans that, beginning between a wait for a batch and the next step, say that the wait fed no step: the wait a
#: framework's callback opens after a step, which an evaluation or a save ends (see _step_parts).
_NOT_A_STEP_AFTER = (
    SpanName.VALIDATION,
    SpanName.TEST,
    SpanName.CHECKPOINT_SAVE_SYNC,
    SpanName.CHECKPOINT_SAVE_ASYNC,
    SpanName.CHECKPOINT_LOAD,
)


def _step_parts(job: Job) -> None:
    """Per step: its duration, the time spent in collectives inside it and its own work; per wait for a batch:
    the step it fed (docs/analysis.md, "ranks")."""
    barriers = ", ".join(f"'{name}'" for name in _NOT_A_STEP_AFTER)
    # What the job recorded decides which parts the statements need: most jobs record no backward phase (their
    # steps skip that join, a pass over every step: 20 ms at 16 ranks), many no collective or no wait for a batch.
    # Planning what is left out cost DuckDB 10 ms of a small job's command.
    present = job.one(
        f"""
        SELECT sum(CASE WHEN name = '{SpanName.BACKWARD}' THEN 1 ELSE 0 END),
               sum(CASE WHEN name = '{SpanName.COLLECTIVE}' THEN 1 ELSE 0 END),
               sum(CASE WHEN name = '{SpanName.DATA_LOADING}' THEN 1 ELSE 0 END)
        FROM spans_small WHERE name IN ('{SpanName.BACKWARD}', '{SpanName.COLLECTIVE}', '{SpanName.DATA_LOADING}')
        """
    )
    with_backward, with_collectives, with_loading = (bool(n) for n in (present or (0, 0, 0)))
    # backward phases, none holding a recorded collective
    unrecorded = "bw.bwd IS NOT NULL AND bc.id IS NULL" if with_collectives else "bw.bwd IS NOT NULL"
    coll = "coalesce(inside.coll, 0)" if with_collectives else "0"
    own = f"{coll} + CASE WHEN {unrecorded} THEN bw.bwd ELSE 0 END" if with_backward else coll
    outside_backward = unrecorded if with_backward else "false"
    join_backward = "LEFT JOIN bw ON bw.stream = it.stream AND bw.id = it.id" if with_backward else ""
    if with_backward and with_collectives:
        join_backward += " LEFT JOIN bw_col bc ON bc.stream = it.stream AND bc.id = it.id"
    backward_parts = (
        f"""
        , bw AS (
            -- A step's backward phases: where DDP's gradient all-reduce waits for the slowest rank, unrecorded
            -- unless a collective began inside them (the Lightning and Trainer callbacks time phases between hooks
            -- and record no all-reduce; record_collectives records DDP's inside backward).
            SELECT stream, parent AS id, sum(dur) AS bwd, min(ts) AS b0, max(ts + dur) AS b1 FROM spans_small
            WHERE name = '{SpanName.BACKWARD}' AND dur IS NOT NULL AND NOT is_agent AND NOT open
            GROUP BY ALL
        )"""
        if with_backward
        else ""
    )
    collective_parts = (
        f"""
        , col AS (
            SELECT stream, ts, dur FROM spans_small
            WHERE name = '{SpanName.COLLECTIVE}' AND dur IS NOT NULL AND NOT is_agent
        ), timed AS (
            -- Only streams with collectives need the steps placed: the running maximum sorts every step. Read
            -- from iterations, not it: a CTE read twice is materialised, every step of every rank at once.
            SELECT stream, ts, dur FROM iterations WHERE status = 'ok' AND stream IN (SELECT stream FROM col)
        ), placed AS (
            -- Each collective with the start of the latest step that began at or before it (an as-of join,
            -- written as a running maximum so that every engine runs it).
            SELECT stream, ts, dur, o, max(its) OVER (
                PARTITION BY stream ORDER BY ts, o ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS its
            FROM (SELECT stream, ts, NULL::BIGINT AS dur, ts AS its, 0 AS o FROM timed
                  UNION ALL SELECT stream, ts, dur, NULL::BIGINT AS its, 1 AS o FROM col)
        ), ends AS (
            SELECT stream, ts AS its, max(ts + dur) AS iend FROM timed GROUP BY stream, ts
        ), inside AS (
            SELECT c.stream, c.its, sum(least(c.ts + c.dur, e.iend) - c.ts) AS coll
            FROM placed c JOIN ends e ON c.stream = e.stream AND c.its = e.its
            WHERE c.o = 1 AND c.ts < e.iend GROUP BY c.stream, c.its
        )"""
        if with_collectives
        else ""
    )
    if with_backward and with_collectives:
        collective_parts += """
        , bw_col AS (
            SELECT DISTINCT b.stream, b.id FROM bw b JOIN col c ON c.stream = b.stream AND c.ts >= b.b0 AND c.ts < b.b1
        )"""
    join_inside = "LEFT JOIN inside ON inside.stream = it.stream AND inside.its = it.ts" if with_collectives else ""
    job.con.execute(
        f"""
        CREATE TEMP TABLE IF NOT EXISTS step_parts AS
        WITH it AS (
            SELECT stream, rank, restart, ts, dur, id, step,
                   row_number() OVER (PARTITION BY stream ORDER BY ts) AS k
            FROM iterations WHERE status = 'ok'
        ), gc AS ({compute_time_sql()}
        ){backward_parts}{collective_parts}
        -- One row per completed step of every rank: only the columns read, the small ones as INTEGER (a
        -- 64-rank job's steps are a third of the command's peak memory).
        SELECT it.rank::INTEGER AS rank, it.restart::INTEGER AS restart, it.k::INTEGER AS k, it.step, it.ts,
               {"inside.coll" if with_collectives else "NULL::BIGINT"} AS coll,  -- NULL: no collective in the step
               -- the step's own work: its compute phases' device time where measured, else outside collectives and
               -- outside its backward phases where no collective began in them (DDP's all-reduce waits there)
               coalesce(gc.gpu_compute, it.dur - ({own})) AS comp,
               it.dur AS dur,
               {outside_backward} AS outside_backward
        FROM it {join_inside}
        LEFT JOIN gc ON gc.stream = it.stream AND gc.id = it.id
        {join_backward};
        """
    )
    if not with_loading:
        job.con.execute(
            """
            CREATE TEMP TABLE IF NOT EXISTS loading_parts AS
            SELECT NULL::BIGINT AS rank, NULL::BIGINT AS restart, NULL::BIGINT AS ts, NULL::BIGINT AS dur,
                   NULL::BIGINT AS whole, NULL::BIGINT AS step, NULL::BIGINT AS k
            FROM (VALUES (1)) AS t(x) WHERE false
            """
        )
        return
    job.con.execute(
        f"""
        CREATE TEMP TABLE IF NOT EXISTS loading_parts AS
        WITH waits AS (
            SELECT stream, rank, restart, ts, dur, id, parent FROM spans_small
            WHERE name = '{SpanName.DATA_LOADING}' AND dur IS NOT NULL AND NOT is_agent
              AND coalesce(status, '') <> '{SpanStatus.INTERRUPTED}'
        ), gathers AS (
            -- Collectives inside a wait (the Trainer gathers each step's token count from every rank as it
            -- fetches the batch): time waiting for the slowest rank's loader, not this rank's own.
            SELECT c.stream, c.parent AS id, sum(c.dur) AS coll FROM spans_small c
            WHERE c.name = '{SpanName.COLLECTIVE}' AND c.dur IS NOT NULL AND NOT c.is_agent
              AND c.stream IN (SELECT stream FROM waits)
            GROUP BY ALL
        ), w AS (
            SELECT w.stream, w.rank, w.restart, w.ts, w.dur - coalesce(g.coll, 0) AS dur, w.dur AS whole, w.parent
            FROM waits w LEFT JOIN gathers g ON g.stream = w.stream AND g.id = w.id
        ), loading_streams AS (
            SELECT DISTINCT stream FROM w
        ), marks AS (
            -- Per stream, in time: where each wait ends, each step begins, each evaluation or save begins.
            SELECT stream, ts + whole AS mark_ts, 0 AS o, ts AS wait_ts, NULL::BIGINT AS its, NULL::BIGINT AS bts FROM w
            UNION ALL SELECT i.stream, i.ts, 1, NULL, i.ts, NULL FROM iterations i
            WHERE i.stream IN (SELECT stream FROM loading_streams)
            UNION ALL SELECT s.stream, s.ts, 1, NULL, NULL, s.ts FROM spans_small s
            WHERE s.name IN ({barriers}) AND s.stream IN (SELECT stream FROM loading_streams)
        ), following AS (
            -- For each wait, the next step to begin after it ends and the next evaluation or save.
            SELECT stream, wait_ts,
                   min(its) OVER (PARTITION BY stream ORDER BY mark_ts DESC, o DESC
                                  ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS next_its,
                   min(bts) OVER (PARTITION BY stream ORDER BY mark_ts DESC, o DESC
                                  ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS next_bts
            FROM marks
        ), fed AS (
            -- The step each wait fed: the step it is inside, else the next step when no evaluation or save
            -- began first (the wait a callback opens after a step, ended by an evaluation, fed none).
            SELECT w.stream, w.rank, w.restart, w.ts, w.dur, w.whole,
                   coalesce(p.ts, CASE WHEN f.next_bts IS NULL OR f.next_bts > f.next_its THEN f.next_its END)
                       AS fed_ts,
                   coalesce(p.step, n.step) AS step
            FROM w JOIN following f ON f.stream = w.stream AND f.wait_ts = w.ts
            LEFT JOIN iterations p ON p.stream = w.stream AND p.id = w.parent
            LEFT JOIN iterations n ON n.stream = w.stream AND n.ts = f.next_its
        ), kept AS (
            -- One row per step fed (the waits before it together: a callback may end one at an epoch's end and
            -- open the next); a stream whose waits are neither inside nor just before its steps keeps them all.
            SELECT stream, rank, restart, min(ts) AS ts, sum(dur) AS dur, sum(whole) AS whole, max(step) AS step
            FROM fed WHERE fed_ts IS NOT NULL GROUP BY stream, rank, restart, fed_ts
            UNION ALL
            SELECT stream, rank, restart, ts, dur, whole, NULL FROM fed
            WHERE stream NOT IN (SELECT stream FROM fed WHERE fed_ts IS NOT NULL)
        )
        -- whole: with the collectives inside the wait (the time it waited for other ranks' loaders).
        SELECT rank, restart, ts, dur, whole, step, row_number() OVER (PARTITION BY stream ORDER BY ts) AS k
        FROM kept;
        """
    )


def _change_point(flags: list[bool]) -> int | None:
    """The index that classifies the most flags right (fast before it, slow from it on; the earliest of equals),
    or None when fewer than ``ONSET_SHARE`` of the flags from it on are slow, or fewer than ``ONSET_MIN_STEPS``
    flags follow it."""
    n = len(flags)
    best, best_at, right = -1, 0, sum(flags)  # right: flags classified right with the change at i (all slow)
    for i in range(n):
        if right > best:
            best, best_at = right, i
        right += 1 if not flags[i] else -1  # flag i moves to the fast side
    if n - best_at < ONSET_MIN_STEPS or sum(flags[best_at:]) < ONSET_SHARE * (n - best_at):
        return None
    return best_at


#: A rank slow at some steps only is a straggler when the time its slow steps held the job up is at least this share
#: of the job's training time (the median over ranks of the time from their first step's start to their last's end)...
INTERMITTENT_SHARE = 0.1
#: ...over at least this many steps (one or two slow steps are a hiccup)...
INTERMITTENT_MIN_STEPS = 3
#: ...and at least this many times what the other ranks' slow steps held it up (the median of theirs): on a busy
#: machine every rank is now and then the slowest by noise.
INTERMITTENT_STANDS_OUT = 3.0
#: A rank's slow steps fall into two classes when, split where they are farthest apart (on a log scale), the upper
#: class's smallest excess is at least BREAK_GAP times the lower's largest, and its typical (geometric mean) excess
#: BREAK_APART times the lower's: then the lower class is noise, however many steps it has.
BREAK_GAP = 2.0
BREAK_APART = 4.0


def _paused(bounds: tuple[int, int, float], pauses: list[tuple[int, int]]) -> float:
    """Seconds a rank paused training between its first step's start and its last step's end (``bounds``): its
    blocking checkpoint saves and validation passes (``pauses``, ns), a save inside a validation pass once.

    What a stall at some steps holds up is the steps, not those passes: a real Lightning job saving 20 MB every
    other step, 0.3 s a save on CI's slow disk, had a rank's 60 ms stall every other step read as under a tenth of
    its time, and ``no stragglers``."""
    lo, hi, _ = bounds
    paused, reach = 0, lo
    for began, ended in sorted(pauses):
        start, end = max(began, reach), min(ended, hi)
        if end > start:
            paused += end - start
            reach = end
    return paused / NS


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _intermittent(
    job: Job, *, ranks: list[int], threshold: float, floor: float, training_time: float, start: int
) -> list[dict[str, Any]]:
    """Ranks whose compute or data loading was slow at some steps only, costing the job a share of its time.

    At each step the slowest rank's part is compared with the next slowest rank's: without its stall the step
    would have waited for that one, so what it held the job up is the difference (against the others' mean, two
    ranks that waited in forward for a third's slow batch, as DDP's second step does when it rebuilds its buckets,
    made the one of them that waited longer a rank slow in compute). A rank's slow steps are those where it was
    ``threshold`` times that and ``floor`` seconds above it, then only those above half the median excess of its
    slow steps (noise on a busy machine passes the first bar now and then, a real stall is far above the
    second); where its slow steps fall into two classes far apart (``BREAK_GAP``, ``BREAK_APART``), only those of
    the upper one (noise at more steps than the stalls made that median the noise's). A rank's slow compute at a
    step where another rank fetched its batch late by half as much or more is not its own: it waited in forward
    for that batch. What they held the job up is the sum of those excesses.
    """
    if training_time <= 0:
        return []
    # Each step's slowest rank and the next slowest, per part: one pass, kept for the two queries below.
    job.con.execute(
        """
        CREATE TEMP TABLE IF NOT EXISTS step_tops AS
        WITH v AS (
            SELECT 'compute' AS part, restart, k, rank, step, ts, comp AS x FROM step_parts WHERE comp IS NOT NULL
            UNION ALL
            SELECT 'data_loading', restart, k, rank, step, ts, dur FROM loading_parts WHERE dur IS NOT NULL
        )
        -- max(x, 2): the two largest, as a list (1-based): the slowest rank's and the next slowest's (in a CASE:
        -- Spark evaluates it before HAVING, and a one-element list has no second item there, but an error).
        SELECT part, restart, k, arg_max(rank, x) AS who, max(x) AS top,
               CASE WHEN count(*) > 1 THEN max(x, 2)[2] END AS ref,
               arg_max(step, x) AS step, arg_max(ts, x) AS ts
        FROM v GROUP BY part, restart, k HAVING count(*) > 1
        """
    )
    kept_sql = """
        WITH s AS (
            SELECT * FROM step_tops
        ), slow AS (
            SELECT part, who, restart, k, step, ts, top - ref AS e FROM s
            WHERE ref > 0 AND top >= $threshold * ref AND top - ref >= $floor
        ), f AS (
            -- Compute that waited: at a step another rank fetched its batch late by half as much or more, a
            -- collective in forward (DDP's second step rebuilds its buckets there) waited for that batch.
            SELECT * FROM slow c WHERE c.part <> 'compute' OR NOT EXISTS (
                SELECT 1 FROM slow d WHERE d.part = 'data_loading' AND d.restart = c.restart AND d.step = c.step
                  AND d.who <> c.who AND d.e * 2 >= c.e)
        ), b AS (
            SELECT part, who, median(e) / 2 AS bar FROM f GROUP BY part, who
        ), o AS (
            -- Each split of a rank's excesses, in order, into a lower and an upper class (n0 and s0: the lower's
            -- count and sum of logarithms; above: the upper's smallest).
            SELECT part, who, e, lead(e) OVER (PARTITION BY part, who ORDER BY e) AS above,
                   count(*) OVER (PARTITION BY part, who ORDER BY e ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)
                       AS n0,
                   sum(ln(e)) OVER (PARTITION BY part, who ORDER BY e ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)
                       AS s0,
                   count(*) OVER (PARTITION BY part, who) AS n, sum(ln(e)) OVER (PARTITION BY part, who) AS s
            FROM f
        ), g AS (
            -- The natural break: the split farthest between its classes (log scale), kept when they are apart.
            SELECT part, who,
                   arg_max(CASE WHEN above >= $gap * e AND exp((s - s0) / (n - n0) - s0 / n0) >= $apart
                           THEN above ELSE 0 END,
                           n0 * (n - n0) * power((s - s0) / (n - n0) - s0 / n0, 2)) AS cut
            FROM o WHERE above IS NOT NULL GROUP BY part, who
        ), kept AS (
            SELECT f.part, f.who, f.restart, f.k, coalesce(f.step, f.k - 1) AS step, f.ts, f.e
            FROM f JOIN b ON b.part = f.part AND b.who = f.who
            LEFT JOIN g ON g.part = f.part AND g.who = f.who
            WHERE f.e >= b.bar AND f.e >= coalesce(g.cut, 0)
        )"""
    params = {"threshold": threshold, "floor": int(floor * NS), "gap": BREAK_GAP, "apart": BREAK_APART}
    totals = job.rows(
        kept_sql
        + """
        SELECT part, who, count(*), sum(e), arg_min(step, ts), arg_max(step, ts), min(ts), arg_min(restart, ts),
               max(e)
        FROM kept GROUP BY part, who
        """,
        params,
    )
    found: list[dict[str, Any]] = []
    for part in ALIGNED_PARTS:
        mine = {int(who): row for p, who, *row in totals if p == part}
        lost = {who: float(row[1]) / NS for who, row in mine.items()}
        for rank, (count, _, first, last, first_ts, first_restart, longest) in mine.items():
            # Ranks with no slow step held the job up for nothing: zeros in the median.
            others = [lost.get(other, 0.0) for other in ranks if other != rank]
            if (
                count < INTERMITTENT_MIN_STEPS
                or lost[rank] < INTERMITTENT_SHARE * training_time
                # Held up at several steps, not at one: a rank's single long stall (a busy machine's 0.75 s in one
                # forward) with two slow steps of noise read as slow in compute at 3 steps.
                or lost[rank] - float(longest) / NS < INTERMITTENT_SHARE * training_time
                or lost[rank] < INTERMITTENT_STANDS_OUT * _median(others)
            ):
                continue
            entry: dict[str, Any] = {
                "rank": rank,
                "slow_in": part,
                "slow_steps": int(count),
                "lost_s": lost[rank],
                "slow_since_step": int(first),
                "slow_until_step": int(last),
                "slow_since_ns": int(first_ts),
                "slow_since_s": (int(first_ts) - start) / NS,
                "slow_since_restart": int(first_restart),
            }
            # The steps between its slow steps (within an attempt): a stall every N steps has one gap mostly.
            steps = job.rows(
                kept_sql + " SELECT restart, k FROM kept WHERE part = $part AND who = $who ORDER BY restart, k",
                {**params, "part": part, "who": rank},
            )
            gaps = [b[1] - a[1] for a, b in itertools.pairwise(steps) if a[0] == b[0]]
            if gaps:
                common = max(set(gaps), key=gaps.count)
                if common >= 2 and gaps.count(common) >= 0.75 * len(gaps):
                    entry["slow_every"] = int(common)
            found.append(entry)
    return found


def _clock_ahead(job: Job, host: str) -> str:
    """SQL: how far the clock of the host in column ``host`` runs ahead of the reference host's (``host_clocks``),
    in ns; ``0`` for a job whose hosts' clocks are not proven apart."""
    offsets = host_clocks(job)["offsets_ns"]
    if not offsets:
        return "0"
    whens = " ".join(f"WHEN {sql_string(h)} THEN {int(ns)}" for h, ns in offsets.items())
    return f"CASE {host} {whens} ELSE 0 END"


def _on_one_clock(job: Job, table: str, columns: tuple[str, ...]) -> str:
    """``table`` (by rank and restart, with a ``ts`` column) with ``ts`` on the reference host's clock: the table
    itself for a job whose hosts' clocks are not proven apart (``host_clocks``)."""
    ahead = _clock_ahead(job, "s.host")
    if ahead == "0":
        return table
    return f"""(
        SELECT {", ".join(f"t.{c}" for c in columns)}, t.ts - coalesce(c.ahead, 0) AS ts FROM {table} t
        LEFT JOIN (
            SELECT DISTINCT f.rank, f.restart, {ahead} AS ahead
            FROM stream_facts f JOIN streams s USING (stream) WHERE NOT f.is_agent
        ) c ON c.rank = t.rank AND c.restart = t.restart
    )"""


def _onset(job: Job, rank: int, part: str, threshold: float, floor: float, *, waits: bool = True) -> dict[str, Any]:
    """From which step (and when) ``part`` became slow on ``rank`` (docs/analysis.md, "ranks").

    Each step is slow when its value is ``threshold`` times the other ranks' median for the same step and
    exceeds it by ``floor`` seconds. The onset is the change point that classifies the most steps right
    (fast before it, slow from it on), so a few noisy steps on either side do not move it; then once more
    with steps counted slow only above the halfway mark between the excess before and after that point.
    """
    if part not in ALIGNED_PARTS:
        return {}
    # Each step's time waiting for other ranks: in backward and collectives (step_parts: the step less its own
    # work), and in collectives inside its wait for its batch (the Trainer gathers each step's token count there,
    # where the ranks wait for the slowest rank's loader; a join only where a wait holds one).
    gathered = job.one("SELECT count(*) FROM loading_parts WHERE whole > dur") if waits else None
    if gathered and gathered[0]:
        gathers = """LEFT JOIN (
            SELECT rank, restart, step, sum(whole - dur) AS g FROM loading_parts WHERE step IS NOT NULL GROUP BY ALL
        ) g ON g.rank = s.rank AND g.restart = s.restart AND g.step = s.step"""
        waited = "s.dur - s.comp + coalesce(g.g, 0)"
    else:
        gathers, waited = "", "s.dur - s.comp"
    if not waits:  # as good as surely not (see ranks): the table itself, no pass over the waits
        source = "step_parts" if part == "compute" else "loading_parts"
        value = "comp" if part == "compute" else "dur"
    elif part == "compute":
        # How much later than this rank another rank fetched the batch of the same step, where that fetch ended
        # inside this rank's step and every rank's step ended with this one's (in lockstep: DDP's all-reduce), and
        # how far into the step: a forward holding a collective (DDP's broadcast of the buffers) waited for it,
        # unrecorded unless record_collectives timed it. (Ranks not in lockstep, one slow in compute and one slow
        # fetching at the same pace, had such fetches end as the slow steps did, and now and then their steps' ends
        # together too, by chance; the ranks not slow ended theirs apart from them.)
        other_in_step = (
            "l.rank <> $r AND l.ts + l.whole > m.ts AND l.ts + l.whole <= m.ts + m.dur AND a.apart * 8 <= m.dur"
        )
        # Times across ranks compared on the reference host's clock (host_clocks).
        loading = _on_one_clock(job, "loading_parts", ("rank", "restart", "step", "dur", "whole"))
        stepping = _on_one_clock(job, "step_parts", ("rank", "restart", "step", "dur"))
        late = f"""LEFT JOIN (
            SELECT l.restart, l.step,
                   max(l.dur) FILTER ({other_in_step}) - max(l.dur) FILTER (l.rank = $r) AS late,
                   max(l.ts + l.whole) FILTER ({other_in_step}) - min(m.ts) AS late_end
            FROM {loading} l
            JOIN (SELECT restart, step, ts, dur FROM {stepping} WHERE rank = $r) m
              ON m.restart = l.restart AND m.step = l.step
            JOIN (
                SELECT restart, step, max(ts + dur) - min(ts + dur) AS apart FROM {stepping} GROUP BY restart, step
            ) a ON a.restart = l.restart AND a.step = l.step
            GROUP BY l.restart, l.step
        ) lb ON lb.restart = s.restart AND lb.step = s.step"""
        columns = f"s.rank, s.restart, s.k, s.ts, s.step, s.comp AS v, {waited} AS waited, lb.late, lb.late_end"
        source, value = f"(SELECT {columns} FROM step_parts s {gathers} {late})", "v"
    else:  # the step each wait fed, for that step's waits (the least, where a rank's step numbers repeat)
        source, value = (
            f"""(
            SELECT l.rank, l.restart, l.k, l.ts, l.step, l.dur AS v, w.waited FROM loading_parts l
            LEFT JOIN (
                SELECT s.rank, s.restart, s.step, min({waited}) AS waited FROM step_parts s {gathers} GROUP BY ALL
            ) w ON w.rank = l.rank AND w.restart = l.restart AND w.step = l.step)""",
            "v",
        )
    late_columns = ", max(late) FILTER (rank = $r), max(late_end) FILTER (rank = $r)"
    rows = job.rows(
        f"""
        SELECT restart, k, max({value}) FILTER (rank = $r), median({value}) FILTER (rank <> $r),
               max(ts) FILTER (rank = $r), max(step) FILTER (rank = $r)
               {", max(waited) FILTER (rank = $r) - min(waited)" if waits else ""}
               {late_columns if waits and part == "compute" else ""}
        FROM {source} GROUP BY restart, k HAVING count(*) FILTER (rank = $r) > 0
        ORDER BY restart, k
        """,
        {"r": rank},
    )
    if not rows:
        return {}
    floor_ns = floor * NS
    pairs = [(row[2], row[3]) for row in rows]  # the rank's value and the others' median, per step
    excess = [None if mine is None or not ref else float(mine - ref) for mine, ref in pairs]
    flags = [
        bool(mine is not None and ref and mine / ref >= threshold and mine - ref >= floor_ns) for mine, ref in pairs
    ]
    at = _change_point(flags)
    if at is None:
        return {}
    # A second look with the bar halfway between the levels before and after that change: on a busy machine
    # single steps pass the ratio and floor tests by noise, and a few of them just before the onset would
    # otherwise pull it earlier; a real slow-down is far above the halfway bar.
    before = [e for e in excess[:at] if e is not None]
    if not before:
        # The change at the first step: a job's first steps are noisy (warm-up, a busy machine), and two slow ones
        # of three before a late onset move it there. The steps not slow then set the lower level.
        before = [e for e, slow in zip(excess, flags, strict=True) if e is not None and not slow]
    after = [e for e in excess[at:] if e is not None]
    bar = max(floor_ns, (_median(before) + _median(after)) / 2 if before else 0.0)
    refined = [flag and e is not None and e >= bar for flag, e in zip(flags, excess, strict=True)]
    second = _change_point(refined)
    if second is not None:
        at = second
    restart, k, _, _, ts, step, *_ = rows[at]
    start = job_bounds(job)[0]

    # Its excess held the job up at a step unless it then waited longer for another rank than the rank that
    # waited least at that step (ranks in lockstep wait for the slowest one; ranks that do not wait for one
    # another wait as little as each other), or, in compute, another rank fetched that step's batch later than it
    # by half its excess or more, that fetch ending within the excess (or the lateness) and half a usual step of the
    # step's start (it waited in forward for that batch, then did its work) and every rank's step ending together
    # (see above). Held nothing up at most steps from the onset on: not a straggler.
    def late_for(e: float, row: tuple[Any, ...]) -> float:
        # (The excess or the lateness, whichever is more: the others' median may count another waiting rank.)
        if len(row) < 9 or row[7] is None or row[8] is None or row[3] is None or row[8] > max(e, row[7]) + row[3] / 2:
            return 0.0
        return float(row[7])

    told = (
        [
            (e, row[6], late_for(e, row))
            for e, row in zip(excess[at:], rows[at:], strict=True)
            if e is not None and row[6] is not None
        ]
        if waits
        else []
    )
    held_up = sum(e > w and e > 2 * late for e, w, late in told)
    # Stalls at some steps, which a busy host's smaller slow-down at the others made pass the first look: from the
    # onset on, fewer than ONSET_SHARE of the steps are at least half the median excess of its slow steps (the
    # halfway bar above misses it when the stalls are fewer than half the steps: its upper level is then noise).
    stalls = [e for e, slow in zip(excess[at:], flags[at:], strict=True) if slow and e is not None]
    stall_bar = max(floor_ns, _median(stalls) / 2 if stalls else 0.0)
    partial = sum(e is not None and e >= stall_bar for e in excess[at:]) < ONSET_SHARE * (len(excess) - at)
    return {
        "slow_since_step": int(step) if step is not None else int(k) - 1,
        "slow_since_ns": int(ts),
        "slow_since_s": (int(ts) - start) / NS,
        "slow_since_restart": int(restart),
        "_partial": partial,
        "_waited": bool(told) and held_up < len(told) / 2,
    }


# ---------------------------------------------------------------- errors


def _enclosing(job: Job, stream: int, span: int) -> tuple[str | None, int | None]:
    """The span an error was raised in, and the step of the iteration enclosing it (not the innermost span)."""
    rows = {
        int(r[0]): (r[1], r[2], r[3])
        for r in job.rows(
            "SELECT id, parent, name, try_cast(attrs->>'step' AS BIGINT) FROM spans_small WHERE stream = $s "
            f"UNION ALL SELECT id, parent, '{ITERATION}', step FROM iterations "
            "WHERE stream = $s",
            {"s": stream},
        )
        if r[0] is not None
    }
    name = rows[span][1] if span in rows else None
    node: int | None = span
    seen: set[int] = set()
    while node is not None and node in rows and node not in seen:
        seen.add(node)
        parent, kind, step = rows[node]
        if kind == ITERATION and step is not None:
            return name, int(step)
        node = parent
    return name, None


def errors(job: Job, hang_after_s: float = 60.0) -> dict[str, Any]:
    """Root cause first: the first error in time, identical errors grouped, each rank's last moments."""
    prepare(job)
    all_errors = job.dicts(
        """
        SELECT stream_rank AS rank, stream_restart AS restart, is_agent AS agent, name, ts, error_type, message,
               stack, attrs AS attrs, stream, span
        FROM other WHERE kind = 'error' ORDER BY ts, rank
        """
    )
    verdict = diagnose(job)
    # The first error is the first cause: peers' consequences (connection closed, timeouts) and hang reports
    # come after it in importance, whatever their time; so does an error a rank raised once it was failing already
    # (after a peer's failure reached it, or a signal came: a handler's or a cleanup's), as the verdict reads it.
    troubled = dict(
        job.rows(
            f"SELECT stream, min(ts) FROM other WHERE kind = 'event' AND name = '{EventName.SIGNAL}' "
            "AND NOT is_agent GROUP BY stream"
        )
    )
    for e in all_errors:  # in time order, on each stream's own clock
        later = e["stream"] in troubled and e["ts"] >= troubled[e["stream"]]
        e["consequence"] = later or (
            e["name"] in HANG_ERRORS or e["error_type"] in HANG_ERRORS or _secondary(e) or _terminated_by(e)
        )
        if e["consequence"] and not e["agent"] and e["name"] not in HANG_ERRORS and e["error_type"] not in HANG_ERRORS:
            troubled[e["stream"]] = min(troubled.get(e["stream"], e["ts"]), e["ts"])
    clocks = host_clocks(job)
    if clocks["offsets_ns"]:
        # Hosts whose clocks run ahead or behind: every error's time on the reference host's clock, as the verdict
        # compares them.
        host_of = dict(job.rows("SELECT stream, host FROM streams"))
        for e in all_errors:
            e["ts"] -= clocks["offsets_ns"].get(host_of.get(e["stream"]), 0)
        all_errors.sort(key=lambda e: (e["ts"], e["rank"] is None, e["rank"] or 0))
    causes = [e for e in all_errors if not e["consequence"]]
    first = causes[0] if causes else (all_errors[0] if all_errors else None)
    if first is not None and first.get("span"):
        where = _enclosing(job, first["stream"], first["span"])
        first["in_span"] = where[0]
        first["step"] = where[1]
    culprit = verdict["culprit"]
    if first is not None and culprit and culprit["error"] and culprit["error"]["ts"] == first["ts"]:
        first["step"] = culprit["step"]  # outside an iteration: the step it was preparing or saving after
    groups: dict[tuple[str, str, str], dict[str, Any]] = {}
    for e in all_errors:
        key = (e["name"] or "", e["error_type"] or "", e["message"] or "")
        g = groups.setdefault(
            key,
            {
                "name": e["name"],
                "error_type": e["error_type"],
                "message": e["message"],
                "count": 0,
                "ranks": [],
                "first_ts": e["ts"],
                "stack": e["stack"],
                "consequence": e["consequence"],
            },
        )
        g["count"] += 1
        if e["rank"] is not None and e["rank"] not in g["ranks"]:
            g["ranks"].append(e["rank"])
    grouped = sorted(groups.values(), key=lambda g: (g["consequence"], g["first_ts"]))
    for g in grouped:
        g["ranks"] = compress_ranks(g["ranks"]) if g["ranks"] else "agent"
    # Each rank's last stream: how it ended, its last record, the spans it still had open.
    last_streams = job.dicts(
        """
        SELECT s.stream, s.rank, s.restart, s.start_ts, s.end_ts, s.closed, s.errors, s.last_ts, f.failed
        FROM streams s JOIN stream_facts f USING (stream)
        WHERE NOT s.is_agent AND s.start_ts = (SELECT max(start_ts) FROM streams t WHERE t.rank = s.rank
                                                AND NOT t.is_agent)
        ORDER BY s.rank
        """
    )
    last_records = {
        row[0]: {"kind": row[1], "name": row[2], "ts": row[3]}
        for row in job.rows(
            """
            SELECT stream, kind, name, ts FROM (
                SELECT stream, kind, name, ts,
                       row_number() OVER (PARTITION BY stream ORDER BY ts DESC, seq DESC NULLS LAST) AS n
                FROM (
                    -- Only the records at their stream's latest time can be its last: the window sorts those, not
                    -- every record (most of a job that records phase spans).
                    SELECT o.stream, o.kind, o.name, o.ts, coalesce(o.seq, 0) AS seq FROM other o
                    JOIN (SELECT stream, max(ts) AS ts FROM other GROUP BY stream) m
                      ON o.stream = m.stream AND o.ts = m.ts
                    UNION ALL
                    SELECT stream, 'span', 'iteration', ts, seq FROM (
                        SELECT stream, max(ts) AS ts, max(seq) AS seq FROM iterations GROUP BY stream)
                )
            ) WHERE n = 1
            """
        )
    }
    open_spans: dict[int, list[dict[str, Any]]] = {}
    for stream, name, ts, attrs in job.rows(
        "SELECT stream, name, ts, attrs FROM spans_small WHERE open ORDER BY stream, ts"
    ):
        open_spans.setdefault(stream, []).append({"name": name, "ts": ts, "attrs": attrs})
    job_end = max((s["end_ts"] for s in last_streams), default=0)
    per_rank = []
    hang_suspects = []
    for s in last_streams:
        rec = last_records.get(s["stream"])
        silent_s = (job_end - s["end_ts"]) / NS
        if s["failed"] and s["errors"]:
            state = "error"
        elif not s["closed"]:
            state = "ended abruptly"
        else:
            state = "closed" if not s["errors"] else "closed, with errors"
        entry = {
            "rank": s["rank"],
            "restart": s["restart"],
            "state": state,
            "last_record": rec,
            "open_spans": open_spans.get(s["stream"], []),
            "silent_before_end_s": silent_s,
        }
        per_rank.append(entry)
        if not s["closed"] and silent_s >= hang_after_s:
            hang_suspects.append(s["rank"])
    for row in job.rows(
        f"SELECT DISTINCT stream_rank FROM other WHERE kind = 'error' AND (name IN ({_names(HANG_NAMES)}) "
        f"OR error_type IN ({_names(HANG_NAMES)})) AND stream_rank IS NOT NULL"
    ):
        if row[0] not in hang_suspects:
            hang_suspects.append(row[0])
    lifecycle = job.dicts(
        "SELECT stream_rank AS rank, name, ts, attrs AS attrs FROM other "
        "WHERE is_agent AND kind IN ('event', 'error') "
        "ORDER BY ts LIMIT 1000"
    )
    return {
        "verdict": verdict["verdict"],
        "status": verdict["status"],
        "culprit": verdict["culprit"],
        "rule": verdict.get("rule"),
        # The attempt the verdict is about and every attempt that failed (a restarted job's last may have finished).
        "restart": verdict.get("restart"),
        "failed_restarts": verdict.get("failed_restarts", []),
        # Earlier failed attempts whose culprit failed the same way (rank, step, phase, cause): a crash loop.
        "same_failure_restarts": verdict.get("same_failure_restarts", []),
        # A launcher's failed rendezvous (rule "launcher: rendezvous failed"): nodes expected and joined, the wait.
        "rendezvous": verdict.get("rendezvous"),
        # A node whose launcher and ranks stopped together (rule "lost node"): its host, ranks and launcher.
        "lost_node": verdict.get("lost_node"),
        # A node whose launcher got a signal from outside, alone (rule "node ended from outside"): a preemption.
        "node_ended": verdict.get("node_ended"),
        # The checkpoint a failed load read, whose save an earlier attempt began and never finished.
        "unfinished_checkpoint": verdict.get("unfinished_checkpoint"),
        "rank_states": verdict["ranks"],
        "first_error": first,
        "error_count": len(all_errors),
        "groups": grouped,
        "ranks": per_rank,
        "hang_suspects": sorted(hang_suspects),
        "hang_after_s": hang_after_s,
        "ranks_missing": compress_ranks(job.missing_ranks()),
        "launcher_events": lifecycle,
        # Hosts whose clocks the records prove off (seconds ahead of the reference host's): times compared on its.
        "clock_offsets": {
            "reference": clocks["reference"],
            "offsets_s": {h: ns / NS for h, ns in clocks["offsets_ns"].items()},
        }
        if clocks["offsets_ns"]
        else None,
        "notes": list(job.notes) + [_clock_note(clocks)] * bool(clocks["offsets_ns"]),
    }


def _clock_note(clocks: dict[str, Any]) -> str:
    """What the errors command corrected for, in words."""
    ahead = "; ".join(
        f"{host}'s clock ran {abs(ns) / NS:.3g} s {'ahead of' if ns > 0 else 'behind'} {clocks['reference']}'s"
        for host, ns in sorted(clocks["offsets_ns"].items())
    )
    return (
        f"{ahead} (its ranks' steps cannot have ended before {clocks['reference']}'s began otherwise): times are "
        f"compared on {clocks['reference']}'s clock"
    )
