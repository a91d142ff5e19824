"""The verdict: which rank caused a failure, at which step, in which phase, and why.

The rules are in docs/analysis.md ("errors: the culprit"); keep the two in step.
Each rank's state is read from its stream (errors, signals, the spans a failure
left open or ended), the launcher's ``worker_failure`` events (exit code,
signal) and, where present, its progress file (the exact step and phase when
the last records were lost).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from .._format import FAULTS_MARKER, FAULTS_SUFFIX  # not .._faults: it imports what the recording side needs
from .._lifecycle import EventType  # not ..events: it would import the recorder
from .._names import EventName, SpanName, SpanStatus
from ._engine import Job, own_progress

#: Messages of errors that are the consequence of another rank's failure, not a cause.
SECONDARY = re.compile(
    r"connection (?:closed|reset|refused|aborted)|closed by peer|reset by peer|broken pipe|timed? ?out|timeout"
    r"|gloo|nccl|socket|remote (?:worker|process)|peer|watchdog|ProcessGroup|unreachable|store",
    re.IGNORECASE,
)
#: A consequence that is a collective of the rank's own timing out (it waited too), not a peer gone.
TIMED_OUT = re.compile(r"timed? ?out|timeout", re.IGNORECASE)
HANG_ERRORS = (EventName.HANG_SUSPECTED, EventName.HANG_EXIT)
#: The status of a job whose ranks all finished while one recorded an error it survived (a background save's).
FINISHED_WITH_ERRORS = "finished_with_errors"
#: Errors that are the rank being terminated, not anything it raised: PyTorch's when a DataLoader worker died of
#: SIGTERM (the launcher's SIGTERM reached the rank's process group: torchrun stops the other ranks so after a
#: failure), and a communication error raised while handling SIGTERM (Lightning's handler broadcasts it to the
#: other ranks, which may be gone).
TERMINATED_WORKER = re.compile(r"DataLoader worker \(pid[^)]*\) is killed by signal: Terminated", re.IGNORECASE)
#: A loader worker gone, which, raised while the rank's SIGTERM handler ran, the same SIGTERM ended.
WORKER_EXITED = re.compile(r"DataLoader worker \(pid(?:\(s\))?[^)]*\) exited unexpectedly", re.IGNORECASE)
IN_SIGTERM_HANDLER = re.compile(r"sigterm", re.IGNORECASE)
#: An allocation that failed: PyTorch's (CUDA: ``CUDA out of memory. Tried to allocate ...``, ``OutOfMemoryError``;
#: the CPU allocator: ``DefaultCPUAllocator: can't allocate memory``), Python's ``MemoryError``, C++'s ``bad_alloc``,
#: the C library's ``ENOMEM`` (``Cannot allocate memory``), cuBLAS's and cuDNN's allocation statuses.
OUT_OF_MEMORY = re.compile(
    r"out of memory|OutOfMemoryError|\bMemoryError\b|can't allocate memory|cannot allocate memory|bad_alloc"
    r"|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED",
    re.IGNORECASE,
)
#: The host's memory this full at a killed rank's last sample: the kernel's OOM killer is the likely sender.
HOST_MEMORY_FULL = 0.9
#: A write that failed for want of space (``ENOSPC``), or of quota (``EDQUOT``).
NO_SPACE = re.compile(r"No space left on device|ENOSPC|Errno 28\b|Disk quota exceeded|EDQUOT|Errno 122\b")
#: Without an earlier checkpoint's size to compare with, a file system this empty counts as full.
FULL_SHARE = 0.01
#: An error that says a value stopped being finite (a check of the loss, autograd's anomaly detection).
NOT_FINITE_ERROR = re.compile(
    r"\b(?:nan|inf|infinity)\b|non-finite|not finite|FloatingPointError|anomal|overflow", re.IGNORECASE
)
CHECKPOINT_SAVES = (
    SpanName.CHECKPOINT_SAVE_SYNC,
    SpanName.CHECKPOINT_SAVE_ASYNC,
    SpanName.CHECKPOINT_SAVE_FINALIZATION,
)
#: Span names that say where a rank is, innermost wins; containers only when nothing finer is open.
CONTAINERS = (SpanName.APPLICATION, SpanName.TRAINING_LOOP)
COLLECTIVE = SpanName.COLLECTIVE
ITERATION = SpanName.ITERATION
#: Where a rank is no more precisely than its open spans already say.
COARSE = (*CONTAINERS, ITERATION, COLLECTIVE)
#: Where a rank in the training loop waits for its first batch, before any step has begun.
FIRST_BATCH_PHASES = (SpanName.DATA_LOADING, SpanName.TRAINING_LOOP)
#: The phases of a training step in the order it runs them: at the same step, a rank in an earlier one is behind.
STEP_ORDER = {SpanName.DATA_LOADING: 0, SpanName.FORWARD: 1, SpanName.BACKWARD: 2, SpanName.OPTIMIZER_STEP: 3}
#: How phases read in a sentence.
PHASE_LABELS = {
    SpanName.DATA_LOADING: "data loading",
    SpanName.FORWARD: "forward",
    SpanName.BACKWARD: "backward",
    SpanName.OPTIMIZER_STEP: "the optimizer step",
    SpanName.ZERO_GRAD: "zero_grad",
    SpanName.CHECKPOINT_SAVE_SYNC: "a checkpoint save",
    SpanName.CHECKPOINT_SAVE_ASYNC: "a checkpoint save",
    SpanName.CHECKPOINT_SAVE_FINALIZATION: "a background checkpoint save",
    SpanName.CHECKPOINT_LOAD: "a checkpoint load",
    SpanName.VALIDATION: "validation",
    SpanName.TEST: "test",
    SpanName.ITERATION: "a step (between phases)",
    SpanName.TRAINING_LOOP: "the training loop (between steps)",
    SpanName.APPLICATION: "the program (outside the training loop)",
    SpanName.DISTRIBUTED_INIT: "distributed initialisation",
    SpanName.MODEL_INIT: "model initialisation",
    SpanName.OPTIMIZER_INIT: "optimizer initialisation",
    SpanName.DATA_LOADER_INIT: "data loader initialisation",
    SpanName.COLLECTIVE: "a collective",
}
#: The ranks of a lost node stop within this much of each other (their writers' last stamps are up to a
#: flush interval apart).
NODE_WINDOW_NS = 2_000_000_000
#: A killed rank is the culprit only when it stopped before every other rank's first sign of trouble;
#: this much clock skew between hosts is tolerated.
SKEW_NS = 50_000_000
#: A rank blocked in a collective (native code) runs its SIGTERM handler only once the collective returns: once
#: the ranks that handled theirs at once have exited, within this long of the last one's last sign of life.
COLLECTIVE_RELEASE_NS = 1_000_000_000
#: A host's clock is corrected only when its ranks' records are impossible without an offset of more than
#: SKEW_NS (see ``clock_offsets``), from at least this many steps the hosts both completed (each step's bounds
#: hold alone; more steps narrow them, and show ranks that do not step together)...
OFFSET_MIN_STEPS = 1
#: ...and when at least this share of those steps end, on the corrected clock, within OFFSET_SPREAD_NS (or a
#: tenth of the offset) of the reference host's ends: data-parallel ranks leave each step's all-reduce together.
OFFSET_ALIGNED_SHARE = 0.5
OFFSET_SPREAD_NS = 10_000_000
#: Steps read for the bounds: every k-th, about this many per attempt (a long job's every step adds little).
OFFSET_SAMPLE_STEPS = 500
#: The progress file and the stream date one instant from two readings of the clocks: apart by up to this.
CLOCKS_NS = 1_000_000
#: The failed attempts before the one the verdict is about that are compared with it (a crash loop's latest).
MAX_COMPARED = 8
#: Spans an exception unwound end up to this long before its error record is written.
UNWIND_NS = 1_000_000_000
#: The others wait on a rank (in a job ended from outside, or running) when it and they have not moved for at
#: least this long before their writers' last stamps, and STUCK_STEPS times their last step's duration.
STUCK_NS = 1_000_000_000
STUCK_STEPS = 10
#: What faulthandler writes for SIGABRT (abort()): a stream that just stopped, beside it.
ABORTED = "Fatal Python error: Aborted"
#: A rank the launcher killed this long after its process's last sign of life (the writer thread's last stamp,
#: its last record) had stopped responding: its process did nothing, writer included, until it was killed.
UNRESPONSIVE_NS = 10_000_000_000


@dataclass
class RankState:
    """One rank's last moments in one attempt (restart)."""

    rank: int
    restart: int
    stream: int
    #: closed | error | killed | terminated | exited | hung | running | ended; a culprit may be diverged
    state: str = "closed"
    step: int | None = None
    phase: str | None = None
    in_collective: bool = False
    collective: str | None = None
    stopped_ns: int | None = None
    last_progress_ns: int | None = None
    error: dict[str, Any] | None = None
    consequence: dict[str, Any] | None = None
    hang: dict[str, Any] | None = None
    exit_code: int | None = None
    signal: str | None = None
    source: list[str] = field(default_factory=list)
    #: Python stacks faulthandler wrote on a fatal signal (``<stream>.faults.txt``), for a crashed rank.
    fault_stacks: str | None = None
    #: It finished normally (closed, no error) before the others' trouble: they waited for it (uneven data).
    left_early: bool = False
    #: From the progress file: when the rank entered what it was doing (its collective, else its phase), the
    #: writer thread's last stamp (the process lived until then) and its last completed step's duration.
    since_ns: int | None = None
    alive_ns: int | None = None
    last_step_ns: int | None = None
    #: The writer thread's last stamp in the progress file, whatever else was read from the file: a rank whose
    #: SIGTERM handler worked (saved a checkpoint) lived that long after the handler's record.
    stamped_ns: int | None = None
    #: When the rank recorded its first signal (SIGTERM from outside or from its launcher); ``stopped_ns`` is
    #: its first error where one came before it.
    signal_ns: int | None = None
    #: From the progress file: when the process's first iteration began. Its initialisation had ended by then,
    #: where the stream of a killed rank lost that span's end (``summary`` ends it there).
    first_step_ns: int | None = None
    #: The job was killed from outside while the others waited for this rank, stuck this long.
    stuck_ns: int | None = None
    #: The signal the launcher itself got (the job was ended from outside), from its ``job_end`` record.
    launcher_signal: str | None = None
    #: Its host's launcher recorded the job's end and got no signal: a SIGTERM the rank got was the launcher's
    #: own (stopping the ranks after a failure) or sent to the rank alone, not the scheduler's to the whole job.
    launcher_unsignalled: bool = False
    #: For a culprit that ran out of memory or was killed: its memory in the sampler's ``device_properties``
    #: events before the end (``_memory``), None without samples.
    memory: dict[str, Any] | None = None
    #: For a culprit whose checkpoint save failed: the space left on the checkpoint's file system when it did
    #: (``fs_free_bytes``, ``fs_total_bytes`` the writer added to the span), the last save's size, and whether
    #: that was too little (``_disk``).
    disk: dict[str, Any] | None = None
    #: For the rank whose metric (a loss) first became NaN or infinite (``non_finite_metric`` events,
    #: ``_non_finite``): the metric, its value and step, and the ranks' own first steps; ``state`` is then
    #: ``diverged`` and ``step`` that step.
    non_finite: dict[str, Any] | None = None
    #: When the launcher saw the rank's process end (its ``worker_failure``'s ``failed_at``, whole seconds).
    launcher_seen_ns: int | None = None
    #: A killed rank whose process showed no sign of life (no writer stamp, no record) for this long before the
    #: launcher saw it end: stopped (SIGSTOP, a suspended job), stuck in native code holding the GIL, or its host
    #: froze; SIGTERM went unanswered and the launcher's SIGKILL ended it.
    unresponsive_ns: int | None = None
    #: Outside the training loop once steps had run (saving the final model, the last barrier): ``step`` is then
    #: the last step completed, not one being prepared.
    after_loop: bool = False
    #: The host its stream names (``TRAINTRACE_HOST``, else the machine's name).
    host: str | None = None
    #: For a hung culprit: the other ranks stuck where it was (the same step and phase, not waiting for anyone),
    #: named with it (every rank of a node whose file system stopped answering, say).
    stuck_with: list[int] = field(default_factory=list)
    #: For a rank of a running job that stopped responding, whose process is on this host: its pid and the
    #: kernel's state of it (``T``: stopped, a SIGSTOP or a suspended job; ``t``: a debugger; ``R``/``S``/``D``:
    #: alive but doing nothing traintrace's writer could see, native code holding the GIL or a deadlock).
    pid: int | None = None
    process_state: str | None = None

    @property
    def out_of_memory(self) -> bool:
        """It raised an allocation failure (``OUT_OF_MEMORY``)."""
        error = self.error if self.state == "error" else None
        return error is not None and bool(OUT_OF_MEMORY.search(f"{error['error_type']}: {error['message'] or ''}"))

    def doing(self) -> str:
        """What the rank was doing, as a phrase: "waiting in a collective in backward at step 7"."""
        where = PHASE_LABELS.get(self.phase or "", self.phase or "an unknown phase")
        if self.in_collective:
            op = f" ({self.collective})" if self.collective and self.collective != "all_reduce" else ""
            what = f"waiting in a collective{op}" + ("" if self.phase in (None, ITERATION) else f" in {where}")
        else:
            what = f"in {where}"
        if self.after_loop and self.step is not None:
            return f"{what} after step {self.step}"
        return what + ("" if self.step is None else f" at step {self.step}")


