"""Diagnosis on real faulty jobs: traintrace-run (torchrun, gloo on CPU) with a fault injected into one rank.

Each scenario runs ``tests/diag_worker.py``, a small DDP training script using the documented API, under
``traintrace-run``, and checks what ``traintrace errors`` and ``summary`` say against a truth the worker
wrote itself, without traintrace (its own JSON lines of step, checkpoint and fault times): the culprit rank,
its step, its phase and its cause, and goodput within one point.

The workers record with the core of the pass (``TRAINTRACE_PURE`` is passed on). Each way the core's own
behaviour decides an answer (an exception's open spans, a death by SIGKILL or SIGSEGV, MemoryError, SIGTERM's
handler, a hang report, a checkpoint's records, the progress file of a running or frozen job, an exit) has a
job that runs in both passes of ``scripts/test``. The others are marked ``once``, saying which job covers
their core's part in the pure pass: those whose answer comes from the launchers' streams and the step times
(restarts, stragglers, nodes, the rendezvous), and further jobs of a kind already run (both cores write the
same records: tests/test_native_encoder.py). The suite must fit CI's 30 minutes: a job whose answer needs no
third rank (a bystander that is neither the culprit nor the rank it stalls) runs two, and each rank costs about
5 s of CPU (importing torch, and torch._dynamo, which DDP's constructor imports), a quarter of a 3-rank job's.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests._reliability import needs_namespace
from tests.diag_worker import LEAK_BYTES
from traintrace._names import SpanName
from traintrace.cli._diagnosis import _ranks_phrase

pytest.importorskip("torch")
pytest.importorskip("duckdb")

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "diag_worker.py"
ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith(("TRAINTRACE_", "OTEL_")) or k == "TRAINTRACE_PURE"},
    "PYTHONPATH": str(ROOT / "src") + os.pathsep + str(ROOT),
    "OMP_NUM_THREADS": "1",
}
pytestmark = [pytest.mark.slow, pytest.mark.subprocess]


@dataclass
class Run:
    folder: Path
    truth: Path
    returncode: int
    output: str
    #: When the launcher's process was seen to end (the test's clock): a rank hung until killed lived until then.
    ended_ns: int | None = None

    def cli(self, *args: str, ranks_only: bool = False) -> dict[str, Any]:
        paths = [str(p) for p in sorted(self.folder.glob("rank*.jsonl"))] if ranks_only else [str(self.folder)]
        result = subprocess.run(
            [sys.executable, "-m", "traintrace.cli", *args, *paths, "--json"],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
            # The reader the pass asks for (tests/conftest.py): the scanner in the native pass, DuckDB's in the pure.
            env={**ENV, "TRAINTRACE_READER": os.environ.get("TRAINTRACE_READER", "auto")},
        )
        assert result.returncode == 0, result.stderr
        data: dict[str, Any] = json.loads(result.stdout)
        return data

    def marks(self) -> dict[int, list[dict[str, Any]]]:
        out = {}
        for path in sorted(self.truth.glob("rank*.jsonl")):
            out[int(path.stem[4:])] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return out


def launch(
    tmp_path: Path,
    nproc: int,
    *args: str,
    env: dict[str, str] | None = None,
    during: Any = None,
    timeout: float = 150,
    max_restarts: int = 0,
    prefix: tuple[str, ...] = (),
    torchrun: bool = False,
) -> Run:
    """Run the worker under traintrace-run, or plain torchrun (no launcher stream), after ``prefix`` (a command that
    runs the rest of the line); ``during(process, truth)`` runs while it does."""
    truth = tmp_path / "truth"
    launcher = (
        [str(Path(sys.executable).with_name("torchrun"))] if torchrun else [sys.executable, "-m", "traintrace.launch"]
    )
    command = [
        *prefix,
        *launcher,
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        str(WORKER),
        str(truth),
        *args,
    ]
    full_env = {**ENV, "TRAINTRACE_LOG_DIR": str(tmp_path / "logs"), "TRAINTRACE_JOB_ID": "job", **(env or {})}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env, start_new_session=True
    )
    try:
        if during is not None:
            during(process, truth)
        output, _ = process.communicate(timeout=timeout)
        ended_ns = time.time_ns()
    finally:
        if process.poll() is None:
            # SIGTERM first: the launcher stops its workers, which run in process groups of their own.
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    return Run(tmp_path / "logs" / "job", truth, process.returncode, output, ended_ns)


def truth_kept(run: Run, failed: bool) -> set[tuple[int, int, int]]:
    """(rank, attempt, step) of every step whose work counts, from the worker's own marks: in an attempt the
    rank ran again later, the steps before the first step it ran there (what the restart really redid); in
    a failed attempt without a later one, the steps its last completed checkpoint holds (one saved after
    step 4 holds steps 0-4)."""
    marks = run.marks()
    every = [m for ms in marks.values() for m in ms]
    last = max(m["restart"] for m in every)
    saved = {
        a: max((m["step"] for m in every if m["restart"] == a and m["event"] == "checkpoint_end"), default=0)
        for a in {m["restart"] for m in every}
    }
    kept = set()
    for rank, ms in marks.items():
        for m in ms:
            if m["event"] != "step_end":
                continue
            later = [x["step"] for x in ms if x["event"] == "step_start" and x["restart"] > m["restart"]]
            if later:
                counts = m["step"] < min(later)
            elif failed or m["restart"] < last:
                counts = m["step"] < saved[m["restart"]]
            else:
                counts = True
            if counts:
                kept.add((rank, m["restart"], m["step"]))
    return kept


def kept_step_times(
    run: Run, failed: bool, since: str = "process_start", until: int | None = None
) -> tuple[dict[int, list[tuple[int, int]]], int]:
    """Each rank's steps of ``truth_kept`` as (end, duration), and the ranks' wall time, from the worker's own
    marks: from the first rank's process start, or (``since="configured"``) from when the first rank's configure()
    returned. The records' wall time begins between the two: at the stream's header, which configure() writes on its
    way (20 ms in, and 0.3 s on a loaded machine). It ends at the last mark, or ``until``."""
    marks = run.marks()
    every = [m for ms in marks.values() for m in ms]
    opened = [m["ts"] for m in every if m["event"] == since]
    start = min(opened or [m["ts"] for m in every if m["event"] == "process_start"])
    # Not past an attempt's exit mark: its exit handler runs after traintrace's closed the stream, and anything
    # after it (the interpreter's finalisation) is beyond what a record can see.
    exits = {(r, m["restart"]): m["ts"] for r, ms in marks.items() for m in ms if m["event"] == "exit"}
    inside = [m["ts"] for r, ms in marks.items() for m in ms if m["ts"] <= exits.get((r, m["restart"]), m["ts"])]
    end = until or max(inside)
    kept = truth_kept(run, failed)
    steps: dict[int, list[tuple[int, int]]] = {}
    for rank, ms in marks.items():
        starts = {(m["restart"], m["step"]): m["ts"] for m in ms if m["event"] == "step_start"}
        steps[rank] = [
            (m["ts"], m["ts"] - starts[m["restart"], m["step"]])
            for m in ms
            if m["event"] == "step_end" and (rank, m["restart"], m["step"]) in kept
        ]
    return steps, end - start


def truth_goodput(run: Run, failed: bool, since: str = "process_start", until: int | None = None) -> float:
    """Productive step time per rank (the steps of ``truth_kept``, less what they waited for another rank's
    phase: ``truth_waits``) over the ranks' wall time (``kept_step_times``), from the worker's own marks."""
    steps, wall = kept_step_times(run, failed, since, until)
    waited = sum(ns for of_rank in truth_waits(run, failed).values() for ns in of_rank.values())
    return (sum(d for kept in steps.values() for _, d in kept) - waited) / len(steps) / wall


def check_steps(run: Run, summary: dict[str, Any], failed: bool, killed: Sequence[int] = ()) -> None:
    """Steps completed (the most any rank kept) and lost (the most iterations any rank started and did not
    keep), against the worker's marks. A rank in ``killed`` (or frozen) may lack its last flush interval of
    records (docs/analysis.md, "Goodput"): the steps it began or ended within two of them before its last mark
    may be missing from its counts."""
    kept = truth_kept(run, failed)
    marks = run.marks()
    events: dict[int, list[tuple[str, int, int]]] = {
        r: [(m["event"], m["restart"], m["step"]) for m in ms if m["event"] in ("step_start", "step_end")]
        for r, ms in marks.items()
    }
    seen: dict[int, set[tuple[str, int, int]]] = {r: set(e) for r, e in events.items()}
    for rank in killed:
        cutoff = marks[rank][-1]["ts"] - 2 * FLUSH_S * 1e9
        seen[rank] = {
            (m["event"], m["restart"], m["step"])
            for m in marks[rank]
            if m["event"] in ("step_start", "step_end") and m["ts"] < cutoff
        }

    def counts(recorded: dict[int, set[tuple[str, int, int]]]) -> tuple[int, int]:
        kept_by = {r: sum(1 for k in kept if k[0] == r and ("step_end", k[1], k[2]) in recorded[r]) for r in marks}
        started = {r: sum(1 for e in recorded[r] if e[0] == "step_start") for r in marks}
        return max(kept_by.values()), max(started[r] - kept_by[r] for r in marks)

    most, least = counts({r: set(e) for r, e in events.items()}), counts(seen)
    found = (summary["steps_completed"], summary["steps_lost"])
    assert least[0] <= found[0] <= most[0] and least[1] <= found[1] <= most[1], (found, least, most)


#: The worker's flush interval (its ``--flush-interval`` default): what a killed or frozen rank's file may lack.
FLUSH_S = 0.1


def unrecorded_share(run: Run, ranks: list[int], failed: bool = True, flush_s: float = FLUSH_S) -> float:
    """The goodput the docs allow to be missing when ``ranks`` were killed or froze (docs/analysis.md, "Goodput":
    such a rank loses its last flush interval of records): the kept steps each completed within ``flush_s`` of
    its last mark, over the ranks and the marks' wall time, as ``truth_goodput`` counts them."""
    steps, wall = kept_step_times(run, failed)
    marks = run.marks()
    missing = 0
    for rank in ranks:
        last = marks[rank][-1]["ts"]
        missing += sum(d for ended, d in steps[rank] if ended >= last - flush_s * 1e9)
    return missing / len(steps) / wall


def check_goodput(run: Run, failed: bool = True, unrecorded: float = 0.0, killed: Sequence[int] = ()) -> dict[str, Any]:
    """Goodput over the ranks' streams within one point of the truth; the categories add up to the wall time, and
    those the worker's marks time match them (``check_time_went``). ``unrecorded``: what the docs allow to be
    missing below the truth (``unrecorded_share``); ``killed``: the ranks that may lack their last flush
    interval (``check_steps``)."""
    summary = run.cli("summary", ranks_only=True)
    # The records' wall time begins within configure(): between the process's start and configure()'s return.
    truth = truth_goodput(run, failed)
    high = truth_goodput(run, failed, "configured")
    low = truth - unrecorded
    outlived = outlived_streams(run)
    if outlived:
        # A SIGTERM handler that ran after its process's stream closed at exit (the launcher's, while the process
        # exited after its exception) worked where no record sees it: without a launcher's stream to say when the
        # process ended (plain torchrun), the job's wall time ends at its records, before that.
        high = max(high, truth_goodput(run, failed, "configured", until=outlived))
    if hung_marks(run) and run.ended_ns:
        # A hung rank that let its SIGTERM pass lived on, writing no mark, until the launcher killed it (30 s under
        # torchrun): the job's wall time ends between the last mark and the launcher's end.
        low = min(low, truth_goodput(run, failed, until=run.ended_ns) - unrecorded)
    print(
        f"goodput {summary['goodput'] * 100:.2f}% truth {truth * 100:.2f}% to {high * 100:.2f}%"
        + (f" (down to {low * 100:.2f}% with a killed rank's last flush interval)" if unrecorded else "")
        + f" wall {summary['wall_s']:.2f} s"
    )
    assert low - 0.01 <= summary["goodput"] <= high + 0.01, (summary["goodput"], truth, high, summary["breakdown_s"])
    # Most of a short test job is start-up, so one point is loose: the productive time must match too.
    assert low - 0.05 * low - 0.002 <= summary["goodput"] <= high + 0.05 * high + 0.002, (summary["goodput"], high)
    assert sum(summary["breakdown_s"].values()) == pytest.approx(summary["wall_s"], rel=1e-9)
    check_steps(run, summary, failed, killed)
    check_time_went(run, summary, failed)
    check_startup(run)
    return summary


def outlived_streams(run: Run) -> int | None:
    """Where a rank's SIGTERM handler ran after its stream had closed (its ``sigterm`` mark says so), the last mark
    of the job before any such handler's; else None."""
    marks = run.marks()
    after = [m["ts"] for ms in marks.values() for m in ms if m["event"] == "sigterm" and m.get("after_close")]
    if not after:
        return None
    return max(m["ts"] for ms in marks.values() for m in ms if m["ts"] < min(after))


def hung_marks(run: Run) -> dict[int, dict[str, Any]]:
    """Rank -> its hang fault's mark, for the ranks that hung and wrote nothing after it (its SIGTERM ignored:
    ``--abort-after-failure``): each lived on, hung, until its launcher killed it."""
    out = {}
    for rank, ms in run.marks().items():
        last = max(ms, key=lambda m: m["ts"])
        if last["event"] == "fault" and str(last.get("kind", "")).startswith("hang"):
            out[rank] = last
    return out


def check_startup(run: Run) -> None:
    """Under traintrace-run, `summary`'s process start-up (the launcher's stream read too: a rank's, from the
    launcher's start of its process to its stream's header) against the kernel's creation time of each worker
    process and its own marks: the header is written inside configure(), after the ``process_start`` mark and
    before ``configured``. Summed over a rank's attempts, the mean over the ranks; 50 ms an attempt of slack (the
    launcher records the start after it, /proc counts in 10 ms ticks) and 5%. Without a launcher stream the job
    begins at the first header: none."""
    summary = run.cli("summary")
    if not list(run.folder.glob("agent*.jsonl")):
        assert summary["breakdown_s"]["startup"] == 0.0, summary["breakdown_s"]
        return
    low = high = 0.0
    attempts = 0
    for ms in run.marks().values():
        starts = [m for m in ms if m["event"] == "process_start"]
        configured = {m["restart"]: m["ts"] for m in ms if m["event"] == "configured"}
        for start in starts:
            attempts += 1
            low += (start["ts"] - start["created"]) / 1e9
            high += (configured.get(start["restart"], start["ts"]) - start["created"]) / 1e9
    ranks = len(run.marks())
    low, high, slack = low / ranks, high / ranks, 0.05 * attempts / ranks
    got = summary["breakdown_s"]["startup"]
    assert low - slack - 0.05 * low <= got <= high + slack + 0.05 * high, (got, low, high)


#: Category of `summary`'s breakdown -> the worker's marks that open and close one of its intervals.
TIMED_BY_MARKS: dict[str, tuple[str, str]] = {
    "initialization": ("init_start", "init_end"),
    "data_loading": ("data_start", "step_start"),
    "checkpoint_save": ("checkpoint_start", "checkpoint_end"),  # a background save's: "checkpoint_copied"
    "validation": ("validation_start", "validation_end"),
    "checkpoint_load": ("checkpoint_load_start", "checkpoint_load_end"),
}
#: Faults whose mark does not end what the rank was doing: the process goes on (or a child process wrote it), or
#: stays where it was until it is ended (a hang, a stopped process, a SIGTERM it waits for).
GOES_ON_AFTER = (
    *("loader_kill", "inf_batch", "async_save", "finish_early", "sigterm", "freeze", "gil_stuck"),
    *("hang_compute", "hang_collective", "hang_data", "hang_in_checkpoint", "hang_validation", "hang_init"),
)


def marked_intervals(ms: list[dict[str, Any]]) -> Iterator[tuple[str | None, dict[str, Any], int]]:
    """A rank's intervals by its marks: (category of ``TIMED_BY_MARKS``, or None for a step; the opening mark; the
    end). An interval its rank never closed (an exception, a signal, the end of the process) ends at the rank's
    next fault mark, the end of its SIGTERM handler (a handler that saves first works inside the interrupted
    interval, whose span stays open until the process ends), its exit or its last mark in that attempt."""
    closing_of = dict(TIMED_BY_MARKS.values())
    ms = sorted(ms, key=lambda m: m["ts"])
    for i, m in enumerate(ms):
        event = m["event"]
        category = next((c for c, (opening, _) in TIMED_BY_MARKS.items() if opening == event), None)
        if category is None and event != "step_start":
            continue
        closing = "step_end" if category is None else closing_of[event]
        if m.get("background"):
            closing = "checkpoint_copied"
        same_attempt = [x for x in ms[i + 1 :] if x["restart"] == m["restart"]]
        end = next(
            (
                x["ts"]
                for x in same_attempt
                if (x["event"] == closing and x.get("step") == m.get("step"))
                or x["event"] in ("raised", "sigterm_done", "exit")
                or (x["event"] == "fault" and x["kind"] not in GOES_ON_AFTER)
            ),
            same_attempt[-1]["ts"] if same_attempt else m["ts"],
        )
        yield category, m, end


#: What `summary` counts as another rank's phase a step may wait for (docs/analysis.md, "Waiting for another
#: rank's phase"), and the margin over the median step a step must run to have waited.
WAITED_FOR = ("checkpoint_save", "checkpoint_load", "validation")
WAIT_MARGIN = 0.1


def truth_waits(run: Run, failed: bool) -> dict[int, dict[str, int]]:
    """Rank -> category -> ns its kept steps waited for another rank's phase of ``WAITED_FOR``, by the marks: a
    step longer than the median of the rank's kept steps by more than ``WAIT_MARGIN`` of it, while another rank
    of its attempt was in such a phase that ended before the step did, waited by the lesser of its overlap with it
    and its excess (shared between the phases in proportion to their overlaps)."""
    marks = run.marks()
    kept = truth_kept(run, failed)
    intervals = {rank: list(marked_intervals(ms)) for rank, ms in marks.items()}
    waits: dict[int, dict[str, int]] = {rank: dict.fromkeys(WAITED_FOR, 0) for rank in marks}
    for rank, ivs in intervals.items():
        steps = [(m, end) for category, m, end in ivs if category is None and (rank, m["restart"], m["step"]) in kept]
        if not steps:
            continue
        median = statistics.median(end - m["ts"] for m, end in steps)
        for m, end in steps:
            excess = end - m["ts"] - median
            if excess <= WAIT_MARGIN * median:
                continue
            overlap = dict.fromkeys(WAITED_FOR, 0)
            for other, theirs in intervals.items():
                for phase, opening, phase_end in theirs:
                    held = phase_end < end  # the step ended after the phase: it may have waited for it
                    if other != rank and phase in overlap and opening["restart"] == m["restart"] and held:
                        both = min(end, phase_end) - max(m["ts"], opening["ts"])
                        overlap[phase] = max(overlap[phase], both)
            total = sum(overlap.values())
            for phase, o in overlap.items():
                if o > 0:
                    waits[rank][phase] += int(o * min(1.0, excess / total))
    return waits


def truth_gap_waits(run: Run) -> dict[int, dict[str, int]]:
    """Rank -> category -> ns it waited for another rank's phase of ``WAITED_FOR`` between its steps and phases
    (at the final barrier while rank 0 saves, say), by the marks: a gap (``marked_gaps``) in which such a phase
    ended waited for it by the lesser of their overlap and the gap's excess over the rank's median gap (shared
    between the phases in proportion to their overlaps). Time outside the steps: not productive, ``other``."""
    marks = run.marks()
    intervals = {rank: list(marked_intervals(ms)) for rank, ms in marks.items()}
    waits: dict[int, dict[str, int]] = {rank: dict.fromkeys(WAITED_FOR, 0) for rank in marks}
    for rank, gaps in marked_gaps(marks, intervals).items():
        usual = statistics.median(g1 - g0 for _, g0, g1 in gaps) if gaps else 0
        for restart, g0, g1 in gaps:
            overlap = dict.fromkeys(WAITED_FOR, 0)
            for other, theirs in intervals.items():
                for phase, opening, phase_end in theirs:
                    if other != rank and phase in overlap and opening["restart"] == restart and g0 < phase_end <= g1:
                        overlap[phase] = max(overlap[phase], phase_end - max(g0, opening["ts"]))
            total, excess = sum(overlap.values()), g1 - g0 - usual
            for phase, o in overlap.items():
                if o > 0 and excess > 0:
                    waits[rank][phase] += int(o * min(1.0, excess / total))
    return waits


