"""Made-up jobs with known truths, for the traintrace command's tests.

``write_job`` writes record-format-v1 files from a scripted timeline (no
library involved); ``expected`` computes, by plain arithmetic on the same
parameters, what the analysis must report. The two share only the
parameters, so an error in the engine cannot hide in both.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

S = 1_000_000_000
T0 = 1_800_000_000 * S
#: What gloo raises in a collective whose peer died.
CLOSED_BY_PEER = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:29500"
#: What gloo raises in a collective that waited longer than the process group's timeout.
TIMED_OUT = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting {ms}ms for recv operation"
#: Where a hung rank can be stuck: a phase of its step (not in a collective), or a collective the others never
#: joined (one more at the end of its step).
HANG_PHASES = ("data_loading", "model_forward", "model_backward", "optimizer_update", "collective")
#: Hangs past the step's all-reduce (in backward): the others finish that step and wait in the next one's.
PAST_ALL_REDUCE = ("optimizer_update", "collective")


@dataclass
class Script:
    ranks: int = 4
    world_size: int | None = None  # > ranks: the extra ranks are missing
    steps: int = 40
    step_s: float = 0.1
    straggler: int | None = 2
    straggler_factor: float = 1.5
    straggler_from: int = 0  # the straggler's steps before this one take step_s
    extra_s: dict[tuple[int, int], float] = field(default_factory=dict)  # (rank, step): seconds added (noise)
    init_s: float = 1.0
    checkpoint_every: int = 10
    save_s: float = 0.5
    save_extra_s: dict[tuple[int, int], float] = field(default_factory=dict)  # (rank, step saved): seconds added
    load_s: float = 0.5
    fail_rank: int | None = 3
    fail_step: int | None = 25  # the failing rank raises in this step; the others are killed in it
    restart_gap_s: float = 60.0
    name_prefix: str = ""
    message: str = "CUDA error: an illegal memory access"
    ranks_per_host: int | None = None  # hosts node0, node1, ... of this many ranks each; None: every rank on "h"
    # How the failing rank fails: "raise" (an exception half-way through the step; the others stop there without
    # a trace, killed) or "died" (it stops without a trace at the step's start, SIGKILLed; the others' collective
    # fails half-way through the step plus ``consequence_after_s``: a communication error, a consequence).
    # Or "terminated": no rank fails; the scheduler's SIGTERM reaches every rank in that step at once (rank r
    # handles it ``r * signal_spread_s`` after rank 0), and each closes its stream. Or "hang": the failing rank
    # stops making progress in ``hang_phase`` of its step while the others wait in their backward's all-reduce
    # (``hang_timeline``). ``expected`` knows "raise" only.
    fault: str = "raise"
    peers_fail: bool = False  # "raise": the others' collective fails (as in "died") instead of their being killed
    # "raise": this many restarts fail the same way (the rank raises in the same step again), then one completes.
    fails_again: int = 0
    consequence_after_s: float = 0.0
    signal_spread_s: float = 0.0
    hang_phase: str = "model_forward"  # one of HANG_PHASES
    # traintrace's hang detection: each rank reports ``hang_suspected`` this long after its last progress (None:
    # off); the hung rank itself does not when ``hung_reports`` is false (its phase's limit is longer).
    hang_report_s: float | None = 1.5
    hung_reports: bool = True
    # How the hang ends: "timeout" (the waiting ranks' collectives time out ``collective_timeout_s`` after they
    # began, they raise and close, and the launcher's SIGTERM reaches the hung rank half a second after the first)
    # or "killed" (from outside, ``kill_after_s`` after the last hang report: nothing more is written).
    hang_end: str = "timeout"
    # Every rank of the hung rank's host hangs with it, at the same place (a node whose file system stopped
    # answering), when there is such a host with other ranks beside ranks elsewhere (``hung_ranks``).
    hang_node: bool = False
    # "stall": step ``fail_step`` lasts this much longer on every rank (a slow file system, a long garbage
    # collection); hang detection reports it when ``hang_report_s`` is shorter, and then that it resolved. The job
    # goes on to its end.
    stall_s: float = 120.0
    collective_timeout_s: float = 30.0
    kill_after_s: float = 5.0
    files: dict[int, Path] = field(default_factory=dict)

    def host(self, rank: int) -> str:
        return "h" if self.ranks_per_host is None else f"node{rank // self.ranks_per_host}"

    def step_dur(self, rank: int) -> int:
        factor = self.straggler_factor if rank == self.straggler else 1.0
        return round(self.step_s * factor * S)

    def step_dur_at(self, rank: int, step: int) -> int:
        """One step's duration; ``expected`` assumes ``step_dur`` (no ``straggler_from`` or ``extra_s``)."""
        d = self.step_dur(rank) if step >= self.straggler_from else round(self.step_s * S)
        if self.fault == "stall" and step == self.fail_step:
            d += round(self.stall_s * S)  # every rank: the others wait for the stalled one in the all-reduce
        return d + round(self.extra_s.get((rank, step), 0.0) * S)