def diagnose(job: Job) -> dict[str, Any]:
    """The job's verdict and each rank's state in the attempt it is about (docs/analysis.md)."""
    facts = job.dicts(
        """
        SELECT f.stream, f.rank, f.restart, f.start_ts, f.end_ts, f.closed, f.failed, f.running, f.hang_ts,
               f.hang_from, s.errors, s.path, s.pid, s.next_start IS NULL AS last_in_file
        FROM stream_facts f JOIN streams s USING (stream) WHERE NOT f.is_agent ORDER BY f.restart, f.rank
        """
    )
    rendezvous = _rendezvous_failure(job)
    if not facts:
        if rendezvous is not None:
            out = _result("failed", rendezvous["verdict"] + "; no rank started", None, [], rendezvous["restart"], [])
            out["rule"] = "launcher: rendezvous failed"
            out["rendezvous"] = rendezvous
            return out
        return {"status": "empty", "verdict": "no rank wrote any record", "culprit": None, "ranks": []}
    restarts = sorted({f["restart"] for f in facts})
    attempts = {r: [f for f in facts if f["restart"] == r] for r in restarts}
    failed = [r for r in restarts if any(f["failed"] for f in attempts[r])]
    last = restarts[-1]
    known = _Facts(job)
    if any(f["running"] for f in attempts[last]) and not any(f["failed"] for f in attempts[last]):
        states = _rank_states(job, attempts[last], known)
        _unresponsive_running(job, states)
        if any(s.hang is not None for s in states):
            behind = min(states, key=_hang_key)
            _stuck_alongside(behind, states)
            out = _result(
                "running", "running, without progress: " + _sentence(behind, states), behind, states, last, failed
            )
            out["rule"] = "stopped responding" if behind.unresponsive_ns is not None else "hang: the rank behind"
            return out
        waited_on = _waited_on(states)  # the writers' stamps are fresh: "now"
        if waited_on is not None:
            out = _result("running", _sentence(waited_on, states), waited_on, states, last, failed)
            out["rule"] = "waiting on a rank"
            return out
        silent = [s for s in states if s.unresponsive_ns is not None]
        if silent:
            quiet = max(silent, key=lambda s: (s.unresponsive_ns or 0, -s.rank))
            sentence = "running, without progress: " + _sentence(quiet, states)
            out = _result("running", sentence, quiet, states, last, failed)
            out["rule"] = "stopped responding"
            return out
        sentence = _running_sentence(states, failed)
        diverged = _non_finite(job, last, states)
        if diverged is not None:
            sentence += f"; {_non_finite_phrase(diverged)}"
        went_on = _went_on(job, known, states, last)
        if went_on is not None:
            sentence += f"; {went_on[1]}"
        return _result("running", sentence, None, states, last, failed)
    if not failed:
        steps = job.one("SELECT max(step) FROM iterations WHERE status = 'ok'")
        done = f"; last step {steps[0]}" if steps and steps[0] is not None else ""
        resolved = _count(len(known.resolved), "rank")
        note = f" (a hang was suspected on {resolved} and resolved)" if known.resolved else ""
        ranks = len({f["rank"] for f in facts})
        states = _rank_states(job, attempts[last], known)
        finished = f"{_count(ranks, 'rank')} finished{done}{note}"
        diverged = _non_finite(job, last, states)
        if diverged is not None:
            sentence = f"diverged: {_non_finite_phrase(diverged)}; {finished}"
            out = _result("diverged", sentence, diverged, states, last, failed)
            out["rule"] = "metric: not finite"
            return out
        went_on = _went_on(job, known, states, last)
        if went_on is not None:
            raised, phrase = went_on
            out = _result(FINISHED_WITH_ERRORS, f"finished with errors: {phrase}; {finished}", raised, states, last, [])
            out["rule"] = "first exception"
            return out
        if known.launcher_signal is not None:
            # Every rank had finished (none recorded the signal): the launcher alone got it, after they ended, and
            # exits non-zero; the scheduler reads the job as failed, the training was not.
            finished += f"; then the launcher got {known.launcher_signal} from outside"
        return _result("healthy", f"healthy: {finished}", None, states, last, failed)
    about = failed[-1]
    states = _rank_states(job, attempts[about], known)
    lost = _lost_node(job, states)
    ended = _node_ended(states) if lost is None else None
    if lost is not None:
        culprit, rule = lost["culprit"], "lost node"
    elif ended is not None:
        culprit, rule = ended["culprit"], "node ended from outside"
    else:
        culprit, rule = _culprit(states)
    if culprit is not None and (culprit.out_of_memory or culprit.state == "killed"):
        culprit.memory = _memory(job, culprit)
    if culprit is not None and culprit.state == "error" and culprit.phase in CHECKPOINT_SAVES:
        culprit.disk = _disk(job, culprit)
    if lost is not None:
        sentence = _lost_node_sentence(lost, states)
    elif ended is not None:
        sentence = _node_ended_sentence(ended, states)
    else:
        sentence = _sentence(culprit, states)
    diverged = _non_finite(job, about, states)
    if diverged is not None and _diverged_first(diverged, culprit):
        # The failure says the values were not finite (a check of the loss): where they first were is the fault.
        sentence = f"{_non_finite_phrase(diverged)}; then {sentence}"
        culprit, rule = diverged, "metric: not finite"
    elif diverged is not None:
        sentence += f"; before it, {_non_finite_phrase(diverged)}"
    unfinished = None
    if culprit is not None and culprit.state == "error" and culprit.phase == SpanName.CHECKPOINT_LOAD:
        unfinished = _unfinished_save(job, known, culprit, {r: attempts[r] for r in failed if r < about})
        if unfinished is not None:
            sentence += _unfinished_phrase(unfinished)
    # A restart that fails as the attempt before it did gets nowhere: say so. One that failed otherwise: the
    # first failure may be the root (a checkpoint it damaged, say), so it is named too.
    earlier_states = {r: _rank_states(job, attempts[r], known) for r in failed[-1 - MAX_COMPARED : -1]}
    earlier = {r: _culprit(states)[0] for r, states in earlier_states.items()}
    same = [r for r, c in earlier.items() if _same_failure_of_attempt(culprit, c, earlier_states[r])]
    if same:
        sentence += f"; {'restart' if len(same) == 1 else 'restarts'} {_and(same)} failed the same way"
    first = failed[0]
    if first != about and first not in same:
        root = earlier[first] if first in earlier else _culprit(_rank_states(job, attempts[first], known))[0]
        what = _sentence(root, [root]) if root is not None else "cause unclear (errors --json: rank_states)"
        sentence += f"; restart {first} had failed first: {what}"
    status = "failed"
    if about != last:
        # A later attempt than the last failed one neither failed nor runs (running is answered above).
        status = "recovered"
        sentence = f"restart {about} failed: {sentence}; restart {last} finished"
    if rendezvous is not None and rendezvous["restart"] > last:
        # The launchers went back to the rendezvous after the failure (torchrun's restart) and it failed there.
        sentence += f"; restart {rendezvous['restart']} never started: {rendezvous['verdict']}"
        out_rendezvous: dict[str, Any] | None = rendezvous
    else:
        out_rendezvous = None
    out = _result(status, sentence, culprit, states, about, failed)
    out["rule"] = rule
    if lost is not None:
        out["lost_node"] = {k: v for k, v in lost.items() if k != "culprit"}
    if ended is not None:
        out["node_ended"] = {k: v for k, v in ended.items() if k != "culprit"}
    if unfinished is not None:
        out["unfinished_checkpoint"] = unfinished
    out["same_failure_restarts"] = same
    if out_rendezvous is not None:
        out["rendezvous"] = out_rendezvous
    return out


def _lost_node(job: Job, states: list[RankState]) -> dict[str, Any] | None:
    """A host whose ranks all stopped together, with no error, signal or exit seen, before the other hosts'
    ranks saw trouble, and whose launcher (when one recorded) ended without its end record: the node went
    down, was cut off or was killed whole. The others then fail on their collectives as consequences, and
    without this rule one of the lost ranks is named as if it alone had died (or hung, while the analysis
    runs within a minute and another host's silent ranks still count as running)."""
    if _killed_together(states):
        return None  # every rank died with no trouble seen first: the whole job was killed, no node was lost
    launchers: dict[str, bool] = {
        str(host): bool(ended)
        for host, ended in job.rows(
            "SELECT s.host, max(CASE WHEN s.closed OR e.stream IS NOT NULL THEN 1 ELSE 0 END) FROM streams s "
            "LEFT JOIN (SELECT DISTINCT stream FROM other WHERE is_agent AND kind = 'event' "
            f"AND name = '{EventType.JOB_END.value}') e ON e.stream = s.stream WHERE s.is_agent GROUP BY s.host"
        )
    }
    by_host: dict[str, list[RankState]] = {}
    for st in states:
        by_host.setdefault(st.host or "", []).append(st)
    if len(by_host) < 2:
        return None

    def silent_stop(st: RankState) -> int | None:
        """When a rank that left no sign stopped: its stream's end, or a silent remote one's last stamp."""
        # In a collective or not: a killed node's ranks may be anywhere in their step.
        if st.error is not None or st.consequence is not None or st.signal or st.exit_code:
            return None
        if st.state == "ended":
            return st.stopped_ns
        if st.state in ("running", "hung") and "launcher" not in st.source:
            return st.alive_ns
        return None

    for host, ranks in sorted(by_host.items()):
        if not host or launchers.get(host, False):
            continue  # its launcher ended normally: its ranks died on a live node (another rule names them)
        if host not in launchers and len(ranks) < 2:
            continue  # one rank, no launcher: nothing tells a lost node from a killed rank
        stops = [silent_stop(st) for st in ranks]
        if any(t is None for t in stops):
            continue
        stopped = [int(t or 0) for t in stops]
        if max(stopped) - min(stopped) > NODE_WINDOW_NS:
            continue
        if any(
            (t := silent_stop(st)) is not None and abs(t - min(stopped)) <= NODE_WINDOW_NS
            for h, group in by_host.items()
            if h != host
            for st in group
        ):
            # A rank of another host stopped as silently at the same moment: the job was torn down (around a
            # rank's failure, or from outside), not one node lost; the other rules name what happened. A lost
            # node's peers see trouble (a collective's error, a hang), or are ended later. A generated 64-rank
            # job whose rank 37 raised while the others stopped without a trace read "node node0 was lost".
            continue
        if any(
            st.error is not None and st.consequence is None and abs(st.error["ts"] - min(stopped)) <= NODE_WINDOW_NS
            for h, group in by_host.items()
            if h != host
            for st in group
        ):
            # A rank of another host raised an error of its own (not a collective's: a lost peer's are) at that
            # moment: the job was torn down around it, on a host where it alone ran too (a random scripted job:
            # rank 5 alone on node1 raised, node0's five ranks stopped without a trace: "node node0 was lost").
            continue
        others = [st for h, group in by_host.items() if h != host for st in group]
        trouble = [t for t in (_first_trouble(o) for o in others) if t is not None]
        if not trouble or max(stopped) > min(trouble) + SKEW_NS:
            continue
        culprit = min(ranks, key=lambda st: st.rank)
        return {
            "culprit": culprit,
            "host": host,
            "ranks": sorted(st.rank for st in ranks),
            "stopped_ns": min(stopped),
            "launcher": "stopped without its end record" if host in launchers else "none recorded",
        }
    return None


def _lost_node_sentence(lost: dict[str, Any], states: list[RankState]) -> str:
    ranks = [st for st in states if st.rank in lost["ranks"]]
    doing = {st.doing() for st in ranks}
    where = f" {doing.pop()}" if len(doing) == 1 else ""
    who = ("its launcher and " if lost["launcher"] != "none recorded" else "") + _ranks_phrase(lost["ranks"])
    head = (
        f"node {lost['host']} was lost: {who} stopped together{where}, with no error, signal or exit seen "
        "(the node went down, was cut off from the network, or was killed whole)"
    )
    others = [st for st in states if st.rank not in lost["ranks"]]
    return head + "; " + _doing_groups(others, died=True) if others else head


def _node_ended(states: list[RankState]) -> dict[str, Any] | None:
    """A host whose launcher got a signal from outside (``traintrace-run`` writes it in its ``job_end``) while
    another host's did not, and whose ranks it then stopped, none of them in trouble before and before the
    other hosts' ranks saw any: that node was ended from outside (a preempted spot instance, an evicted pod, a
    drained node, a cancelled job step), and the others failed for want of it. Without this rule the first of
    its ranks was named as terminated by SIGTERM, and the others as merely in forward."""
    by_host: dict[str, list[RankState]] = {}
    for st in states:
        by_host.setdefault(st.host or "", []).append(st)
    if len(by_host) < 2 or "" in by_host:
        return None
    signalled = {h: sig for h, ranks in by_host.items() for sig in {s.launcher_signal for s in ranks} if sig}
    if not signalled or len(signalled) == len(by_host):
        return None  # no launcher, or every launcher got the signal: the whole job was (rule 2's)
    for host, sig in sorted(signalled.items()):
        ranks = by_host[host]
        if any(s.error is not None or s.consequence is not None or s.hang is not None for s in ranks):
            continue
        if any(s.state not in ("terminated", "killed", "ended") for s in ranks):
            continue
        stopped = min(s.stopped_ns or 0 for s in ranks)
        others = [o for h, group in by_host.items() if h != host for o in group]
        trouble = [t for t in (_first_trouble(o) for o in others) if t is not None]
        if trouble and min(trouble) + SKEW_NS < stopped:
            continue  # another host's ranks were in trouble first: its signal came after
        return {
            "culprit": min(ranks, key=lambda s: s.rank),
            "host": host,
            "ranks": sorted(s.rank for s in ranks),
            "signal": sig,
            "stopped_ns": stopped,
        }
    return None