def marked_gaps(
    marks: dict[int, list[dict[str, Any]]], intervals: dict[int, list[tuple[str | None, dict[str, Any], int]]]
) -> dict[int, list[tuple[int, int, int]]]:
    """Rank -> (attempt, start, end) of each stretch its marks put outside all of its steps and phases: between
    two of them, and from the last to the attempt's last mark (its exit, say)."""
    gaps: dict[int, list[tuple[int, int, int]]] = {}
    for rank, ivs in intervals.items():
        for restart in sorted({m["restart"] for m in marks[rank]}):
            merged: list[list[int]] = []
            for t0, t1 in sorted((m["ts"], end) for _, m, end in ivs if m["restart"] == restart):
                if merged and t0 <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], t1)
                else:
                    merged.append([t0, t1])
            if not merged:
                continue
            last = max(m["ts"] for m in marks[rank] if m["restart"] == restart)
            bounds = [(a[1], b[0]) for a, b in itertools.pairwise(merged)] + [(merged[-1][1], last)]
            gaps.setdefault(rank, []).extend((restart, g0, g1) for g0, g1 in bounds if g1 > g0)
    return gaps


def truth_time_went(run: Run, failed: bool) -> dict[str, float]:
    """`summary`'s badput categories the worker marks (``TIMED_BY_MARKS`` and ``lost_progress``), in seconds per rank
    (the mean over the ranks), from the worker's own marks alone (``marked_intervals``), with the time ranks waited
    for another rank's phase in their steps and between them (``truth_waits``, ``truth_gap_waits``). Lost progress:
    the started steps ``truth_kept`` does not keep, a step never ended included."""
    marks = run.marks()
    kept = truth_kept(run, failed)
    totals = dict.fromkeys([*TIMED_BY_MARKS, "lost_progress"], 0)
    for rank, ms in marks.items():
        for category, m, end in marked_intervals(ms):
            if category is None and (rank, m["restart"], m["step"]) in kept:
                continue
            totals[category or "lost_progress"] += end - m["ts"]
    for waits in (truth_waits(run, failed), truth_gap_waits(run)):
        for waited in waits.values():
            for category, ns in waited.items():
                totals[category] += ns
    return {category: ns / 1e9 / len(marks) for category, ns in totals.items()}


#: A thread preempted between a span's end and the worker's mark beside it, on a busy host (8.4 ms seen).
BUSY_S = 0.015


def check_time_went(run: Run, summary: dict[str, Any], failed: bool) -> None:
    """`summary`'s seconds per rank in each category ``truth_time_went`` knows, against it: within 2 ms per
    interval of a rank (a mark is written beside its span, not inside it), 5% and ``BUSY_S``; less by up to a
    flush interval for each rank that ended without its exit handlers (a signal, ``os._exit``: its last flush
    interval of records may be missing). Where a rank hung, only what a hang can explain (docs/analysis.md,
    "Goodput")."""
    truth = truth_time_went(run, failed)
    marks = run.marks()
    unflushed = sum(max(ms, key=lambda m: m["ts"])["event"] != "exit" for ms in marks.values())
    slack_s = FLUSH_S * unflushed / len(marks)
    breakdown = summary["breakdown_s"]
    # A rank hung with no hang report of its own (detection off; a model initialisation's or a save's own limit is
    # 30 minutes): nothing records when it stopped working. `summary` counts its phase until its peers were left
    # waiting for it, at the latest until the first of them failed (the timeout of the collective it never
    # joined): by the marks, its phase may run that long past its fault's mark.
    unreported_s = 0.0
    for rank, fault in hung_marks(run).items():
        failures = [
            m["ts"]
            for other, ms in marks.items()
            if other != rank
            for m in ms
            if m["event"] == "raised" and m["restart"] == fault["restart"] and m["ts"] > fault["ts"]
        ]
        if failures:
            unreported_s += (min(failures) - fault["ts"]) / 1e9 / len(marks)
    for category, seconds in truth.items():
        opening = TIMED_BY_MARKS[category][0] if category in TIMED_BY_MARKS else "step_start"
        intervals = max(sum(m["event"] == opening for m in ms) for ms in marks.values())
        got = breakdown[category]
        slack = 0.002 * intervals + 0.05 * seconds + BUSY_S
        if breakdown["hang"]:
            # Ranks that waited in a collective for one that failed and lingered (hang detection on) were reported
            # hung: from the end of their last step to the end of their stream, their time is the hang's
            # (docs/analysis.md, "Goodput"), taken from the step they were in, or from anything else.
            assert got <= seconds + slack + unreported_s, (category, got, seconds, breakdown)
            if category == "lost_progress":
                assert got + breakdown["hang"] >= seconds - slack - slack_s, (category, got, seconds, breakdown)
            continue
        assert seconds - slack - slack_s <= got <= seconds + slack, (category, got, seconds, breakdown)
    check_step_times(run, summary)


def check_step_times(run: Run, summary: dict[str, Any]) -> None:
    """`summary`'s step-time statistics (every step that ended, on every rank) against the marks' step times: the
    count (less the steps a rank that ended without its exit handlers finished in its last flush interval), the
    median and the 90th percentile within 2 ms and 5% of bounds. A step's span began between its ``step_start`` and
    ``step_entered`` marks and ended between ``step_leaving`` and ``step_end``: its duration lies between the two
    marks inside and the two outside (a busy machine can stall a mark's write by 10 ms). A quantile is monotone in
    each duration, so it lies between the quantiles of the lower and the upper bounds. With steps that may be
    unrecorded, a quantile is bounded by those of the steps surely recorded joined by the shortest, or the longest,
    of the others, as many as the count says were recorded."""
    durations: list[tuple[int, int]] = []  # (lower, upper) bounds of each step's duration
    kept: list[tuple[int, int]] = []  # less the steps that may be unrecorded
    maybe: list[tuple[int, int]] = []
    for ms in run.marks().values():
        # Each attempt's process ended on its own (a restart's killed rank loses its attempt's last interval).
        last = {m["restart"]: m for m in sorted(ms, key=lambda m: m["ts"])}
        at = {(m["event"], m["restart"], m["step"]): m["ts"] for m in ms if "step" in m}
        for m in ms:
            if m["event"] != "step_end":
                continue
            key = (m["restart"], m["step"])
            upper = m["ts"] - at[("step_start", *key)]
            entered, leaving = at.get(("step_entered", *key)), at.get(("step_leaving", *key))
            lower = upper if entered is None or leaving is None else leaving - entered
            durations.append((lower, upper))
            ended = last[m["restart"]]
            # (Two flush intervals: a flush takes time, and the writer wakes once an interval.)
            if ended["event"] == "exit" or m["ts"] < ended["ts"] - 2 * FLUSH_S * 1e9:
                kept.append((lower, upper))
            else:
                maybe.append((lower, upper))
    unrecorded = len(maybe)
    stats = summary["step_time"]
    if not durations:
        assert stats is None or stats["count"] == 0, stats
        return
    assert len(durations) - unrecorded <= stats["count"] <= len(durations), (stats, len(durations), unrecorded)
    if not stats["count"]:
        return
    extra = stats["count"] - len(kept)
    if extra < 0:  # fewer recorded than surely were (a slow flush): any `count` of the steps
        kept, maybe, extra = [], list(durations), stats["count"]
    shortest = sorted(d[0] for d in maybe)[:extra]
    longest = sorted(d[1] for d in maybe)[len(maybe) - extra :]
    for key, q in (("median_s", 0.5), ("p90_s", 0.9)):
        low = _quantile(sorted([d[0] for d in kept] + shortest), q)
        high = _quantile(sorted([d[1] for d in kept] + longest), q)
        assert low - 0.002 - 0.05 * low <= stats[key] <= high + 0.002 + 0.05 * high, (key, stats, low, high)


def _quantile(durations: list[int], q: float) -> float:
    """Linear between the closest ranks, as DuckDB's quantile_cont, in seconds."""
    at = q * (len(durations) - 1)
    low = durations[int(at)]
    return (low + (durations[min(int(at) + 1, len(durations) - 1)] - low) * (at - int(at))) / 1e9


def check_culprit(run: Run, rank: int, step: int, phase: str, cause: str) -> dict[str, Any]:
    errors = run.cli("errors")
    culprit = errors["culprit"]
    assert culprit is not None, (errors["verdict"], run.output[-3000:])
    assert (culprit["rank"], culprit["step"], culprit["phase"]) == (rank, step, phase), errors["verdict"]
    assert cause in culprit["cause"], culprit["cause"]
    assert errors["verdict"].startswith(f"rank {rank} "), errors["verdict"]
    assert errors["status"] == "failed"
    # One line says what every other rank was doing.
    for other in errors["rank_states"]:
        if other["rank"] != rank:
            assert str(other["rank"]) in errors["verdict"].split(";", 1)[1]
    return errors


def steps_by_marks(marks: list[dict[str, Any]], *, killed: bool) -> set[int]:
    """The step a rank stopped in by its own marks: the last it began, or, for a rank killed after a step's end
    (making the next batch), the next one: the progress file says where a killed rank was, and outside an
    iteration that is the step it was preparing (cli/_diagnosis._from_progress). Between its ``step_leaving``
    and ``step_end`` marks the iteration's span was ending: either step is right then."""
    last = [m for m in marks if m["event"] in ("step_start", "step_leaving", "step_end")][-1]
    ahead = {"step_start": {0}, "step_leaving": {0, 1}, "step_end": {1}}[last["event"]] if killed else {0}
    return {last["step"] + n for n in ahead}


def fault_step_of(run: Run, rank: int) -> dict[str, Any]:
    faults = [m for m in run.marks()[rank] if m["event"] == "fault"]
    assert faults, "the worker did not inject its fault"
    return faults[0]


@pytest.mark.parametrize(
    ("nproc", "where", "rank", "step", "phase"),
    [
        pytest.param(2, "data", 1, 7, "data_loading", marks=pytest.mark.once),
        (2, "forward", 1, 9, "model_forward"),
        pytest.param(2, "backward", 1, 7, "model_backward", marks=pytest.mark.once),
        pytest.param(4, "optimizer", 3, 8, "optimizer_update", marks=pytest.mark.once),
        pytest.param(2, "iteration", 1, 6, "iteration", marks=pytest.mark.once),
    ],
)
def test_an_exception_on_one_rank(  # noqa: PLR0917 - pytest passes the parameters by position
    tmp_path: Path, nproc: int, where: str, rank: int, step: int, phase: str
) -> None:
    """The raising rank, its step and phase are named; the peers' connection errors are consequences."""
    run = launch(tmp_path, nproc, "--fault", where, "--fault-rank", str(rank), "--fault-step", str(step))
    assert run.returncode != 0
    fault = fault_step_of(run, rank)
    errors = check_culprit(run, rank, fault["step"], phase, "RuntimeError: injected failure")
    assert errors["first_error"]["rank"] == rank and errors["first_error"]["step"] == step
    assert all(g["consequence"] for g in errors["groups"][1:])
    check_goodput(run)


@pytest.mark.once
def test_an_exception_in_data_loading_while_rank_0_broadcasts_the_buffers(tmp_path: Path) -> None:
    """A model with a BatchNorm layer: DDP broadcasts its buffers from rank 0 before each forward. Rank 1 raises
    fetching its batch at step 7, so rank 0 waits in that broadcast (in forward), which then fails, the peer gone.
    `errors` says rank 0 was waiting in a collective (the broadcast) in forward at the step the workers' marks give
    (it read `rank 0 was in forward` before, its broadcast's failure recorded at the forward), and rank 1 is the
    culprit."""
    run = launch(tmp_path, 2, "--fault", "data", "--fault-rank", "1", "--fault-step", "7", "--batch-norm")
    assert run.returncode != 0
    marks = run.marks()
    step = fault_step_of(run, 1)["step"]
    assert max(m["step"] for m in marks[0] if m["event"] == "step_start") == step  # rank 0 was in that step
    assert not any(m["event"] == "step_end" and m["step"] == step for m in marks[0])
    errors = check_culprit(run, 1, step, "data_loading", "RuntimeError: injected failure")
    rank0 = next(s for s in errors["rank_states"] if s["rank"] == 0)
    assert (rank0["phase"], rank0["in_collective"], rank0["collective"]) == ("model_forward", True, "broadcast")
    assert f"rank 0 was waiting in a collective (broadcast) in forward at step {step}" in errors["verdict"]


def first_non_finite_loss(run: Run) -> tuple[int, int, float]:
    """(step, rank, value) of the first NaN or infinite loss, from the workers' own notes."""
    return min(
        (m["step"], rank, m["value"])
        for rank, ms in run.marks().items()
        for m in ms
        if m["event"] == "loss" and not math.isfinite(m["value"])
    )


# Its core's part is tested in both passes by an exception's open spans: test_an_exception_on_one_rank.
@pytest.mark.once
def test_a_loss_that_becomes_infinite_on_one_rank(tmp_path: Path) -> None:
    """Rank 1's batch at step 7 overflows its loss (a corrupt sample); the all-reduce of its gradients spreads
    NaN to every rank's weights, whose losses are NaN from step 8 on, and the job runs to its end. ``errors``
    says the job diverged and where: rank 1 at step 7, not the ranks that followed."""
    run = launch(tmp_path, 2, "--fault", "inf_batch", "--fault-rank", "1", "--fault-step", "7", "--steps", "14")
    assert run.returncode == 0, run.output[-3000:]
    step, rank, value = first_non_finite_loss(run)
    assert (step, rank) == (7, 1) and math.isinf(value)
    marks = run.marks()
    followed = {
        r: min(m["step"] for m in ms if m["event"] == "loss" and not math.isfinite(m["value"]))
        for r, ms in marks.items()
        if r != rank
    }
    errors = run.cli("errors")
    assert errors["status"] == "diverged" and errors["rule"] == "metric: not finite", errors["verdict"]
    culprit = errors["culprit"]
    assert (culprit["rank"], culprit["step"], culprit["state"]) == (rank, step, "diverged")
    facts = culprit["non_finite"]
    assert (facts["metric"], facts["value"], facts["ranks_at_first"]) == ("loss", "Infinity", [rank])
    assert {int(r): s for r, s in facts["first_steps"].items() if int(r) != rank} == followed
    assert errors["verdict"].startswith(f"diverged: rank {rank}'s loss became Infinity at step {step}")
    assert run.cli("summary")["status"] == "diverged"


@pytest.mark.once  # in the pure pass, the pure core's error records: test_an_exception_on_one_rank
def test_a_nan_check_that_fails_every_rank(tmp_path: Path) -> None:
    """The same corrupt batch, and every rank raises when its loss is NaN (a guard that misses infinity): both
    raise FloatingPointError at step 8 within moments of each other, so the first error names any of them.
    The verdict starts where the loss first stopped being finite: rank 1 at step 7."""
    run = launch(tmp_path, 2, "--fault", "inf_batch", "--fault-rank", "1", "--fault-step", "7", "--nan-check")
    assert run.returncode != 0
    step, rank, _ = first_non_finite_loss(run)
    checks = {r: m["step"] for r, ms in run.marks().items() for m in ms if m["event"] == "nan_check"}
    assert len(checks) >= 2 and set(checks.values()) == {step + 1}, checks
    errors = run.cli("errors")
    assert errors["status"] == "failed" and errors["rule"] == "metric: not finite", errors["verdict"]
    culprit = errors["culprit"]
    assert (culprit["rank"], culprit["step"], culprit["state"]) == (rank, step, "diverged")
    assert errors["verdict"].startswith(f"rank {rank}'s loss became Infinity at step {step}"), errors["verdict"]
    assert "then rank" in errors["verdict"] and "raised FloatingPointError" in errors["verdict"]


@pytest.mark.once  # in the pure pass, the pure core's error records: test_an_exception_on_one_rank
def test_an_exception_in_a_checkpoint_save(tmp_path: Path) -> None:
    """Rank 0 fails while saving after step 9: the step it was saving (10), in checkpoint_save_sync."""
    run = launch(tmp_path, 2, "--fault", "checkpoint", "--fault-rank", "0", "--fault-step", "10")
    check_culprit(run, 0, 10, "checkpoint_save_sync", "OSError")
    summary = check_goodput(run)
    assert summary["steps_completed"] == 5  # the checkpoint after step 4 protects steps 0-4 on every rank


@pytest.mark.once  # in the pure pass, the pure core's error records: test_an_exception_on_one_rank
def test_two_ranks_exception_in_forward(tmp_path: Path) -> None:
    """A 2-rank job: the same answer."""
    run = launch(tmp_path, 2, "--fault", "forward", "--fault-rank", "1", "--fault-step", "6")
    errors = check_culprit(run, 1, 6, "model_forward", "RuntimeError")
    assert "rank 0 was waiting in a collective" in errors["verdict"]
    check_goodput(run)


@pytest.mark.parametrize(("fault", "sig"), [("sigkill", "SIGKILL"), ("sigsegv", "SIGSEGV")])
def test_a_rank_killed_by_a_signal(tmp_path: Path, fault: str, sig: str) -> None:
    """The killed rank is named from the launcher's signal and its stream's end, not a survivor's error."""
    run = launch(tmp_path, 2, "--fault", fault, "--fault-rank", "1", "--fault-step", "8")
    errors = check_culprit(run, 1, 8, "model_forward", f"killed by {sig}")
    assert errors["culprit"]["state"] == "killed"
    if sig == "SIGSEGV":  # faulthandler's Python stack of the crash, read beside the stream
        assert "diag_worker.py" in errors["culprit"]["fault_stacks"]
    check_goodput(run, unrecorded=unrecorded_share(run, [1]))


# Its core's part is tested in both passes by a death by a signal, an exception: test_a_rank_killed_by_a_signal,
# test_an_exception_on_one_rank.
@pytest.mark.once
def test_an_exception_a_survivor_raised_after_the_failure_reached_it_is_not_the_cause(tmp_path: Path) -> None:
    """Rank 1 is killed by SIGKILL in forward at step 4; rank 0, its all-reduce broken by the lost peer, runs a
    cleanup of its own that raises OSError (an emergency checkpoint on a full disk). That later exception is a
    consequence: the culprit is rank 1, killed, and the first error is rank 0's connection error, marked a
    consequence (the OSError, raised once the peer's failure had reached rank 0, named rank 0 before; a sweep
    found it as a SIGTERM handler's error)."""
    run = launch(tmp_path, 2, "--fault", "sigkill", "--fault-rank", "1", "--fault-step", "4", "--cleanup-raises")
    assert any(m["event"] == "cleanup_raised" for m in run.marks()[0]), "the premise: rank 0's cleanup raised"
    errors = check_culprit(run, 1, 4, SpanName.FORWARD, "killed by SIGKILL")
    assert errors["rule"] == "died first", errors["rule"]
    assert errors["first_error"]["rank"] == 0 and errors["first_error"]["consequence"], errors["first_error"]
    assert errors["first_error"]["error_type"] != "OSError", errors["first_error"]
    rank0 = next(s for s in errors["rank_states"] if s["rank"] == 0)
    assert rank0["error"] is None and rank0["consequence"] is not None, rank0


