"""Random real faulty jobs, each checked against the truth its workers wrote: a sweep to run by hand.

    .venv/bin/python -m tests.fault_sweep --seed 1 --jobs 25

Each job is tests/diag_worker.py under traintrace-run (gloo on CPU, 2 to 4 ranks; with ``--nodes 2``, two launchers
of 2 ranks each on this machine, named node-a and node-b, as tests/test_diagnosis.py's two-node jobs) with one fault
drawn at random: an exception in a phase (data loading, forward, backward, optimizer, between phases, a validation
pass, building the model, writing the final model after the loop, rank 0's background checkpoint write), SIGKILL,
SIGSEGV, SIGTERM from another process to the rank alone, an exit with a code (``os._exit`` or ``sys.exit``), a
process that stops responding (SIGSTOP, or C code that keeps the GIL), a rank that leaves the loop early, a hang in
compute, in data loading (from the first batch on), in a collective, in a validation pass, in model initialisation
or in rank 0's checkpoint save (hang detection on or off), an exception in that save or a SIGKILL inside it, a
DataLoader worker killed (torchrun restarts the job, which finishes), a batch whose loss overflows (the job
diverges), a rank slow in compute or data loading from some step on (at every step, at every few steps only, or for
a few steps only), a rank that runs out of memory (an address-space limit), rank 0's saves on a file system that
fills up (a 2 MiB tmpfs in the job's mount namespace; the job's streams on it too, or not), or the scheduler ending
the whole job (SIGTERM or SIGKILL to the launcher and every rank at once, while it trains or 3 s after a rank hung
in forward), or Ctrl-C in its terminal (SIGINT to every process). The faulty rank, the step, the checkpoint
interval, validation passes, asynchronous or large saves, the step time and how long a failed rank lingers are drawn
too. Checked as tests/test_diagnosis.py checks its fixed cases: ``errors`` names the rank, step, phase and cause the
worker's own marks say (a diverged job: the first infinite loss's rank and step); ``ranks`` names the slow rank, its
part and its first slow step (and, slow at some steps only, its last and how many, as the worker marked them);
goodput within a point of the marks', the seconds of each category they time, the step times, and the steps
completed and lost; with two nodes, the Perfetto timeline against the marks. With ``--nodes 2 --skew``, node-b's
launcher and workers read their wall clock ahead of node-a's or behind (0.5 or 2 s, drawn; tests/clock_ahead.c
preloaded, as NTP off on one node): the answers must be the same, and the workers' marks from node-b are moved back
onto node-a's clock by the offset the sweep gave before they are compared. With ``--busy N``, N processes spin on
the CPU beside the jobs: a busy host, as CI's is while its other tests run. With ``--first-steps``, a fault in a
step comes at step 0 or 1: a killed rank's initialisation and first steps in its last flush interval. With
``--restarts``, a fault in a step (or a hang there) comes in the first attempt only and the launcher restarts the
job once (resuming from its last checkpoint, or not), which finishes: ``errors`` must name the first attempt's
culprit and say the job recovered. With ``--abort``, the ranks a failure reached are aborted (SIGABRT) once their
collective failed (after their exception), and with ``--watchdog`` once they have waited 3 s in a collective (no
exception: NCCL's watchdog). With ``--torchrun``, plain torchrun instead of traintrace-run: no launcher stream, so a
process that ended without a record (killed, crashed, ``os._exit``, frozen) is said to have ended so, and the rest
must be as right. A line per job; the exit status is the number of jobs whose answer was wrong (at most 99). It
takes 10 to 20 s a job on a 2-core machine (40 s for a process that stops responding): not part of the suite, whose
fixed cases cover every fault."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests._fault_runs import busy_host, say_wrong, tally
from tests.diag_worker import LEAK_STEPS
from tests.test_diagnosis import (
    SHARED_DISK_MOUNT,
    SMALL_DISK_MOUNT,
    Run,
    check_culprit,
    check_goodput,
    check_timeline_on_one_clock,
    clock_ahead_library,
    fault_step_of,
    first_non_finite_loss,
    kill_the_job,
    launch,
    steps_by_marks,
    two_nodes,
    unrecorded_share,
    wait_for_mark,
    wait_for_step,
)
from traintrace.cli._engine import RECENT_S

#: fault -> the phase the culprit was in (None: read from the worker's marks), the cause said, the job failed.
FAULTS: dict[str, tuple[str | None, str, bool]] = {
    "data": ("data_loading", "RuntimeError", True),
    "forward": ("model_forward", "RuntimeError", True),
    "backward": ("model_backward", "RuntimeError", True),
    "optimizer": ("optimizer_update", "RuntimeError", True),
    "iteration": ("iteration", "RuntimeError", True),
    "sigkill": ("model_forward", "killed by SIGKILL", True),
    "sigsegv": ("model_forward", "killed by SIGSEGV", True),
    # SIGTERM from another process to the rank alone, in forward (its handler may save first): the launcher stops
    # the others after it.
    "sigterm": ("model_forward", "terminated by SIGTERM", True),
    "exit": ("model_backward", "exit code", True),
    "sys_exit": ("model_backward", "exit code", True),
    "hang_compute": ("model_forward", "hang", True),
    "hang_collective": ("iteration", "hang", True),
    "hang_data": ("data_loading", "hang", True),
    # Rank 0 saves (the replicated model): it fails or stalls in the save after a step the interval divides.
    "checkpoint": ("checkpoint_save_sync", "OSError", True),
    "hang_in_checkpoint": ("checkpoint_save_sync", "hang", True),
    "kill_in_checkpoint": ("checkpoint_save_sync", "killed by SIGKILL", True),
    # A validation pass after every N-th step (N drawn); the faulty rank raises in the one after step ``step - 1``.
    "validation": ("validation_loop", "ValueError", True),
    "hang_validation": ("validation_loop", "hang", True),
    # Rank 0's background write of an asynchronous save fails; training goes on and the job finishes.
    "async_save": (None, "", False),
    # The process stops in forward (SIGSTOP, or C code that keeps the GIL): the others time out, torchrun's
    # SIGTERM goes unanswered and its SIGKILL ends it 30 s later.
    "freeze": ("model_forward", "stopped responding", True),
    "gil_stuck": ("model_forward", "stopped responding", True),
    # Before the first step: an exception building the model, or stuck there before DDP's first broadcast.
    "model_init": ("model_initialization", "RuntimeError", True),
    "hang_init": ("model_initialization", "hang: stopped making progress", True),
    # Writing the final model fails after the last step, while the others wait at the final barrier.
    "after_loop": ("main_function", "OSError", True),
    "finish_early": (None, "", True),
    # The rank's DataLoader worker is killed in the first attempt; torchrun restarts the job, which finishes.
    "loader_kill": (None, "", False),
    "inf_batch": (None, "", False),
    "slow_compute": (None, "", False),
    "slow_data": (None, "", False),
    # Forward keeps a 64 MiB tensor a step under an address-space limit until an allocation fails.
    "leak_oom": ("model_forward", "ran out of memory", True),
    # Rank 0's synchronous saves of 700 KiB go to a 2 MiB file system (a tmpfs in the job's own mount namespace):
    # the third does not fit.
    "full_disk": ("checkpoint_save_sync", "RuntimeError", True),
    # The same with the job's streams on that file system too (one scratch folder for both).
    "full_disk_logs": ("checkpoint_save_sync", "RuntimeError", True),
    # The scheduler ends the whole job at rank 0's step: SIGTERM (a time limit) or SIGKILL to the launcher and
    # every rank at once; or SIGTERM 3 s after a rank hung in forward (no hang detection, long collective timeout).
    "term_all": (None, "", True),
    # Ctrl-C: SIGINT to the launcher and every rank (the terminal's process group; torchrun passes it on too).
    "int_all": (None, "", True),
    # The terminal closed (an ssh session dropped): SIGHUP to the launcher and every rank.
    "hup_all": (None, "", True),
    "kill_all": (None, "", True),
    "hang_term": ("model_forward", "hang", True),
}
#: Faults in rank 0's checkpoint save.
IN_SAVE = ("checkpoint", "hang_in_checkpoint", "kill_in_checkpoint", "async_save")
#: Faults in a validation pass.
IN_VALIDATION = ("validation", "hang_validation")
#: Faults that end the process (a signal, ``os._exit``), or stop it, before its writer flushes: its last flush
#: interval of records may be missing (docs/analysis.md, "Goodput").
UNFLUSHED = ("sigkill", "sigsegv", "kill_in_checkpoint", "exit", "freeze", "gil_stuck")
#: The cause said of a process that ended without a record under plain torchrun, whose agent writes none.
WITHOUT_LAUNCHER = "ended without a close record"
#: Faults before the first step: no step to draw.
BEFORE_LOOP = ("model_init", "hang_init")
#: Faults of rank 0's saves on a small file system.
ON_SMALL_DISK = ("full_disk", "full_disk_logs")
#: The scheduler's signals to the whole job: no rank failed first.
FROM_OUTSIDE = ("term_all", "kill_all", "int_all", "hup_all")


#: Faults inside a step after which every other rank waits in (or fails out of) that step's gradient all-reduce, or
#: the next step's when the culprit got past it: in backward, where DDP runs it.
IN_STEP = ("data", "forward", "backward", "optimizer", "iteration", "sigkill", "sigsegv", "exit", "sys_exit")
IN_STEP_HANGS = ("hang_compute", "hang_data", "freeze", "gil_stuck", "sigterm")
#: Faults that stop the rank before its model's forward, where DDP broadcasts a model's buffers from rank 0.
BEFORE_BROADCAST = (
    *("data", "hang_data", "forward", "sigkill", "sigsegv", "hang_compute", "freeze", "gil_stuck", "sigterm"),
)
#: Faults after the step's all-reduce: the other ranks may end the step and wait in what comes next (the next
#: forward's broadcast of the buffers, or the validation pass's all-reduce).
AFTER_ALL_REDUCE = ("optimizer", "iteration")


def check_others(run: Run, errors: dict[str, Any], culprit: int, fault: str = "", *, buffers: bool = False) -> None:
    """Every other rank's step in the failed attempt, as the answer gives it, is where its own marks say it was:
    the last step it began, or the next one if it had ended a step and was preparing the next (outside the loop
    after its last step: that step). In a step, they wait in backward's all-reduce; with buffers (--batch-norm)
    and the culprit stopped before its forward's broadcast of them, a rank that was to pass them on to it waits in
    that broadcast, in forward, instead (rank 0, or another with gloo's tree over 4 ranks; every other rank when
    the culprit is rank 0, the root). A culprit that failed after the all-reduce (in the optimizer step) let the
    others end the step: they wait in the next forward's broadcast, or in the validation pass their marks say they
    began."""
    restart = errors["culprit"]["restart"]
    for state in errors["rank_states"]:
        if state["rank"] == culprit or state["restart"] != restart or state["step"] is None:
            continue
        marks = [m for m in run.marks()[state["rank"]] if m["restart"] == restart]
        if not any(m["event"] in ("step_start", "step_leaving", "step_end") for m in marks):
            continue
        if state["after_loop"]:  # outside the loop once steps had run: the last step it completed
            allowed = {max(m["step"] for m in marks if m["event"] == "step_end")}
        else:
            allowed = steps_by_marks(marks, killed=True)
        assert state["step"] in allowed, (state["rank"], state["step"], state["doing"], allowed, errors["verdict"])
        if fault in IN_STEP + IN_STEP_HANGS:
            where = (state["phase"], state["in_collective"], state["collective"])
            if (
                buffers
                and fault in BEFORE_BROADCAST + AFTER_ALL_REDUCE
                and where == ("model_forward", True, "broadcast")
            ):
                continue
            # Past the culprit's all-reduce, into the validation pass its marks say it began after its last step.
            begun = [m for m in marks if m["event"] in ("step_end", "validation_start", "validation_end")]
            validating = bool(begun) and begun[-1]["event"] == "validation_start"
            if fault in AFTER_ALL_REDUCE and validating and where == ("validation_loop", True, "all_reduce"):
                continue
            # Still in its forward by its marks (no loss of that step): DDP's forward in a job's second step
            # rebuilds its gradient buckets with a broadcast from rank 0, where the others then wait.
            began = any(m["event"] == "step_start" and m["step"] == state["step"] for m in marks)
            lossless = not any(m["event"] == "loss" and m["step"] == state["step"] for m in marks)
            if began and lossless and state["phase"] == "model_forward":
                continue
            # Saving its checkpoint after its last step when the end came (rank 0, a large save), by its marks.
            saving = [m for m in marks if m["event"] in ("checkpoint_start", "checkpoint_end", "step_start")]
            if saving and saving[-1]["event"] == "checkpoint_start" and state["phase"] == "checkpoint_save_sync":
                continue
            assert state["phase"] == "model_backward", (state["rank"], state["doing"], errors["verdict"])


def check(
    run: Run, fault: str, rank: int, step: int, *, goodput: bool = True, buffers: bool = False, torchrun: bool = False
) -> None:
    phase, cause, _ = FAULTS[fault]
    if torchrun and fault in UNFLUSHED:  # no launcher stream: no record says how the process ended
        cause = WITHOUT_LAUNCHER
    if fault in ("exit", "sys_exit", "hang_in_checkpoint"):
        mark = fault_step_of(run, rank)
        said = f"exit code {mark['exit_code']}" if "exit_code" in mark and cause != WITHOUT_LAUNCHER else cause
        check_others(run, check_culprit(run, rank, mark["step"], str(phase), said), rank, fault, buffers=buffers)
    elif fault == "after_loop":
        mark = fault_step_of(run, rank)
        last = max(m["step"] for m in run.marks()[rank] if m["event"] == "step_end" and m["ts"] < mark["ts"])
        errors = check_culprit(run, rank, last, str(phase), cause)
        assert errors["culprit"]["after_loop"], errors["verdict"]
        check_others(run, errors, rank)
    elif fault in ("full_disk", "full_disk_logs"):
        failed = [m for m in run.marks()[0] if m["event"] == "checkpoint_failed"]
        assert failed, run.output[-3000:]
        errors = check_culprit(run, 0, failed[0]["step"], str(phase), cause)
        assert "the checkpoint's file system was full" in errors["verdict"], errors["verdict"]
        check_others(run, errors, rank)
    elif fault == "hang_term":
        mark = fault_step_of(run, rank)
        errors = run.cli("errors")
        # Hang detection on: its report names the hang before the signal comes.
        assert errors["rule"] == "terminated while waiting for a rank" or errors["rule"].startswith("hang"), errors[
            "verdict"
        ]
        culprit = errors["culprit"]
        assert (culprit["rank"], culprit["step"], culprit["phase"]) == (rank, mark["step"], phase), errors["verdict"]
        assert errors["verdict"].startswith(f"rank {rank} hung in forward at step {mark['step']}"), errors["verdict"]
        check_others(run, errors, rank, "hang_compute", buffers=buffers)
    elif fault in FROM_OUTSIDE:
        errors = run.cli("errors")
        rule, verdict = {
            "term_all": ("terminated together", "terminated by SIGTERM"),
            "int_all": ("terminated together", "terminated by SIGINT"),
            "hup_all": ("terminated together", "terminated by SIGHUP"),
            "kill_all": ("killed together", "killed"),
        }[fault]
        assert errors["culprit"] is None and errors["rule"] == rule, errors["verdict"]
        assert errors["status"] == "failed" and errors["verdict"].startswith(verdict), errors["verdict"]
        marks = run.marks()
        for state in errors["rank_states"]:
            allowed = steps_by_marks(marks[state["rank"]], killed=True)
            assert state["step"] in allowed, (state, allowed, errors["verdict"])
    elif phase is not None:
        errors = check_culprit(run, rank, None if fault in BEFORE_LOOP else step, phase, cause)
        check_others(run, errors, rank, fault, buffers=buffers)
        if fault in ("freeze", "gil_stuck") and not torchrun:
            assert errors["rule"] == "stopped responding", errors["verdict"]
        if fault == "hang_init":  # the others' hang reports, or their collective's timeout, if it came first
            assert errors["rule"].startswith("hang: the rank"), errors["verdict"]
    elif fault == "finish_early":
        mark = fault_step_of(run, rank)
        errors = run.cli("errors")
        culprit = errors["culprit"]
        assert culprit is not None and errors["rule"] == "left early", errors["verdict"]
        assert (culprit["rank"], culprit["step"], culprit["left_early"]) == (rank, mark["step"], True), errors[
            "verdict"
        ]
        assert errors["status"] == "failed", errors["verdict"]
    elif fault == "loader_kill":
        mark = fault_step_of(run, rank)
        errors = run.cli("errors")
        culprit = errors["culprit"]
        assert culprit is not None, errors["verdict"]
        assert (culprit["rank"], culprit["restart"], culprit["step"], culprit["phase"]) == (
            rank,
            mark["restart"],
            mark["step"],
            "data_loading",
        ), errors["verdict"]
        assert "DataLoader worker" in culprit["cause"], culprit["cause"]
        assert errors["status"] == "recovered" and errors["verdict"].endswith("finished"), errors["verdict"]
    elif fault == "async_save":
        mark = fault_step_of(run, rank)
        errors = run.cli("errors")
        culprit = errors["culprit"]
        assert errors["status"] == "finished_with_errors" and culprit is not None, errors["verdict"]
        assert (culprit["rank"], culprit["step"], culprit["phase"]) == (
            rank,
            mark["step"],
            "checkpoint_save_finalization",
        ), errors["verdict"]
        assert errors["verdict"].startswith(
            f"finished with errors: rank {rank} raised OSError in a background checkpoint save at step {mark['step']}"
        ), errors["verdict"]
    elif fault == "inf_batch":
        # The first infinite loss by the workers' own notes; the job runs on to its end.
        first = first_non_finite_loss(run)
        assert first[:2] == (step, rank), first
        errors = run.cli("errors")
        assert (errors["status"], errors["rule"]) == ("diverged", "metric: not finite"), errors["verdict"]
        culprit = errors["culprit"]
        assert (culprit["rank"], culprit["step"], culprit["state"]) == (rank, step, "diverged"), errors["verdict"]
    else:
        ranks = run.cli("ranks")
        assert ranks["stragglers"] == [rank], ranks["stragglers"]
        slow = next(r for r in ranks["ranks"] if r["rank"] == rank)
        part = "compute" if fault == "slow_compute" else "data_loading"
        assert (slow["slow_in"], slow["slow_since_step"]) == (part, step), slow
        # Slow at some steps only (--slow-every, --slow-for): those steps, by the worker's own marks.
        slow_steps = [m["step"] for m in run.marks()[rank] if m["event"] == "slow"]
        last = max(m["step"] for m in run.marks()[rank] if m["event"] == "step_end")
        if slow_steps != list(range(step, last + 1)):
            seen = (slow.get("slow_since_step"), slow.get("slow_until_step"), slow.get("slow_steps"))
            assert seen == (slow_steps[0], slow_steps[-1], len(slow_steps)), (seen, slow_steps)
        errors = run.cli("errors")
        assert errors["status"] != "failed", errors["verdict"]
    if goodput:
        check_where_the_time_went(run, fault, rank)


def check_recovered(run: Run, fault: str, rank: int, *, torchrun: bool = False) -> None:
    """A fault in a step of the first attempt only (``--restarts``): the restart finished. ``errors`` names the
    first attempt's culprit, step, phase and cause, by the worker's marks, and says the job recovered; the goodput
    and the time of each category as for a job that finished."""
    phase, cause, _ = FAULTS[fault]
    mark = fault_step_of(run, rank)
    assert mark["restart"] == 0, mark
    if torchrun and fault in UNFLUSHED:
        cause = WITHOUT_LAUNCHER
    elif "exit_code" in mark:
        cause = f"exit code {mark['exit_code']}"
    errors = run.cli("errors")
    culprit = errors["culprit"]
    assert culprit is not None, errors["verdict"]
    found = (culprit["rank"], culprit["restart"], culprit["step"], culprit["phase"])
    assert found == (rank, 0, mark["step"], phase), errors["verdict"]
    assert cause in culprit["cause"], culprit["cause"]
    assert errors["status"] == "recovered" and errors["verdict"].endswith("finished"), errors["verdict"]
    check_goodput(run, failed=False)


def check_where_the_time_went(run: Run, fault: str, rank: int) -> None:
    """Goodput, and the seconds of each category the worker's marks time."""
    killed = sorted(run.marks()) if fault == "kill_all" else []
    check_goodput(run, failed=FAULTS[fault][2], unrecorded=unrecorded(run, fault, rank), killed=killed)