def _node_ended_sentence(ended: dict[str, Any], states: list[RankState]) -> str:
    ranks = [st for st in states if st.rank in ended["ranks"]]
    doing = {st.doing() for st in ranks}
    where = f" {doing.pop()}" if len(doing) == 1 else ""
    head = (
        f"node {ended['host']} was terminated by {ended['signal']} from outside: its launcher got the signal and "
        f"stopped {_ranks_phrase(ended['ranks'])}{where} (a preempted, evicted or drained node, or a cancelled "
        "job step)"
    )
    others = [st for st in states if st.rank not in ended["ranks"]]
    return head + "; " + _doing_groups(others, died=True) if others else head


def _unfinished_save(
    job: Job, facts: _Facts, culprit: RankState, earlier: dict[int, list[dict[str, Any]]]
) -> dict[str, Any] | None:
    """For a rank whose checkpoint load failed: the save of that checkpoint an earlier attempt began and never
    finished (its rank killed, terminated or failed in it), when the load names the checkpoint (its
    ``checkpoint_path`` or ``current_iteration``) and no save of that path completed. A save that writes straight
    to its final name leaves the file cut short; the restart loads the newest file and fails, every time."""
    saves = ", ".join(f"'{n}'" for n in CHECKPOINT_SAVES)
    load = job.rows(
        f"""
        SELECT attrs->>'checkpoint_path', try_cast(attrs->>'current_iteration' AS BIGINT)
        FROM spans_small WHERE stream = {int(culprit.stream)} AND name = '{SpanName.CHECKPOINT_LOAD}'
        ORDER BY ts DESC LIMIT 1
        """
    )
    if not load or (load[0][0] is None and load[0][1] is None):
        return None
    path, step = load[0]
    done = {
        str(p)
        for (p,) in job.rows(
            f"SELECT DISTINCT attrs->>'checkpoint_path' FROM spans_small WHERE name IN ({saves}) "
            f"AND status = '{SpanStatus.OK}' AND NOT open AND attrs->>'checkpoint_path' IS NOT NULL"
        )
    }
    if path is not None and str(path) in done:
        return None  # that checkpoint was written whole: something else is wrong with it
    for restart in sorted(earlier, reverse=True):
        for st in _rank_states(job, earlier[restart], facts):
            if st.phase not in CHECKPOINT_SAVES or st.state not in ("killed", "terminated", "ended", "exited", "error"):
                continue
            if step is not None and st.step != step:
                continue
            return {"path": path, "step": st.step, "restart": restart, "rank": st.rank, "how": _ended_phrase(st)}
    return None


def _ended_phrase(st: RankState) -> str:
    """How a rank's process ended, after "when it": "was killed by SIGKILL", "raised OSError"."""
    if st.state == "error" and st.error is not None:
        return f"raised {st.error['error_type']}"
    if st.state in ("killed", "terminated"):
        return f"was {_cause(st)}"
    if st.state == "exited":
        return f"exited with exit code {st.exit_code}"
    return "stopped (its stream ended without a close record)"


def _unfinished_phrase(unfinished: dict[str, Any]) -> str:
    what = f"the checkpoint loaded ({Path(unfinished['path']).name})" if unfinished["path"] else "the checkpoint loaded"
    at = "" if unfinished["step"] is None else f" at step {unfinished['step']}"
    return (
        f"; {what} never completed: restart {unfinished['restart']}'s rank {unfinished['rank']} was saving it"
        f"{at} when it {unfinished['how']} (a save written straight to its final name leaves a partial file that "
        "every restart loads: write to a temporary name, then rename)"
    )


def _non_finite(job: Job, restart: int, states: list[RankState]) -> RankState | None:
    """The rank whose float metric (a loss) became NaN or infinite first in the attempt, from the writers'
    ``non_finite_metric`` events (one per rank and metric): the lowest step, then the earliest. A state of that
    rank, ``diverged`` at that step, with the metric's first step on every rank that had one (the ranks of a
    data-parallel job follow a step later: the all-reduce of its gradients spreads the value)."""
    rows = job.dicts(
        "SELECT stream_rank AS rank, ts, try_cast(attrs->>'step' AS BIGINT) AS step, "
        "attrs->>'metric' AS metric, attrs->>'value' AS value FROM other "
        f"WHERE kind = 'event' AND name = '{EventName.NON_FINITE_METRIC}' AND NOT is_agent "
        f"AND stream_restart = {int(restart)} ORDER BY ts"
    )
    rows = [r for r in rows if r["metric"] is not None]
    if not rows:
        return None
    # A loss first: the metric people watch, and the one the others' values follow from.
    losses = [r for r in rows if "loss" in str(r["metric"]).lower()] or rows
    # One iteration can hold several (``loss`` and a logged ``train_loss``): the plain name, else the first by name.
    first = min(losses, key=lambda r: (r["step"] is None, r["step"] or 0, r["ts"], r["metric"] != "loss", r["metric"]))
    metric = first["metric"]
    same = [r for r in rows if r["metric"] == metric]
    steps: dict[int, Any] = {}
    for r in same:
        steps.setdefault(int(r["rank"]), r["step"])
    state = next((st for st in states if st.rank == first["rank"]), None)
    if state is None:
        return None
    at_first = sorted(rank for rank, step in steps.items() if step == first["step"])
    info = {
        "metric": metric,
        "value": first["value"],
        "step": first["step"],
        "ts": first["ts"],
        "ranks_at_first": at_first,
        "first_steps": {str(rank): step for rank, step in sorted(steps.items())},
        "finite_ranks": sorted(st.rank for st in states if st.rank not in steps),
    }
    # A state of its own: where the rank was when it stopped (its error, its signal) is another moment.
    return RankState(
        rank=state.rank,
        restart=state.restart,
        stream=state.stream,
        state="diverged",
        step=first["step"],
        phase=ITERATION,
        source=["stream"],
        non_finite=info,
    )


def _diverged_first(diverged: RankState, culprit: RankState | None) -> bool:
    """The failure came from the values that stopped being finite: its error says so, at or after that step."""
    if culprit is None or culprit.error is None or culprit.state != "error":
        return False
    info = diverged.non_finite or {}
    text = f"{culprit.error['error_type']}: {culprit.error['message'] or ''}"
    later = culprit.step is None or info.get("step") is None or culprit.step >= info["step"]
    return later and bool(NOT_FINITE_ERROR.search(text))


def _non_finite_phrase(diverged: RankState) -> str:
    """ "rank 1's loss became Infinity at step 7, the first non-finite value (ranks 0 and 2 followed at step 8)"."""
    info = diverged.non_finite or {}
    ranks = info.get("ranks_at_first") or [diverged.rank]
    at = "" if info.get("step") is None else f" at step {info['step']}"
    metric = info.get("metric")
    whose = f"rank {ranks[0]}'s {metric}" if len(ranks) == 1 else f"the {metric} of {_ranks_phrase(ranks)}"
    head = f"{whose} became {info.get('value')}{at}, the first non-finite value"
    later: dict[Any, list[int]] = {}
    for rank, step in (info.get("first_steps") or {}).items():
        if int(rank) not in ranks:
            later.setdefault(step, []).append(int(rank))
    parts = [
        f"{_ranks_phrase(r)} followed" + ("" if step is None else f" at step {step}")
        for step, r in sorted(later.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))
    ]
    if info.get("finite_ranks"):
        parts.append(f"{_ranks_phrase(info['finite_ranks'])} recorded none")
    return head + (f" ({'; '.join(parts)})" if parts else "")


def _same_failure(a: RankState | None, b: RankState | None) -> bool:
    """The same rank failing in the same phase of the same step, the same way (exception type, or signal)."""
    if a is None or b is None:
        return False

    def how(s: RankState) -> tuple[Any, ...]:
        return (s.rank, s.step, s.phase, s.state, s.error and s.error["error_type"], s.signal, s.exit_code)

    return how(a) == how(b)


def _same_failure_of_attempt(culprit: RankState | None, theirs: RankState | None, states: list[RankState]) -> bool:
    """An earlier attempt failed as this one did: its culprit failed the same way, or several ranks raised the
    same error in the same place in both and another of them happened to be first there (every rank loading the
    same broken checkpoint)."""
    if _same_failure(culprit, theirs):
        return True
    mine = next((s for s in states if culprit is not None and s.rank == culprit.rank), None)
    if culprit is None or theirs is None or mine is None or mine.error is None:
        return False

    def place(s: RankState) -> tuple[Any, ...]:  # the exit code is the launcher's: a rank it stopped differs
        return (s.step, s.phase, s.state, s.error and s.error["error_type"])

    return place(culprit) == place(theirs) == place(mine)


def _went_on(job: Job, known: _Facts, states: list[RankState], restart: int) -> tuple[RankState, str] | None:
    """In an attempt no rank of which failed, the first error a rank recorded and survived (a background
    thread's: an asynchronous checkpoint save that failed, while the training thread went on), and the phrase
    that says so: which rank raised what where, how many errors in all, and for a checkpoint save, which
    checkpoint is the last that completed (the one a restart would load)."""
    raised = [s for s in states if s.state == "error" and s.error is not None]
    if not raised:
        return None
    first = min(raised, key=lambda s: (s.error["ts"] if s.error else 0, s.rank))
    if first.phase in CHECKPOINT_SAVES:
        first.disk = _disk(job, first)
    error = first.error or {}
    line = _error_line(error.get("error_type"), error.get("message"))
    phrase = f"rank {first.rank} raised {error.get('error_type')} {first.doing()}{_disk_phrase(first.disk)} ({line})"
    total = sum(
        1
        for s in states
        for e in known.errors.get(s.stream, [])
        if e["name"] not in HANG_ERRORS and e["error_type"] not in HANG_ERRORS and not _secondary(e)
    )
    ranks = len(raised)
    if total > 1:
        phrase += f"; {total} errors on {_count(ranks, 'rank')}, the first named"
    phrase += "; the program went on"
    if first.phase in CHECKPOINT_SAVES:
        row = job.one(f"SELECT max(ckpt_step) FROM stream_facts WHERE restart = {int(restart)} AND NOT is_agent")
        held = row[0] if row else None
        phrase += "; no checkpoint completed" if held is None else f"; the last checkpoint completed holds step {held}"
    return first, phrase


def _and(items: list[int]) -> str:
    """``0``, ``0 and 1``, ``0, 1 and 2``."""
    words = [str(i) for i in items]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + f" and {words[-1]}"


def _result(  # noqa: PLR0917 - a private constructor of the answer
    status: str, verdict: str, culprit: RankState | None, states: list[RankState], restart: int, failed: list[int]
) -> dict[str, Any]:
    return {
        "status": status,
        "verdict": verdict,
        "restart": restart,
        "failed_restarts": failed,
        "culprit": None if culprit is None else _public(culprit),
        "ranks": [_public(s) for s in states],
    }


def _public(state: RankState) -> dict[str, Any]:
    out = asdict(state)
    out["doing"] = state.doing()
    out["cause"] = _cause(state)
    out["out_of_memory"] = state.out_of_memory
    return out


# ---------------------------------------------------------------- one rank


class _Facts:
    """What the rank states are read from, each fetched in one query for all streams."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self._last_span: dict[int, int] | None = None
        self.hosts: dict[int, str] = {}
        launcher_hosts: set[str] = set()
        for stream, host, is_agent in job.rows("SELECT stream, host, is_agent FROM streams"):
            if host:
                self.hosts[int(stream)] = str(host)
                if is_agent:
                    launcher_hosts.add(str(host))
        #: host -> how far its clock runs ahead of the reference host's, where the records prove it (``clock_offsets``).
        self.offsets: dict[str, int] = host_clocks(job)["offsets_ns"]
        self.failures, self.launcher_signal, by_stream, quiet = _launcher_events(job)
        self.launcher_hosts = launcher_hosts
        self.host_signals = {self.hosts[stream]: sig for stream, sig in by_stream.items() if stream in self.hosts}
        #: Hosts whose launcher recorded the job's end and got no signal itself.
        self.quiet_launcher_hosts = {self.hosts[stream] for stream in quiet if stream in self.hosts}
        self.errors: dict[int, list[dict[str, Any]]] = {}
        for e in job.dicts(
            "SELECT stream, ts, name, error_type, message, stack, span, attrs FROM other "
            "WHERE kind = 'error' AND NOT is_agent ORDER BY ts, seq"
        ):
            self.errors.setdefault(e["stream"], []).append(e)
        self.signals: dict[int, list[tuple[int, Any]]] = {}
        for stream, ts, attrs in job.rows(
            f"SELECT stream, ts, attrs FROM other WHERE kind = 'event' AND name = '{EventName.SIGNAL}' "
            "AND NOT is_agent ORDER BY ts"
        ):
            self.signals.setdefault(stream, []).append((ts, attrs))
        #: stream -> the exit status of the last ``sys.exit()`` that left one of its spans (its own record of how
        #: it ended, for a process no launcher of traintrace's saw end).
        self.exits: dict[int, int] = {}
        for stream, attrs in job.rows(
            f"SELECT stream, attrs FROM other WHERE kind = 'event' AND name = '{EventName.SYSTEM_EXIT}' "
            "AND NOT is_agent ORDER BY ts"
        ):
            code = _attrs(attrs).get("exit_code")
            if isinstance(code, int) and not isinstance(code, bool):
                self.exits[int(stream)] = code
        self.resolved: dict[int, int] = dict(
            job.rows(
                f"SELECT stream, max(ts) FROM other WHERE kind = 'event' AND name = '{EventName.HANG_RESOLVED}' "
                "AND NOT is_agent GROUP BY stream"
            )
        )
        # Each stream's last completed iteration: its plain records were aggregated with the streams table,
        # start/end pairs are few. The step of the latest one that began.
        self.last_ok: dict[int, tuple[Any, Any]] = {
            row[0]: (row[1], row[2])
            for row in job.rows(
                """
                SELECT stream, max(end_ns), arg_max(step, ts) FROM (
                    SELECT stream, ok_end AS end_ns, ok_step AS step, ok_ts AS ts FROM streams
                    WHERE ok_ts IS NOT NULL AND NOT is_agent
                    UNION ALL
                    SELECT stream, ts + dur, step, ts FROM iterations_small WHERE status = 'ok'
                ) GROUP BY stream
                """
            )
        }

    def signal_of_launcher(self, host: str | None) -> str | None:
        """The signal the launcher of ``host`` got: its own launcher's when that host has one with a stream,
        else any launcher's (one launcher for the job, or hosts not named)."""
        if host is not None and host in self.launcher_hosts:
            return self.host_signals.get(host)
        return self.launcher_signal

    def last_span_ns(self, st: RankState) -> int:
        """When the stream's spans last began or ended (all streams in one query, on first use). Its events do
        not count: the monitor's device readings and the interval statistics come from other threads, and an
        event says nothing of where the training thread is; every standard phase it enters or leaves moves the
        progress file."""
        if self._last_span is None:
            self._last_span = {
                int(stream): int(last or 0)
                for stream, last in self.job.rows(
                    "SELECT stream, max(CASE WHEN open THEN ts ELSE ts + dur END) FROM spans_small "
                    "WHERE NOT is_agent GROUP BY stream"
                )
            }
        return max(self._last_span.get(st.stream, 0), int(st.last_progress_ns or 0))