@pytest.mark.parametrize("torchrun", [False, True], ids=["launcher", "torchrun"])
# Its core's part is tested in both passes by a hang report and a death by a signal: test_a_rank_hung_in_compute,
# test_a_rank_killed_by_a_signal.
@pytest.mark.once
def test_ranks_aborted_after_their_collective_timed_out_are_not_the_cause(tmp_path: Path, torchrun: bool) -> None:
    """Rank 1 hangs loading its batch for step 5 (hang detection off); the others' collective times out and each,
    once its timeout error is written, is aborted (SIGABRT), as NCCL's watchdog aborts a rank whose collective timed
    out (and as gloo's threads sometimes do here). A rank killed by a signal after the failure had reached it is a
    consequence: the culprit is rank 1, hung in data loading (an aborted survivor, killed first, was named before:
    a sweep found it, `fault_sweep --seed 220`). Under plain torchrun nothing says how the aborted ranks ended but
    their streams, cut after their timeout errors, and faulthandler's stacks: they were named before, `died first`
    where each stream ended, outside the loop (`fault_sweep --seed 290 --abort --torchrun`)."""
    run = launch(
        tmp_path,
        2,
        *("--fault", "hang_data", "--fault-rank", "1", "--fault-step", "5", "--hang-timeout", "0"),
        "--abort-after-failure",
        torchrun=torchrun,
    )
    aborted = [r for r, ms in run.marks().items() if any(m["event"] == "abort" for m in ms)]
    assert aborted and 1 not in aborted, run.output[-3000:]  # the premise: a survivor aborted
    errors = check_culprit(run, 1, 5, SpanName.DATA_LOADING, "hang")
    for state in errors["rank_states"]:
        if state["rank"] in aborted:
            assert state["state"] == "error" and state["consequence"] is not None, state
            assert (state["step"], state["in_collective"]) == (5, True), state
            if torchrun:  # no launcher saw the signal; faulthandler's stacks beside the stream name it
                assert "Fatal Python error: Aborted" in (state["fault_stacks"] or ""), state
            else:
                assert state["cause"].endswith("; then killed by SIGABRT"), state["cause"]


@pytest.mark.parametrize("torchrun", [False, pytest.param(True, marks=pytest.mark.once)], ids=["launcher", "torchrun"])
# Its core's part is tested in both passes by a hang and a death by a signal: test_a_rank_hung_in_compute,
# test_a_rank_killed_by_a_signal.
@pytest.mark.once
def test_ranks_a_watchdog_aborted_in_their_collective_are_not_the_cause(tmp_path: Path, torchrun: bool) -> None:
    """Rank 1 hangs in forward at step 6 (hang detection off); rank 0 waits in backward's all-reduce until a
    watchdog thread aborts it (SIGABRT) after 3 s there, as NCCL's watchdog tears down a rank whose collective
    timed out: no exception in Python, the stream just stops (faulthandler writes `Fatal Python error: Aborted`
    beside it). The aborted ranks waited; rank 1 is named, hung in forward, under traintrace-run (which sees the
    signal) and plain torchrun (which records nothing). Before, the first rank aborted was named: killed first."""
    run = launch(
        tmp_path,
        2,
        *("--fault", "hang_compute", "--fault-rank", "1", "--fault-step", "6", "--hang-timeout", "0"),
        *("--gloo-timeout", "30", "--watchdog-abort", "3"),
        torchrun=torchrun,
    )
    aborted = [r for r, ms in run.marks().items() if any(m["event"] == "abort" for m in ms)]
    assert aborted and 1 not in aborted, run.output[-3000:]  # the premise: the others were aborted
    errors = check_culprit(run, 1, 6, SpanName.FORWARD, "hang")
    assert errors["rule"] == "hang: the rank the collectives timed out on", errors["rule"]
    for state in errors["rank_states"]:
        if state["rank"] in aborted:
            assert (state["state"], state["in_collective"], state["phase"]) == ("error", True, "model_backward")
            assert state["cause"].startswith("failed as a consequence: SIGABRT: aborted after waiting"), state
    # Their 3 s in the step until the abort, writing nothing, are lost progress by the marks, and the job lasted
    # until then: the progress files' last stamps say so (the step counted to the streams' last records before,
    # the rest idle with no process).
    check_goodput(run)
    check_open_spans_drawn_until(run, {r: next(m for m in run.marks()[r] if m["event"] == "abort") for r in aborted})


def exports(run: Run) -> list[list[dict[str, Any]]]:
    """The events of `traintrace export`'s timeline of ``run``, as DuckDB writes it and as the plain reader does."""
    found = []
    for name, block in (("trace.json", ""), ("plain.json", "import sys; sys.modules['duckdb'] = None\n")):
        out = run.folder.parent / name
        args = ["export", str(run.folder), "-o", str(out), "--quiet"]
        code = f"{block}from traintrace.cli import main\nraise SystemExit(main({args!r}))"
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=ENV, capture_output=True)
        found.append(json.loads(out.read_text())["traceEvents"])
    return found


def check_open_spans_drawn_until(run: Run, deaths: dict[int, dict[str, Any]]) -> None:
    """`traintrace export`'s timeline draws the spans a rank left open up to its death (``deaths``: rank -> the
    worker's mark of it), as `summary` counts them: within a flush interval before it (the writer's last stamp of
    the progress file) and a little after. The trace's times against the marks: the shift of the rank's last
    step drawn (its end) from the worker's mark of that step's end. Before, they ended at the stream's last record.
    The export without DuckDB (the plain reader's) draws them the same."""
    trace, plain = exports(run)

    def open_spans(drawn: list[dict[str, Any]]) -> list[tuple[int, str, float, float]]:
        return sorted(
            (e["pid"], e["name"], e["ts"], e["dur"])
            for e in drawn
            if e.get("ph") == "X" and e["args"].get("status") == "open"
        )

    assert open_spans(plain) == open_spans(trace)
    events = [e for e in trace if e.get("ph") == "X"]
    for rank, death in deaths.items():
        steps = [e for e in events if e["pid"] == rank and e["name"] == "iteration" and "step" in e["args"]]
        last = max(steps, key=lambda e: e["ts"])
        mark = next(
            m
            for m in run.marks()[rank]
            if m["event"] == "step_end" and m["step"] == last["args"]["step"] and m["restart"] == death["restart"]
        )
        shift_us = last["ts"] + last["dur"] - mark["ts"] / 1e3
        ends = [e["ts"] + e["dur"] for e in events if e["pid"] == rank and e["args"].get("status") == "open"]
        assert ends, rank
        for end in ends:
            late_s = (end - shift_us - death["ts"] / 1e3) / 1e6
            assert -(FLUSH_S + 0.15) <= late_s <= 0.15, (rank, late_s)


def test_a_rank_killed_in_its_first_steps_keeps_its_initialisation(tmp_path: Path) -> None:
    """Rank 1 is killed by SIGKILL in its second step, within a flush interval of its initialisation's end: its
    stream most often ends at the initialisation's start, its end and the first step lost with the last flush
    interval. The progress file's first iteration ends it: `summary`'s initialisation is the marks' (not the part
    up to the stream's last record, nor the rest read as idle with no process), and the verdict names the step."""
    run = launch(tmp_path, 2, "--fault", "sigkill", "--fault-rank", "1", "--fault-step", "1", "--step-ms", "10")
    check_culprit(run, 1, 1, "model_forward", "killed by SIGKILL")
    summary = check_goodput(run, unrecorded=unrecorded_share(run, [1]))
    init = [m for m in run.marks()[1] if m["event"] in ("init_start", "init_end")]
    marked = (init[1]["ts"] - init[0]["ts"]) / 1e9
    records = [json.loads(line) for line in (run.folder / "rank1.jsonl").read_text().splitlines()]
    lost_its_end = not any(r.get("kind") in ("end", "span") and r.get("name") == SpanName.MODEL_INIT for r in records)
    print(f"rank 1's stream {'lost' if lost_its_end else 'kept'} its initialisation's end; marks {marked:.3f} s")
    per_rank = summary["breakdown_s"]["initialization"] * 2
    others = sum((ms[1]["ts"] - ms[0]["ts"]) / 1e9 for r, ms in _init_marks(run).items() if r != 1)
    assert per_rank - others == pytest.approx(marked, abs=0.01 + 0.05 * marked), (per_rank, others, marked)


def _init_marks(run: Run) -> dict[int, list[dict[str, Any]]]:
    return {rank: [m for m in ms if m["event"] in ("init_start", "init_end")][:2] for rank, ms in run.marks().items()}


def test_a_rank_out_of_memory(tmp_path: Path) -> None:
    """Rank 1 leaks 64 MiB a step in forward until an allocation fails (an address-space limit, so that the
    machine's memory is not at stake): named as out of memory, at the step and phase its own marks say, with
    its resident memory from traintrace's samples bounded by the worker's own /proc readings around them."""
    run = launch(
        tmp_path,
        2,
        *("--fault", "leak_oom", "--fault-rank", "1", "--fault-step", "8", "--step-ms", "100"),
        env={"TRAINTRACE_DEVICE_SAMPLE_INTERVAL": "0.05"},
    )
    fault = fault_step_of(run, 1)
    assert fault["kind"] == "leak_oom" and "can't allocate memory" in fault["error"], fault
    errors = check_culprit(run, 1, fault["step"], "model_forward", "ran out of memory: RuntimeError")
    assert errors["verdict"].startswith(f"rank 1 ran out of memory (RuntimeError) in forward at step {fault['step']}")
    culprit = errors["culprit"]
    assert culprit["out_of_memory"] is True
    memory = culprit["memory"]
    assert memory is not None and memory["samples"] >= 2, memory
    # The worker's own readings, each taken before its step's allocation: memory only grows in the leak, so the
    # last sample shows at least the reading before it and at most the one taken after the failed allocation.
    readings = [(m["ts"], m["rss"]) for m in run.marks()[1] if m["event"] == "memory"]
    before = [rss for ts, rss in readings if ts <= memory["rss_last_ts"]]
    assert before, (readings, memory)
    slack = 8 << 20  # what else the process allocates between a reading and a sample
    assert before[-1] - slack <= memory["rss_last"] <= fault["rss"] + slack, (readings, memory, fault["rss"])
    grown = memory["rss_last"] - memory["rss_first"]
    if memory["rss_last"] > memory["rss_first"]:
        assert "its resident memory grew from" in errors["verdict"], errors["verdict"]
    assert grown >= (len(before) - 1) * (64 << 20) - slack, (readings, memory)
    assert "host memory" in errors["verdict"] and 0 < memory["host_used"] <= memory["host_total"]
    # The other rank's peer error is a consequence, never the first error.
    assert errors["first_error"]["rank"] == 1