def _line(record: dict[str, Any]) -> str:
    return json.dumps(record, separators=(",", ":")) + "\n"


def write_job(folder: Path, script: Script) -> Script:
    folder.mkdir(parents=True, exist_ok=True)
    world = script.world_size or script.ranks
    for rank in range(script.ranks):
        path = folder / f"rank{rank}.jsonl"
        script.files[rank] = path
        with path.open("w") as out:
            last = script.fail_step + 1 if script.fail_step is not None and script.fault == "raise" else script.steps
            attempts = [(0, 0, last)]
            if script.fail_step is not None and script.fault != "stall":
                resume = (script.fail_step // script.checkpoint_every) * script.checkpoint_every
                attempts += [(k, resume, script.fail_step + 1) for k in range(1, script.fails_again + 1)]
                attempts.append((script.fails_again + 1, resume, script.steps))
            for restart, first, last in attempts:
                out.write("".join(_attempt(script, rank, world, restart, first, last)))
    return script


def clock_ahead(folder: Path, ranks: list[int], ns: int, *, ends_only: bool = False) -> None:
    """Rewrite the ranks' files as a host whose clock runs ``ns`` ahead would have written them (``ends_only``:
    instead, each of their steps ends ``ns`` later, its start and the rest as they were)."""
    for rank in ranks:
        path = folder / f"rank{rank}.jsonl"
        out = []
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if ends_only:
                if record.get("name") == "iteration" and isinstance(record.get("dur"), int):
                    record["dur"] += ns
            else:
                for key in ("ts", "last_ts"):
                    if isinstance(record.get(key), int):
                        record[key] += ns
            out.append(json.dumps(record))
        path.write_text("\n".join(out) + "\n")


def write_framework_job(
    folder: Path,
    slow_rank: int,
    slow_from: int,
    part: str,
    *,
    gather: bool = False,
    every: int = 1,
    until: int = 12,
    ranks: int = 2,
    wait_in_forward: tuple[int, ...] = (),
    busy: dict[tuple[int, int], int] | None = None,
    at: tuple[int, ...] = (),
    slow_fetch: tuple[int, int, int] | None = None,
    save_ms: int = 0,
) -> None:
    """Two ranks of a data-parallel job as the Lightning and Trainer callbacks record it: per step a wait for the
    batch just before the step, then forward, backward and the optimizer's step, no collective recorded; every
    four steps a validation pass, with the short waits the callback opens around it. From step ``slow_from`` on
    ``slow_rank`` is 50 ms slower in forward (``part`` "compute") or in its wait (``data_loading``), and the other
    rank waits as long in backward (DDP's all-reduce), or with ``gather`` in a collective inside its own wait (the
    Trainer's token-count gather, which waits for the slow rank's loader). With ``every`` or ``until``, slower at
    every ``every``-th step from ``slow_from`` only, and before step ``until`` only. With ``ranks``, that many
    ranks; at the steps in ``wait_in_forward`` the others wait in forward instead (DDP's second step rebuilds its
    buckets there, a broadcast), each rank after the first 1 ms longer; ``busy`` adds milliseconds to a rank's
    forward at a step, by (rank, step): a busy host's noise. With ``at``, slower at those steps only. With
    ``slow_fetch`` (rank, from step, ms), that rank waits that much longer for each batch from that step on, and the
    others as much longer in backward. With ``save_ms``, every rank saves a checkpoint (blocking) for that long after
    every other step (ModelCheckpoint's ``every_n_train_steps=2``)."""
    ms = 1_000_000
    folder.mkdir(parents=True, exist_ok=True)
    for rank in range(ranks):
        lines: list[str] = []

        def rec(kind: str, ts: int, out: list[str] = lines, **fields: Any) -> None:
            out.append(json.dumps({"seq": len(out), "kind": kind, "ts": ts, **fields}) + "\n")

        start = now = 1_790_000_000 * 10**9
        rec("header", now, schema="traintrace", schema_version=1, job="framework", rank=rank, world_size=ranks, pid=9)
        rec("start", now, name="training_loop", id=1, parent=0, tid=7)
        ids = 2
        for step in range(12):
            slow = step in at if at else slow_from <= step < until and (step - slow_from) % every == 0
            extra = 50 * ms if slow else 0
            wait, forward, backward = 2 * ms, 3 * ms, 4 * ms
            # A busy host's extra time in forward; a rank that then waits for the slow one waits as much less.
            noise = (busy or {}).get((rank, step), 0) * ms
            waited = max(extra - noise, 0)
            if rank == slow_rank and part == "compute":
                forward += extra
            elif rank == slow_rank:
                wait += extra
            elif part == "data_loading" and gather:
                wait += extra
                if extra:
                    rec("span", now + ms, name="collective", id=ids + 1, parent=ids, tid=7, dur=extra, status="ok")
            elif step in wait_in_forward:
                forward += waited + rank * ms
            else:
                backward += waited
            forward += noise
            if slow_fetch is not None and step >= slow_fetch[1]:
                if rank == slow_fetch[0]:
                    wait += slow_fetch[2] * ms
                else:
                    backward += slow_fetch[2] * ms
            rec("span", now, name="data_loading", id=ids, parent=1, tid=7, dur=wait, status="ok")
            now += wait
            it, step_ns = ids + 2, forward + backward + ms
            rec("span", now, name="iteration", id=it, parent=1, tid=7, dur=step_ns, status="ok", attrs={"step": step})
            rec("span", now, name="model_forward", id=it + 1, parent=it, tid=7, dur=forward, status="ok")
            rec("span", now + forward, name="model_backward", id=it + 2, parent=it, tid=7, dur=backward, status="ok")
            rec("span", now + forward + backward, name="optimizer_update", id=it + 3, parent=it, tid=7, dur=ms,
                status="ok")  # fmt: skip
            now += step_ns
            ids += 6
            if save_ms and step % 2 == 1:
                rec("span", now, name="checkpoint_save_sync", id=ids, parent=1, tid=7, dur=save_ms * ms, status="ok")
                now += save_ms * ms
                ids += 1
            if step % 4 == 3:  # the wait the callback opens after the step, ended by the validation pass, and after it
                rec("span", now, name="data_loading", id=ids, parent=1, tid=7, dur=ms // 2, status="ok")
                rec("span", now + ms, name="validation_loop", id=ids + 1, parent=0, tid=7, dur=8 * ms, status="ok")
                rec("span", now + 9 * ms, name="data_loading", id=ids + 2, parent=1, tid=7, dur=ms // 3, status="ok")
                now += 10 * ms
                ids += 3
        rec("end", now, name="training_loop", id=1, dur=now - start, status="ok")
        rec("close", now, records=len(lines) + 1, dropped=0)
        (folder / f"rank{rank}.jsonl").write_text("".join(lines))


def _raised(rec: Any, at: int, span: int, tid: int, message: str) -> None:
    """A RuntimeError with ``message`` raised in span ``span`` at ``at``, as traintrace records an exception."""
    stack = f'Traceback (most recent call last):\n  File "train.py", line 9\nRuntimeError: {message}'
    rec("error", at, name="exception", span=span, tid=tid, error_type="RuntimeError", message=message, stack=stack)


def _attempt(  # noqa: PLR0917
    script: Script, rank: int, world: int, restart: int, first: int, last: int
) -> list[str]:
    start = attempt_start(script, restart)
    d = script.step_dur(rank)
    lines = []
    seq = 0

    def rec(kind: str, ts: int, **fields: Any) -> None:
        nonlocal seq
        lines.append(_line({"seq": seq, "kind": kind, "ts": ts, **fields}))
        seq += 1

    rec(
        "header",
        start,
        schema="traintrace",
        schema_version=1,
        time="",
        mono=0,
        job="scripted",
        rank=rank,
        world_size=world,
        local_rank=rank,
        local_world_size=world,
        node_rank=0,
        restart=restart,
        host=script.host(rank),
        pid=100 + rank + 10 * restart,
        library_version="0",
        python="3",
    )
    tid = 7

    def peer_failed(name: str, began: int, d: int, span: int, cause: int) -> None:
        """The rank's collective in its step (span ``span`` named ``name``, begun at ``began``, of ``d`` ns)
        fails after ``cause``: a peer is gone, a consequence."""
        failed_at = max(began + d // 2, cause + S // 1000) + round(script.consequence_after_s * S)
        _raised(rec, failed_at, span, tid, CLOSED_BY_PEER)
        rec("end", failed_at, name=name, id=span, dur=failed_at - began, status="error")

    rec("thread", start, tid=tid, thread_name="MainThread")
    rec("start", start, name="main_function", id=1, parent=0, tid=tid)
    now = start
    rec("span", now, name="model_initialization", id=2, parent=1, tid=tid, dur=round(script.init_s * S), status="ok")
    now += round(script.init_s * S)
    ids = 3
    if restart:
        rec("span", now, name="checkpoint_load", id=ids, parent=1, tid=tid, dur=round(script.load_s * S), status="ok")
        ids += 1
        now += round(script.load_s * S)
    loop = ids
    ids += 1
    rec("start", now, name="training_loop", id=loop, parent=1, tid=tid)
    failed = False
    for step in range(first, last):
        d = script.step_dur_at(rank, step)
        name = script.name_prefix + "iteration" if script.name_prefix else "iteration"
        if restart == 0 and step == script.fail_step and script.fault == "terminated":
            rec("start", now, name=name, id=ids, parent=loop, tid=tid, attrs={"step": step})
            # Every rank is in this step when the signal comes: after the last one began it.
            began = max(first_attempt_step_start(script, r, step) for r in range(script.ranks))
            at = began + S // 1000 + round(rank * script.signal_spread_s * S)
            rec("event", at, name="signal", span=ids, tid=tid, attrs={"reason": "SIGTERM"})
            rec("end", at, name=name, id=ids, dur=at - now, status="terminated")
            rec("end", at, name="training_loop", id=loop, dur=at - start, status="terminated")
            rec("end", at, name="main_function", id=1, dur=at - start, status="terminated")
            rec("close", at, records=seq + 1, dropped=0)
            failed = True
            break
        if restart == 0 and script.fault == "hang" and script.fail_step is not None and step == hang_step(script, rank):
            _hang(script, rank, rec, lines, loop, ids, now)
            failed = True
            break
        if restart == 0 and step == script.fail_step and script.fault == "died":
            rec("start", now, name=name, id=ids, parent=loop, tid=tid, attrs={"step": step})
            if rank != script.fail_rank:
                # Not before the failing rank died: ranks in lockstep wait for each other (a straggler's peers wait).
                peer_failed(name, now, d, ids, first_attempt_step_start(script, script.fail_rank, step))
            failed = True
            break
        if script.fault == "raise" and step == script.fail_step and restart <= script.fails_again:
            if rank == script.fail_rank:
                rec("start", now, name=name, id=ids, parent=loop, tid=tid, attrs={"step": step})
                _raised(rec, now + d // 2, ids, tid, script.message)
                rec("end", now + d // 2, name=name, id=ids, dur=d // 2, status="error")
            else:
                rec("start", now, name=name, id=ids, parent=loop, tid=tid, attrs={"step": step})
                if script.peers_fail:
                    fail_rank = script.fail_rank
                    assert fail_rank is not None
                    raised = (
                        first_attempt_step_start(script, fail_rank, step) + script.step_dur_at(fail_rank, step) // 2
                    )
                    peer_failed(name, now, d, ids, raised)
            failed = True
            break
        limit = script.hang_report_s or 0.0
        stalled = script.fault == "stall" and step == script.fail_step and 0 < limit < script.stall_s
        if stalled:  # reported by hang detection, then resolved
            reported = now + round(limit * S) + rank * S // 1000
            rec("thread", reported, tid=9, thread_name="traintrace-watchdog")
            rec(
                "error",
                reported,
                name="hang_suspected",
                span=0,
                tid=9,
                message=f"no progress for {limit:.1f}s; last completed step {step - 1}",
                stack=f'Thread "MainThread" (tid {tid}):\n  File "train.py", line 20, in main\n',
                attrs={"last_step": step - 1, "completed_steps": step, "progress_phase": "collective"},
            )
        rec(
            "span",
            now,
            name=name,
            id=ids,
            parent=loop,
            tid=tid,
            dur=d,
            status="ok",
            attrs={"step": step, "loss": 1.0 / (1 + step), "batch_size": 8},
        )
        if stalled:
            resolved = {"hang_seconds": round(d / S - limit, 3), "last_step": step}
            rec("event", now + d, name="hang_resolved", span=0, tid=9, attrs=resolved)
        ids += 1
        now += d
        if (step + 1) % script.checkpoint_every == 0:
            save = round((script.save_s + script.save_extra_s.get((rank, step + 1), 0.0)) * S)
            rec(
                "span",
                now,
                name="checkpoint_save_sync",
                id=ids,
                parent=loop,
                tid=tid,
                dur=save,
                status="ok",
                attrs={"current_iteration": step + 1},
            )
            ids += 1
            now += save
    if not failed:
        rec("end", now, name="training_loop", id=loop, dur=now - start, status="ok")
        rec("end", now, name="main_function", id=1, dur=now - start, status="ok")
        rec("close", now, records=seq + 1, dropped=0)
    return lines


def hung_ranks(script: Script) -> list[int]:
    """The ranks that hang: the failing one, and with ``hang_node`` every rank of its host when others wait."""
    if not script.hang_node or script.fail_rank is None:
        return [script.fail_rank] if script.fail_rank is not None else []
    host = script.host(script.fail_rank)
    same = [r for r in range(script.ranks) if script.host(r) == host]
    return same if len(same) < script.ranks else [script.fail_rank]


def hang_step(script: Script, rank: int) -> int:
    """The step ``rank`` hangs in: the hung rank's, or the next one for the others when it hung past the
    step's all-reduce."""
    assert script.fail_step is not None
    ahead = rank not in hung_ranks(script) and script.hang_phase in PAST_ALL_REDUCE
    return script.fail_step + 1 if ahead else script.fail_step


def hang_timeline(script: Script) -> tuple[dict[int, dict[str, int | None]], int]:
    """Per rank, when (ns) it began its hang step (``began``), began waiting in its all-reduce (``waits``;
    None for the hung rank), reported a hang (``report``, or None), its collective timed out (``timeout``, or
    None) and its stream stopped (``stopped``: its last record); and when the attempt ended (the launcher's
    SIGTERM to the hung rank, or the kill from outside)."""
    assert script.fail_step is not None
    times: dict[int, dict[str, int | None]] = {}
    for rank in range(script.ranks):
        step = hang_step(script, rank)
        began = first_attempt_step_start(script, rank, step)
        # Ranks in lockstep: none made progress after the last of them began the step (its peers waited for it
        # in the previous step's all-reduce), and none waits in this step's before then.
        latest = max(first_attempt_step_start(script, r, step) for r in range(script.ranks))
        hung = rank in hung_ranks(script)
        reports = script.hang_report_s is not None and (script.hung_reports or not hung)
        report = latest + round((script.hang_report_s or 0.0) * S) + rank * S // 1000 if reports else None
        waits = None if hung else max(began + script.step_dur_at(rank, step) // 2, latest) + S // 10_000
        timeout = None
        if waits is not None and script.hang_end == "timeout":
            timeout = waits + round(script.collective_timeout_s * S)
        times[rank] = {"began": began, "waits": waits, "report": report, "timeout": timeout, "stopped": None}
    if script.hang_end == "timeout":
        ended = min(t["timeout"] or 0 for t in times.values() if t["timeout"] is not None) + S // 2
        for t in times.values():
            t["stopped"] = t["timeout"] or ended
        return times, ended
    for t in times.values():
        t["stopped"] = t["report"] or t["waits"] or t["began"]
    return times, max(t["stopped"] or 0 for t in times.values()) + round(script.kill_after_s * S)


def _hang(script: Script, rank: int, rec: Any, lines: list[str], loop: int, ids: int, now: int) -> None:  # noqa: PLR0917
    """``rank``'s records in the step it hangs in, from ``now`` (the training loop's span is ``loop``, span ids
    above ``ids`` are free), as traintrace writes them for the hung rank (stuck in ``hang_phase``) and for the
    ranks waiting for it (in backward's all-reduce, which may time out)."""
    t = hang_timeline(script)[0][rank]
    step = hang_step(script, rank)
    d = script.step_dur_at(rank, step)
    tid, watchdog = 7, 9
    hung = rank in hung_ranks(script)
    phase = script.hang_phase if hung else "collective"
    opened: list[tuple[str, int, int]] = []  # (name, id, began): the spans open in the hang

    def start(name: str, parent: int, at: int, **attrs: Any) -> int:
        nonlocal ids
        ids += 1
        rec("start", at, name=name, id=ids, parent=parent, tid=tid, **({"attrs": attrs} if attrs else {}))
        opened.append((name, ids, at))
        return ids

    def done(name: str, parent: int, at: int, dur: int) -> None:
        nonlocal ids
        ids += 1
        rec("span", at, name=name, id=ids, parent=parent, tid=tid, dur=dur, status="ok")

    if hung and phase == "data_loading":
        start("data_loading", loop, now)
    else:
        it = start(script.name_prefix + "iteration" if script.name_prefix else "iteration", loop, now, step=step)
        if hung and phase == "model_forward":
            start("model_forward", it, now)
        elif hung and phase in PAST_ALL_REDUCE:
            done("model_forward", it, now, d // 4)
            done("model_backward", it, now + d // 4, d // 4)
            if phase == "optimizer_update":
                start("optimizer_update", it, now + d // 2)
            else:
                done("optimizer_update", it, now + d // 2, d // 4)
                start("collective", it, now + 3 * d // 4, op="all_reduce", group="pair")
        else:
            done("model_forward", it, now, d // 4)
            backward = start("model_backward", it, now + d // 4)
            if t["waits"] is not None:
                start("collective", backward, t["waits"], op="all_reduce", bytes=644)
    if t["report"] is not None:
        reported = t["report"]
        idle = (reported - now) / S
        rec("thread", reported, tid=watchdog, thread_name="traintrace-watchdog")
        rec(
            "error",
            reported,
            name="hang_suspected",
            span=0,
            tid=watchdog,
            message=f"no progress for {idle:.1f}s (limit {script.hang_report_s:g}s); last completed step {step - 1}",
            stack=f'Thread "MainThread" (tid {tid}):\n  File "train.py", line 20, in main\n',
            attrs={
                "idle_seconds": round(idle, 3),
                "limit_seconds": script.hang_report_s,
                "last_step": step - 1,
                "completed_steps": step,
                "open_spans": [
                    {"name": n, "id": i, "open_seconds": round((reported - b) / S, 3), "tid": tid} for n, i, b in opened
                ],
                "threads": 3,
                "progress_phase": phase,
            },
        )
    if t["timeout"] is not None:
        at = t["timeout"]
        message = TIMED_OUT.format(ms=round(script.collective_timeout_s * 1000))
        for name, span, began in reversed(opened):
            if name == "model_backward":
                _raised(rec, at, span, tid, message)
            rec("end", at, name=name, id=span, dur=at - began, status="error")
        loop_began = T0 + round(script.init_s * S)
        rec("end", at, name="training_loop", id=loop, dur=at - loop_began, status="error")
        rec("end", at, name="main_function", id=1, dur=at - T0, status="error")
        rec("close", at, records=len(lines) + 1, dropped=0)
    elif hung and script.hang_end == "timeout":
        rec("event", t["stopped"], name="signal", span=opened[-1][1], tid=tid, attrs={"signal": "SIGTERM"})


def first_attempt_step_start(script: Script, rank: int, step: int) -> int:
    """When ``rank`` began ``step`` in the first attempt (as ``_attempt`` writes it)."""
    now = T0 + round(script.init_s * S)
    for k in range(step):
        now += script.step_dur_at(rank, k)
        if (k + 1) % script.checkpoint_every == 0:
            now += round((script.save_s + script.save_extra_s.get((rank, k + 1), 0.0)) * S)
    return now


def attempt_start(script: Script, restart: int) -> int:
    """When attempt ``restart`` begins (0: T0): a failed restart resumes from the last save before the failing
    step, loads it and fails in that step again, and the next begins ``restart_gap_s`` after."""
    if restart == 0:
        return T0
    if restart == 1:
        return attempt1_start(script)
    assert script.fail_step is not None
    worst = max(script.step_dur(r) for r in range(script.ranks))
    every = script.checkpoint_every
    resume = (script.fail_step // every) * every
    saves = script.fail_step // every - resume // every
    failing = (
        round((script.init_s + script.load_s) * S)
        + (script.fail_step - resume + 1) * worst
        + saves * round(script.save_s * S)
    )
    return attempt_start(script, restart - 1) + failing + round(script.restart_gap_s * S)


def attempt1_start(script: Script) -> int:
    if script.fault == "hang":
        return hang_timeline(script)[1] + round(script.restart_gap_s * S)
    worst = max(script.step_dur(r) for r in range(script.ranks))
    assert script.fail_step is not None
    saves = script.fail_step // script.checkpoint_every
    # "died": after the others' consequences, which come up to a step and consequence_after_s later.
    waited = worst + round(script.consequence_after_s * S) if script.fault == "died" or script.peers_fail else 0
    if script.fault == "terminated":
        waited = worst + round(script.ranks * script.signal_spread_s * S)
    return (
        T0
        + round(script.init_s * S)
        + script.fail_step * worst
        + saves * round(script.save_s * S)
        + waited
        + round(script.restart_gap_s * S)
    )


def expected(script: Script) -> dict[str, Any]:
    """What ``traintrace summary`` must say, from the script alone."""
    per_rank = {}
    ends = []
    durations: list[float] = []
    for rank in range(script.ranks):
        d = script.step_dur(rank) / S
        init, save, load = script.init_s, script.save_s, script.load_s
        if script.fail_step is None:
            productive = script.steps * d
            lost = 0.0
            saves = script.steps // script.checkpoint_every
            end0 = T0 / S + init + productive + saves * save
            covered = end0 - T0 / S
            ends.append(end0)
            loads = 0
            durations += [d] * script.steps
        else:
            f = script.fail_step
            resume = (f // script.checkpoint_every) * script.checkpoint_every
            saves0 = f // script.checkpoint_every
            partial = d / 2 if rank == script.fail_rank else 0.0
            end0 = T0 / S + init + f * d + saves0 * save + partial
            t1 = attempt1_start(script) / S
            steps1 = script.steps - resume
            saves1 = script.steps // script.checkpoint_every - resume // script.checkpoint_every
            end1 = t1 + init + load + steps1 * d + saves1 * save
            ends.append(end1)
            covered = (end0 - T0 / S) + (end1 - t1)
            productive = (resume + steps1) * d
            lost = (f - resume) * d + partial
            saves = saves0 + saves1
            loads = 1
            durations += [d] * (f + steps1)
        per_rank[rank] = {
            "productive": productive,
            "lost_progress": lost,
            "initialization": init * (2 if script.fail_step is not None else 1),
            "checkpoint_save": saves * save,
            "checkpoint_load": loads * load,
            "covered": covered,
        }
    wall = max(ends) - T0 / S
    n = script.ranks
    mean = {k: sum(v[k] for v in per_rank.values()) / n for k in next(iter(per_rank.values()))}
    restart_idle = sum(wall - v["covered"] for v in per_rank.values()) / n
    return {
        "wall_s": wall,
        "goodput": mean["productive"] / wall,
        "breakdown": {**{k: v for k, v in mean.items() if k != "covered"}, "restart_idle": restart_idle},
        "step_median_s": statistics.median(durations),
        "step_max_s": max(durations),
        "steps_completed": script.steps,
        "steps_lost": 0 if script.fail_step is None else script.fail_step % script.checkpoint_every + 1,
    }


#: Four scripted jobs every engine and reader must answer alike: a failure and a restart, a clean run,
#: rank 0 failing beside a straggler, and ranks missing from a job of six.
SCRIPTS = [
    Script(),
    Script(fail_step=None, fail_rank=None, straggler=None),
    Script(fail_rank=0, fail_step=12, straggler=1),
    Script(world_size=6, fail_step=None, fail_rank=None),
]
SCRIPT_IDS = ["failure-and-restart", "clean", "rank0-fails", "missing-ranks"]


class Recording:
    """A DuckDB connection that keeps the text of every statement run on it."""

    def __init__(self, con: Any, log: list[str]) -> None:
        self._con = con
        self._log = log

    def execute(self, sql: str, *args: Any) -> Any:
        self._log.append(sql)
        return self._con.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._con, name)


@st.composite
def scripts(draw: st.DrawFn) -> Script:
    """Any scripted job: 1 to 8 ranks on one host or several, ranks missing, a straggler or none, checkpoints every
    step to never; a clean run, or a rank that raises (the others killed, or their collectives failing) or dies
    without a trace (the others' collectives failing at once or half a minute later), its clock up to 45 ms ahead of
    the others', or the scheduler's SIGTERM on every rank at once, or a rank that hangs (in a phase of its step or a
    collective the others never joined, while they wait in theirs; alone or with every rank of its host; reported by
    hang detection or not; ended by the collectives' timeout or a kill from outside), or a step that stalls on
    every rank and goes on (reported and resolved or not); then a restart, after up to
    two restarts that fail the same way when the rank raised."""
    ranks = draw(st.integers(1, 8))
    steps = draw(st.integers(2, 30))
    fault = draw(st.sampled_from(["raise", "died", "terminated", "stall", *(["hang"] if ranks > 1 else [])]))
    peers_fail = draw(st.booleans())
    fails = draw(st.booleans())
    fail_rank = draw(st.integers(0, ranks - 1)) if fails and fault not in ("terminated", "stall") else None
    ahead = draw(st.sampled_from([0.0, 0.0, 0.02, 0.045])) if fails else 0.0
    missing = draw(st.integers(0, 2))
    every = draw(st.integers(1, 12))
    fail_step = draw(st.integers(0, steps - 1)) if fails else None
    hang_phase = draw(st.sampled_from(HANG_PHASES))
    last = fail_step is not None and ((fail_step + 1) % every == 0 or fail_step == steps - 1)
    if hang_phase in PAST_ALL_REDUCE and last:
        hang_phase = "model_forward"  # the others would save a checkpoint or finish after the hung step
    hang_end = draw(st.sampled_from(["timeout", "killed"]))
    collective_timeout_s = draw(st.sampled_from([6.0, 30.0, 1800.0]))
    hang_report_s = draw(st.sampled_from([None, 1.5, 60.0, 600.0]))
    if hang_end == "timeout" and hang_report_s is not None and hang_report_s >= collective_timeout_s:
        hang_report_s = None  # the ranks were gone before their detection fired
    if hang_end == "killed":
        # Killed without a hang report, or with the hung rank's stream ending where it stopped, the stream says no
        # more than that it was cut off: the progress files (not written here) are what tell such a hang.
        hang_report_s = hang_report_s or 600.0
    return Script(
        ranks=ranks,
        world_size=ranks + missing if missing else None,
        steps=steps,
        step_s=draw(st.sampled_from([0.05, 0.1, 0.25])),
        straggler=draw(st.none() | st.integers(0, ranks - 1)),
        straggler_factor=draw(st.sampled_from([1.5, 2.0, 3.0])),
        init_s=draw(st.sampled_from([0.2, 1.0, 3.0])),
        checkpoint_every=every,
        save_s=draw(st.sampled_from([0.1, 0.5])),
        load_s=draw(st.sampled_from([0.1, 0.5])),
        fail_rank=fail_rank,
        fail_step=fail_step,
        restart_gap_s=draw(st.sampled_from([1.0, 60.0])),
        ranks_per_host=draw(st.none() | st.integers(1, ranks)),
        fault=fault,
        peers_fail=peers_fail,
        fails_again=draw(st.integers(0, 2)) if fault == "raise" and not peers_fail else 0,
        consequence_after_s=draw(st.sampled_from([0.0, 0.5, 30.0])),
        signal_spread_s=draw(st.sampled_from([0.0, 0.005])),
        extra_s={(fail_rank, 0): -ahead} if ahead and fail_rank is not None else {},
        hang_phase=hang_phase,
        hang_report_s=hang_report_s,
        hung_reports=hang_end == "killed" or draw(st.booleans()),
        hang_end=hang_end,
        hang_node=hang_phase not in PAST_ALL_REDUCE and draw(st.booleans()),
        stall_s=draw(st.sampled_from([5.0, 120.0])),
        collective_timeout_s=collective_timeout_s,
    )


def expected_hang(script: Script) -> dict[str, Any]:
    """What ``traintrace summary`` must say of a job whose first attempt hung (``fault="hang"``) and whose restart
    completed, by docs/analysis.md's definitions: a rank that reported the hang spent it in ``hang``, from its last
    progress (the end of its last step, or of the save after it; the training loop's start before its first step)
    to the end of its stream; a rank that did not lost the step it was in (or, loading its batch, spent the time
    in ``data_loading``), and a hung rank that did not, until its peers were left waiting for it, the rest in
    ``hang``."""
    assert script.fail_step is not None
    times, _ = hang_timeline(script)
    every = script.checkpoint_every
    resume = (script.fail_step // every) * every
    t1 = attempt1_start(script)
    per_rank: dict[int, dict[str, float]] = {}
    ends = []
    for rank in range(script.ranks):
        t = times[rank]
        cat = dict.fromkeys(("productive", "lost_progress", "checkpoint_save", "hang", "data_loading"), 0)
        cat["initialization"] = 2 * round(script.init_s * S)
        cat["checkpoint_load"] = round(script.load_s * S)
        hung_step = hang_step(script, rank)
        for step in range(hung_step):
            cat["productive" if step < resume else "lost_progress"] += script.step_dur_at(rank, step)
            if (step + 1) % every == 0:
                cat["checkpoint_save"] += round((script.save_s + script.save_extra_s.get((rank, step + 1), 0.0)) * S)
        began, stopped = t["began"] or 0, t["stopped"] or 0
        if t["report"] is not None:
            cat["hang"] = stopped - began
            began = stopped
        elif rank in hung_ranks(script):
            # Hung without a report of its own: the hang's from when the ranks not hung were left waiting in their
            # all-reduce (or, none waiting, from the first of them to fail).
            peers = [times[r] for r in range(script.ranks) if r not in hung_ranks(script)]
            waited = [p["waits"] for p in peers if p["waits"] is not None]
            failed = [p["timeout"] for p in peers if p["timeout"] is not None]
            if waited or failed:
                hung_from = min(max(min(waited or failed), began), stopped)
                cat["hang"] = stopped - hung_from
                stopped = hung_from
        if rank in hung_ranks(script) and script.hang_phase == "data_loading":
            cat["data_loading"] = stopped - began
        else:
            cat["lost_progress"] += stopped - began
        stopped = t["stopped"] or 0
        now = t1 + round((script.init_s + script.load_s) * S)
        for step in range(resume, script.steps):
            cat["productive"] += script.step_dur_at(rank, step)
            now += script.step_dur_at(rank, step)
            if (step + 1) % every == 0:
                save = round((script.save_s + script.save_extra_s.get((rank, step + 1), 0.0)) * S)
                cat["checkpoint_save"] += save
                now += save
        ends.append(now)
        per_rank[rank] = {k: v / S for k, v in cat.items()}
        per_rank[rank]["covered"] = (stopped - T0 + now - t1) / S
    wall = (max(ends) - T0) / S
    n = script.ranks
    mean = {k: sum(v[k] for v in per_rank.values()) / n for k in per_rank[0]}
    mean["restart_idle"] = wall - mean.pop("covered")
    return {"wall_s": wall, "goodput": mean["productive"] / wall, "breakdown": mean}