def _launcher_events(
    job: Job,
) -> tuple[dict[tuple[int, int], dict[str, Any]], str | None, dict[int, str], set[int]]:
    """From the launchers' streams, in one pass: (rank, restart) -> exit code and signal of its worker_failure
    events, the signal a launcher got itself (``traintrace-run`` writes torchrun's SignalException in
    ``job_end``: the job was ended from outside), each launcher stream's own signal (one node's: a
    preempted or drained node), and the launcher streams whose ``job_end`` names no signal."""
    failures: dict[tuple[int, int], dict[str, Any]] = {}
    launcher_signal: str | None = None
    by_stream: dict[int, str] = {}
    quiet: set[int] = set()
    failure, end = EventType.WORKER_FAILURE.value, EventType.JOB_END.value
    for stream, name, attrs_text, ts in job.rows(
        f"SELECT stream, name, attrs, ts FROM other WHERE is_agent AND kind = 'event' "
        f"AND name IN ('{failure}', '{end}') ORDER BY ts"
    ):
        try:
            attrs = json.loads(attrs_text) if isinstance(attrs_text, str) else dict(attrs_text or {})
        except ValueError:
            continue
        raw = attrs.get("data")
        data: dict[str, Any] = raw if isinstance(raw, dict) else {}
        if name == end:
            if isinstance(data.get("signal"), str):
                launcher_signal = launcher_signal or str(data["signal"])
                by_stream.setdefault(int(stream), str(data["signal"]))
            else:
                quiet.add(int(stream))
            continue
        rank, restart = attrs.get("rank"), attrs.get("restart", 0)
        if not isinstance(rank, int):
            continue
        code = attrs.get("exit_code")
        failed_at = data.get("failed_at")  # torchelastic's, in whole seconds: when the agent saw it end
        failures[(rank, int(restart or 0))] = {
            "exit_code": code if isinstance(code, int) else None,
            "signal": data.get("signal"),
            "ts": ts,
            "failed_at_ns": failed_at * 1_000_000_000 if type(failed_at) is int and failed_at > 0 else None,
            "progress": _copied_progress(data, rank, int(restart or 0)),
        }
    return failures, launcher_signal, by_stream, quiet - by_stream.keys()


def _copied_progress(data: dict[str, Any], rank: int, restart: int) -> SimpleNamespace | None:
    """The dead rank's progress file as the launcher copied it into ``worker_failure`` (``progress_fields``), read
    as the file is: a restart rewrites the file, and the failed attempt's exact step and phase are then only
    here. None without the copy (an older launcher, no file); a hostile value reads as unknown."""

    def number(name: str) -> int | None:
        value = data.get(name)
        return value if type(value) is int else None

    updated = number("last_progress_ns")
    if updated is None:
        return None
    phase = data.get("last_phase")
    return SimpleNamespace(
        rank=rank,
        restart=restart,
        step=number("last_step"),
        step_done=number("last_step_done"),
        phase=phase if isinstance(phase, str) else None,
        in_collective=data.get("in_collective") is True,
        updated_ns=updated,
        phase_started_ns=number("phase_started_ns"),
        collective_started_ns=number("collective_started_ns"),
        alive_ns=number("alive_ns"),
        last_step_ns=number("last_step_ns"),
        first_step_ns=number("first_step_ns"),
    )


def _rendezvous_failure(job: Job) -> dict[str, Any] | None:
    """When a launcher ended with torchrun's rendezvous error (``RendezvousTimeoutError``: not every node came;
    ``RendezvousClosedError``...), what its stream and the other launchers' say: the nodes expected (``nnodes``),
    those whose launcher joined that round, how long it waited. None otherwise."""
    start, end, join = EventType.JOB_START.value, EventType.JOB_END.value, EventType.NODE_JOIN.value
    rdzv = EventType.RENDEZVOUS_START.value
    events: dict[int, list[tuple[str, int, dict[str, Any]]]] = {}
    for stream, name, attrs_text, ts in job.rows(
        f"SELECT stream, name, attrs, ts FROM other WHERE is_agent AND kind = 'event' "
        f"AND name IN ('{start}', '{end}', '{join}', '{rdzv}') ORDER BY ts"
    ):
        try:
            attrs = json.loads(attrs_text) if isinstance(attrs_text, str) else dict(attrs_text or {})
        except ValueError:
            continue
        events.setdefault(int(stream), []).append((str(name), int(ts), attrs))

    def data(attrs: dict[str, Any]) -> dict[str, Any]:
        raw = attrs.get("data")
        return raw if isinstance(raw, dict) else {}

    def attempt(attrs: dict[str, Any]) -> int:  # a hostile file's restart is no number: the first attempt
        value = attrs.get("restart")
        return value if type(value) is int else 0

    failed = None
    for stream, stream_events in events.items():
        for name, ts, attrs in stream_events:
            error = str(data(attrs).get("error_type") or "")
            if name == end and error.startswith("Rendezvous") and (failed is None or ts < failed[1]):
                failed = (stream, ts, error, attempt(attrs))
    if failed is None:
        return None
    stream, ended, error, restart = failed
    mine = events[stream]
    expected = next((str(data(a).get("nnodes") or "") for n, _, a in mine if n == start), "")
    began = [ts for n, ts, a in mine if n == rdzv and attempt(a) == restart]
    waited = (ended - began[-1]) / 1e9 if began else None
    # A launcher joined this round when its own stream says so (each node's launcher writes its own stream).
    joined = [s for s, es in events.items() if any(n == join and attempt(a) == restart for n, _, a in es)]
    hosts = {int(s): h for s, h in job.rows("SELECT stream, host FROM streams WHERE is_agent")}
    names = sorted({str(hosts.get(s) or "?") for s in joined})
    least = expected.split(":", 1)[0]
    how = "timed out" if error == "RendezvousTimeoutError" else f"failed ({error})"
    verdict = f"the rendezvous {how}"
    if waited is not None:
        verdict += f" after {waited:.0f} s"
    if least.isdigit():
        verdict += f": {len(joined)} of {least} nodes joined"
        if names:
            verdict += f" ({', '.join(names)})"
        if len(joined) < int(least):
            verdict += "; the others never came (not started, or they cannot reach the rendezvous endpoint)"
    return {
        "verdict": verdict,
        "error_type": error,
        "restart": restart,
        "nnodes": expected or None,
        "joined": len(joined),
        "hosts": names,
        "waited_s": waited,
    }


def _rank_states(job: Job, streams: list[dict[str, Any]], facts: _Facts) -> list[RankState]:
    """The state of each stream's rank; the spans open where each stopped come from one query for all."""
    started = [_rank_state(job, f, facts) for f in streams]
    spans = _spans_at(job, [(st.stream, at) for st, at, _ in started])
    for (st, _, error_span), f in zip(started, streams, strict=True):
        _locate(st, spans.get(st.stream, []), error_span)
        finer = (st.hang or {}).get("progress_phase")
        if st.phase in (None, ITERATION, *CONTAINERS) and finer in PHASE_LABELS and finer not in COARSE:
            st.phase = finer  # the hang report's reading of the progress file: a phase no open span showed
        last_done_step = facts.last_ok.get(st.stream, (None, None))[1]
        if st.step is None and last_done_step is not None:
            st.step = int(last_done_step) + 1  # outside an iteration: the step it was preparing or saving after
        _from_progress(job, st, f, facts)
        if st.phase == SpanName.APPLICATION and last_done_step is not None and st.step == int(last_done_step) + 1:
            st.step, st.after_loop = int(last_done_step), True
        _unresponsive(st)
        _aborted_waiting(st)
    states = [st for st, _, _ in started]
    for st in states:
        offset = facts.offsets.get(st.host or "")
        if offset:
            _on_reference_clock(st, offset)
    _first_batch(states, facts)
    return states


def host_clocks(job: Job) -> dict[str, Any]:
    """``clock_offsets`` of the job, computed once (a job of one host has none)."""
    if job.clocks is None:
        hosts = job.one("SELECT count(DISTINCT host) FROM streams WHERE NOT is_agent")
        job.clocks = clock_offsets(job) if hosts and (hosts[0] or 0) > 1 else {"reference": None, "offsets_ns": {}}
    return job.clocks