def memory_cgroup(limit: int) -> tuple[Path, str]:
    """A new memory cgroup under this process's, limited to ``limit`` bytes, and the file its OOM kills are
    counted in; skips the test where none can be made (not root, no writable memory controller)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hierarchy, controllers, path = [*line.split(":", 2), "", ""][:3]
        if "memory" in controllers.split(","):
            base, limit_name, events = Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes", "memory.oom_control"
        elif hierarchy == "0" and controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            base, limit_name, events = Path("/sys/fs/cgroup"), "memory.max", "memory.events"
        else:
            continue
        parent = base / path.lstrip("/")
        folder = (parent if parent.is_dir() else base) / f"traintrace-test-{os.getpid()}-{time.monotonic_ns()}"
        try:
            folder.mkdir()
            (folder / limit_name).write_text(str(limit))
        except OSError as exc:
            if folder.exists():
                folder.rmdir()
            pytest.skip(f"no memory cgroup can be made here ({exc}): the kernel's OOM killer is not reachable")
        return folder, events
    pytest.skip("no memory cgroup controller here: the kernel's OOM killer is not reachable")


@pytest.mark.once  # in the pure pass, a SIGKILLed pure core: test_a_rank_killed_by_a_signal
def test_a_rank_killed_by_the_oom_killer(tmp_path: Path) -> None:
    """Rank 1 leaks 64 MiB a step inside a memory cgroup limited to four of them (a container's limit): the
    kernel's OOM killer sends SIGKILL, which leaves no message. The rank, its last step (its own marks) and the
    signal are named, and the sampler's cgroup readings make the verdict point at the OOM killer; the cgroup's
    own count of OOM kills is the truth that it was."""
    limit = LEAK_BYTES * 4 + (16 << 20)
    folder, events = memory_cgroup(limit)
    try:
        run = launch(
            tmp_path,
            2,
            # 300 ms a step: the samples after the last tensor that fit are flushed before the kill (a SIGKILL
            # loses the last flush interval, 0.1 s here).
            *("--fault", "cgroup_oom", "--fault-rank", "1", "--fault-step", "8", "--step-ms", "300"),
            *("--cgroup", str(folder)),
            env={"TRAINTRACE_DEVICE_SAMPLE_INTERVAL": "0.05"},
        )
        kills = re.search(r"oom_kill (\d+)", (folder / events).read_text())
    finally:
        for _ in range(100):  # the killed process leaves the cgroup once reaped
            try:
                folder.rmdir()
                break
            except OSError:
                time.sleep(0.05)
    assert kills is not None and int(kills.group(1)) >= 1, "the kernel did not OOM-kill the rank"
    started = [m["step"] for m in run.marks()[1] if m["event"] == "step_start"]
    errors = check_culprit(run, 1, started[-1], "model_forward", "killed by SIGKILL")
    assert "likely the kernel's OOM killer" in errors["verdict"], errors["verdict"]
    memory = errors["culprit"]["memory"]
    assert memory["cgroup_limit"] == limit and 0.9 * limit <= memory["cgroup_used"] <= limit, memory


#: A command that mounts a 2 MiB tmpfs on the folder after it, in a mount namespace of its own (the job's), then
#: runs the rest of its line.
SMALL_DISK_MOUNT = ("unshare", "-m", "--propagation", "private", "sh", "-c")
SMALL_DISK_MOUNT += ('mount -t tmpfs -o size=2m tmpfs "$0" && exec "$@"',)


#: The same with the telemetry's folder on it too (the tmpfs on the job's log folder, the checkpoints in it): what
#: it holds is copied to ``<folder>.kept`` before the namespace, and the tmpfs, are gone.
SHARED_DISK_MOUNT = ("unshare", "-m", "--propagation", "private", "sh", "-c")
SHARED_DISK_MOUNT += (
    'mount -t tmpfs -o size=2m tmpfs "$0" && mkdir "$0/checkpoints" && "$@"; s=$?; cp -a "$0/." "$0.kept"; exit $s',
)


def launch_on_a_small_disk(tmp_path: Path, *args: str, logs_too: bool = False) -> tuple[Run, Path]:
    """A 2-rank job whose rank 0 saves 700 KiB checkpoints to a 2 MiB file system (a tmpfs in the job's own
    mount namespace), and that folder; with ``logs_too``, the job's streams on that file system too."""
    if logs_too:
        logs = tmp_path / "logs"
        logs.mkdir()
        disk = logs / "checkpoints"
        prefix = (*SHARED_DISK_MOUNT, str(logs))
    else:
        disk = tmp_path / "checkpoints"
        disk.mkdir()
        prefix = (*SMALL_DISK_MOUNT, str(disk))
    run = launch(tmp_path, 2, *("--checkpoint-dir", str(disk), "--checkpoint-pad-kb", "700", *args), prefix=prefix)
    if logs_too:
        shutil.copytree(tmp_path / "logs.kept", tmp_path / "logs", dirs_exist_ok=True)
    return run, disk


@needs_namespace
# Apart: the checkpoint's disk fills, not the streams' (in the pure pass, its error record: an exception's).
@pytest.mark.once
@pytest.mark.parametrize("logs_too", [False, True], ids=["apart", "logs-too"])
def test_a_checkpoint_save_on_a_full_disk(tmp_path: Path, logs_too: bool) -> None:
    """Rank 0 saves 700 KiB checkpoints every 5 steps to a 2 MiB file system (a tmpfs in the job's own mount
    namespace) until one does not fit: PyTorch's zip writer then says only ``unexpected pos ...``. The rank, the
    step being saved and the phase are named, and the verdict says the file system was full, with the space the
    worker itself read (statvfs) when its save failed. With the job's streams on the same file system (a scratch
    folder for both), the records after it filled, the save's exception first, are written into the space each
    stream set aside (``reserve_bytes``): before, they were lost, and the rank read as `exited with exit code 1
    (no exception, no signal)`."""
    run, disk = launch_on_a_small_disk(tmp_path, logs_too=logs_too)
    failed = [m for m in run.marks()[0] if m["event"] == "checkpoint_failed"]
    assert failed, run.output[-3000:]
    truth = failed[0]
    errors = check_culprit(run, 0, truth["step"], "checkpoint_save_sync", "RuntimeError")
    assert "the checkpoint's file system was full" in errors["verdict"], errors["verdict"]
    disk_facts = errors["culprit"]["disk"]
    if logs_too:  # the streams' reserves, released as each found the disk full, came back as free space
        assert disk_facts["total"] == truth["total"] and truth["free"] <= disk_facts["free"] < 700 * 1024
        assert not list(run.folder.glob(".*.reserve")), list(run.folder.iterdir())  # each removed at close
    else:
        assert (disk_facts["free"], disk_facts["total"]) == (truth["free"], truth["total"]), (disk_facts, truth)
    assert disk_facts["full"] and disk_facts["path"] == str(disk / f"step{truth['step']}.pt")
    assert disk_facts["last_checkpoint_size"] > 700 * 1024 > disk_facts["free"]


@needs_namespace
# Its core's part is tested in both passes by a full disk: test_a_checkpoint_save_on_a_full_disk.
@pytest.mark.once
def test_a_background_checkpoint_save_on_a_full_disk(tmp_path: Path) -> None:
    """Rank 0 saves asynchronously (the state copied in the loop, written on a thread of its own, as
    torch.distributed.checkpoint's async_save does) 700 KiB checkpoints every 5 steps to a 2 MiB file system:
    the saves of steps 15 and 20 fail on their thread while training goes on, and the job finishes. Not
    "healthy": finished with errors, the first named (rank, the step its checkpoint holds, the background save,
    the full file system), how many, and the last checkpoint that completed, each from the worker's marks."""
    run, _ = launch_on_a_small_disk(tmp_path, "--async-checkpoint")
    assert run.returncode == 0, run.output[-3000:]
    marks = run.marks()[0]
    failed = [m for m in marks if m["event"] == "checkpoint_failed"]
    assert failed and all(m["thread"] == "checkpoint" for m in failed), run.output[-3000:]
    completed = max(m["step"] for m in marks if m["event"] == "checkpoint_end")
    errors = run.cli("errors")
    assert errors["status"] == "finished_with_errors", errors["verdict"]
    culprit = errors["culprit"]
    assert (culprit["rank"], culprit["step"], culprit["phase"]) == (
        0,
        failed[0]["step"],
        SpanName.CHECKPOINT_SAVE_FINALIZATION,
    ), errors["verdict"]
    verdict = errors["verdict"]
    assert verdict.startswith(
        f"finished with errors: rank 0 raised RuntimeError in a background checkpoint save at step {failed[0]['step']}"
        "; the checkpoint's file system was full"
    ), verdict
    assert f"; {len(failed)} errors on 1 rank, the first named; the program went on" in verdict, verdict
    assert f"; the last checkpoint completed holds step {completed}; 2 ranks finished" in verdict, verdict
    disk_facts = culprit["disk"]
    assert (disk_facts["free"], disk_facts["total"]) == (failed[0]["free"], failed[0]["total"]), disk_facts
    check_goodput(run, failed=False)


@pytest.mark.once  # no rank starts: no recording core takes part
def test_a_node_that_never_joins_the_rendezvous(tmp_path: Path) -> None:
    """A 2-node job of which only one node's launcher starts (the other node down, or a wrong endpoint): the
    rendezvous times out and no rank ever starts. The verdict says so instead of "no rank wrote any record":
    how long it waited (between the join timeout and the test's own clock) and that 1 of 2 nodes joined."""
    join_timeout = 4
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        *(sys.executable, "-m", "traintrace.launch", "--nnodes", "2", "--nproc-per-node", "1"),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job"),
        *("--rdzv-conf", f"join_timeout={join_timeout}", str(WORKER), str(tmp_path / "truth")),
    ]
    env = {**ENV, "TRAINTRACE_LOG_DIR": str(tmp_path / "logs"), "TRAINTRACE_JOB_ID": "job"}
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120, check=False)
    wall = time.monotonic() - started
    assert done.returncode != 0 and "RendezvousTimeoutError" in done.stderr + done.stdout
    assert not (tmp_path / "truth").exists()  # no worker ever ran
    run = Run(tmp_path / "logs" / "job", tmp_path / "truth", done.returncode, done.stdout + done.stderr)
    errors = run.cli("errors")
    assert errors["status"] == "failed" and errors["rule"] == "launcher: rendezvous failed", errors["verdict"]
    assert errors["verdict"].startswith("the rendezvous timed out after "), errors["verdict"]
    assert "1 of 2 nodes joined" in errors["verdict"] and errors["verdict"].endswith("no rank started")
    rendezvous = errors["rendezvous"]
    assert join_timeout <= rendezvous["waited_s"] <= wall, (rendezvous, wall)
    assert (rendezvous["joined"], rendezvous["nnodes"], rendezvous["hosts"]) == (1, "2", [socket.gethostname()])
    summary = run.cli("summary")
    assert summary["job"] == "job" and summary["verdict"] == errors["verdict"]  # the launcher's stream names it


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (torchrun starts each worker in a session of its own)."""
    children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=False)
    return [pid, *(p for child in children.stdout.split() for p in process_tree(int(child)))]


@contextmanager
def two_nodes(
    tmp_path: Path, *args: str, node_env: dict[str, dict[str, str]] | None = None
) -> Iterator[tuple[subprocess.Popen[str], subprocess.Popen[str]]]:
    """Two launchers on this machine, named node-a and node-b (``TRAINTRACE_HOST``), 2 ranks each, running the
    worker for 200 steps with ``args``; the truth in ``tmp_path/truth``, the records in ``tmp_path/logs/job``.
    ``node_env``: more environment for a node's launcher and workers, by name. On the way out, what still runs
    of either is killed."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**ENV, "TRAINTRACE_LOG_DIR": str(tmp_path / "logs"), "TRAINTRACE_JOB_ID": "job"}

    def node(name: str) -> subprocess.Popen[str]:
        command = [
            *(sys.executable, "-m", "traintrace.launch", "--nnodes", "2", "--nproc-per-node", "2"),
            *("--max-restarts", "0", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"),
            *("--rdzv-id", "job", "--rdzv-conf", "join_timeout=20", str(WORKER), str(tmp_path / "truth")),
            *("--steps", "200", *args),
        ]
        return subprocess.Popen(
            command,
            env={**env, "TRAINTRACE_HOST": name, **(node_env or {}).get(name, {})},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )

    launched = [node("node-a")]
    try:
        time.sleep(0.5)
        launched.append(node("node-b"))
        yield launched[0], launched[1]
    finally:
        for process in launched:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.mark.once  # a launcher's end; in the pure pass, a SIGKILLed pure core: test_a_rank_killed_by_a_signal
def test_a_node_lost_mid_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2-node job (two launchers on this machine, named node-a and node-b, 2 ranks each): node-b's launcher and
    workers are SIGKILLed together at step 10, as when a node goes down. node-a's ranks fail on their all-reduce
    (connection reset) and its launcher ends the job. The verdict names the node, its ranks and their step
    (the truth: the processes the test killed, and the step their own notes last began), both within a minute
    (node-b's silent ranks still count as running) and later (their streams ended without a close record)."""
    truth = tmp_path / "truth"
    with two_nodes(tmp_path, "--gloo-timeout", "6") as (survivor, lost):
        for rank in range(4):
            wait_for_step(survivor, truth, rank, 10)
        killed = process_tree(lost.pid)
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        survivor.wait(timeout=120)
    run = Run(tmp_path / "logs" / "job", truth, survivor.returncode, "")
    marks = run.marks()
    lost_ranks = sorted(r for r, ms in marks.items() if any(m.get("pid") in killed for m in ms))
    assert len(lost_ranks) == 2, (lost_ranks, killed)
    # Each lost rank's step by its own notes (one may have begun the next step when the kill came, or ended its
    # step and be loading the next one's batch: the step it prepares, docs/analysis.md "The culprit").
    last = [m for m in marks[lost_ranks[0]] if m["event"] in ("step_start", "step_end", "data_start")][-1]
    step = last["step"] + (last["event"] == "step_end")
    head = f"node node-b was lost: its launcher and {' and '.join(map(str, lost_ranks)).join(('ranks ', ''))}"
    soon = run.cli("errors")
    later = read_later(run, monkeypatch)
    for errors in (soon, later):
        assert errors["rule"] == "lost node" and errors["status"] == "failed", errors["verdict"]
        assert errors["verdict"].startswith(f"{head} stopped together"), errors["verdict"]
        facts = errors["lost_node"]
        assert (facts["host"], facts["ranks"], facts["launcher"]) == (
            "node-b",
            lost_ranks,
            "stopped without its end record",
        )
        assert (errors["culprit"]["rank"], errors["culprit"]["step"]) == (lost_ranks[0], step)
        survivors = [s for s in errors["rank_states"] if s["rank"] not in lost_ranks]
        assert all(s["consequence"] is not None for s in survivors), survivors


@pytest.mark.once  # the records' reading, not the core that wrote them (test_a_node_lost_mid_training's pair)
def test_a_rank_raises_and_the_scheduler_kills_the_two_node_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 2-node job (two launchers, 2 ranks each): rank 3 raises in forward at step 10 and stays (its process
    lingers, as one finishing its exception hook); the others wait in their all-reduce for it, where no Python
    signal handler runs. Then everything is SIGKILLed at once (a scheduler's kill-on-bad-exit, an operator's
    scancel). Every rank but 3 ends without a trace, on both nodes: the verdict names rank 3's exception (the
    truth: the worker's own mark before it raised), not a lost node, both within a minute (the others' writers
    stamped on until the kill) and later, when their streams' ends are all there is (it read "node node-a was
    lost: its launcher and ranks 0 and 1 stopped together" then)."""
    truth = tmp_path / "truth"
    with two_nodes(tmp_path, "--fault", "forward", "--fault-rank", "3", "--fault-step", "10", "--linger", "60") as (
        first,
        _,
    ):
        wait_for_mark(first, truth, 3, "fault", 10)
        time.sleep(1.0)  # its writer flushes the error (every 0.1 s); the others' all-reduce waits for 6 s
        killed = kill_the_job(truth)
        assert len(killed) >= 6, killed  # two launchers and four workers
    run = Run(tmp_path / "logs" / "job", truth, -9, "")
    fault = next(m for m in run.marks()[3] if m["event"] == "fault")
    for errors in (run.cli("errors"), read_later(run, monkeypatch)):
        assert errors["rule"] == "first exception" and errors.get("lost_node") is None, errors["verdict"]
        culprit = errors["culprit"]
        assert (culprit["rank"], culprit["step"], culprit["phase"]) == (3, fault["step"], "model_forward")
        assert culprit["error"]["message"] == "injected failure in forward on rank 3 at step 10", culprit["error"]
        assert errors["verdict"].startswith("rank 3 raised RuntimeError in forward at step 10"), errors["verdict"]


def clock_ahead_library(folder: Path) -> Path:
    """tests/clock_ahead.c built with the system C compiler: preloaded, a process reads the wall clock ahead."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler to build tests/clock_ahead.c")
    library = folder / "libclock_ahead.so"
    command = [compiler, "-shared", "-fPIC", "-O1", "-Wall", "-o", str(library), str(ROOT / "tests" / "clock_ahead.c")]
    subprocess.run([*command, "-ldl"], check=True, timeout=120)
    return library


@pytest.mark.once  # the records' reading, not the core that wrote them
def test_a_rank_killed_on_a_node_whose_clock_runs_ahead(tmp_path: Path) -> None:
    """A 2-node job (two launchers, 2 ranks each) whose node-b reads its wall clock 1 s ahead of node-a's
    (tests/clock_ahead.c preloaded in node-b's launcher and workers: NTP off on one node). node-b's local
    rank 1 SIGKILLs itself at step 10; the others' all-reduce fails at once (gloo: connection reset). By the raw
    times the killed rank stopped a second after node-a's ranks saw their collective fail, and the verdict read
    "rank 3 was hang: stopped making progress ...; then killed" (rule: the rank the collectives timed out on).
    The ranks' step order proves node-b's clock 1 s ahead; the culprit is the rank the worker's own notes say
    killed itself, at their step, killed by SIGKILL before anyone saw trouble, and the offset found is the one the
    test gave."""
    ahead_s = 1.0
    clock = {"LD_PRELOAD": str(clock_ahead_library(tmp_path)), "CLOCK_AHEAD_NS": str(int(ahead_s * 1e9))}
    truth = tmp_path / "truth"
    args = ("--fault", "sigkill", "--fault-host", "node-b", "--fault-local-rank", "1", "--fault-step", "10")
    with two_nodes(tmp_path, *args, "--gloo-timeout", "6", node_env={"node-b": clock}) as (node_a, node_b):
        node_a.wait(timeout=120)
        node_b.wait(timeout=120)
    run = Run(tmp_path / "logs" / "job", truth, node_a.returncode, "")
    marks = run.marks()
    [(killed, fault)] = [(r, m) for r, ms in marks.items() for m in ms if m["event"] == "fault"]
    hosts = {r: next(m["host"] for m in ms if m["event"] == "process_start") for r, ms in marks.items()}
    assert hosts[killed] == "node-b"
    errors = run.cli("errors")
    culprit = errors["culprit"]
    assert (culprit["rank"], culprit["step"]) == (killed, fault["step"]), errors["verdict"]
    assert culprit["state"] == "killed" and culprit["signal"] == "SIGKILL", culprit
    assert errors["rule"] == "died first", errors["verdict"]
    assert errors["verdict"].startswith(f"rank {killed} was killed by SIGKILL"), errors["verdict"]
    # Offsets are said against rank 0's host.
    other = "node-a" if hosts[0] == "node-b" else "node-b"
    expected = ahead_s if other == "node-b" else -ahead_s
    assert errors["clock_offsets"]["reference"] == hosts[0]
    assert errors["clock_offsets"]["offsets_s"] == {other: pytest.approx(expected, abs=0.1)}, errors["clock_offsets"]
    check_timeline_on_one_clock(run, {other: expected})


@pytest.mark.once  # the records' reading, not the core that wrote them
def test_a_late_batch_on_a_node_whose_clock_runs_ahead(tmp_path: Path) -> None:
    """A 2-node job (2 ranks each) with a BatchNorm layer and no collective recorded, whose node-b reads its wall
    clock 2 s ahead; rank 3 fetches its batches 80 ms late from step 8. The ranks wait for it in forward (DDP's
    broadcast of the buffers), which ``ranks`` tells by when rank 3's fetch ended inside their steps: on one clock
    (by the raw times, rank 3's fetches ended 2 s off the steps of the ranks on the other host, and one of them,
    waiting for it, was named too: ``[3, 1]``)."""
    ahead_s = 2.0
    clock = {"LD_PRELOAD": str(clock_ahead_library(tmp_path)), "CLOCK_AHEAD_NS": str(int(ahead_s * 1e9))}
    faulty = ("--fault", "slow_data", "--fault-rank", "3", "--fault-step", "8", "--slow-ms", "80", "--steps", "30")
    with two_nodes(tmp_path, *faulty, "--batch-norm", "--no-record-collectives", node_env={"node-b": clock}) as nodes:
        for node in nodes:
            node.wait(timeout=150)
    run = Run(tmp_path / "logs" / "job", tmp_path / "truth", max(node.returncode for node in nodes), "")
    assert run.returncode == 0
    hosts = {r: next(m["host"] for m in ms if m["event"] == "process_start") for r, ms in run.marks().items()}
    result = run.cli("ranks")
    assert result["stragglers"] == [3], result["ranks"]
    slow = next(r for r in result["ranks"] if r["rank"] == 3)
    assert (slow["slow_in"], slow["slow_since_step"]) == ("data_loading", 8)
    if hosts[3] != hosts[0]:  # the clocks told apart (rank 3 on the other host than rank 0's)
        offsets = run.cli("errors")["clock_offsets"]["offsets_s"]
        assert offsets == {hosts[3]: pytest.approx(ahead_s if hosts[3] == "node-b" else -ahead_s, abs=0.1)}


def check_timeline_on_one_clock(run: Run, ahead_s: dict[str, float]) -> None:
    """`traintrace export`'s timeline against the worker's marks: every step a rank ended is drawn as an iteration
    slice that begins between the rank's ``step_start`` and ``step_entered`` marks, each host's marks moved onto the
    reference host's clock by what the test made its clock read (``ahead_s``: host -> seconds ahead). The trace
    counts from the job's first record, the marks from the epoch: one shift, which every slice of a rank must
    admit (each bounds it from both sides; a mark's own stall, a preempted thread, widens the bounds, never
    breaks them), and the same for every rank within 5 ms (the offset is estimated from the records)."""
    trace = run.folder.parent / "trace.json"
    export = [sys.executable, "-m", "traintrace.cli", "export", str(run.folder), "-o", str(trace), "--quiet"]
    subprocess.run(export, check=True, timeout=120, env=ENV, capture_output=True)
    drawn: dict[tuple[int, int], float] = {}
    twice: set[tuple[int, int]] = set()  # a step run again after a restart: its slices are not told apart here
    for e in json.loads(trace.read_text())["traceEvents"]:
        if e["ph"] == "X" and e["name"] == "iteration" and "step" in e.get("args", {}):
            key = (e["pid"], e["args"]["step"])
            if key in drawn:
                twice.add(key)
            drawn[key] = e["ts"]
    rounding_us = 1.0  # the trace's microseconds
    shift_bounds: dict[int, tuple[float, float]] = {}  # rank -> (lowest, highest) shift its slices admit, µs
    for rank, ms in run.marks().items():
        host = next(m["host"] for m in ms if m["event"] == "process_start")
        last = max(ms, key=lambda m: m["ts"])
        # A rank that ended without its exit handlers may lack its last flush interval of records.
        recorded_by = last["ts"] - (FLUSH_S * 1e9 if last["event"] != "exit" else 0)
        ended = [(m["restart"], m["step"]) for m in ms if m["event"] == "step_end" and m["ts"] <= recorded_by]
        once = {key for key in ended if [step for _, step in ended].count(key[1]) == 1}
        entered = {(m["restart"], m["step"]): m["ts"] for m in ms if m["event"] == "step_entered"}
        for m in ms:
            if m["event"] == "step_start" and (m["restart"], m["step"]) in once and (rank, m["step"]) not in twice:
                assert (rank, m["step"]) in drawn, (rank, m["step"])
                ahead_ns = ahead_s.get(host, 0.0) * 1e9
                began_after_us = (m["ts"] - ahead_ns) / 1e3
                began_before_us = (entered[m["restart"], m["step"]] - ahead_ns) / 1e3
                low, high = shift_bounds.get(rank, (-math.inf, math.inf))
                slice_us = drawn[rank, m["step"]]
                shift_bounds[rank] = (
                    max(low, slice_us - began_before_us - rounding_us),
                    min(high, slice_us - began_after_us + rounding_us),
                )
    if not shift_bounds:
        return  # no rank ended a step (a job that failed in its initialisation): no slice to place
    for rank, (low, high) in shift_bounds.items():
        assert low <= high, (
            f"rank {rank}: no one shift puts all its iteration slices between their marks ({low} > {high} µs)"
        )
    lowest_high = min(high for _, high in shift_bounds.values())
    highest_low = max(low for low, _ in shift_bounds.values())
    assert highest_low - lowest_high <= 5000, shift_bounds  # µs


def faulty_node(
    run: Run,
) -> tuple[dict[int, list[dict[str, Any]]], list[int], dict[int, dict[str, Any]], int]:
    """A 2-node job's truth where both of node-b's ranks noted a fault: every rank's marks, node-b's ranks, their
    fault marks, and the step they came at (the same on both)."""
    marks = run.marks()
    on_b = sorted(r for r, ms in marks.items() if ms[0]["host"] == "node-b")
    faults = {r: next(m for m in ms if m["event"] == "fault") for r, ms in marks.items() if r in on_b}
    assert len(on_b) == 2 and len(faults) == 2, marks
    (step,) = {f["step"] for f in faults.values()}
    return marks, on_b, faults, step


def read_later(run: Run, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """``errors`` as read a minute after the streams stopped (in this process): another host's silent ranks
    then count as ended, not running."""
    from traintrace.cli import _analysis
    from traintrace.cli._engine import Job

    monkeypatch.setattr("traintrace.cli._engine.RECENT_S", 0.0)
    job = Job.open([run.folder], lean=True)
    try:
        return _analysis.errors(job)
    finally:
        job.close()


@pytest.mark.parametrize(
    "ending", ["hang reports", *(pytest.param(e, marks=pytest.mark.once) for e in ("timeouts", "killed"))]
)
# Its core's part is tested in both passes by a hang report: test_a_rank_hung_in_compute.
@pytest.mark.once
def test_a_node_whose_file_system_stops_answering(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ending: str) -> None:
    """A 2-node job (node-a, node-b, 2 ranks each): at step 8 both of node-b's ranks block in data loading, on
    a read that never returns (a FIFO nobody writes, as a hung network file system), while node-a's ranks wait
    for them in the all-reduce. Both stuck ranks are named, with their node, not one of them alone:

    - ``hang reports``: traintrace's hang detection on; node-a's collectives time out (6 s) and its launcher ends;
      then the scheduler ends node-b (SIGTERM to its launcher);
    - ``timeouts``: the same with hang detection off: the timeouts and where each rank was say it;
    - ``killed``: hang detection off, collectives' timeout 60 s; 3 s after the faults the scheduler kills every
      process. Read at once, the job is running (node-b's ranks are remote: their silence is not death yet) and
      waits on them; read a minute later, they hung until the kill (and no node is called lost).

    The truth: each rank's host and its fault mark (the worker's own), the step the others last began, and for
    the kill the test's own clock."""
    truth = tmp_path / "truth"
    detection, timeout = {"hang reports": ("1.5", "6"), "timeouts": ("0", "6"), "killed": ("0", "60")}[ending]
    fault = ("--fault", "hang_data", "--fault-host", "node-b", "--fault-step", "8")
    times: dict[str, float] = {}
    with two_nodes(tmp_path, "--gloo-timeout", timeout, "--hang-timeout", detection, *fault) as (first, second):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(list(truth.glob("stuck.*.fifo"))) < 2:
            time.sleep(0.05)
        if ending == "killed":
            time.sleep(3.0)
            times["killed"] = time.time()
            kill_the_job(truth)
            times["dead"] = time.time()
            first.wait(timeout=30)
        else:
            first.wait(timeout=120)
            os.killpg(second.pid, signal.SIGTERM)
        second.wait(timeout=60)
    run = Run(tmp_path / "logs" / "job", truth, first.returncode, "")
    marks, on_b, faults, step = faulty_node(run)
    waiting = [r for r in marks if r not in on_b]
    assert all(max(m["step"] for m in marks[r] if m["event"] == "step_start") == step for r in waiting)
    head = f"ranks {on_b[0]} and {on_b[1]} (every rank of node node-b)"

    def check(errors: dict[str, Any], rule: str, verdict: str) -> None:
        assert (errors["rule"], errors["status"]) == (rule, "running" if verdict.startswith("running") else "failed")
        assert errors["verdict"].startswith(verdict), errors["verdict"]
        culprit = errors["culprit"]
        # The culprit is the one whose last step ended first (rule 5) or the lowest rank: either of the two.
        assert (sorted([culprit["rank"], *culprit["stuck_with"]]), culprit["step"]) == (on_b, step), culprit
        assert (culprit["phase"], culprit["in_collective"], culprit["host"]) == ("data_loading", False, "node-b")
        others = [s for s in errors["rank_states"] if s["rank"] in waiting]
        assert all(s["in_collective"] and s["step"] == step and s["host"] == "node-a" for s in others), others
        assert errors["verdict"].endswith(
            f"{_ranks_phrase(waiting)} were waiting in a collective in backward at step {step}"
        )

    where = f"in data loading at step {step}, not in a collective"
    if ending != "killed":
        rule = "hang: the rank behind" if ending == "hang reports" else "hang: the rank the collectives timed out on"
        check(run.cli("errors"), rule, f"{head} hung {where}; ")
        return
    check(run.cli("errors"), "waiting on a rank", f"running, waiting on {head}: {where}, for ")
    later = read_later(run, monkeypatch)
    check(later, "killed while waiting for a rank", f"{head} hung {where}: no progress for ")
    # Stuck from data loading's start (after the step before ended) to the kill, by the worker's marks and the
    # test's clock, less up to a writer cycle (0.1 s) and scheduling.
    began = max(next(m["ts"] for m in marks[r] if m["event"] == "step_end" and m["step"] == step - 1) for r in on_b)
    low = times["killed"] - max(f["ts"] for f in faults.values()) / 1e9 - 0.5
    assert low <= later["culprit"]["stuck_ns"] / 1e9 <= times["dead"] - began / 1e9, (later["culprit"], low)


# Its core's part is tested in both passes by a hang report: test_a_rank_hung_in_compute.
@pytest.mark.once
def test_a_node_hung_without_reports_of_its_own_is_hung_on_every_rank(tmp_path: Path) -> None:
    """A 2-node job (2 ranks each) whose node-b's ranks block in data loading at step 8 (a read that never
    returns) with their hang detection off, node-a's on (1.5 s): node-a's ranks report their hang in the
    all-reduce, their collectives time out (6 s) and their launcher ends; then the scheduler ends node-b (SIGTERM
    to its launcher). Both of node-b's ranks hung from when node-a's were left waiting: `errors` said so of one
    (the culprit) and the other was `terminated by SIGTERM`, and `summary` counted the other's stuck seconds as
    data loading. The truth: the workers' marks (their host, the fault, when each step's data loading began and
    its step began)."""
    truth = tmp_path / "truth"
    fault = ("--fault", "hang_data", "--fault-host", "node-b", "--fault-step", "8")
    quiet = {"node-b": {"DIAG_HANG_TIMEOUT": "0"}}
    with two_nodes(tmp_path, "--gloo-timeout", "6", "--hang-timeout", "1.5", *fault, node_env=quiet) as (first, second):
        first.wait(timeout=120)
        os.killpg(second.pid, signal.SIGTERM)
        second.wait(timeout=60)
    run = Run(tmp_path / "logs" / "job", truth, first.returncode, "")
    marks, on_b, _, step = faulty_node(run)
    errors = run.cli("errors")
    culprit = errors["culprit"]
    assert errors["rule"] == "hang: the rank behind", errors["verdict"]
    assert (sorted([culprit["rank"], *culprit["stuck_with"]]), culprit["step"]) == (on_b, step), errors["verdict"]
    assert culprit["phase"] == "data_loading", culprit
    for state in errors["rank_states"]:
        if state["rank"] in on_b:
            assert state["cause"].startswith("hang: "), (state["rank"], state["cause"])
    # Data loading by the marks: each step's, from its data_start to its step_start; node-b's at the hung step
    # until node-a's ranks began that step (they then waited in its all-reduce), with a second's slack for the
    # forward before it. Their stuck seconds after that are the hang's.
    began_a = max(next(m["ts"] for m in marks[r] if m["event"] == "step_start" and m["step"] == step) for r in marks
                  if r not in on_b)  # fmt: skip
    loading = 0.0
    for rank, ms in marks.items():
        started = {m["step"]: m["ts"] for m in ms if m["event"] == "step_start"}
        for m in ms:
            if m["event"] == "data_start":
                ended = started.get(m["step"], began_a + 1e9 if rank in on_b else m["ts"])
                loading += max(ended - m["ts"], 0) / 1e9
    summary = run.cli("summary")
    recorded = summary["breakdown_s"]["data_loading"] * len(marks)
    assert recorded <= loading + 0.5, (summary["breakdown_s"], loading)


@pytest.mark.once  # the launchers' signals; in the pure pass, SIGTERM's handler: tests/test_progress_jobs.py
@pytest.mark.parametrize("signalled", ["node-b", "every node"])
def test_a_node_terminated_from_outside(tmp_path: Path, signalled: str) -> None:
    """A 2-node job (node-a, node-b, 2 ranks each) training at step 10: SIGTERM to node-b's launcher alone (a
    preempted spot instance, an evicted pod, a drained node), which stops its ranks; node-a's ranks then fail on
    their all-reduce and its launcher ends the job. The verdict names the node and says it was ended from
    outside, not that its first rank failed. SIGTERM to both launchers at once (the scheduler's time limit) is
    the whole job's, as on one node. The truth: the launchers the test signalled, each rank's host and its own
    SIGTERM handler's mark, and the step each began last."""
    truth = tmp_path / "truth"
    with two_nodes(tmp_path, "--gloo-timeout", "6") as (first, second):
        for rank in range(4):
            wait_for_step(first, truth, rank, 10)
        for launcher in (second,) if signalled == "node-b" else (first, second):
            os.kill(launcher.pid, signal.SIGTERM)
        first.wait(timeout=120)
        second.wait(timeout=60)
    run = Run(tmp_path / "logs" / "job", truth, first.returncode, "")
    marks = run.marks()
    hosts = {r: ms[0]["host"] for r, ms in marks.items()}
    began = {r: max(m["step"] for m in ms if m["event"] == "step_start") for r, ms in marks.items()}
    handled = {r: next((m["ts"] for m in ms if m["event"] == "sigterm"), None) for r, ms in marks.items()}
    errors = run.cli("errors")
    if signalled == "every node":
        ends = [
            (path.name, record.get("attrs", {}).get("data"))
            for path in sorted((tmp_path / "logs" / "job").glob("*.jsonl"))
            for record in map(json.loads, path.read_text().splitlines())
            if record.get("name") == "job_end"
        ]  # each launcher's own word on the signal it got, for a failure's message
        assert errors["rule"] == "terminated together" and errors["culprit"] is None, (errors["verdict"], ends)
        assert errors["verdict"].startswith(
            "terminated by SIGTERM from outside: the launchers and all 4 ranks got the signal at once"
        ), errors["verdict"]
        assert all(handled.values()), handled
        return
    on_b = sorted(r for r in marks if hosts[r] == "node-b")
    on_a = sorted(r for r in marks if r not in on_b)
    assert len(on_b) == 2 and all(handled[r] for r in on_b), (hosts, handled)
    # node-b's ranks got the signal before anything happened to node-a's (their handlers' marks, if any, later)
    assert all(handled[a] is None or handled[a] > max(handled[b] or 0 for b in on_b) for a in on_a), handled
    (step,) = {began[r] for r in on_b}
    assert errors["rule"] == "node ended from outside" and errors["status"] == "failed", errors["verdict"]
    assert errors["verdict"].startswith(
        f"node node-b was terminated by SIGTERM from outside: its launcher got the signal and stopped "
        f"{_ranks_phrase(on_b)} "
    ), errors["verdict"]
    assert f" at step {step} (a preempted, evicted or drained node" in errors["verdict"], errors["verdict"]
    assert errors["node_ended"] == {
        "host": "node-b",
        "ranks": on_b,
        "signal": "SIGTERM",
        "stopped_ns": errors["node_ended"]["stopped_ns"],
    }
    assert (errors["culprit"]["rank"], errors["culprit"]["step"]) == (on_b[0], step)
    # node-b's ranks stopped when their handlers ran (within the writer's 0.1 s), not when node-a failed.
    assert abs(errors["node_ended"]["stopped_ns"] - min(handled[r] or 0 for r in on_b)) < 200_000_000
    states = {s["rank"]: s for s in errors["rank_states"]}
    assert all(states[r]["state"] == "terminated" and states[r]["host"] == "node-b" for r in on_b), states
    assert all(states[r]["consequence"] is not None and states[r]["step"] == began[r] for r in on_a), states
    # node-a's ranks at the step they began last, by their own marks: the step node-b's were stopped in, or the next
    # (the signal came after step 10's all-reduce, before node-b's ranks ended its backward: CI's loaded machine).
    (waited_at,) = {began[r] for r in on_a}
    phrase = f"{_ranks_phrase(on_a)} were waiting in a collective in backward at step {waited_at}"
    assert errors["verdict"].endswith(phrase), (errors["verdict"], began)


@pytest.mark.once  # in the pure pass, a SIGKILLed pure core: test_a_rank_killed_by_a_signal
def test_a_rank_dying_during_a_checkpoint_save(tmp_path: Path) -> None:
    """Rank 0 killed inside its save after step 14: the save before (after step 9) is the last completed one."""
    run = launch(tmp_path, 2, "--fault", "kill_in_checkpoint", "--fault-rank", "0", "--fault-step", "15")
    check_culprit(run, 0, 15, "checkpoint_save_sync", "killed by SIGKILL")
    summary = check_goodput(run)
    assert summary["steps_completed"] == 10


def wait_for_mark(
    process: subprocess.Popen[str], truth: Path, rank: int, event: str, step: int | None = None, *, poll: float = 0.005
) -> None:
    """Until the worker's own marks say ``rank`` wrote ``event`` (at ``step``, when given)."""
    deadline = time.monotonic() + 120
    mark = truth / f"rank{rank}.jsonl"
    while time.monotonic() < deadline and process.poll() is None:
        marks = [json.loads(x) for x in (mark.read_text().splitlines() if mark.exists() else []) if x.strip()]
        if any(m.get("event") == event and (step is None or m.get("step") == step) for m in marks):
            return
        time.sleep(poll)


def wait_for_step(process: subprocess.Popen[str], truth: Path, rank: int, step: int) -> None:
    """Until the worker's own marks say ``rank`` started ``step``."""
    wait_for_mark(process, truth, rank, "step_start", step)


def kill_the_job(truth: Path, sig: int = signal.SIGKILL) -> list[int]:
    """``sig`` to the launcher and every worker (each has the truth folder on its command line)."""
    killed = []
    for entry in Path("/proc").iterdir():
        try:
            mine = str(truth).encode() in (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if entry.name.isdigit() and mine:
            os.kill(int(entry.name), sig)
            killed.append(int(entry.name))
    return killed


# Its core's part is tested in both passes by SIGKILL: test_a_rank_killed_by_a_signal.
@pytest.mark.once
def test_the_whole_job_killed_at_once(tmp_path: Path) -> None:
    """SIGKILL to the launcher and every rank at once while they run step 7 (the scheduler's kill, the OOM
    killer on a whole node): no rank failed first, so none is named; each rank's step is the one it ran."""
    killed: list[int] = []

    def kill_everything(process: subprocess.Popen[str], truth: Path) -> None:
        wait_for_step(process, truth, 0, 7)
        killed.extend(kill_the_job(truth))

    run = launch(tmp_path, 2, during=kill_everything)
    assert run.returncode == -signal.SIGKILL and len(killed) == 3, (run.returncode, killed)  # launcher and 2 ranks
    errors = run.cli("errors")
    assert errors["culprit"] is None and errors["rule"] == "killed together", errors["verdict"]
    assert errors["status"] == "failed"
    assert errors["verdict"].startswith("killed from outside: both ranks were"), errors["verdict"]
    for state in errors["rank_states"]:
        assert state["step"] in steps_by_marks(run.marks()[state["rank"]], killed=True), state
        assert f"{state['rank']}" in errors["verdict"].split(";", 1)[1]


# Its core's part is tested in both passes by SIGKILL: test_a_rank_killed_by_a_signal; a save:
# test_a_rank_dying_during_a_checkpoint_save.
@pytest.mark.once
def test_the_whole_job_killed_just_after_a_checkpoint(tmp_path: Path) -> None:
    """SIGKILL to everything 50 ms after rank 0's save after step 9 ends, with a 2 s flush interval: the save's
    record is on disk (its end wakes the writer), so the 10 steps it holds count as completed, as the worker's
    own marks say; it used to be lost with the last flush interval, and the steps with it."""

    def kill_after_the_save(process: subprocess.Popen[str], truth: Path) -> None:
        wait_for_mark(process, truth, 0, "checkpoint_end", 10, poll=0.002)
        time.sleep(0.05)
        kill_the_job(truth)

    run = launch(tmp_path, 2, "--flush-interval", "2", during=kill_after_the_save)
    assert run.returncode == -signal.SIGKILL, run.output[-2000:]
    saved = [m["step"] for m in run.marks()[0] if m["event"] == "checkpoint_end"]
    assert saved[-1] == 10, saved
    errors = run.cli("errors")
    assert errors["rule"] == "killed together", errors["verdict"]
    summary = run.cli("summary")
    assert summary["steps_completed"] == saved[-1], summary


@pytest.mark.once  # in the pure pass, the pure core's hang report and SIGKILL: tests of each alone
def test_a_hung_job_killed_by_the_scheduler(tmp_path: Path) -> None:
    """Rank 1 hangs in forward at step 6; before any timeout or hang report, the whole job is SIGKILLed (the
    scheduler's time limit). The progress files say the others had waited in a collective since, and until when
    each process lived: rank 1 is named, stuck as long as the test's own clock says."""
    times: dict[str, float] = {}

    def kill_after_the_hang(process: subprocess.Popen[str], truth: Path) -> None:
        wait_for_mark(process, truth, 1, "fault")
        time.sleep(3.0)
        times["killed"] = time.time()
        kill_the_job(truth)
        times["dead"] = time.time()  # the processes lived until some time between the two readings

    run = launch(
        tmp_path,
        2,
        *("--fault", "hang_compute", "--fault-rank", "1", "--fault-step", "6"),
        *("--hang-timeout", "0", "--gloo-timeout", "60"),
        during=kill_after_the_hang,
    )
    assert run.returncode == -signal.SIGKILL, run.output[-2000:]
    fault = fault_step_of(run, 1)
    errors = run.cli("errors")
    assert errors["rule"] == "killed while waiting for a rank", errors["verdict"]
    culprit = errors["culprit"]
    assert (culprit["rank"], culprit["step"], culprit["phase"]) == (1, fault["step"], "model_forward")
    assert errors["verdict"].startswith("rank 1 hung in forward at step 6, not in a collective: no progress for ")
    # Stuck from forward's start (after the step's start mark, before the fault mark) to the kill by the test's
    # clock, less up to a writer cycle (0.1 s) and scheduling.
    began = next(m["ts"] for m in run.marks()[1] if m["event"] == "step_start" and m["step"] == fault["step"])
    low, high = times["killed"] - fault["ts"] / 1e9 - 0.5, times["dead"] - began / 1e9
    assert low <= culprit["stuck_ns"] / 1e9 <= high, (culprit["stuck_ns"], low, high)
    others = [r for r in errors["rank_states"] if r["rank"] != 1]
    assert all(r["in_collective"] and r["step"] == 6 for r in others), others
    assert "rank 0 was waiting in a collective" in errors["verdict"], errors["verdict"]


@pytest.mark.parametrize(
    ("hung", "torchrun", "saving"),
    [
        (False, False, False),
        pytest.param(False, False, True, marks=pytest.mark.once),
        pytest.param(True, False, False, marks=pytest.mark.once),
        pytest.param(True, True, False, marks=pytest.mark.once),
    ],
    ids=["training", "training-saving", "hung", "hung-torchrun"],
)
# Its core's part is tested in both passes by SIGTERM's handler: test_reliability_death.py, test_progress_jobs.py.
@pytest.mark.once
def test_the_whole_job_terminated_by_the_scheduler(tmp_path: Path, hung: bool, torchrun: bool, saving: bool) -> None:
    """SIGTERM to the launcher and every rank at once (the scheduler's time limit: Slurm signals every task),
    while the job trains, or while rank 1 hangs in forward: no rank is blamed for the signal; a hang is named.
    Under plain torchrun (no launcher stream) the ranks' SIGTERM handlers save for 2 s before the process ends:
    the ranks blocked in the all-reduce run theirs only once rank 1 has exited, 2 s after it ran its own, by
    their marks. They read as rank 1 terminated first (`died first`) before. With hang detection on (1.5 s) and
    handlers that save for 2.5 s, no rank hung: every one read as hung in forward before, its watchdog's report
    coming in its handler."""
    times: dict[str, float] = {}

    def terminate_everything(process: subprocess.Popen[str], truth: Path) -> None:
        if hung:
            wait_for_mark(process, truth, 1, "fault")
            time.sleep(3.0)
        else:
            wait_for_step(process, truth, 0, 7)
        times["signalled"] = time.time()
        kill_the_job(truth, signal.SIGTERM)

    fault = ("--fault", "hang_compute", "--fault-rank", "1", "--fault-step", "6") if hung else ()
    fault += ("--sigterm-cleanup", "2.0") if torchrun else ()
    fault += ("--sigterm-cleanup", "2.5") if saving else ()
    run = launch(
        tmp_path,
        2,
        *fault,
        *("--hang-timeout", "1.5" if saving else "0", "--gloo-timeout", "60"),
        during=terminate_everything,
        torchrun=torchrun,
    )
    if torchrun:  # the others' handlers ran once rank 1's process had ended, by their own marks
        handled = {rank: next(m["ts"] for m in ms if m["event"] == "sigterm") for rank, ms in run.marks().items()}
        assert handled[0] - handled[1] >= 2e9, handled
    errors = run.cli("errors")
    if not hung:
        assert errors["culprit"] is None and errors["rule"] == "terminated together", errors["verdict"]
        assert errors["verdict"].startswith(
            "terminated by SIGTERM from outside: the launcher and both ranks got the signal at once, none failed first"
        ), errors["verdict"]
        for state in errors["rank_states"]:
            started = [m["step"] for m in run.marks()[state["rank"]] if m["event"] == "step_start"]
            assert state["step"] == started[-1], (state, started[-1])
            assert state["hang"] is None, state
        if saving:  # the premise: the handlers worked past the hang limit before the job ended (the test's clock)
            assert run.ended_ns is not None and run.ended_ns / 1e9 - times["signalled"] >= 2.5, run.ended_ns
        return
    assert errors["rule"] == "terminated while waiting for a rank", errors["verdict"]
    fault_mark = fault_step_of(run, 1)
    culprit = errors["culprit"]
    assert (culprit["rank"], culprit["step"], culprit["phase"]) == (1, fault_mark["step"], "model_forward")
    assert errors["verdict"].startswith(
        "rank 1 hung in forward at step 6, not in a collective: no progress for 3 s when the whole job was "
        "terminated by SIGTERM from outside; rank 0 was waiting in a collective in backward at step 6"
    ), errors["verdict"]
    # From forward's start to the signal, by the worker's marks and the test's clock (the signal is handled
    # within milliseconds of the kill).
    began = next(m["ts"] for m in run.marks()[1] if m["event"] == "step_start" and m["step"] == fault_mark["step"])
    low, high = times["signalled"] - fault_mark["ts"] / 1e9 - 0.5, times["signalled"] - began / 1e9 + 0.5
    assert low <= culprit["stuck_ns"] / 1e9 <= high, (culprit["stuck_ns"], low, high)


@pytest.mark.once  # in the pure pass, the pure core's hang report and SIGKILL: tests of each alone
def test_a_job_hung_in_a_collective_killed_by_the_scheduler(tmp_path: Path) -> None:
    """Rank 0 waits at step 6 in an all-reduce its partner never joins; the others wait for it at step 7; the
    whole job is SIGKILLed 3 s later, before any timeout: rank 0 is named, inside a collective at step 6."""

    def kill_after_the_hang(process: subprocess.Popen[str], truth: Path) -> None:
        wait_for_mark(process, truth, 0, "fault")
        time.sleep(3.0)
        kill_the_job(truth)

    run = launch(
        tmp_path,
        2,
        *("--fault", "hang_collective", "--fault-rank", "0", "--fault-step", "6"),
        *("--hang-timeout", "0", "--gloo-timeout", "60"),
        during=kill_after_the_hang,
    )
    assert run.returncode == -signal.SIGKILL, run.output[-2000:]
    fault = fault_step_of(run, 0)
    errors = run.cli("errors")
    assert errors["rule"] == "killed while waiting for a rank", errors["verdict"]
    culprit = errors["culprit"]
    assert (culprit["rank"], culprit["step"], culprit["in_collective"]) == (0, fault["step"], True)
    assert errors["verdict"].startswith(
        "rank 0 hung inside a collective at step 6: no progress for 3 s when the whole job was killed from outside"
    ), errors["verdict"]
    others = [r for r in errors["rank_states"] if r["rank"] != 0]
    assert all(r["in_collective"] and r["step"] == fault["step"] + 1 for r in others), others


@pytest.mark.once  # in the pure pass, a SIGKILLed pure core: test_a_rank_killed_by_a_signal
def test_two_ranks_killed_at_once(tmp_path: Path) -> None:
    """SIGKILL to ranks 1 and 2 at once while they run step 7 (a node lost, the OOM killer); the launcher stops
    the others: one of the two is named, and the verdict says the other was killed too."""
    pids: dict[int, int] = {}

    def kill_two(process: subprocess.Popen[str], truth: Path) -> None:
        wait_for_step(process, truth, 0, 7)
        for rank in (1, 2):
            marks = [json.loads(x) for x in (truth / f"rank{rank}.jsonl").read_text().splitlines() if x.strip()]
            pids[rank] = next(m["pid"] for m in marks if m["event"] == "process_start")
        for pid in pids.values():
            os.kill(pid, signal.SIGKILL)

    run = launch(tmp_path, 3, during=kill_two)
    errors = run.cli("errors")
    culprit = errors["culprit"]
    assert culprit is not None and culprit["rank"] in pids and culprit["state"] == "killed", errors["verdict"]
    other = ({1, 2} - {culprit["rank"]}).pop()
    assert errors["rule"] == "died first"
    assert f"rank {other} was killed by SIGKILL (exit code -9) too" in errors["verdict"], errors["verdict"]
    for state in errors["rank_states"]:
        assert state["step"] in steps_by_marks(run.marks()[state["rank"]], killed=state["state"] == "killed"), state


@pytest.mark.once  # in the pure pass, the pure core's SIGTERM record: test_progress_jobs.py, test_reliability_death.py
def test_sigterm_from_outside(tmp_path: Path) -> None:
    """SIGTERM sent by another process to one rank: that rank, not the ranks the launcher stopped after."""

    def send_sigterm(process: subprocess.Popen[str], truth: Path) -> None:
        pid_file = truth / "sigterm.pid"
        deadline = time.monotonic() + 120
        while not pid_file.exists() and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.02)
        time.sleep(0.05)
        os.kill(int(pid_file.read_text()), signal.SIGTERM)

    run = launch(
        tmp_path,
        2,
        "--fault",
        "sigterm",
        "--fault-rank",
        "1",
        "--fault-step",
        "6",
        env={"TRAINTRACE_HANG_TIMEOUT": "60"},
        during=send_sigterm,
    )
    errors = check_culprit(run, 1, 6, "model_forward", "SIGTERM")
    assert errors["culprit"]["state"] == "terminated"
    check_goodput(run)


def signal_from_the_terminal(
    tmp_path: Path, sig: signal.Signals, torchrun: bool, why: str
) -> tuple[Run, int, dict[str, Any]]:
    """``sig`` to the launcher's process group, the job's terminal's foreground group (torchrun passes it on), at step
    8 of rank 0; the verdict read as the whole job's, no rank blamed, each where its marks say it began last, and
    not before the test's signal. Returns the run, when the test sent the signal and ``errors``' answer."""
    sent: dict[str, int] = {}

    def send(process: subprocess.Popen[str], truth: Path) -> None:
        wait_for_step(process, truth, 0, 8)
        sent["ns"] = time.time_ns()
        os.killpg(process.pid, sig)

    run = launch(tmp_path, 2, "--steps", "200", during=send, torchrun=torchrun)
    marks = run.marks()
    errors = run.cli("errors")
    assert errors["culprit"] is None and errors["rule"] == "terminated together", errors["verdict"]
    who = "" if torchrun else "the launcher and "
    assert errors["verdict"].startswith(
        f"terminated by {sig.name} from outside: {who}both ranks got the signal at once, none failed first ({why}"
    ), errors["verdict"]
    for state in errors["rank_states"]:
        assert state["signal"] == sig.name, state
        # Where its marks say it began last, or, between a step's end and the next step's start (making the next
        # batch), the step it was preparing, as docs/analysis.md says of a rank outside an iteration (the clean
        # clone's run: rank 1's KeyboardInterrupt came 0.8 ms after its step 7 ended, and it was read at step 8).
        assert state["step"] in steps_by_marks(marks[state["rank"]], killed=True), (state, marks[state["rank"]][-4:])
        assert sent["ns"] <= state["stopped_ns"], (state, sent)
    assert check_goodput(run)["status"] == "failed"
    return run, sent["ns"], errors


@pytest.mark.once  # the records either core writes of Ctrl-C: test_exception_exit_and_os_exit[sigint]
@pytest.mark.parametrize("torchrun", [False, True], ids=["launcher", "torchrun"])
def test_the_whole_job_interrupted_from_its_terminal(tmp_path: Path, torchrun: bool) -> None:
    """Ctrl-C in the job's terminal: SIGINT to the launcher's process group at step 8 of rank 0 (torchrun passes it
    on to the workers); every rank raises KeyboardInterrupt, which ends its spans `terminated` and closes its
    stream. Nobody is blamed: the job was interrupted, each rank where its marks say. It read as `failed, cause
    unclear: the first sign is on rank 0 (error)` before: nothing recorded the interrupt."""
    run, _, errors = signal_from_the_terminal(tmp_path, signal.SIGINT, torchrun, "Ctrl-C in its terminal); ")
    marks = run.marks()
    interrupted = {r: [m for m in ms if m.get("error") == "KeyboardInterrupt"] for r, ms in marks.items()}
    assert all(interrupted.values()), run.output[-3000:]  # the premise: every rank got it
    for state in errors["rank_states"]:
        # Its stream's signal record comes as KeyboardInterrupt leaves the spans: after the test's signal, before
        # the worker noted the exception (the spans it went through had ended then).
        assert state["stopped_ns"] <= interrupted[state["rank"]][0]["ts"], state


@pytest.mark.once  # the records either core writes of SIGHUP: test_sighup_ends_the_process_as_sigterm_does
@pytest.mark.parametrize("torchrun", [False, True], ids=["launcher", "torchrun"])
def test_the_whole_job_hung_up_by_its_terminal(tmp_path: Path, torchrun: bool) -> None:
    """The job's terminal closed (an ssh session dropped, no nohup or tmux): SIGHUP to the launcher's process group
    at step 8 of rank 0 (torchrun passes it on). Each rank's traintrace handles it as SIGTERM: its records kept, a
    signal record, then the process dies of SIGHUP. It read as `killed from outside: all 3 ranks were cut off
    without a close record at once (the scheduler, the OOM killer or a lost node)` before, with the last writer
    cycle's records lost, and so under traintrace-run too, whose launcher had recorded the SIGHUP. The truth: when
    the test sent the signal, when it saw the launcher end, and the step each rank's marks say it began last."""
    run, _, errors = signal_from_the_terminal(tmp_path, signal.SIGHUP, torchrun, "its terminal closed: ")
    for state in errors["rank_states"]:
        assert state["state"] == "terminated" and state["stopped_ns"] <= (run.ended_ns or 0), (state, run.ended_ns)
    for path in sorted(run.folder.glob("rank*.jsonl")):  # nothing lost: each stream ends with its close record
        assert json.loads(path.read_text().splitlines()[-1])["kind"] == "close", path


@pytest.mark.parametrize("detection", ["on", pytest.param("off", marks=pytest.mark.once)])
def test_a_rank_hung_in_compute(tmp_path: Path, detection: str) -> None:
    """Rank 1 sleeps in forward; the others wait in the all-reduce until gloo times out: rank 1 is named.

    With traintrace's hang detection off (or slower than the collective's timeout: both default to 10
    minutes), no record says "hang": the others' timeouts and where rank 1 was say it."""
    hang_timeout = "1.5" if detection == "on" else "0"
    run = launch(
        tmp_path, 2, "--fault", "hang_compute", "--fault-rank", "1", "--fault-step", "6", "--hang-timeout", hang_timeout
    )
    errors = check_culprit(run, 1, 6, "model_forward", "hang")
    assert not errors["culprit"]["in_collective"]
    assert errors["verdict"].startswith("rank 1 hung in forward at step 6, not in a collective;"), errors["verdict"]
    others = [r for r in errors["rank_states"] if r["rank"] != 1]
    assert all(r["in_collective"] and r["step"] == 6 for r in others), others
    summary = check_goodput(run)
    if detection == "on":
        assert "Thread" in (errors["culprit"]["hang"]["stack"] or "") or "File" in errors["culprit"]["hang"]["stack"]
        assert summary["breakdown_s"]["hang"] > 0
    else:
        assert errors["rule"] == "hang: the rank the collectives timed out on"
        assert "timed out" in errors["culprit"]["cause"].lower(), errors["culprit"]["cause"]
        assert not errors["hang_suspects"]


@pytest.mark.parametrize("detection", ["on", pytest.param("off", marks=pytest.mark.once)])
# Its core's part is tested in both passes by a hang report: test_a_rank_hung_in_compute.
@pytest.mark.once
def test_a_rank_hung_loading_its_first_batch(tmp_path: Path, detection: str) -> None:
    """Rank 1 blocks in data loading before step 0 (a file system that stopped answering) while the others wait
    in step 0's all-reduce. With no iteration begun it had no step and counted as ahead of them: the verdict named
    rank 0 (`hung inside a collective`), or, with detection off, said `cause unclear`. Its hang begins at the
    training loop's start, not at the stream's: its initialisation is not hang time."""
    hang_timeout = "1.5" if detection == "on" else "0"
    run = launch(
        tmp_path, 2, "--fault", "hang_data", "--fault-rank", "1", "--fault-step", "0", "--hang-timeout", hang_timeout
    )
    assert fault_step_of(run, 1)["step"] == 0
    errors = check_culprit(run, 1, 0, "data_loading", "hang")
    assert errors["verdict"].startswith("rank 1 hung in data loading at step 0, not in a collective;")
    others = [r for r in errors["rank_states"] if r["rank"] != 1]
    assert all(r["in_collective"] and r["step"] == 0 for r in others), others
    summary = check_goodput(run)
    assert summary["breakdown_s"]["initialization"] > 0, summary["breakdown_s"]
    if detection == "on":
        assert errors["rule"] == "hang: the rank behind"
        assert summary["breakdown_s"]["hang"] > 0
    else:
        assert errors["rule"] == "hang: the rank the collectives timed out on"


@pytest.mark.parametrize("detection", ["on", pytest.param("off", marks=pytest.mark.once)])
# Its core's part is tested in both passes by a hang report: test_a_rank_hung_in_compute; a save:
# test_a_rank_dying_during_a_checkpoint_save.
@pytest.mark.once
def test_a_rank_hung_in_a_checkpoint_save(tmp_path: Path, detection: str) -> None:
    """Rank 0 stalls in its save after step 9 (a file system that stopped answering); the others wait for it in
    the all-reduce of step 10. A save has a longer hang timeout than a step, so with detection on only the
    waiting ranks report a hang: rank 0 is still the one named as hung, not only as terminated at the end."""
    hang_timeout = "1.5" if detection == "on" else "0"
    run = launch(
        tmp_path,
        2,
        *("--fault", "hang_in_checkpoint", "--fault-rank", "0", "--fault-step", "10", "--hang-timeout", hang_timeout),
    )
    fault = fault_step_of(run, 0)
    errors = check_culprit(run, 0, fault["step"], "checkpoint_save_sync", "hang")
    assert errors["verdict"].startswith(
        f"rank 0 hung in a checkpoint save at step {fault['step']}, not in a collective;"
    ), errors["verdict"]
    others = [r for r in errors["rank_states"] if r["rank"] != 0]
    assert all(r["in_collective"] and r["step"] == fault["step"] for r in others), others
    if detection == "on":
        assert errors["rule"] == "hang: the rank behind"
        assert all(r["hang"] is not None for r in others)  # their own reports; rank 0 made none


@pytest.mark.once
@pytest.mark.parametrize(
    ("fault", "phase", "torchrun"),
    [("hang_in_checkpoint", "checkpoint_save_sync", True), ("hang_init", SpanName.MODEL_INIT, False)],
    ids=["save-torchrun", "init-launcher"],
)
def test_a_rank_hung_past_its_peers_is_hang_time(tmp_path: Path, fault: str, phase: str, torchrun: bool) -> None:
    """Rank 0 hangs in its save after step 9, or in model initialisation, with no hang report of its own (a
    long phase's limit is 30 minutes); the others' collective times out and they are aborted, and rank 0, which
    lets its SIGTERM pass, lives on until the launcher kills it 30 s later. That time is the hang's, by the
    marks: `summary` read it as 23% of the job in checkpoint saves (and its initialisation alone as a third of
    the job), the hang nowhere (`fault_sweep --seed 290 --abort --torchrun`, `--seed 291 --abort`). The hang
    detection's report of the others, in the second, came as their failed initialisation ended, counted from
    the progress before it: their whole initialisation was read as a hang."""
    run = launch(
        tmp_path,
        2,
        *("--fault", fault, "--fault-rank", "0", "--fault-step", "10", "--hang-timeout", "1.5"),
        "--abort-after-failure",
        torchrun=torchrun,
    )
    assert hung_marks(run).keys() == {0}, run.output[-3000:]  # the premise: rank 0 lived on after its last mark
    errors = run.cli("errors")
    culprit = errors["culprit"]
    step = 10 if fault == "hang_in_checkpoint" else None
    assert (culprit["rank"], culprit["step"], culprit["phase"]) == (0, step, phase), errors["verdict"]
    assert culprit["cause"].startswith("hang"), culprit["cause"]
    records = [json.loads(line) for line in (run.folder / "rank0.jsonl").read_text().splitlines() if line.strip()]
    assert not [r for r in records if r["kind"] == "error" and r.get("name") == "hang_suspected"]  # none its own
    summary = check_goodput(run)
    # From its peers' first failure to the job's last mark (the kill came after it) rank 0 was hung: at least that.
    marks = run.marks()
    failed = min(m["ts"] for r, ms in marks.items() if r != 0 for m in ms if m["event"] == "raised")
    last = max(m["ts"] for ms in marks.values() for m in ms)
    assert summary["breakdown_s"]["hang"] * len(marks) >= (last - failed) / 1e9 - 0.2, summary["breakdown_s"]


@pytest.mark.parametrize(
    ("linger", "detection"),
    [("0", "on"), pytest.param("1.0", "on", marks=pytest.mark.once), pytest.param("0", "off", marks=pytest.mark.once)],
)
# Its core's part is tested in both passes by a hang report: test_a_rank_hung_in_compute.
@pytest.mark.once
def test_a_rank_hung_in_a_collective(tmp_path: Path, linger: str, detection: str) -> None:
    """Rank 0 waits in an all-reduce its partner never joins; the others wait for rank 0 one step later.

    When the collective fails at last, the ranks may take a while to exit (``linger``: a second
    between the exception and the exit): the failed step is not progress, the hang stays the cause.
    With hang detection off, the ranks' timeouts and steps name rank 0 all the same."""
    hang_timeout = "1.5" if detection == "on" else "0"
    run = launch(
        tmp_path,
        2,
        *("--fault", "hang_collective", "--fault-rank", "0", "--fault-step", "6"),
        *("--linger", linger, "--hang-timeout", hang_timeout),
    )
    errors = check_culprit(run, 0, 6, "iteration", "hang")
    assert errors["culprit"]["in_collective"]
    assert "inside a collective" in errors["verdict"]
    if detection == "off":
        assert errors["rule"] == "hang: the rank the collectives timed out on"
        assert "never joined" in errors["culprit"]["cause"], errors["culprit"]["cause"]
    check_goodput(run)


def test_a_healthy_run(tmp_path: Path) -> None:
    """No fault: healthy, every step completed, goodput as the worker measured it."""
    run = launch(tmp_path, 2)
    assert run.returncode == 0, run.output[-3000:]
    errors = run.cli("errors")
    assert errors["status"] == "healthy" and errors["verdict"].startswith("healthy")
    assert errors["culprit"] is None
    summary = check_goodput(run, failed=False)
    assert summary["steps_completed"] == 24 and summary["steps_lost"] == 0


@pytest.mark.once  # the records' reading, not the core that wrote them
@pytest.mark.parametrize("validate", [False, True])
def test_the_others_wait_for_rank_0s_checkpoint_save(tmp_path: Path, validate: bool) -> None:
    """Rank 0 alone saves the replicated model, 80 MB every 3 steps (the save takes about 100 ms); the other ranks
    go on to the next step and wait for it in that step's all-reduce, so every rank loses the save's time, not
    only rank 0. `summary` counted the others' wait as productive step time: checkpoint save 0.14 s a rank and
    goodput 17% on a real 12-step job whose workers' timestamps give 0.34 s and 11%. With validation passes
    (every rank validates) beside the saves too. Checked against the marks (``check_goodput``), and that each
    rank's share of the save time is most of rank 0's saves that a step followed."""
    validation = ("--validate-every", "4") if validate else ()
    run = launch(
        tmp_path, 2, "--checkpoint-every", "3", "--checkpoint-pad-kb", "80000", "--step-ms", "20", "--steps", "12",
        *validation,
    )  # fmt: skip
    assert run.returncode == 0, run.output[-3000:]
    summary = check_goodput(run, failed=False)
    marks = run.marks()
    last_step = max(m["ts"] for m in marks[0] if m["event"] == "step_start")
    saves = [(a, end) for category, a, end in marked_intervals(marks[0]) if category == "checkpoint_save"]
    followed = sum(end - a["ts"] for a, end in saves if end < last_step) / 1e9
    assert len(saves) == 4 and followed > 0.15, saves  # the premise: saves that a step waited for
    # Every rank waited for the saves a step followed; rank 0 also for its last one, after the last step.
    assert summary["breakdown_s"]["checkpoint_save"] >= 0.8 * followed, (summary["breakdown_s"], followed)


@pytest.mark.once  # the records' reading, not the core that wrote them
def test_the_others_wait_for_rank_0s_save_and_then_for_its_stall(tmp_path: Path) -> None:
    """Rank 0 saves 20 MB every 3 steps and stalls 100 ms in forward every 4th step from step 3: after some saves it
    stalls in the next step too, and the others wait in that step's all-reduce for the save and then for the
    stall. Their wait for the save is checkpoint time (the step's overlap with the save), though the step ended
    long after the save did: a real 4-rank job read goodput 39.0% against its workers' 37.0% (the step ended more
    than two usual steps after the save, so no wait was counted)."""
    run = launch(
        tmp_path, 2, "--fault", "slow_compute", "--fault-rank", "0", "--fault-step", "3", "--checkpoint-every", "3",
        "--step-ms", "30", "--validate-every", "2", "--checkpoint-pad-kb", "20000", "--steps", "30",
        "--slow-every", "4", "--slow-ms", "100",
    )  # fmt: skip
    assert run.returncode == 0, run.output[-3000:]
    marks = run.marks()[0]
    saved_after = {m["step"] for m in marks if m["event"] == "checkpoint_start"}
    stalled = {m["step"] for m in marks if m["event"] == "slow"}
    assert {s + 1 for s in saved_after} & stalled or saved_after & stalled, (saved_after, stalled)  # the premise
    check_goodput(run, failed=False)


@pytest.mark.once  # the reading of a live job; in the pure pass, its flushes: test_a_rank_killed_in_its_first_steps_...
def test_a_running_job_is_running(tmp_path: Path) -> None:
    """While the job runs, its ranks are running, not failed; nothing is lost."""
    seen: dict[str, Any] = {}

    def look(process: subprocess.Popen[str], truth: Path) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            marks = list(truth.glob("rank*.jsonl"))
            if len(marks) == 2 and all('"step": 10' in p.read_text() for p in marks):
                break
            time.sleep(0.1)
        run = Run(tmp_path / "logs" / "job", truth, 0, "")
        seen["errors"] = run.cli("errors")
        seen["summary"] = run.cli("summary")
        os.killpg(process.pid, signal.SIGTERM)

    launch(tmp_path, 2, "--steps", "100000", during=look)
    assert seen["errors"]["status"] == "running", seen["errors"]["verdict"]
    assert seen["errors"]["verdict"].startswith("running")
    assert seen["summary"]["failed_streams"] == 0 and seen["summary"]["steps_lost"] == 0


@pytest.mark.once
@pytest.mark.parametrize(
    ("nproc", "fault", "rank", "part", "model"),
    [
        (3, "slow_compute", 2, "compute", ()),
        (3, "slow_data", 1, "data_loading", ()),
        (2, "slow_compute", 1, "compute", ()),
        (3, "slow_compute", 2, "compute", ("--batch-norm",)),
        (3, "slow_data", 1, "data_loading", ("--batch-norm", "--no-record-collectives")),
        (3, "slow_data", 0, "data_loading", ("--batch-norm", "--no-record-collectives")),
    ],
    ids=["compute-3", "data-3", "compute-2", "compute-3-buffers", "data-3-buffers-unrecorded", "root-late-unrecorded"],
)
def test_a_straggler_in_data_parallel_training(  # noqa: PLR0917 - pytest passes the parameters by position
    tmp_path: Path, nproc: int, fault: str, rank: int, part: str, model: tuple[str, ...]
) -> None:
    """One rank slower in forward (or data loading) from step 8 on: the all-reduce makes every rank's step as
    long, yet ``ranks`` names it, the part it is slow in, and the step it became slow at; with 2 ranks too. With
    a BatchNorm layer (buffers), DDP broadcasts them from rank 0 before each forward, where rank 0 then waits for
    the late rank: not named, whether record_collectives timed that broadcast or, for a late batch, nothing
    recorded any collective (both read ``[2, 0]`` and ``[1, 0]`` before). Rank 0 itself late, unrecorded: the two
    others wait for it in forward (``[0, 2, 1]`` while the others' median, counting the other waiting rank, halved
    their excess)."""
    # 80 ms slower: a step is slow when it is at least halfway from the level before the onset to the level after
    # it, and on a machine busy with other jobs two steps in a row delayed by 20 ms (half of 40) once moved the
    # onset two steps early, with 2 ranks (one rank's steps the reference).
    faulty = ("--fault", fault, "--fault-rank", str(rank), "--fault-step", "8", "--slow-ms", "80")
    run = launch(tmp_path, nproc, *faulty, "--steps", "30", *model)
    assert run.returncode == 0, run.output[-3000:]
    marks = run.marks()
    durations = {
        r: [
            b["ts"] - a["ts"]
            for a, b in zip(
                [m for m in ms if m["event"] == "step_start"], [m for m in ms if m["event"] == "step_end"], strict=True
            )
        ]
        for r, ms in marks.items()
    }
    late = {r: sorted(d[10:])[len(d[10:]) // 2] for r, d in durations.items()}
    if part == "compute":  # the premise: collectives equalise the step times the worker measured itself
        assert max(late.values()) < 1.3 * min(late.values()), late
    result = run.cli("ranks")
    assert result["stragglers"] == [rank], result["ranks"]
    slow = next(r for r in result["ranks"] if r["rank"] == rank)
    assert slow["slow_in"] == part
    assert slow["slow_since_step"] == 8
    start = next(m["ts"] for m in marks[rank] if m["event"] == "step_start" and m["step"] == 8)
    assert abs(slow["slow_since_ns"] - start) < 0.2e9  # the step's start, as the worker saw it
    errors = run.cli("errors")
    assert errors["status"] == "healthy"


@pytest.mark.once
@pytest.mark.parametrize(
    ("fault", "rank", "shape", "slow_ms"),
    [
        ("slow_compute", 1, ("--slow-every", "5"), "150"),
        ("slow_data", 2, ("--slow-every", "4"), "120"),
    ],
    ids=["compute-every-5th-step", "data-every-4th-step"],
)
def test_a_rank_slow_at_some_steps_only(
    tmp_path: Path, fault: str, rank: int, shape: tuple[str, str], slow_ms: str
) -> None:
    """One rank stalls at every few steps only (its own logging, a neighbour's cron job): its medians are the
    others', yet every step it stalled the whole job waited for it. ``ranks`` names it, the part, and its slow steps
    as the worker's own marks give them. (Slow for a few steps only, then recovered: the synthetic
    test_ranks_names_a_rank_slow_at_some_steps_only, and tests/fault_sweep.py's --slow-for draws.)"""
    faulty = ("--fault", fault, "--fault-rank", str(rank), "--fault-step", "4", "--slow-ms", slow_ms, *shape)
    run = launch(tmp_path, 3, *faulty, "--steps", "30")
    assert run.returncode == 0, run.output[-3000:]
    marks = run.marks()
    slow_steps = [m["step"] for m in marks[rank] if m["event"] == "slow"]
    result = run.cli("ranks")
    assert result["stragglers"] == [rank], result["ranks"]
    slow = next(r for r in result["ranks"] if r["rank"] == rank)
    assert slow["slow_in"] == ("compute" if fault == "slow_compute" else "data_loading")
    # The premise: the stalls leave the rank's medians as the others' (no straggler by the medians alone).
    assert "slow_until_step" in slow, slow
    assert (slow["slow_since_step"], slow["slow_until_step"], slow["slow_steps"]) == (
        slow_steps[0],
        slow_steps[-1],
        len(slow_steps),
    ), slow
    if shape[0] == "--slow-every":
        assert slow["slow_every"] == int(shape[1])
    # What the stalls held the job up: each slept slow_ms beyond the others' step.
    assert abs(slow["lost_s"] - len(slow_steps) * float(slow_ms) / 1e3) < 0.3 * len(slow_steps) * float(slow_ms) / 1e3
    assert run.cli("errors")["status"] == "healthy"


@pytest.mark.once
def test_a_slow_node(tmp_path: Path) -> None:
    """A 2-node job (node-a, node-b, 2 ranks each) whose node-b ranks are both slower in forward from step 8 on (a
    throttled or shared host): ``ranks`` names both, and their node, from the step the worker's own marks say."""
    fault = ("--fault", "slow_compute", "--fault-host", "node-b", "--fault-step", "8")
    with two_nodes(tmp_path, "--steps", "30", *fault) as (first, second):
        assert first.wait(timeout=180) == 0 and second.wait(timeout=60) == 0
    run = Run(tmp_path / "logs" / "job", tmp_path / "truth", 0, "")
    marks = run.marks()
    on_b = sorted(r for r, ms in marks.items() if ms[0]["host"] == "node-b")
    result = run.cli("ranks")
    assert sorted(result["stragglers"]) == on_b and len(on_b) == 2, result["ranks"]
    assert result["straggler_node"] == {"host": "node-b", "every_rank": True}
    for rank in on_b:
        slow = next(r for r in result["ranks"] if r["rank"] == rank)
        assert (slow["slow_in"], slow["slow_since_step"]) == ("compute", 8), slow
        start = next(m["ts"] for m in marks[rank] if m["event"] == "step_start" and m["step"] == 8)
        assert abs(slow["slow_since_ns"] - start) < 0.2e9
    text = subprocess.run(
        [sys.executable, "-m", "traintrace.cli", "ranks", str(run.folder)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
        check=True,
    ).stdout
    assert f"stragglers: ranks {', '.join(map(str, result['stragglers']))} (every rank of node node-b)" in text, text
    assert run.cli("errors")["status"] == "healthy"


# Its core's part is tested in both passes by a hang report: test_a_rank_hung_in_compute; a running job:
# test_a_running_job_is_running.
@pytest.mark.once
def test_a_hang_seen_while_the_job_still_hangs(tmp_path: Path) -> None:
    """Looked at while it hangs (no timeout has fired yet): running, without progress, rank 1 behind."""
    seen: dict[str, Any] = {}

    def look(process: subprocess.Popen[str], truth: Path) -> None:
        folder = tmp_path / "logs" / "job"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            streams = list(folder.glob("rank*.jsonl"))
            if len(streams) == 2 and all("hang_suspected" in p.read_text() for p in streams):
                break
            time.sleep(0.2)
        seen["errors"] = Run(folder, truth, 0, "").cli("errors")
        os.killpg(process.pid, signal.SIGTERM)  # the launcher stops its workers (their own process groups)

    launch(
        tmp_path,
        2,
        "--fault",
        "hang_compute",
        "--fault-rank",
        "1",
        "--fault-step",
        "6",
        "--gloo-timeout",
        "120",
        during=look,
    )
    errors = seen["errors"]
    assert errors["status"] == "running", errors["verdict"]
    assert errors["verdict"].startswith("running, without progress: rank 1 hung in forward at step 6")
    culprit = errors["culprit"]
    assert (culprit["rank"], culprit["step"], culprit["phase"], culprit["in_collective"]) == (
        1,
        6,
        "model_forward",
        False,
    )


@pytest.mark.once  # in the pure pass, a running pure core: test_a_hang_seen_while_the_job_still_hangs
def test_a_running_job_waiting_on_a_rank_without_hang_detection(tmp_path: Path) -> None:
    """Looked at 3 s into rank 1's hang, hang detection off and no timeout yet: still running, waiting on rank 1,
    from the progress files' phases and the writers' stamps; how long, by the worker's marks and the test's clock."""
    seen: dict[str, Any] = {}

    def look(process: subprocess.Popen[str], truth: Path) -> None:
        wait_for_mark(process, truth, 1, "fault")
        time.sleep(3.0)
        seen["looked"] = time.time()
        seen["errors"] = Run(tmp_path / "logs" / "job", truth, 0, "").cli("errors")
        seen["answered"] = time.time()
        os.killpg(process.pid, signal.SIGTERM)  # the launcher stops its workers (their own process groups)

    run = launch(
        tmp_path,
        2,
        *("--fault", "hang_compute", "--fault-rank", "1", "--fault-step", "6"),
        *("--hang-timeout", "0", "--gloo-timeout", "120"),
        during=look,
    )
    errors = seen["errors"]
    assert errors["status"] == "running" and errors["rule"] == "waiting on a rank", errors["verdict"]
    assert errors["verdict"].startswith(
        "running, waiting on rank 1: in forward at step 6, not in a collective, for "
    ), errors["verdict"]
    assert errors["verdict"].endswith(" s; rank 0 was waiting in a collective in backward at step 6"), errors["verdict"]
    fault = fault_step_of(run, 1)
    began = next(m["ts"] for m in run.marks()[1] if m["event"] == "step_start" and m["step"] == fault["step"])
    # The command reads the files between the two readings of the test's clock.
    low, high = seen["looked"] - fault["ts"] / 1e9 - 0.5, seen["answered"] - began / 1e9
    assert low <= errors["culprit"]["stuck_ns"] / 1e9 <= high, (errors["culprit"]["stuck_ns"], low, high)


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of a process (``T`` stopped, ``Z`` a zombie), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def pid_of(truth: Path, rank: int) -> int:
    marks = [json.loads(x) for x in (truth / f"rank{rank}.jsonl").read_text().splitlines() if x.strip()]
    return int(next(m["pid"] for m in marks if m["event"] == "process_start"))


@pytest.mark.once  # the pure core up to a stop: the pure pass's SIGKILL and hang tests (49 s of its 370 here)
# Native code holding the GIL (gil_stuck) ends the same way: test_a_running_job_with_a_rank_that_stopped_responding
# tells the two apart while the job runs, and tests/fault_sweep.py draws it (46 s of the suite's time here).
@pytest.mark.parametrize("fault", ["freeze"])
def test_a_rank_that_stops_responding(tmp_path: Path, fault: str) -> None:
    """Rank 1's process stops in forward at step 7: SIGSTOP (a suspended job, a debugger), or C code that never
    returns and keeps the GIL (a deadlocked extension); traintrace's writer thread stops with it. The others
    report a hang, time out in their all-reduce and exit; torchrun's SIGTERM to rank 1 goes unanswered and its
    SIGKILL ends it 30 s later. Not "killed by SIGKILL" (an OOM kill): it stopped responding, for as long as the
    test saw it before it was gone (the kernel's state of the process: stopped, or its CPU time not growing)."""
    seen: dict[str, float] = {}

    def watch(process: subprocess.Popen[str], truth: Path) -> None:
        wait_for_mark(process, truth, 1, "fault")
        pid = pid_of(truth, 1)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            state = process_state(pid)
            if state == "T" or (state == "S" and fault == "gil_stuck"):
                seen.setdefault("stopped", time.time())
            if state in (None, "Z"):
                seen["gone"] = time.time()
                return
            time.sleep(0.05)

    began = time.time()
    run = launch(tmp_path, 2, "--fault", fault, "--fault-rank", "1", "--fault-step", "7", during=watch)
    assert "stopped" in seen and "gone" in seen, seen  # the premise: the kernel had it stopped, then it ended
    fault = fault_step_of(run, 1)
    errors = check_culprit(run, 1, 7, "model_forward", "stopped responding")
    culprit = errors["culprit"]
    assert errors["rule"] == "stopped responding", errors["verdict"]
    assert (culprit["state"], culprit["signal"]) == ("killed", "SIGKILL"), culprit
    assert "rank 1 stopped responding in forward at step 7: its process" in errors["verdict"]
    assert "rank 0 was waiting in a collective in backward at step 7" in errors["verdict"]
    # From the fault to when the test saw the process gone (about 36 s); the launcher's time is in whole seconds,
    # and on a loaded machine the test's polling and the launcher's reaping may each lag a little.
    truth = seen["gone"] - fault["ts"] / 1e9
    assert truth - 3 <= culprit["unresponsive_ns"] / 1e9 <= truth + 2, (culprit["unresponsive_ns"], truth)
    check_goodput(run)
    # Where the time went, the launcher's stream read too: rank 1's process was there, stopped, until it was gone
    # (hang), not "no process" (restart_idle read 34.9 s a rank before, against at most 23.7 by the truth). No
    # process: after the others exited (their marks) until the job ended as the frozen one was gone, and before each
    # rank's process started: at most since the test launched the job (`began`; the launcher's own start is later
    # on a loaded machine, by seconds).
    summary = run.cli("summary")
    marks = run.marks()
    started = {r: next(m["ts"] for m in ms if m["event"] == "process_start") / 1e9 for r, ms in marks.items()}
    exited = {r: next(m["ts"] for m in ms if m["event"] == "exit") / 1e9 for r, ms in marks.items() if r != 1}
    after = [seen["gone"] - exited[r] if r in exited else 0.0 for r in marks]
    before = [started[r] - began for r in marks]
    breakdown = summary["breakdown_s"]
    idle = breakdown["restart_idle"]
    assert sum(after) / len(marks) - 2 <= idle <= (sum(after) + sum(before)) / len(marks) + 2, (
        breakdown,
        after,
        before,
    )
    assert breakdown["hang"] >= (truth - 2) / len(marks), (breakdown, truth)


@pytest.mark.once  # in the pure pass, the writer's stamps of a frozen process: test_a_rank_that_stops_responding
@pytest.mark.parametrize(("fault", "detection"), [("freeze", "on"), ("freeze", "off"), ("gil_stuck", "on")])
def test_a_running_job_with_a_rank_that_stopped_responding(tmp_path: Path, fault: str, detection: str) -> None:
    """Read 14 s after rank 1's process stopped in forward at step 7 (SIGSTOP, or C code keeping the GIL), the
    collectives' timeout not reached: running, rank 1 stopped responding (the others' writers stamp their
    progress files, its does not), for as long as the test's clock says, hang detection on (the others report
    hangs) or off; the verdict says what the kernel says of the process (stopped, or alive in native code) and
    what to do, as the test's own reading of /proc says."""
    seen: dict[str, Any] = {}

    def look(process: subprocess.Popen[str], truth: Path) -> None:
        wait_for_mark(process, truth, 1, "fault")
        seen["pid"] = pid = pid_of(truth, 1)
        time.sleep(14.0)
        seen["state"] = process_state(pid)
        seen["looked"] = time.time()
        seen["errors"] = Run(tmp_path / "logs" / "job", truth, 0, "").cli("errors")
        seen["answered"] = time.time()
        watch = [sys.executable, "-m", "traintrace.cli", "watch", str(tmp_path / "logs" / "job"), "--once"]
        seen["watch"] = subprocess.run(watch, check=False, capture_output=True, text=True, timeout=60, env=ENV).stdout
        os.kill(pid, signal.SIGKILL)  # a stopped process would keep the launcher 30 s in its SIGTERM's grace
        os.killpg(process.pid, signal.SIGTERM)

    hang_timeout = "1.5" if detection == "on" else "0"
    run = launch(
        tmp_path,
        2,
        *("--fault", fault, "--fault-rank", "1", "--fault-step", "7"),
        *("--hang-timeout", hang_timeout, "--gloo-timeout", "120"),
        during=look,
    )
    # The premise: the kernel had it stopped, or asleep holding the GIL, when the command read the job.
    assert seen["state"] == ("T" if fault == "freeze" else "S"), seen
    errors = seen["errors"]
    assert errors["status"] == "running" and errors["rule"] == "stopped responding", errors["verdict"]
    culprit = errors["culprit"]
    assert (culprit["rank"], culprit["step"], culprit["phase"], culprit["in_collective"]) == (
        1,
        7,
        "model_forward",
        False,
    ), errors["verdict"]
    assert errors["verdict"].startswith(
        "running, without progress: rank 1 stopped responding in forward at step 7: its process"
    ), errors["verdict"]
    assert errors["verdict"].endswith("rank 0 was waiting in a collective in backward at step 7")
    pid = seen["pid"]
    assert (culprit["pid"], culprit["process_state"]) == (pid, seen["state"]), culprit
    if fault == "freeze":
        assert f"(process {pid} is stopped, state T: a SIGSTOP" in errors["verdict"], errors["verdict"]
        assert f"; kill -CONT {pid} resumes it)" in errors["verdict"], errors["verdict"]
    else:
        assert f"(process {pid} is alive, state S, but runs no Python" in errors["verdict"], errors["verdict"]
    fault_record = fault_step_of(run, 1)
    # The others' latest stamp is up to a flush interval old when read (more on a loaded machine).
    low, high = seen["looked"] - fault_record["ts"] / 1e9 - 3.0, seen["answered"] - fault_record["ts"] / 1e9 + 0.5
    assert low <= culprit["unresponsive_ns"] / 1e9 <= high, (culprit["unresponsive_ns"], low, high)
    # `watch` says the same of rank 1, and of no other.
    rows = [line for line in seen["watch"].splitlines() if " rank=" in line]
    lines = {int(line.split(" rank=")[1].split()[0]): line for line in rows}
    assert 'note="NOT RESPONDING: no sign of life for ' in lines[1], seen["watch"]
    said = f"; stopped, state T: kill -CONT {pid} resumes it)" if fault == "freeze" else "; alive, state S, running no"
    assert said in lines[1], seen["watch"]
    assert "NOT RESPONDING" not in lines[0], seen["watch"]


def steps_done_before(run: Run, rank: int, ts: int) -> int:
    """How many steps the rank had completed before ``ts`` in the fault's attempt, from its own marks."""
    return len([m for m in run.marks()[rank] if m["event"] == "step_end" and m["ts"] < ts])


@pytest.mark.once  # in the pure pass, the pure core's error records: test_an_exception_on_one_rank
def test_an_exception_in_validation(tmp_path: Path) -> None:
    """A validation pass every 4 steps; rank 1 raises in the one after step 7: validation, step 8 (the step
    being prepared, as for a checkpoint save), while the others wait in the pass's all-reduce."""
    run = launch(
        tmp_path, 2, "--fault", "validation", "--fault-rank", "1", "--fault-step", "8", "--validate-every", "4"
    )
    fault = fault_step_of(run, 1)
    assert fault["step"] == steps_done_before(run, 1, fault["ts"])  # the premise: after the last completed step
    errors = check_culprit(run, 1, fault["step"], SpanName.VALIDATION, "ValueError: injected failure in validation")
    assert "raised ValueError in validation at step 8" in errors["verdict"]
    others = [r for r in errors["rank_states"] if r["rank"] != 1]
    assert all(r["phase"] == SpanName.VALIDATION and r["in_collective"] for r in others), others
    check_goodput(run)


@pytest.mark.once  # in the pure pass, the pure core's error records: test_an_exception_on_one_rank
def test_an_exception_before_the_training_loop(tmp_path: Path) -> None:
    """Rank 1 raises while building the model: no step, model initialisation."""
    run = launch(tmp_path, 2, "--fault", "model_init", "--fault-rank", "1")
    fault = fault_step_of(run, 1)
    assert fault["step"] is None and not any(m["event"] == "step_start" for ms in run.marks().values() for m in ms)
    errors = check_culprit(run, 1, fault["step"], SpanName.MODEL_INIT, "RuntimeError: injected failure in model_init")
    assert errors["verdict"].startswith("rank 1 raised RuntimeError in model initialisation;")
    summary = check_goodput(run)
    assert summary["steps_completed"] == 0


@pytest.mark.once  # in the pure pass, the pure core's error records: test_an_exception_on_one_rank
@pytest.mark.parametrize("abort", [False, True], ids=["raise", "aborted"])
def test_an_exception_after_the_training_loop(tmp_path: Path, abort: bool) -> None:
    """Rank 0 raises after its last step (writing the final model fails) while the others wait at the final
    barrier: outside the training loop after step 11 (the last step every rank's marks end), not "at step 12",
    a step that never ran. With the others aborted (SIGABRT) 0.3 s after their barrier failed, writing nothing
    more: the job's wall time reaches their progress files' last stamps, and the goodput is the marks' (the wall
    ended at their last records before, the goodput several points high: `fault_sweep --seed 230 --abort`)."""
    more = ("--abort-after-failure",) if abort else ()
    run = launch(tmp_path, 2, "--fault", "after_loop", "--fault-rank", "0", "--steps", "12", *more)
    if abort:
        assert any(m["event"] == "abort" for m in run.marks()[1]), run.output[-3000:]  # the premise
    fault = fault_step_of(run, 0)
    last = max(m["step"] for m in run.marks()[0] if m["event"] == "step_end" and m["ts"] < fault["ts"])
    assert last == 11
    errors = check_culprit(run, 0, last, SpanName.APPLICATION, "OSError: injected failure saving the final model")
    assert errors["verdict"].startswith(
        "rank 0 raised OSError in the program (outside the training loop) after step 11; "
    ), errors["verdict"]
    assert errors["culprit"]["after_loop"]
    check_goodput(run)


@pytest.mark.parametrize(
    ("fault", "torchrun"),
    # os._exit runs nothing of either core, as SIGKILL (in the pure pass: test_a_rank_killed_by_a_signal)
    [
        pytest.param("exit", False, marks=pytest.mark.once),
        ("sys_exit", False),
        pytest.param("sys_exit", True, marks=pytest.mark.once),
    ],
    ids=["exit", "sys_exit", "sys_exit-torchrun"],
)
def test_a_rank_exiting_with_a_code(tmp_path: Path, fault: str, torchrun: bool) -> None:
    """Rank 1 calls os._exit(3) (its last records lost) or sys.exit(3) (its spans end terminated, its stream
    closes) in backward, no exception, no signal: named with its exit code, not a survivor that saw the
    connection close. Under plain torchrun, which records nothing, the code is the one its own stream says
    sys.exit() left its spans with (it read as a hang before: stopped making progress, not in a collective)."""
    run = launch(tmp_path, 2, "--fault", fault, "--fault-rank", "1", "--fault-step", "7", torchrun=torchrun)
    fault = fault_step_of(run, 1)
    errors = check_culprit(run, 1, fault["step"], SpanName.BACKWARD, f"exit code {fault['exit_code']}")
    assert errors["culprit"]["state"] == "exited" and errors["culprit"]["exit_code"] == fault["exit_code"]
    assert errors["verdict"].startswith(f"rank 1 exited with exit code {fault['exit_code']} ")
    check_goodput(run)


@pytest.mark.once
@pytest.mark.parametrize("resume", [True, False], ids=["from-checkpoint", "from-scratch"])
def test_a_restart_after_a_failure(tmp_path: Path, resume: bool) -> None:
    """In the first attempt, rank 1's DataLoader worker process is killed by SIGKILL while fetching batch 7
    (the rank raises about its worker, in data loading); torchrun restarts the job, which loads the
    checkpoint after step 4 (or, without ``--resume``, starts again from step 0) and finishes: the status is
    ``recovered``, the verdict is about the failed attempt and says the restart finished; every step counts
    once, and the failed attempt's steps that the restart ran again are lost."""
    run = launch(
        tmp_path,
        2,
        "--fault",
        "loader_kill",
        "--fault-rank",
        "1",
        "--fault-step",
        "7",
        "--fault-attempt",
        "0",
        *(["--resume"] if resume else []),
        max_restarts=1,
    )
    assert run.returncode == 0, run.output[-3000:]
    marks = run.marks()
    fault = fault_step_of(run, 1)
    assert any(m["event"] == "loader_worker_killed" and m["restart"] == fault["restart"] for m in marks[1])
    last = max(m["restart"] for ms in marks.values() for m in ms)
    assert last == fault["restart"] + 1
    first_redone = min(m["step"] for m in marks[1] if m["event"] == "step_start" and m["restart"] == last)
    assert first_redone == (5 if resume else 0)  # the checkpoint after step 4 holds steps 0-4
    errors = run.cli("errors")
    culprit = errors["culprit"]
    assert (culprit["rank"], culprit["restart"], culprit["step"], culprit["phase"]) == (
        1,
        fault["restart"],
        fault["step"],
        SpanName.DATA_LOADING,
    ), errors["verdict"]
    assert "RuntimeError: DataLoader worker" in culprit["cause"]
    assert all(r["restart"] == fault["restart"] for r in errors["rank_states"]), errors["rank_states"]
    assert (errors["restart"], errors["failed_restarts"]) == (fault["restart"], [fault["restart"]])
    assert errors["status"] == "recovered"
    head = f"restart {fault['restart']} failed: rank 1 raised RuntimeError in data loading at step {fault['step']};"
    assert errors["verdict"].startswith(head), errors["verdict"]
    assert errors["verdict"].endswith(f"; restart {last} finished"), errors["verdict"]
    summary = check_goodput(run, failed=False)  # the job finished: only the failed attempt lost steps
    assert summary["status"] == "recovered"
    # Each of the job's 24 steps once, however many times it ran.
    assert summary["steps_completed"] == len(
        {m["step"] for ms in marks.values() for m in ms if m["event"] == "step_end"}
    )
    assert summary["steps_completed"] == 24


@pytest.mark.once
def test_a_restart_that_fails_the_same_way(tmp_path: Path) -> None:
    """Rank 1 raises in backward at step 7 in every attempt; torchrun restarts twice from the checkpoint after
    step 4, and gives up: the verdict is about the last attempt and says the earlier two failed the same way;
    each attempt lost the steps it ran after the checkpoint."""
    run = launch(
        tmp_path, 2, "--fault", "backward", "--fault-rank", "1", "--fault-step", "7", "--resume", max_restarts=2
    )
    assert run.returncode != 0
    faults = [m for m in run.marks()[1] if m["event"] == "fault"]
    assert [(m["restart"], m["step"]) for m in faults] == [(0, 7), (1, 7), (2, 7)]
    errors = check_culprit(run, 1, 7, SpanName.BACKWARD, "RuntimeError")
    assert (errors["restart"], errors["failed_restarts"], errors["same_failure_restarts"]) == (2, [0, 1, 2], [0, 1])
    assert errors["verdict"].endswith("; restarts 0 and 1 failed the same way"), errors["verdict"]
    check_goodput(run)


@pytest.mark.once  # in the pure pass, the pure core's checkpoint records: test_a_rank_dying_during_a_checkpoint_save
def test_a_restart_that_loads_a_checkpoint_cut_short(tmp_path: Path) -> None:
    """Rank 0 saves straight to the checkpoint's final name (no temporary file) and is killed half-way through
    the save after step 14; torchrun restarts twice, each restart loads the newest file, cut short, and every rank
    fails there. The verdict links the failed loads to the save that never completed, says the restarts fail the
    same way, and places restart 0's rank 0 in that save (its progress file, rewritten by the restarts, is read
    from the launcher's copy). The truth: the worker's fault mark (the file, its step), its load marks and the
    saves it completed."""
    run = launch(
        tmp_path,
        2,
        *("--fault", "torn_checkpoint", "--fault-rank", "0", "--fault-step", "15", "--fault-attempt", "0"),
        "--resume",
        max_restarts=2,
    )
    assert run.returncode != 0
    marks = run.marks()
    fault = fault_step_of(run, 0)
    loads = {
        (m["restart"], r, m["step"]) for r, ms in marks.items() for m in ms if m["event"] == "checkpoint_load_start"
    }
    assert loads == {(a, r, fault["step"]) for a in (1, 2) for r in range(2)}, loads
    assert not any(m["event"] == "checkpoint_load_end" for ms in marks.values() for m in ms)
    assert fault["step"] not in {m["step"] for m in marks[0] if m["event"] == "checkpoint_end"}
    errors = run.cli("errors")
    assert (errors["status"], errors["restart"], errors["failed_restarts"]) == ("failed", 2, [0, 1, 2])
    assert errors["culprit"]["phase"] == "checkpoint_load" and errors["culprit"]["state"] == "error"
    unfinished = errors["unfinished_checkpoint"]
    assert {k: unfinished[k] for k in ("path", "step", "restart", "rank")} == {
        "path": fault["path"],
        "step": fault["step"],
        "restart": 0,
        "rank": 0,
    }
    verdict = errors["verdict"]
    assert (
        f"; the checkpoint loaded (step{fault['step']}.pt) never completed: restart 0's rank 0 was saving it at "
        f"step {fault['step']} when it was killed by SIGKILL" in verdict
    ), verdict
    assert errors["same_failure_restarts"] == [1] and "; restart 1 failed the same way" in verdict, verdict
    assert verdict.endswith(
        f"; restart 0 had failed first: rank 0 was killed by SIGKILL (exit code -9) in a checkpoint save at step "
        f"{fault['step']}"
    ), verdict


@pytest.mark.once
def test_a_rank_killed_in_an_attempt_plain_torchrun_restarted(tmp_path: Path) -> None:
    """Plain torchrun (no launcher stream) restarts a 2-rank job after rank 1 is SIGKILLed in forward at step 7 of
    the first attempt; the restart finishes. Rank 1's stream lost its last flush interval (three steps), and the
    restarted process made its progress file anew: the first attempt's, kept under its attempt's name, alone says
    where it died. `errors` names rank 1, restart 0, step 7 and forward, as the worker's marks say, and that the job
    recovered (it read the step and phase of the stream's last records before)."""
    run = launch(
        tmp_path,
        2,
        *("--fault", "sigkill", "--fault-rank", "1", "--fault-step", "7", "--fault-attempt", "0"),
        max_restarts=1,
        torchrun=True,
    )
    fault = fault_step_of(run, 1)
    assert (fault["restart"], fault["step"]) == (0, 7)
    assert (run.folder / "rank1.restart0.progress").exists()
    errors = run.cli("errors")
    culprit = errors["culprit"]
    assert culprit is not None, errors["verdict"]
    found = (culprit["rank"], culprit["restart"], culprit["step"], culprit["phase"])
    assert found == (1, 0, 7, SpanName.FORWARD), errors["verdict"]
    assert "ended without a close record" in culprit["cause"], culprit["cause"]
    assert errors["status"] == "recovered" and errors["verdict"].endswith("finished"), errors["verdict"]
    check_goodput(run, failed=False)


@pytest.mark.once  # the subject is reading each attempt's part of the fault files, not what either core writes
def test_ranks_a_watchdog_aborted_before_a_restart_are_not_the_cause(tmp_path: Path) -> None:
    """Under plain torchrun, rank 1 hangs in forward at step 6 of the first attempt; rank 0 waits in backward's
    all-reduce until a watchdog aborts it (SIGABRT) after 3 s; torchrun stops rank 1 and restarts the job, which
    finishes. The restart's processes append to the same stream files, and so to the same fault files: `errors`
    reads each attempt's own part of them (a process's marker line), and names rank 1, hung in forward at step 6 of
    restart 0, and that the job recovered. Before, the stacks beside an attempt's stream were read for a file's
    last stream only: an aborted rank's stream just ended, and it was named, `died first` (rank 2 of 3)."""
    run = launch(
        tmp_path,
        2,
        *("--fault", "hang_compute", "--fault-rank", "1", "--fault-step", "6", "--fault-attempt", "0"),
        *("--hang-timeout", "0", "--gloo-timeout", "30", "--watchdog-abort", "3"),
        max_restarts=1,
        torchrun=True,
    )
    aborted = {r for r, ms in run.marks().items() if any(m["event"] == "abort" and m["restart"] == 0 for m in ms)}
    assert aborted and 1 not in aborted, run.output[-3000:]  # the premise: the others were aborted
    fault = fault_step_of(run, 1)
    assert (fault["restart"], fault["step"]) == (0, 6)
    errors = run.cli("errors")
    culprit = errors["culprit"]
    assert culprit is not None, errors["verdict"]
    found = (culprit["rank"], culprit["restart"], culprit["step"], culprit["phase"])
    assert found == (1, 0, 6, SpanName.FORWARD), errors["verdict"]
    assert errors["verdict"].startswith("restart 0 failed: rank 1 hung in forward at step 6"), errors["verdict"]
    assert errors["status"] == "recovered" and errors["verdict"].endswith("finished"), errors["verdict"]
    for rank in aborted:  # each aborted attempt's own stacks, the ones faulthandler wrote at its abort
        state = next(s for s in errors["rank_states"] if (s["rank"], s["restart"]) == (rank, 0))
        assert state["cause"].startswith("failed as a consequence: SIGABRT: aborted after waiting"), state


@pytest.mark.once
def test_a_job_run_again_under_its_id_is_read_as_its_last_run(tmp_path: Path) -> None:
    """Plain torchrun twice into one folder (its default job id, master address and port, is the same each time):
    rank 1 is SIGKILLed in forward at step 7 of the first run; the second finishes. The second run's processes
    append to the first's files with the same restart number. `errors` and `summary` are about the last run, with
    a note: healthy, its wall time the second run's by its workers' marks. Before, the two were read as one
    attempt: `failed`, rank 1 `in forward at step 5` (the step of the stream's last records: the second run had
    replaced the progress file) and `ranks 0 and 1 were in an unknown phase at step 24`."""
    logs = {"TRAINTRACE_LOG_DIR": str(tmp_path / "logs")}
    faulty = ("--fault", "sigkill", "--fault-rank", "1", "--fault-step", "7")
    first = launch(tmp_path / "first", 2, *faulty, torchrun=True, env=logs)
    assert first.returncode != 0 and fault_step_of(first, 1)["step"] == 7
    began = time.time_ns()
    second = launch(tmp_path / "second", 2, torchrun=True, env=logs)
    assert second.returncode == 0, second.output[-3000:]
    run = Run(tmp_path / "logs" / "job", second.truth, second.returncode, second.output)
    errors = run.cli("errors")
    assert errors["status"] == "healthy" and errors["culprit"] is None, errors["verdict"]
    states = [(s["rank"], s["restart"], s["state"]) for s in errors["rank_states"]]
    assert states == [(0, 0, "closed"), (1, 0, "closed")], errors["verdict"]
    assert any("more than one run of this job" in note for note in errors["notes"]), errors["notes"]
    summary = run.cli("summary")
    marks = [m for ms in run.marks().values() for m in ms]
    assert min(m["ts"] for m in marks) >= began
    marked = (max(m["ts"] for m in marks) - min(m["ts"] for m in marks)) / 1e9
    # The records begin within configure() (after the process's first mark) and end before its last.
    assert marked - 1.0 <= summary["wall_s"] <= marked + 0.1, (summary["wall_s"], marked)
    # The timeline draws the last run's steps alone, with and without DuckDB.
    ended = sorted((r, m["step"]) for r, ms in run.marks().items() for m in ms if m["event"] == "step_end")
    for trace in exports(run):
        drawn = sorted((e["pid"], e["args"]["step"]) for e in trace if e.get("ph") == "X" and e["name"] == "iteration")
        assert drawn == ended


@pytest.mark.once
def test_a_restart_that_fails_otherwise(tmp_path: Path) -> None:
    """Rank 1 raises in backward at step 7 in the first attempt, and in forward at step 7 in the restart: the
    verdict is about the last attempt and names the first failure too (it may be the root)."""
    run = launch(
        tmp_path,
        2,
        *("--fault", "backward", "--fault-attempt", "0", "--later-fault", "forward"),
        *("--fault-rank", "1", "--fault-step", "7", "--resume"),
        max_restarts=1,
    )
    assert run.returncode != 0
    faults = [m for m in run.marks()[1] if m["event"] == "fault"]
    assert [(m["restart"], m["step"]) for m in faults] == [(0, 7), (1, 7)]
    errors = check_culprit(run, 1, 7, SpanName.FORWARD, "RuntimeError")
    assert (errors["restart"], errors["failed_restarts"], errors["same_failure_restarts"]) == (1, [0, 1], [])
    tail = "; restart 0 had failed first: rank 1 raised RuntimeError in backward at step 7"
    assert errors["verdict"].endswith(tail), errors["verdict"]
    check_goodput(run)


@pytest.mark.once  # in the pure pass, the pure core's exits: test_a_rank_exiting_with_a_code
def test_a_rank_that_leaves_early(tmp_path: Path) -> None:
    """Rank 1's data runs out before step 6 (uneven inputs): it leaves the loop, closes and exits 0; the others
    wait for it in backward's all-reduce at step 6 until gloo says the peer is gone. Rank 1 is named, not the
    first rank whose collective failed."""
    run = launch(tmp_path, 2, "--fault", "finish_early", "--fault-rank", "1", "--fault-step", "6")
    fault = fault_step_of(run, 1)
    errors = run.cli("errors")
    culprit = errors["culprit"]
    assert culprit is not None and errors["rule"] == "left early", errors["verdict"]
    assert (culprit["rank"], culprit["step"], culprit["state"], culprit["left_early"]) == (
        1,
        fault["step"],
        "closed",
        True,
    )
    assert errors["verdict"].startswith(f"rank 1 left early: it finished normally before step {fault['step']}")
    others = [r for r in errors["rank_states"] if r["rank"] != 1]
    assert all(r["in_collective"] and r["step"] == fault["step"] for r in others), others
    assert errors["status"] == "failed"
    check_goodput(run)


@pytest.mark.once  # in the pure pass, the pure core's hang report: test_a_rank_hung_in_compute[on]
def test_a_rank_stuck_before_the_loop(tmp_path: Path) -> None:
    """Rank 1 is stuck in model initialisation (a slow download, a stuck file system) before DDP's first
    broadcast; the others time out in that broadcast and torchrun stops rank 1. No step and no collective span
    say who held the others up, but rank 1 is the only rank whose collective did not fail: it is named."""
    run = launch(tmp_path, 2, "--fault", "hang_init", "--fault-rank", "1")
    assert any(m["event"] == "fault" for m in run.marks()[1])
    errors = run.cli("errors")
    culprit = errors["culprit"]
    assert culprit is not None, errors["verdict"]
    assert (culprit["rank"], culprit["step"], culprit["phase"]) == (1, None, SpanName.MODEL_INIT), errors["verdict"]
    assert errors["verdict"].startswith("rank 1 hung in model initialisation, not in a collective;")
    assert "did not fail" in culprit["cause"] and errors["rule"] == "hang: the rank the collectives timed out on"
    summary = run.cli("summary", ranks_only=True)
    assert summary["steps_completed"] == 0 and summary["goodput"] == 0