def unrecorded(run: Run, fault: str, rank: int) -> float:
    """The goodput the docs allow to be missing: a killed or frozen rank's last flush interval of records."""
    if fault == "kill_all":
        return unrecorded_share(run, sorted(run.marks()), True)
    return unrecorded_share(run, [rank], FAULTS[fault][2]) if fault in UNFLUSHED else 0.0


def launch_two_nodes(
    folder: Path,
    *args: str,
    timeout: float = 150,
    node_env: dict[str, dict[str, str]] | None = None,
    during: Any = None,
) -> Run:
    """The worker on two launchers (node-a and node-b, 2 ranks each, one rendezvous), run to their end;
    ``during(node-a's launcher, truth)`` runs while they do."""
    with two_nodes(folder, *args, node_env=node_env) as launchers:
        if during is not None:
            during(launchers[0], folder / "truth")
        ends = time.monotonic() + timeout
        for launcher in launchers:
            launcher.wait(timeout=max(ends - time.monotonic(), 1))
        ended_ns = time.time_ns()  # the sweep's clock: node-a's, which node-b's marks are moved onto
        returncode = max(launcher.returncode for launcher in launchers)
    return Run(folder / "logs" / "job", folder / "truth", returncode, "", ended_ns)


def marks_on_one_clock(truth: Path, host: str, ahead_ns: int) -> None:
    """The marks of the workers that ran on ``host``, whose wall clock the sweep set ``ahead_ns`` ahead, moved back
    onto the other host's clock (a worker names its host in its first mark)."""
    for path in truth.glob("rank*.jsonl"):
        marks = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        hosts = [m["host"] for m in marks if m.get("event") == "process_start"]
        if host not in hosts:
            continue
        for m in marks:
            m["ts"] -= ahead_ns
            if "created" in m:  # the process's creation, read against the same (skewed) wall clock
                m["created"] -= ahead_ns
        path.write_text("".join(json.dumps(m) + "\n" for m in marks))