def clock_offsets(job: Job) -> dict[str, Any]:
    """How far each host's clock runs ahead of the reference host's (the host of the lowest rank), where the
    records are impossible otherwise; hosts without proof are not listed (their offset is taken as 0).

    Ranks on one host share its clock; hosts' clocks may differ (NTP off or slow to converge). In a
    data-parallel job no rank completes step k before every rank has begun it (the step's all-reduce needs every
    rank's gradients), so for each step both hosts completed, host h's offset d is bounded: above its latest
    start less the reference's earliest end, below its earliest end less the reference's latest start. When the
    bounds exclude 0 by more than SKEW_NS, the offset is the median of the difference of the hosts' mean step
    ends (ranks leave the all-reduce together), held within the bounds, and it must explain most steps' ends.
    Bounds that contradict each other (a job whose ranks do not step together) or that include 0 change nothing:
    a pipeline stage that ends its steps later, or a slow node, is not taken for a clock. A long job's steps are
    sampled (every k-th, about OFFSET_SAMPLE_STEPS of them): fewer steps give wider bounds, never wrong ones.
    """
    ref_row = job.one(
        "SELECT s.host FROM stream_facts f JOIN streams s USING (stream) "
        "WHERE NOT f.is_agent AND s.host IS NOT NULL ORDER BY f.rank, f.restart LIMIT 1"
    )
    out: dict[str, Any] = {"reference": None, "offsets_ns": {}}
    if not ref_row:
        return out
    reference = str(ref_row[0])
    out["reference"] = reference
    last_step = job.one("SELECT max(ok_step) FROM streams WHERE NOT is_agent")
    every = max(1, int(last_step[0] or 0) // OFFSET_SAMPLE_STEPS) if last_step else 1
    per_step = f"""
        WITH h AS (
            SELECT s.host, i.restart, i.step, max(i.ts) AS s1, min(i.ts + i.dur) AS e0, avg(i.ts + i.dur) AS em
            FROM iterations i JOIN streams s ON s.stream = i.stream
            WHERE i.status = '{SpanStatus.OK}' AND i.step % {every} = 0 AND s.host IS NOT NULL AND NOT s.is_agent
            GROUP BY s.host, i.restart, i.step
        ), r AS (SELECT * FROM h WHERE host = $reference)
        SELECT h.host, h.s1 - r.e0 AS lo, h.e0 - r.s1 AS hi, h.em - r.em AS diff
        FROM h JOIN r ON h.restart = r.restart AND h.step = r.step WHERE h.host <> $reference
    """
    by_host: dict[str, list[tuple[float, float, float]]] = {}
    for host, lo, hi, diff in job.rows(per_step, {"reference": reference}):
        by_host.setdefault(str(host), []).append((float(lo), float(hi), float(diff)))
    for host, steps in sorted(by_host.items()):
        if len(steps) < OFFSET_MIN_STEPS:
            continue
        lo, hi = max(x[0] for x in steps), min(x[1] for x in steps)
        if lo > hi or (lo <= SKEW_NS and hi >= -SKEW_NS):
            continue  # no step order a single offset explains, or none needs one
        diffs = sorted(x[2] for x in steps)
        offset = min(max(diffs[len(diffs) // 2], lo), hi)
        spread = max(OFFSET_SPREAD_NS, abs(offset) / 10)
        if sum(abs(d - offset) <= spread for d in diffs) < OFFSET_ALIGNED_SHARE * len(diffs):
            continue
        out["offsets_ns"][host] = round(offset)
    return out


def _on_reference_clock(st: RankState, offset: int) -> None:
    """The rank's times on the reference host's clock (its host's runs ``offset`` ahead)."""
    names = ("stopped_ns", "signal_ns", "last_progress_ns", "since_ns", "alive_ns", "stamped_ns", "launcher_seen_ns")
    for name in (*names, "first_step_ns"):
        value = getattr(st, name)
        if value is not None:
            setattr(st, name, value - offset)
    for info in (st.error, st.consequence):
        if info is not None and info.get("ts") is not None:
            info["ts"] -= offset
    if st.hang is not None:
        for key in ("ts", "from_ns"):
            if st.hang.get(key) is not None:
                st.hang[key] -= offset


def _first_batch(states: list[RankState], facts: _Facts) -> None:
    """A rank of the attempt still loading its first batch (in data loading or between steps, no iteration begun,
    none completed) is at the attempt's first step: the one the ranks that completed none yet are in (its peers
    cannot complete a step before it begins it, their all-reduce waits for it). Without this a rank stuck
    loading its first batch would have no step and count as ahead of the ranks waiting for it."""

    def completed_none(s: RankState) -> bool:
        return facts.last_ok.get(s.stream, (None, None))[1] is None

    firsts = [s.step for s in states if s.step is not None and completed_none(s)]
    if not firsts:
        return
    for s in states:
        if s.step is None and s.phase in FIRST_BATCH_PHASES and completed_none(s):
            s.step = min(firsts)


def _rank_state(job: Job, f: dict[str, Any], facts: _Facts) -> tuple[RankState, int | None, int | None]:
    """The rank's state from its stream's facts, with the time to look for open spans at and its error's span."""
    stream = f["stream"]
    st = RankState(rank=int(f["rank"]), restart=int(f["restart"]), stream=int(stream), host=facts.hosts.get(stream))
    errors = facts.errors.get(stream, [])
    hangs = [e for e in errors if e["name"] in HANG_ERRORS or e["error_type"] in HANG_ERRORS]
    real = [e for e in errors if e not in hangs]
    signals = facts.signals.get(stream, [])
    torn = [e for e in real if _terminated_by(e)]
    if torn:
        # The rank was terminated, it raised nothing of its own: read as the signal it was.
        real = [e for e in real if e not in torn]
        signals = signals or [(torn[0]["ts"], {"signal": "SIGTERM"})]
    resolved = facts.resolved.get(stream)
    if hangs and resolved is not None and resolved >= hangs[-1]["ts"]:
        hangs = []  # progress resumed after the last hang report
    if hangs and signals:
        # Reported once the process was being ended (its SIGTERM handler saving a checkpoint, streams written
        # before traintrace paused hang detection there): no hang of training.
        hangs = [e for e in hangs if e["ts"] < signals[0][0]]
    # An exception of its own raised once the rank was failing already (after a peer's failure reached it, or a
    # signal came: a handler's or a cleanup's error) did not start the failure: it is a consequence too.
    troubled = [e["ts"] for e in real if _secondary(e)] + [ts for ts, _ in signals[:1]]
    since = min(troubled) if troubled else None
    primary = [e for e in real if not _secondary(e) and (since is None or e["ts"] < since)]
    secondary = [e for e in real if e not in primary]
    st.last_progress_ns = facts.last_ok.get(stream, (None, None))[0]
    st.launcher_signal = facts.signal_of_launcher(st.host)
    st.launcher_unsignalled = st.launcher_signal is None and st.host in facts.quiet_launcher_hosts
    fail = facts.failures.get((st.rank, st.restart))
    if fail:
        st.exit_code, st.signal = fail["exit_code"], fail["signal"]
        st.launcher_seen_ns = fail.get("failed_at_ns")
        st.source.append("launcher")
    elif facts.exits.get(stream) and f["closed"]:
        st.exit_code = facts.exits[stream]  # sys.exit(code) left its spans: the status its process ended with
    killed = bool(st.signal and st.signal != "SIGTERM") or (
        st.exit_code is not None and st.exit_code < 0 and st.exit_code != -15
    )
    if primary:
        st.state, st.error = "error", _error_info(primary[0])
        st.stopped_ns = primary[0]["ts"]
    elif killed and secondary:
        # Killed once the failure had reached it (its collective timed out, a peer was gone): a consequence too,
        # as the abort a communication library's watchdog sends a rank whose collective timed out (SIGABRT).
        st.state = "error"
    elif killed:
        st.state = "killed"
    elif secondary and not f["closed"] and not signals:
        # Its stream cut after the failure had reached it, with no launcher to say how it ended (plain torchrun):
        # aborted once its collective failed (faulthandler's stacks beside it say so), or killed while it wound
        # down. A consequence, as the same rank's SIGABRT the launcher saw is above.
        st.state = "error"
    elif signals:
        st.state = "terminated"
        sig = _attrs(signals[0][1])
        st.signal = st.signal or str(sig.get("signal") or sig.get("reason") or "SIGTERM")
    elif hangs:
        st.state = "hung"
    elif f["running"]:
        st.state = "running"
    elif st.exit_code is not None and st.exit_code > 0 and not secondary:
        # No exception, no signal: a process that left with a non-zero code the launcher saw, its stream cut
        # (os._exit(3)) or closed with its spans terminated (sys.exit(3)).
        st.state = "exited"
    elif not f["closed"]:
        st.state = "ended"
    elif secondary or f["failed"]:
        st.state = "error"
    if st.state in ("killed", "exited", "ended") or (st.state == "error" and not f["closed"] and not primary):
        st.fault_stacks = _fault_stacks(str(f["path"]), f["pid"], last_in_file=bool(f["last_in_file"]))
    if secondary:
        st.consequence = _error_info(secondary[0])
    if hangs:
        st.hang = {
            "ts": hangs[0]["ts"],
            "message": hangs[0]["message"],
            "stack": hangs[0]["stack"],
            "from_ns": f["hang_from"],
            # Where the progress file said the training thread was (phases timed without a span are only there).
            "progress_phase": _attrs(hangs[0]["attrs"]).get("progress_phase"),
        }
    # When the rank stopped: its first error or signal, else the end of its stream.
    marks = [e["ts"] for e in real[:1]] + [signals[0][0] for _ in signals[:1]]
    if signals:
        st.signal_ns = signals[0][0]
    if st.stopped_ns is None:
        st.stopped_ns = min(marks) if marks else f["end_ts"]
    # Where it was: at the hang if it hung first, else when it stopped.
    at = hangs[0]["ts"] if hangs and hangs[0]["ts"] <= st.stopped_ns else st.stopped_ns
    return st, at, primary[0]["span"] if primary else None


def _spans_at(job: Job, wanted: list[tuple[int, int | None]]) -> dict[int, list[dict[str, Any]]]:
    """stream -> its spans open at the time given for it (still open, or ended after it; spans a failure
    ended, not ok, may end just before its record), in the order they began."""
    pairs = ", ".join(f"({int(stream)}, {int(at)})" for stream, at in wanted if at is not None)
    out: dict[int, list[dict[str, Any]]] = {}
    if not pairs:
        return out
    times = [int(at) for _, at in wanted if at is not None]
    # Bounds every match is within, constants the engine applies before joining the plain iterations (a
    # scan of every record) with their streams.
    earliest, latest = min(times) - UNWIND_NS, max(times)
    # The (stream, time) pairs inline: one statement for every rank, in either engine's dialect. Plain
    # iteration records are not in spans_small (the iteration an exception unwound is one of them): read from
    # raw as the iterations view does, those near the times first.
    for row in job.dicts(
        f"""
        SELECT s.stream, s.id, s.parent, s.name, s.ts, s.dur, s.status, s.open, s.attrs, s.tid, s.step
        FROM (SELECT stream, id, parent, name, ts, dur, status, open, attrs, tid, NULL::BIGINT AS step
              FROM spans_small
              UNION ALL
              SELECT f.stream, r.id, r.parent, '{ITERATION}' AS name, r.ts, r.dur, r.status, false AS open, r.attrs,
                     r.tid, r.step
              FROM (SELECT * FROM raw WHERE plain
                    AND ts <= {latest} AND ts + dur >= {earliest}) r
              JOIN stream_facts f ON r.file = f.file AND r.ts >= f.lo AND r.ts < f.hi
              WHERE NOT f.is_agent) s
        JOIN (VALUES {pairs}) AS q(stream, at_ns) ON s.stream = q.stream
        WHERE s.ts <= q.at_ns
          AND (s.open OR s.ts + s.dur >= q.at_ns
               OR (s.status <> '{SpanStatus.OK}' AND s.ts + s.dur >= q.at_ns - {UNWIND_NS}))
        ORDER BY s.stream, s.ts, s.id
        """
    ):
        out.setdefault(row.pop("stream"), []).append(row)
    return out


def _locate(st: RankState, spans: list[dict[str, Any]], error_span: int | None) -> None:
    """Step, phase and collective from the spans a failure left open (or ended with it) where the rank stopped."""
    by_id = {s["id"]: s for s in spans}
    chain: list[dict[str, Any]] = []
    if error_span and error_span in by_id:
        node: dict[str, Any] | None = by_id[error_span]
        while node is not None and node not in chain:
            chain.append(node)
            node = by_id.get(node["parent"])
        chain.reverse()
    else:
        # The training thread's spans (a background checkpoint writer is not where the rank is), and its
        # collectives, which a communication hook may open from the autograd engine's threads.
        loops = [s for s in spans if s["name"] in (ITERATION, SpanName.TRAINING_LOOP)]
        tid = loops[-1]["tid"] if loops else None
        chain = [s for s in spans if tid is None or s["tid"] == tid or s["name"] == COLLECTIVE]
    since: int | None = None
    for span in chain:
        name = span["name"]
        if name == COLLECTIVE:
            st.in_collective = True
            st.collective = str(_attrs(span["attrs"]).get("op") or "collective")
            since = span["ts"]
            continue
        if name == ITERATION:
            # A plain iteration record's step is a column (its attributes are not kept for summary, ranks and
            # errors); an iteration's start record keeps its attributes.
            step = span.get("step")
            if step is None:
                step = _attrs(span["attrs"]).get("step")
            if isinstance(step, int):
                st.step = step
        elif name == SpanName.CHECKPOINT_SAVE_FINALIZATION and st.step is None:
            # A background save's thread has no iteration open: the step the save holds.
            held = _attrs(span["attrs"]).get("current_iteration")
            if type(held) is int:
                st.step = held
        if name not in CONTAINERS or st.phase in (None, *CONTAINERS):
            if st.in_collective and st.phase is not None and name not in CONTAINERS:
                st.in_collective = False  # a phase opened after the collective ended
            st.phase = name
            if not st.in_collective:
                since = span["ts"]
    if chain:
        st.source.append("stream")
    if st.state == "terminated" and since is not None:
        # What the signal interrupted, since when; the process lived until its handler ran.
        st.since_ns, st.alive_ns = int(since), st.stopped_ns


def _from_progress(job: Job, st: RankState, f: dict[str, Any], facts: _Facts) -> None:
    """A rank that died without writing its last records: the progress file knows its exact step and phase."""
    # The stream's own process's file: a job run again under the same restart number writes a new one.
    progress: Any = own_progress(job.progress_of_attempts().get((st.rank, st.restart)), f.get("pid"))
    if progress is None:
        # A later attempt rewrote the file (written before restarts kept theirs): the launcher's copy of it, made
        # when it saw this attempt's rank die.
        progress = (facts.failures.get((st.rank, st.restart)) or {}).get("progress")
        if progress is None:
            return
    st.stamped_ns = getattr(progress, "alive_ns", None)
    if st.state not in ("killed", "exited", "ended", "terminated", "running") or st.hang is not None:
        return  # an exception or a hang report says where the rank was; the file says where it ended up
    if st.state == "exited" and f["closed"]:
        return  # sys.exit(): the stream has every record, and the file counts the step it ended as done
    if st.state == "terminated" and "stream" in st.source:
        # The signal handler wrote everything: the stream says what the signal interrupted (the file, what was
        # left after it). Only the last step's duration is the file's.
        st.last_step_ns = getattr(progress, "last_step_ns", None)
        return
    updated = int(getattr(progress, "updated_ns", 0) or 0)
    if updated + CLOCKS_NS < (f["end_ts"] or 0) and updated + CLOCKS_NS < facts.last_span_ns(st):
        return  # the stream's spans went on after the file's last update: it knows more
    step, phase = getattr(progress, "step", None), getattr(progress, "phase", None)
    done = getattr(progress, "step_done", None)
    if isinstance(step, int):
        # Its last iteration completed: outside an iteration, the step it was preparing or saving after.
        st.step = step + 1 if done == step else step
    if isinstance(phase, str) and phase:
        st.in_collective = bool(getattr(progress, "in_collective", False)) or phase == COLLECTIVE
        if phase != COLLECTIVE:
            st.phase = phase
    collective = getattr(progress, "collective_started_ns", None)
    st.since_ns = collective if st.in_collective and collective else getattr(progress, "phase_started_ns", None)
    st.alive_ns = getattr(progress, "alive_ns", None)
    st.last_step_ns = getattr(progress, "last_step_ns", None)
    st.first_step_ns = getattr(progress, "first_step_ns", None)
    if st.state in ("killed", "exited", "ended"):
        st.stopped_ns = max(st.stopped_ns or 0, updated)
    st.source.append("progress file")


def _unresponsive(st: RankState) -> None:
    """A rank killed by a signal that the launcher saw end UNRESPONSIVE_NS or more after the last sign of life
    of its process: the writer thread stamps the progress file every flush interval whatever the training
    thread does, so a process that stamped nothing for that long did not run at all (torchrun's agent sends
    SIGTERM when another rank fails, and SIGKILL 30 s later to a process that did not end)."""
    if st.state != "killed" or st.launcher_seen_ns is None:
        return
    last_sign = max(st.alive_ns or 0, st.stopped_ns or 0)
    if last_sign and st.launcher_seen_ns - last_sign >= UNRESPONSIVE_NS:
        st.unresponsive_ns = st.launcher_seen_ns - last_sign


def _aborted_waiting(st: RankState) -> None:
    """A rank aborted (SIGABRT: the launcher's signal, or faulthandler's ``Fatal Python error: Aborted`` beside a
    stream that just stopped) after waiting STUCK_NS or more in a collective, until its process last stamped its
    progress file: a communication library's watchdog tore it down when the collective timed out (NCCL's, under
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING``), no exception raised. A consequence of the rank it waited for, as a
    timeout error would be; without this, the ranks that waited were killed first and named the culprits."""
    if st.state not in ("killed", "ended") or not st.in_collective or st.error is not None or st.consequence:
        return
    by_signal = st.signal == "SIGABRT" or st.exit_code == -6
    if not by_signal and not (st.state == "ended" and st.fault_stacks and ABORTED in st.fault_stacks):
        return
    died = max(st.alive_ns or 0, st.launcher_seen_ns or 0, st.stopped_ns or 0)
    if st.since_ns is None or died - st.since_ns < STUCK_NS:
        return  # an abort in the collective itself (a crash), not a wait the watchdog ended
    waited = (died - st.since_ns) / 1e9
    st.state, st.signal = "error", st.signal or "SIGABRT"
    st.consequence = {
        "ts": died,
        "error_type": "SIGABRT",
        "message": f"aborted after waiting {waited:.1f} s in a collective (a watchdog's timeout, as NCCL's)",
        "stack": st.fault_stacks,
    }


def _unresponsive_running(job: Job, states: list[RankState]) -> None:
    """In a running job, a rank read as running whose writer thread last stamped its progress file
    UNRESPONSIVE_NS or more before the latest stamp of the attempt's other ranks: their processes run, its does
    not (stopped, stuck holding the GIL, or its host froze or is cut off from the file system)."""
    files = job.progress_files()
    stamps = {
        s.rank: int(getattr(files.get(s.rank), "alive_ns", None) or 0)
        for s in states
        if getattr(files.get(s.rank), "restart", s.restart) == s.restart
    }
    for st in states:
        others = [t for r, t in stamps.items() if r != st.rank and t]
        mine = stamps.get(st.rank, 0)
        if st.state == "running" and mine and others and max(others) - mine >= UNRESPONSIVE_NS:
            st.unresponsive_ns = max(others) - mine
            _look_at_process(st, files.get(st.rank))


def _look_at_process(st: RankState, progress: Any) -> None:
    """The kernel's state of an unresponsive rank's process, where it runs on this host (``RankState.pid``)."""
    import socket

    from ..progress import process_state

    pid = getattr(progress, "pid", None)
    if not isinstance(pid, int) or getattr(progress, "host", None) != socket.gethostname():
        return
    state = process_state(pid, getattr(progress, "created_ns", None))
    if state is not None:
        st.pid, st.process_state = pid, state


def _why_unresponsive(st: RankState) -> str:
    """The likely causes of a rank that stopped responding, narrowed by its process's state where known."""
    if st.process_state == "t":
        return f"process {st.pid} is stopped by a debugger, state t"
    if st.process_state == "T":
        return (
            f"process {st.pid} is stopped, state T: a SIGSTOP, or a suspended job or shell; "
            f"kill -CONT {st.pid} resumes it"
        )
    if st.process_state is not None:
        return (
            f"process {st.pid} is alive, state {st.process_state}, but runs no Python: native code holding the GIL, "
            f"or a deadlock; py-spy dump --native --pid {st.pid} shows where"
        )
    return "a stopped or suspended process, native code stuck holding the GIL, or a frozen host"


#: At most this much of a fault file is read (a stream file's processes share it, each its part).
MAX_FAULTS_BYTES = 8 << 20


def _fault_stacks(stream_path: str, pid: Any, *, last_in_file: bool, limit: int = 65536) -> str | None:
    """What faulthandler wrote beside the stream when its process (``pid``) crashed (docs/reliability.md): the
    part of the fault file after that process's marker line. A file without marker lines (an older traintrace's)
    is the last process's of the stream file: before, a restart's processes shared it unmarked, and an attempt
    aborted before a restart that finished read as no more than a stream that ended."""
    path = Path(stream_path)
    try:
        with path.with_name(path.name + FAULTS_SUFFIX).open("rb") as handle:
            text = handle.read(MAX_FAULTS_BYTES).decode("utf-8", "replace")
    except OSError:
        return None
    parts: dict[str, str] = {}
    owner: str | None = None
    lines: list[str] = []
    for line in text.splitlines(keepends=True):
        if line.startswith(FAULTS_MARKER):
            if owner is not None:
                parts[owner] = "".join(lines)
            owner, lines = line[len(FAULTS_MARKER) :].strip(), []
        else:
            lines.append(line)
    if owner is None:
        mine = text if last_in_file else ""
    else:
        parts[owner] = "".join(lines)
        mine = parts.get(str(pid), "")
    return mine[:limit] if mine.strip() else None


def _attrs(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return {}


def _terminated_by(error: dict[str, Any]) -> bool:
    """The error is the rank's own termination by SIGTERM (``TERMINATED_WORKER``, ``IN_SIGTERM_HANDLER``)."""
    message = str(error.get("message") or "")
    if TERMINATED_WORKER.search(message):
        return True
    # Lightning's handler broadcasts to the other ranks: a peer gone fails it, and a loader worker the same SIGTERM
    # ended may be found gone while that failure is handled (the exception then names the worker).
    gone = _secondary(error) or bool(WORKER_EXITED.search(message))
    return gone and bool(IN_SIGTERM_HANDLER.search(str(error.get("stack") or "")))


def _secondary(error: dict[str, Any]) -> bool:
    text = f"{error.get('error_type') or ''}: {error.get('message') or ''}"
    return bool(SECONDARY.search(text))


def _error_info(error: dict[str, Any]) -> dict[str, Any]:
    return {
        "ts": error["ts"],
        "error_type": error["error_type"] or error["name"],
        "message": error["message"],
        "stack": error["stack"],
    }


# ---------------------------------------------------------------- the culprit


def _culprit(states: list[RankState]) -> tuple[RankState | None, str]:
    """The rank that caused the failure, and the rule that named it (docs/analysis.md)."""
    raised = [s for s in states if s.state == "error" and s.error is not None]
    if raised:
        return min(raised, key=lambda s: (s.error["ts"] if s.error else 0, s.rank)), "first exception"
    if _killed_together(states):
        # Nobody saw trouble before dying: no rank went first. One rank behind the others when the kill came is
        # not evidence of a hang (ranks in lockstep are a phase apart at any instant), unless the progress files
        # say it and the others had not moved for long before it.
        stuck = _waited_on(states)
        if stuck is not None:
            return stuck, "killed while waiting for a rank"
        return None, "killed together"
    if _terminated_together(states):
        stuck = _waited_on(states)
        if stuck is not None:
            return stuck, "terminated while waiting for a rank"
        return None, "terminated together"
    # A rank that died (a signal, or its stream just stopped) before any other rank saw trouble.
    died = [s for s in states if s.state in ("killed", "terminated", "exited", "ended")]
    for s in sorted(died, key=lambda s: (s.stopped_ns or 0, s.rank)):
        others = [o for o in states if o is not s]
        trouble = [_first_trouble(o) for o in others]
        if all(t is None or (s.stopped_ns or 0) <= t + SKEW_NS for t in trouble):
            return s, "stopped responding" if s.unresponsive_ns is not None else "died first"
    early = _left_early(states)
    if early is not None:
        return early, "left early"
    hung = [s for s in states if s.hang is not None or s.state == "hung"]
    if hung:
        last = min(states, key=_hang_key)
        others = [s for s in hung if s is not last and s.hang is not None]
        unreported = last.hang is None and last.state != "hung" and bool(others)
        if unreported:
            _hung_unreported(last, others)
        for stuck in _stuck_alongside(last, states):
            # Stuck where the rank behind is, with no report of its own either (a node's ranks that hung together):
            # hung as it is, not only ended by the signal that came later (its time is the hang's, not its phase's).
            if unreported and stuck.hang is None and stuck.state != "hung":
                _hung_unreported(stuck, others)
        return last, "hang: the rank behind"
    behind = _waited_for(states)
    if behind is not None:
        return behind, "hang: the rank the collectives timed out on"
    return None, "unknown"


def _hung_unreported(behind: RankState, reported: list[RankState]) -> None:
    """The rank behind made no hang report of its own (its phase has a longer timeout, a checkpoint save's, or
    its detection is off) while others reported theirs: it is marked hung from their first report, as a rank the
    collectives timed out on is, so that the verdict says it hung rather than only how it ended."""
    first = min(reported, key=lambda s: (s.hang or {}).get("ts") or 0)
    said = _first_line((first.hang or {}).get("message"), 100)
    where = "not in a collective" if not behind.in_collective else "in a collective the others never joined"
    message = f"{where} when rank {first.rank} reported a hang" + (f": {said}" if said else "")
    behind.hang = {
        "ts": (first.hang or {}).get("ts"),
        "message": message,
        "stack": None,
        "from_ns": behind.last_progress_ns,
    }


def _same_place(a: RankState, b: RankState) -> bool:
    """At the same step and phase, both in the same collective or both outside any."""
    return (a.step, a.phase, a.in_collective, a.collective) == (b.step, b.phase, b.in_collective, b.collective)


def _stuck_alongside(culprit: RankState, states: list[RankState]) -> list[RankState]:
    """The other ranks stuck where the hung culprit is: at its step and phase, not waiting in a collective the
    others wait in, with no error of their own (a rank that could move on would be in the others' collective
    by the time they timed out or reported a hang). They are named with it (``stuck_with``)."""
    if culprit.step is None:
        return []
    alongside = [
        s
        for s in states
        if s is not culprit
        and _same_place(s, culprit)
        and s.error is None
        and s.consequence is None
        and s.state in ("hung", "terminated", "killed", "ended", "running")
    ]
    culprit.stuck_with = sorted(s.rank for s in alongside)
    return alongside


def _left_early(states: list[RankState]) -> RankState | None:
    """A rank that finished normally (its stream closed, no error, no signal) before any other rank's trouble,
    while others then failed waiting (a timeout, a peer that closed the connection, a hang): its data ran out
    (uneven inputs) or its loop ended early, and the others waited for it in a collective."""
    left = [s for s in states if s.state == "closed" and s.hang is None and s.consequence is None]
    troubled = [(s, _first_trouble(s)) for s in states if s.consequence is not None or s.hang is not None]
    if not left or not troubled:
        return None
    first = min(left, key=lambda s: (s.stopped_ns or 0, s.rank))
    if all(t is None or (first.stopped_ns or 0) <= t + SKEW_NS for _, t in troubled):
        first.left_early = True
        return first
    return None


def _killed_together(states: list[RankState]) -> bool:
    """Every rank of the attempt died (a signal the launcher saw, or its stream cut) with no rank having seen
    trouble first (an error, a timeout, a hang report): a kill from outside, the scheduler's or the OOM
    killer's on every rank, or a lost node. Not where a launcher of ``traintrace-run``'s got a signal itself: it
    then stopped its ranks (``_terminated_together``), which died of it, or of its SIGKILL after they lingered,
    where nothing of traintrace's handled the signal (SIGQUIT, ``handle_sigterm=False``)."""
    if any(s.launcher_signal for s in states):
        return False
    return len(states) > 1 and all(
        s.state in ("killed", "ended") and s.error is None and s.consequence is None and s.hang is None for s in states
    )


def _terminated_together(states: list[RankState]) -> bool:
    """Every rank got a signal from outside at once (the scheduler's time limit or a cancelled job: Slurm signals
    every task) and none had seen trouble first: the launcher itself got a signal (``traintrace-run`` says so),
    or every rank handled SIGTERM within SKEW_NS of the first, but a rank blocked in native code when it came (in
    a collective, or where it had been since before: DDP's all-reduce inside backward), whose handler ran only
    once that returned, by COLLECTIVE_RELEASE_NS after the last of the prompt ones showed life (a 4-rank torchrun
    job terminated while rank 2 hung: the three in the all-reduce handled theirs 26 to 58 ms after it; later
    where a handler saves a checkpoint before the process exits, or where Lightning's handler broadcast to the
    others: a rank in backward's all-reduce handled its own 10 s later, when that timed out). (A launcher that
    stops the other ranks after one failed signals them later than that, and the failed rank did not handle a
    signal; the others, left in a collective by a rank that exited, record its failure before any signal. Where
    a launcher of ``traintrace-run``'s recorded the end and got no signal itself, nobody signalled the whole job:
    a scheduler signals the launcher too.)"""
    if len(states) < 2 or any(s.error is not None or s.hang is not None for s in states):
        return False
    # A consequence after the rank's own signal is its handler's (Lightning's broadcasts to the others): no sign
    # of trouble before it.
    if any(s.consequence is not None and not _after_own_signal(s, s.consequence) for s in states):
        return False
    if any(s.launcher_signal for s in states):
        return all(s.state in ("terminated", "killed", "ended") for s in states)
    if not all(s.state == "terminated" for s in states) or any(s.launcher_unsignalled for s in states):
        return False
    first = min(s.stopped_ns or 0 for s in states)
    prompt = [s for s in states if (s.stopped_ns or 0) - first <= SKEW_NS]
    late = [s for s in states if s not in prompt]
    # Blocked in native code when the signal came: in a collective, or where it had been since before the first
    # rank's signal (DDP's all-reduce inside backward, which a framework's callback records nowhere).
    if any(not s.in_collective and (s.since_ns is None or s.since_ns > first) for s in late):
        return False
    released = max(max(s.alive_ns or 0, s.stamped_ns or 0, s.stopped_ns or 0) for s in prompt)
    return all((s.stopped_ns or 0) - released <= COLLECTIVE_RELEASE_NS for s in late)


def _after_own_signal(s: RankState, info: dict[str, Any]) -> bool:
    ts = info.get("ts")
    return s.state == "terminated" and s.signal_ns is not None and isinstance(ts, int) and ts >= s.signal_ns


def _ended_how(states: list[RankState]) -> str:
    """How a job ended from outside was ended: "killed", or "terminated by SIGTERM"."""
    if _killed_together(states):
        return "killed"
    signal = next((s.launcher_signal for s in states if s.launcher_signal), None)
    signal = signal or next((s.signal for s in states if s.state == "terminated" and s.signal), "SIGTERM")
    return f"terminated by {signal}"


def _waited_on(states: list[RankState]) -> RankState | None:
    """In a job killed from outside (the scheduler's time limit on a hung job), or running, the rank the others
    wait for: the only rank not in a collective, at their step or behind (or, every rank in a collective, the
    one a step behind all the others; or, no rank in a recorded collective, the one behind all the others in the
    training step), whose progress file says it had been where it was for at least STUCK_NS (and STUCK_STEPS
    steps) when its writer last stamped the file, while every other rank had been waiting as long by its own
    file."""
    if any(s.since_ns is None or s.alive_ns is None for s in states):
        return None
    outside = [s for s in states if not s.in_collective]
    if outside and all(_same_place(s, outside[0]) for s in outside):
        # One rank, or several stuck at the same place (every rank of a node whose file system hangs).
        rank = min(outside, key=lambda s: s.rank)
        waiting = [s for s in states if s not in outside]
        if rank.step is None:
            # No step known: only when no rank has begun one, all in the loop for their first batch (the Hugging
            # Face Trainer fetches a step's batch before the step begins).
            if any(s.step is not None or s.phase not in FIRST_BATCH_PHASES for s in states):
                return None
        elif any(s.step is None or s.step < rank.step for s in waiting):
            return None
        stuck = outside
    elif not outside:
        # Every rank in a collective: the one a step behind all the others is in one they never joined.
        rank = min(states, key=lambda s: (s.step if s.step is not None else -1, s.rank))
        waiting = [s for s in states if s is not rank]
        if rank.step is None or any(s.step is None or s.step <= rank.step for s in waiting):
            return None
        stuck = [rank]
    elif len(outside) == len(states):
        behind = _behind_in_step(states)
        if behind is None:
            return None
        rank, stuck = behind
    else:
        return None
    steps = sorted(s.last_step_ns for s in states if s.last_step_ns)
    least = max(STUCK_NS, STUCK_STEPS * steps[len(steps) // 2]) if steps else STUCK_NS

    def still(s: RankState) -> int:
        return (s.alive_ns or 0) - (s.since_ns or 0)

    if any(still(s) < least for s in states):
        return None
    rank.stuck_ns = min(still(s) for s in stuck)
    rank.stuck_with = sorted(s.rank for s in stuck if s is not rank)
    return rank


def _behind_in_step(states: list[RankState]) -> tuple[RankState, list[RankState]] | None:
    """No rank in a recorded collective (the Lightning and Hugging Face callbacks record none: DDP's all-reduce
    runs inside backward), every rank in a phase of a training step: the rank behind all the others, at an
    earlier step or an earlier phase of the same one (in forward while they are in backward, whose all-reduce
    waits for its gradients), and the ranks at its very place with it. None when no one rank is behind."""
    if any(s.step is None or s.phase not in STEP_ORDER for s in states):
        return None

    def where(s: RankState) -> tuple[int, int]:
        return s.step or 0, STEP_ORDER[s.phase or ""]

    rank = min(states, key=lambda s: (*where(s), s.rank))
    stuck = [s for s in states if where(s) == where(rank)]
    if len(stuck) == len(states):
        return None
    return rank, stuck


def _waited_for(states: list[RankState]) -> RankState | None:
    """A hang that no report names (detection off, or slower than the collective's timeout), told by the ranks
    whose collective timed out: the rank at their step or behind that was not in a collective, or the one
    rank a step behind all the others (stuck in a collective they never joined). That rank is marked hung
    from the first timeout on (the verdict then reads as for a reported hang)."""
    known = [s for s in states if s.step is not None]
    waiting = [s for s in known if s.consequence is not None]
    if not waiting:
        return _waited_for_before_the_loop(states)
    behind = min(known, key=_hang_key)
    peers = [s for s in waiting if s is not behind]
    if not peers:
        return None  # only the rank's own collective failed: nothing says the others waited for it
    first = min(peers, key=lambda s: s.consequence["ts"] if s.consequence else 0)
    timeout = first.consequence or {}
    said = _first_line(timeout.get("message"), 100)
    ahead = min(s.step or 0 for s in known if s is not behind)
    # Its own failure, if any, came after the others' collective failed and was no timeout of its own: the
    # teardown (a peer gone, the launcher's SIGTERM), not a collective it waited in too.
    own = behind.consequence
    torn_down = (
        own is not None
        and (own.get("ts") or 0) > (timeout.get("ts") or 0)
        and not TIMED_OUT.search(str(own.get("message") or ""))
    )
    if (
        not behind.in_collective
        and (own is None or torn_down)
        and (behind.step or 0) <= min(s.step or 0 for s in peers)
    ):
        message = f"not in a collective when rank {first.rank}'s collective failed: {said}"
    elif behind.in_collective and (behind.step or 0) < ahead:
        message = (
            f"in a collective at step {behind.step} that the others, at step {ahead}, never joined; "
            f"rank {first.rank}'s failed: {said}"
        )
    else:
        return None
    for stuck in (behind, *_stuck_alongside(behind, states)):
        stuck.hang = {"ts": timeout.get("ts"), "message": message, "stack": None, "from_ns": stuck.last_progress_ns}
    return behind


def _waited_for_before_the_loop(states: list[RankState]) -> RankState | None:
    """Before the training loop (no step known, no collective span: DDP's first broadcast is inside model
    initialisation), the ranks whose collective timed out waited for the one rank that saw no error at all:
    only when it is the only one (with more, the launcher stopped some before their own timeout, and which
    one held the others up is not known)."""
    if any(s.step is not None for s in states):
        return None
    waiting = [s for s in states if s.consequence is not None and s.error is None]
    quiet = [s for s in states if s.consequence is None and s.error is None and s.state != "closed"]
    if not waiting or len(quiet) != 1:
        return None
    (behind,) = quiet
    first = min(waiting, key=lambda s: s.consequence["ts"] if s.consequence else 0)
    timeout = first.consequence or {}
    behind.hang = {
        "ts": timeout.get("ts"),
        "message": f"the only rank whose collective did not fail when rank {first.rank}'s did: "
        f"{_first_line(timeout.get('message'), 100)}",
        "stack": None,
        "from_ns": behind.last_progress_ns,
    }
    return behind


def _first_trouble(s: RankState) -> int | None:
    marks = [
        t
        for t in (
            s.consequence and s.consequence["ts"],
            s.hang and s.hang["ts"],
            s.stopped_ns if s.state != "closed" else None,
        )
        if t
    ]
    return min(marks) if marks else None


def _hang_key(s: RankState) -> tuple[float, int, float, float, int]:
    """Lowest step first, then not waiting in a collective, then the earlier phase of the step (a rank still
    loading its batch is behind one in backward), then the earliest last progress."""
    step = float(s.step) if s.step is not None else float("inf")
    order = float(STEP_ORDER.get(s.phase or "", 1.5))
    return step, int(_waits(s)), order, float(s.last_progress_ns or 0), s.rank


def _waits(s: RankState) -> bool:
    """In a collective, or failed by one: a communication error (a timeout, a peer gone) is raised by a
    collective whether or not the rank's collectives were recorded (DDP's all-reduce runs inside backward, and
    the Lightning and Hugging Face callbacks record no collective spans)."""
    return s.in_collective or s.consequence is not None


def _cause(s: RankState) -> str:
    if s.state == "diverged" and s.non_finite is not None:
        info = s.non_finite
        return f"its {info['metric']} became {info['value']}" + ("" if s.step is None else f" at step {s.step}")
    if s.stuck_ns is not None and s.state == "running":
        return f"the others wait for it: no progress for {s.stuck_ns / 1e9:.1f} s (no hang report yet)"
    if s.stuck_ns is not None:
        how = "terminated" if s.state == "terminated" else "killed"
        return f"hang: no progress for {s.stuck_ns / 1e9:.1f} s, then the whole job was {how} from outside"
    if s.hang is not None and s.error is None:
        then = {"terminated": f"; then terminated by {s.signal or 'SIGTERM'}", "killed": "; then killed"}
        ending = then.get(s.state, "")
        if not ending and s.state == "error" and s.consequence is not None:
            # The teardown's error (a peer gone once the others gave up), said as how the rank ended.
            kind = s.consequence["error_type"]
            ending = f"; then failed as a consequence: {kind}: {_error_line(kind, s.consequence['message'])}"
        return f"hang: stopped making progress ({_first_line(s.hang['message'])}){ending}"
    if s.state == "error" and s.error is not None:
        line = f"{s.error['error_type']}: {_error_line(s.error['error_type'], s.error['message'])}"
        if s.out_of_memory:
            return f"ran out of memory: {line}"
        return f"raised {line}" + (" (the checkpoint's file system was full)" if s.disk and s.disk.get("full") else "")
    if s.state == "killed":
        sig = s.signal or (f"signal {-s.exit_code}" if s.exit_code is not None and s.exit_code < 0 else "a signal")
        killed = f"killed by {sig}" + ("" if s.exit_code is None else f" (exit code {s.exit_code})")
        if s.unresponsive_ns is not None:
            return f"stopped responding: no sign of life for {s.unresponsive_ns / 1e9:.0f} s, then {killed}"
        return killed
    if s.state == "running" and s.unresponsive_ns is not None:
        return f"stopped responding: no sign of life for {s.unresponsive_ns / 1e9:.0f} s while the other ranks' wrote"
    if s.state == "terminated":
        return f"terminated by {s.signal or 'SIGTERM'}"
    if s.state == "exited":
        return f"exited with exit code {s.exit_code} (no exception, no signal)"
    if s.left_early:
        return "left early: finished normally (no error, no signal) while the others still trained"
    if s.hang is not None:
        return "stopped making progress (hang)"
    if s.state == "ended":
        return "its stream ended without a close record (killed, or crashed)"
    if s.consequence is not None:
        by = s.signal if s.signal and s.signal != "SIGTERM" else None
        if by is None and s.exit_code is not None and s.exit_code < 0 and s.exit_code != -15:
            by = f"signal {-s.exit_code}"
        ending = "" if by is None or s.consequence["error_type"] == by else f"; then killed by {by}"
        kind, message = s.consequence["error_type"], _first_line(s.consequence["message"])
        return f"failed as a consequence: {kind}: {message}{ending}"
    return s.state


#: Wrappers that hide the informative part of communication errors (torch futures nest the cause).
_NOISE = (
    re.compile(r"(?:Got the following error when running the callback: \w+: )+"),
    re.compile(r"\[[^\]\s]*\.(?:cc|cpp|h|hpp):\d+\] "),
    # PyTorch's failed checks: "[enforce fail at alloc_cpu.cpp:127] err == 0. " before the message.
    re.compile(r"\[enforce fail at [^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*(?:[^.\n]{0,80}\.\s+)?"),
)


#: PyTorch's ExceptionWrapper (a DataLoader worker's exception re-raised in the training process): the message
#: says where it was caught, then the original traceback, whose exception line is the informative part.
_CAUGHT = re.compile(r"Caught \w+ in (.+?)\.\s*\nOriginal Traceback \(most recent call last\):\n")


def _error_line(error_type: str | None, message: str | None) -> str:
    """The line that says what went wrong: the original exception of one re-raised from a DataLoader worker
    (``corrupt sample 24 (in DataLoader worker process 0)``), else the message's first line."""
    caught = _CAUGHT.match(message or "")
    if caught is not None and message is not None:
        # The exception line is the first after the frames that is not indented.
        original = next((ln for ln in message[caught.end() :].splitlines() if ln and not ln[0].isspace()), None)
        if original is not None:
            if error_type and original.startswith(f"{error_type}:"):
                original = original[len(error_type) + 1 :].strip()
            return _first_line(f"{original} (in {caught.group(1)})")
    return _first_line(message)


def _first_line(text: str | None, limit: int = 160) -> str:
    for noise in _NOISE:
        text = noise.sub("", text or "")
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _every_rank(count: int) -> str:
    return "the only rank" if count == 1 else "both ranks" if count == 2 else f"all {count} ranks"


#: What a signal the whole job got at once says of where it came from, for those a terminal sends.
_TERMINAL_SIGNALS = {
    "SIGINT": "Ctrl-C in its terminal",
    "SIGHUP": "its terminal closed: an ssh session dropped or its shell exited; run it under nohup, tmux or a "
    "scheduler",
}


def _sentence(culprit: RankState | None, states: list[RankState]) -> str:
    if culprit is None and _killed_together(states):
        launcher = any("launcher" in s.source for s in states)
        how = "killed by a signal" if launcher else "cut off without a close record"
        were = "was" if len(states) == 1 else "were"
        return (
            f"killed from outside: {_every_rank(len(states))} {were} {how} at once, none failed first "
            f"(the scheduler, the OOM killer or a lost node); " + _doing_groups(states)
        )
    if culprit is None and _terminated_together(states):
        launchers = "the launchers" if len({s.host for s in states}) > 1 else "the launcher"
        who = f"{launchers} and " if any(s.launcher_signal for s in states) else ""
        how = _ended_how(states)
        # SIGINT is Ctrl-C in the job's terminal (to the launcher's process group; torchrun passes it on), SIGHUP
        # the terminal closing (the kernel's to its foreground process group, the shell's to its jobs).
        why = _TERMINAL_SIGNALS.get(how.rpartition(" ")[2], "the scheduler's time limit, or a cancelled job")
        return (
            f"{how} from outside: {who}{_every_rank(len(states))} got the signal at once, none failed "
            f"first ({why}); " + _doing_groups(states)
        )
    if culprit is None:
        first = min(
            (s for s in states if _first_trouble(s) is not None), key=lambda s: _first_trouble(s) or 0, default=None
        )
        if first is None:
            return "failed, cause unknown: no rank recorded an error, a signal or a hang"
        # The cause reads as a state ("running", "hang: ...") as often as an action: given in parentheses.
        head = f"failed, cause unclear: the first sign is on rank {first.rank} ({_cause(first)}), {first.doing()}"
        rest = [s for s in states if s is not first]
        return head + "; " + _doing_groups(rest, died=True) if rest else head
    who = _group_phrase(culprit, states)
    if culprit.out_of_memory and culprit.error is not None:
        head = f"rank {culprit.rank} ran out of memory ({culprit.error['error_type']}) {culprit.doing()}"
        head += _memory_phrase(culprit.memory)
    elif culprit.state == "error" and culprit.error is not None:
        head = f"rank {culprit.rank} raised {culprit.error['error_type']} {culprit.doing()}"
        head += _disk_phrase(culprit.disk)
    elif culprit.stuck_ns is not None and culprit.state == "running":
        head = f"running, waiting on {who}: {_where_stuck(culprit)}, for {culprit.stuck_ns / 1e9:.0f} s"
    elif culprit.stuck_ns is not None:
        head = (
            f"{who} hung {_where_stuck(culprit)}: no progress for "
            f"{culprit.stuck_ns / 1e9:.0f} s when the whole job was {_ended_how(states)} from outside"
        )
    elif culprit.unresponsive_ns is not None and culprit.state == "running":
        head = (
            f"rank {culprit.rank} stopped responding {culprit.doing()}: its process, traintrace's writer thread "
            f"included, has done nothing for {culprit.unresponsive_ns / 1e9:.0f} s while the other ranks' wrote "
            f"({_why_unresponsive(culprit)})"
        )
    elif culprit.unresponsive_ns is not None:
        head = (
            f"rank {culprit.rank} stopped responding {culprit.doing()}: its process, traintrace's writer thread "
            f"included, did nothing for {culprit.unresponsive_ns / 1e9:.0f} s until the launcher killed it "
            f"({culprit.signal or 'SIGKILL'}) (a stopped or suspended process, native code stuck holding the "
            "GIL, or a frozen host)"
        )
    elif culprit.state in ("killed", "terminated") and culprit.hang is None:
        head = f"rank {culprit.rank} was {_cause(culprit)} {culprit.doing()}"
        if culprit.state == "killed":
            head += _host_full_phrase(culprit.memory)
    elif culprit.hang is not None or culprit.state == "hung":
        head = f"{who} hung {_where_stuck(culprit)}"
    elif culprit.state == "ended":
        head = f"rank {culprit.rank} stopped: {_cause(culprit)} {culprit.doing()}"
    elif culprit.left_early:
        at = "" if culprit.step is None else f" {'after' if culprit.after_loop else 'before'} step {culprit.step}"
        head = f"rank {culprit.rank} left early: it finished normally{at} while the others still trained"
    else:
        head = f"rank {culprit.rank} {_cause(culprit)} {culprit.doing()}"
    others = [s for s in states if s is not culprit and s.rank not in culprit.stuck_with]
    return head + "; " + _doing_groups(others, died=True) if others else head


def _group_phrase(culprit: RankState, states: list[RankState]) -> str:
    """``rank 2``; with ranks stuck alongside, ``ranks 2 and 3``, and in a job of several hosts the host they
    share: ``ranks 2 and 3 (every rank of node node-b)`` (a node's file system or network is the suspect)."""
    group = [culprit.rank, *culprit.stuck_with]
    return _ranks_phrase(group) + node_phrase(shared_node(group, {s.rank: s.host for s in states}))


def shared_node(group: list[int], host_of: dict[int, str | None]) -> dict[str, Any] | None:
    """The host that every rank of ``group`` (two or more) runs on, in a job of several hosts, and whether they
    are all of its ranks: ``{"host": "node-b", "every_rank": True}``; None otherwise."""
    mine = {host_of.get(rank) for rank in group}
    if len(group) < 2 or len(set(host_of.values())) < 2 or len(mine) != 1 or None in mine:
        return None
    host = mine.pop()
    return {"host": host, "every_rank": {r for r, h in host_of.items() if h == host} == set(group)}


def node_phrase(node: dict[str, Any] | None) -> str:
    """`` (every rank of node node-b)``, `` (all on node node-b)`` or nothing."""
    if node is None:
        return ""
    return f" (every rank of node {node['host']})" if node["every_rank"] else f" (all on node {node['host']})"


def _memory(job: Job, st: RankState) -> dict[str, Any] | None:
    """The rank's memory in its stream's ``device_properties`` samples up to its end: its resident set at the
    first and the last sample and its peak, the host's, its memory cgroup's and the GPU's use at the last. None
    without samples."""
    until = st.stopped_ns if st.stopped_ns is not None else (1 << 62)
    rows = job.rows(
        f"""
        SELECT ts, try_cast(attrs->>'process_rss' AS BIGINT), try_cast(attrs->>'host_memory_used' AS BIGINT),
               try_cast(attrs->>'host_memory_total' AS BIGINT), try_cast(attrs->>'memory_usage' AS BIGINT),
               try_cast(attrs->>'memory_total' AS BIGINT), try_cast(attrs->>'cgroup_memory_used' AS BIGINT),
               try_cast(attrs->>'cgroup_memory_limit' AS BIGINT)
        FROM other WHERE stream = {int(st.stream)} AND kind = 'event' AND name = '{EventName.DEVICE_PROPERTIES}'
              AND ts <= {int(until)}
        ORDER BY ts
        """
    )
    rss = [(int(ts), int(value)) for ts, value, *_ in rows if value is not None]
    if not rows:
        return None
    last = rows[-1]
    out: dict[str, Any] = {"samples": len(rows), "last_sample_ts": int(last[0])}
    if rss:
        out |= {
            "rss_first": rss[0][1],
            "rss_first_ts": rss[0][0],
            "rss_last": rss[-1][1],
            "rss_last_ts": rss[-1][0],
            "rss_max": max(v for _, v in rss),
        }
    keys = ("host_used", "host_total", "gpu_used", "gpu_total", "cgroup_used", "cgroup_limit")
    for key, value in zip(keys, last[2:], strict=True):
        if value is not None:
            out[key] = int(value)
    return out


def _size(n: int) -> str:
    """Bytes as people read them: ``672 MiB``, ``1.4 GiB``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{n} B"


def _memory_phrase(memory: dict[str, Any] | None) -> str:
    """``; its resident memory grew from 320 MiB to 648 MiB over the 0.6 s before its last sample (host memory
    45% used)``, the GPU's use too when sampled; empty without samples."""
    if not memory:
        return ""
    extras = []
    if memory.get("cgroup_limit") and memory.get("cgroup_used") is not None:
        extras.append(f"its memory cgroup {memory['cgroup_used'] / memory['cgroup_limit']:.0%} of its limit")
    if memory.get("host_total") and memory.get("host_used") is not None:
        extras.append(f"host memory {memory['host_used'] / memory['host_total']:.0%} used")
    if memory.get("gpu_total") and memory.get("gpu_used") is not None:
        extras.append(f"GPU memory {_size(memory['gpu_used'])} of {_size(memory['gpu_total'])} used")
    if "rss_last" in memory:
        first, last = memory["rss_first"], memory["rss_last"]
        seconds = (memory["rss_last_ts"] - memory["rss_first_ts"]) / 1e9
        if last > first and seconds > 0:
            grew = f"grew from {_size(first)} to {_size(last)}"
            phrase = f"its resident memory {grew} over the {seconds:.1f} s before its last sample"
        else:
            phrase = f"its resident memory was {_size(last)} at its last sample"
    elif extras:
        phrase, extras = f"at its last memory sample: {extras[0]}", extras[1:]
    else:
        return ""
    return "; " + phrase + (f" ({', '.join(extras)})" if extras else "")


def _disk(job: Job, st: RankState) -> dict[str, Any] | None:
    """The space the failed save left on its file system, the last completed save's size, and ``full``: the
    error says so (``NO_SPACE``), or less is free than the last save took (without one: under ``FULL_SHARE``)."""
    names = ", ".join(f"'{n}'" for n in CHECKPOINT_SAVES)
    rows = job.rows(
        f"""
        SELECT status, try_cast(attrs->>'fs_free_bytes' AS BIGINT), try_cast(attrs->>'fs_total_bytes' AS BIGINT),
               attrs->>'checkpoint_path', try_cast(attrs->>'checkpoint_size' AS BIGINT)
        FROM spans_small WHERE stream = {int(st.stream)} AND name IN ({names}) AND NOT open
        ORDER BY ts
        """
    )
    failed = [r for r in rows if r[0] == SpanStatus.ERROR]
    error = st.error or {}
    said = bool(NO_SPACE.search(f"{error.get('error_type') or ''}: {error.get('message') or ''}"))
    if not failed and not said:
        return None
    out: dict[str, Any] = {"full": said}
    if failed:
        _, free, total, path, _ = failed[-1]
        last = next((r[4] for r in reversed(rows) if r[0] == SpanStatus.OK and r[4] is not None), None)
        out |= {"free": free, "total": total, "path": path, "last_checkpoint_size": last}
        if free is not None and total:
            out["full"] = said or (free < last if last else free < FULL_SHARE * total)
    return out


def _disk_phrase(disk: dict[str, Any] | None) -> str:
    """``; the checkpoint's file system was full: 12 KiB free of 2.0 MiB, less than the last checkpoint took
    (700 KiB)``; empty unless it was."""
    if not disk or not disk.get("full"):
        return ""
    if disk.get("free") is None or not disk.get("total"):
        return "; the checkpoint's file system was full (no space left on the device)"
    phrase = f"; the checkpoint's file system was full: {_size(disk['free'])} free of {_size(disk['total'])}"
    if disk.get("last_checkpoint_size"):
        phrase += f", less than the last checkpoint took ({_size(disk['last_checkpoint_size'])})"
    return phrase


def _host_full_phrase(memory: dict[str, Any] | None) -> str:
    """For a killed rank: its memory cgroup's limit (a container's, a Slurm job's) or the host's memory nearly
    reached at its last sample points at the kernel's OOM killer, which sends SIGKILL and leaves no message."""
    if not memory:
        return ""
    for used, total, what in (
        ("cgroup_used", "cgroup_limit", f"of its memory cgroup's {_size(memory.get('cgroup_limit') or 0)} limit"),
        ("host_used", "host_total", "of the host's memory"),
    ):
        if memory.get(total) and memory.get(used) is not None:
            share = memory[used] / memory[total]
            if share >= HOST_MEMORY_FULL:
                return f" ({share:.0%} {what} was used at its last sample: likely the kernel's OOM killer)"
    return ""


def _where_stuck(s: RankState) -> str:
    """Where a hung rank is: "in forward at step 6, not in a collective", "inside a collective at step 6"."""
    at = "" if s.step is None else f" at step {s.step}"
    phase = PHASE_LABELS.get(s.phase or "", s.phase or "an unknown phase")
    if s.in_collective:
        inside = "" if s.phase in (None, ITERATION) else f" in {phase}"
        return f"inside a collective{inside}{at}"
    return f"in {phase}{at}, not in a collective"


def _doing_groups(states: list[RankState], *, died: bool = False) -> str:
    """What the ranks were doing, ranks doing the same in one phrase: "ranks 0 and 2 were in forward at step 6";
    with ``died``, a rank the launcher saw killed or exit says so, first ("rank 1 was killed by SIGKILL ... too"),
    and so does one that raised an error of its own ("ranks 0 and 2 raised FloatingPointError too, in ...")."""
    groups: dict[tuple[bool, bool, str], list[int]] = {}
    for s in states:
        gone = died and s.state in ("killed", "exited")
        raised = died and s.state == "error" and s.error is not None and s.consequence is None
        what = f"raised {s.error['error_type']} too, " if raised and s.error is not None else ""
        groups.setdefault((not (gone or raised), raised, f"{_cause(s)} too, " * gone + what + s.doing()), []).append(
            s.rank
        )
    return "; ".join(
        f"{_ranks_phrase(ranks)} {'' if raised else 'was ' if len(ranks) == 1 else 'were '}{doing}"
        for (_, raised, doing), ranks in sorted(groups.items(), key=lambda kv: (kv[0][0], min(kv[1])))
    )


def _ranks_phrase(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) <= 4:
        return "ranks " + ", ".join(str(r) for r in ranks[:-1]) + f" and {ranks[-1]}"
    from ._engine import compress_ranks

    return f"ranks {compress_ranks(ranks)}"


def _running_sentence(states: list[RankState], failed: list[int]) -> str:
    steps = [s.step for s in states if s.step is not None]
    at = f", at step {max(steps)}" if steps else ""
    hung = [s.rank for s in states if s.hang is not None]
    extra = f"; a hang is suspected on {_ranks_phrase(hung)}" if hung else ""
    earlier = f" (after {len(failed)} failed attempt(s))" if failed else ""
    return f"running: {_count(len(states), 'rank')} still writing{at}{earlier}{extra}"


def _count(n: int, noun: str) -> str:
    """``1 rank``, ``3 ranks``: sentences read by people."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