def from_outside(fault: str, rank: int, step: int, *, watchdog: bool) -> Any:
    """For the scheduler's faults, what ends the job while it runs (``launch``'s ``during``): SIGTERM or SIGKILL to
    the launcher and every rank once rank 0 began ``step``; SIGTERM a while after ``rank`` hung (2 s under the
    watchdog, which aborts a rank 3 s in a collective; else 3 s). For ``sigterm``, SIGTERM to ``rank`` alone once
    it waits in forward for it."""
    if fault not in (*FROM_OUTSIDE, "hang_term", "sigterm"):
        return None

    def end(process: subprocess.Popen[str], truth: Path) -> None:
        if fault == "sigterm":
            wait_for_mark(process, truth, rank, "fault")
            pid_file, deadline = truth / "sigterm.pid", time.monotonic() + 10
            while not pid_file.exists() and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(0.05)
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
            return
        if fault == "hang_term":
            wait_for_mark(process, truth, rank, "fault")
            time.sleep(2.0 if watchdog else 3.0)
        else:
            wait_for_step(process, truth, 0, step)
        if process.poll() is None:
            signals = {"kill_all": signal.SIGKILL, "int_all": signal.SIGINT, "hup_all": signal.SIGHUP}
            kill_the_job(truth, signals.get(fault, signal.SIGTERM))

    return end


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--keep", action="store_true", help="keep every job's folder (a wrong one's is always kept)")
    parser.add_argument("--nodes", type=int, choices=(1, 2), default=1, help="2: two launchers of 2 ranks each")
    parser.add_argument("--skew", action="store_true", help="with --nodes 2: node-b's clock ahead or behind")
    parser.add_argument("--busy", type=int, default=0, help="that many processes spinning beside the jobs")
    parser.add_argument(
        "--first-steps",
        action="store_true",
        help="faults in a step drawn at step 0 or 1 (records of the rank's "
        "initialisation and first steps in one flush interval; DDP's bucket rebuild in step 1's forward)",
    )
    parser.add_argument(
        "--restarts",
        action="store_true",
        help="a fault in a step comes in the first attempt only; the launcher restarts the job once, which finishes",
    )
    parser.add_argument(
        "--abort",
        action="store_true",
        help="ranks the failure reached are aborted (SIGABRT) once their collective failed, as NCCL's watchdog does",
    )
    parser.add_argument(
        "--watchdog",
        action="store_true",
        help="a rank 3 s in a collective is aborted (SIGABRT) by a watchdog thread, as NCCL's; no Python exception",
    )
    parser.add_argument(
        "--torchrun", action="store_true", help="plain torchrun instead of traintrace-run: no launcher stream"
    )
    parser.add_argument("--faults", default="", help=f"comma-separated, to draw from these only: {', '.join(FAULTS)}")
    args = parser.parse_args()
    faults = sorted(FAULTS) if not args.faults else sorted(args.faults.split(","))
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        parser.error(f"unknown fault {', '.join(unknown)}: choose from {', '.join(FAULTS)}")
    if args.nodes == 2:  # the two launchers restart nothing; the small disk is one launcher's
        faults = [f for f in faults if f not in ("loader_kill", *ON_SMALL_DISK)] or parser.error(
            "loader_kill and the full disks need one node"
        )
    if args.torchrun and args.nodes != 1:
        parser.error("--torchrun needs one node")
    if args.skew and args.nodes != 2:
        parser.error("--skew needs --nodes 2")
    with busy_host(args.busy):
        return sweep(args, faults)


def sweep(args: argparse.Namespace, faults: list[str]) -> int:
    """The jobs ``args`` ask for, each with a fault drawn from ``faults``; the number of wrong answers."""
    draw = random.Random(args.seed)
    library = clock_ahead_library(Path(tempfile.mkdtemp(prefix="traintrace-sweep-clock-"))) if args.skew else None
    wrong = 0
    # Two nodes: the goodput (the ranks' streams only) is checked once the last job is over a minute old. Within
    # a minute a silent rank on another host (node-b is not this machine's name) still counts as running, as it
    # would (docs/analysis.md, "Running jobs"); the launchers' streams, which say it ended, are left out there.
    later: list[tuple[str, Path, Run, str, int, int]] = []
    for _ in range(args.jobs):
        nproc = draw.choice([2, 3, 4]) if args.nodes == 1 else 4
        fault = draw.choice(faults)
        rank = draw.randrange(nproc)
        # A rank can hang loading its very first batch; the slow rank needs steps before it to compare with.
        slow = fault.startswith("slow")
        step = draw.randrange(0 if fault == "hang_data" else 2, 9 if slow else 19)
        if args.first_steps and fault in IN_STEP + IN_STEP_HANGS:
            step = draw.choice([0, 1])
        every = draw.choice([3, 5, 50])
        if fault in IN_SAVE:
            rank, every = 0, draw.choice([3, 5])
            step = every * draw.randrange(1, 18 // every + 1)  # the save after step ``step - 1``
        elif fault in ("full_disk", "full_disk_logs"):
            rank, every = 0, draw.choice([3, 5])
            step = every * 3  # the third save does not fit
        elif fault == "leak_oom":
            step = draw.randrange(LEAK_STEPS + 1, 19)
        extra = ["--checkpoint-every", str(every), "--step-ms", str(draw.choice([10, 30, 60]))]
        # A validation pass every few steps in some jobs (always for a fault in it); async saves in others.
        validate = draw.choice([0, 0, 2, 3, 4])
        if fault in IN_VALIDATION:
            validate = draw.choice([2, 3, 4])
            step = validate * draw.randrange(1, 18 // validate + 1)  # the pass after step ``step - 1``
        if validate:
            extra += ["--validate-every", str(validate)]
        if fault == "async_save" or (fault not in (*IN_SAVE, *ON_SMALL_DISK) and draw.random() < 0.25):
            extra += ["--async-checkpoint"]
        if fault in ON_SMALL_DISK:
            extra += ["--checkpoint-pad-kb", "700"]
        elif draw.random() < 0.3:  # a large save (20 MB): the other ranks wait for rank 0's in their next step
            extra += ["--checkpoint-pad-kb", "20000"]
        if draw.random() < 0.3:  # buffers, which DDP broadcasts from rank 0 before each forward
            extra += ["--batch-norm"]
            # ...recorded nowhere, as in most users' loops: a late batch is told then, not a rank slow in forward
            # before the broadcast, where every rank then waits as long (docs/analysis.md, "ranks").
            if fault == "slow_data" and draw.random() < 0.5:
                extra += ["--no-record-collectives"]
        if args.abort and fault not in (*FROM_OUTSIDE, "hang_term", "sigterm"):  # (the workers would ignore SIGTERM)
            extra += ["--abort-after-failure"]
        if args.watchdog:
            extra += ["--gloo-timeout", "30", "--watchdog-abort", "3"]
        restarts = 0
        if args.restarts and fault in IN_STEP + IN_STEP_HANGS:
            extra += ["--fault-attempt", "0", *(["--resume"] if draw.random() < 0.5 else [])]
            restarts = 1
        if fault == "loader_kill":
            extra += ["--fault-attempt", "0", *(["--resume"] if draw.random() < 0.5 else [])]
            restarts = 1
        if fault in ("term_all", "hang_term", "sigterm"):  # a SIGTERM handler that saves before the process ends
            extra += ["--sigterm-cleanup", draw.choice(["0", "0", "0.3", "2.0"])]
        if fault == "hang_term":  # nothing ends the hang but the scheduler's signal (hang detection on or off)
            extra += ["--hang-timeout", draw.choice(["1.5", "0"]), "--gloo-timeout", "60"]
        elif fault in ("hang_init", "freeze", "gil_stuck") or fault.startswith("hang"):
            extra += ["--hang-timeout", draw.choice(["1.5", "0"])]
        elif slow:
            extra += ["--steps", "30"]
            # A stall at every few steps only, or slow for a stretch only (a straggler that recovers).
            shape = draw.choice(["", "", "every", "for"])
            if shape == "every":
                extra += ["--slow-every", str(draw.choice([3, 4, 5])), "--slow-ms", str(draw.choice([100, 150]))]
            elif shape == "for":
                extra += ["--slow-for", str(draw.choice([6, 8, 10])), "--slow-ms", "60"]
        elif FAULTS[fault][1] == "RuntimeError" and draw.random() < 0.3:
            extra += ["--linger", draw.choice(["0.5", "2.0"])]
        job = f"{nproc} ranks, {fault} on rank {rank} at step {step}, {' '.join(extra)}"
        ahead_ns = int(draw.choice([-2.0, -0.5, 0.5, 2.0]) * 1e9) if library else 0
        if ahead_ns:
            job += f", node-b's clock {ahead_ns / 1e9:+g} s"
        folder = Path(tempfile.mkdtemp(prefix="traintrace-sweep-"))
        began = time.monotonic()
        try:
            worker_fault = {"hang_term": "hang_compute", **dict.fromkeys(FROM_OUTSIDE, "none")}.get(fault, fault)
            faulty = ("--fault", worker_fault, "--fault-rank", str(rank), "--fault-step", str(step), *extra)
            during = from_outside(fault, rank, step, watchdog=args.watchdog)
            if fault == "full_disk":
                disk = folder / "checkpoints"
                disk.mkdir()
                faulty += ("--checkpoint-dir", str(disk))
                prefix: tuple[str, ...] = (*SMALL_DISK_MOUNT, str(disk))
            elif fault == "full_disk_logs":
                (folder / "logs").mkdir()
                faulty += ("--checkpoint-dir", str(folder / "logs" / "checkpoints"))
                prefix = (*SHARED_DISK_MOUNT, str(folder / "logs"))
            else:
                prefix = ()
            if args.nodes == 1:
                run = launch(
                    folder, nproc, *faulty, max_restarts=restarts, torchrun=args.torchrun, during=during, prefix=prefix
                )
                if fault == "full_disk_logs":  # what the tmpfs held, copied out before it went
                    shutil.copytree(folder / "logs.kept", folder / "logs", dirs_exist_ok=True)
            else:
                clock = {"LD_PRELOAD": str(library), "CLOCK_AHEAD_NS": str(ahead_ns)}
                run = launch_two_nodes(folder, *faulty, node_env={"node-b": clock} if ahead_ns else None, during=during)
                if ahead_ns:
                    marks_on_one_clock(run.truth, "node-b", ahead_ns)
            buffers = "--batch-norm" in extra
            if restarts and fault != "loader_kill":
                check_recovered(run, fault, rank, torchrun=args.torchrun)
            elif args.nodes == 2 and fault == "kill_all":
                pass  # within a minute the other host's silent ranks still count as running (below)
            else:
                check(run, fault, rank, step, goodput=args.nodes == 1, buffers=buffers, torchrun=args.torchrun)
        except Exception:  # an assertion or anything else: the job's answer is wrong
            wrong += 1
            say_wrong(job, folder)
            continue
        if args.nodes == 2:
            later.append((job, folder, run, fault, rank, step))
            print(f"right so far {job} ({time.monotonic() - began:.0f} s)", flush=True)
            continue
        print(f"right {job} ({time.monotonic() - began:.0f} s)", flush=True)
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    if later:
        time.sleep(RECENT_S + 1)
    for job, folder, run, fault, rank, step in later:
        try:
            if fault == "kill_all":  # no launcher stream says it ended: a minute without a sign of life does
                check(run, fault, rank, step, goodput=False)
            check_where_the_time_went(run, fault, rank)
            check_timeline_on_one_clock(run, {})  # node-b's marks are on node-a's clock already
        except Exception:  # as above
            wrong += 1
            say_wrong(job, folder)
            continue
        print(f"right {job}: goodput", flush=True)
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    return tally(args.jobs, wrong)


if __name__ == "__main__":
    sys.exit(main())
