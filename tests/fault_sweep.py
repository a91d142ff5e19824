"""Random real faulty jobs, each checked against the truth its workers wrote: a sweep to run by hand.

    .venv/bin/python -m tests.fault_sweep --seed 1 --jobs 25

Each job is tests/diag_worker.py under traintrace-run (gloo on CPU, 2 to 4 ranks; with ``--nodes 2``, two launchers
of 2 ranks each on this machine, named node-a and node-b, as tests/test_diagnosis.py's two-node jobs) with one fault
drawn at random: an exception in a phase (data loading, forward, backward, optimizer, between phases), SIGKILL,
SIGSEGV, an exit with a code (``os._exit`` or ``sys.exit``), a hang in compute, in data loading (from the first
batch on), in a collective or in rank 0's checkpoint save (hang detection on or off), an exception in that save, a
batch whose loss overflows (the job diverges), or a rank slow in compute or data loading from some step on. The
faulty rank, the step, the checkpoint interval, the step time and how long a failed rank lingers are drawn too.
Checked as tests/test_diagnosis.py checks its fixed cases: ``errors`` names the rank, step, phase and cause the
worker's own marks say (a diverged job: the first infinite loss's rank and step); ``ranks`` names the slow rank, its
part and its first slow step; goodput within a point of the marks' and the steps completed and lost. A line per job;
the exit status is the number of jobs whose answer was wrong (at most 99). It takes 10 to 20 s a job on a 2-core
machine: not part of the suite, whose fixed cases cover every fault.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from tests.test_diagnosis import (
    Run,
    check_culprit,
    check_goodput,
    fault_step_of,
    first_non_finite_loss,
    launch,
    two_nodes,
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
    "exit": ("model_backward", "exit code", True),
    "sys_exit": ("model_backward", "exit code", True),
    "hang_compute": ("model_forward", "hang", True),
    "hang_collective": ("iteration", "hang", True),
    "hang_data": ("data_loading", "hang", True),
    # Rank 0 saves (the replicated model): it fails or stalls in the save after a step the interval divides.
    "checkpoint": ("checkpoint_save_sync", "OSError", True),
    "hang_in_checkpoint": ("checkpoint_save_sync", "hang", True),
    "inf_batch": (None, "", False),
    "slow_compute": (None, "", False),
    "slow_data": (None, "", False),
}
#: Faults in rank 0's checkpoint save.
IN_SAVE = ("checkpoint", "hang_in_checkpoint")


def check(run: Run, fault: str, rank: int, step: int, goodput: bool = True) -> None:
    phase, cause, failed = FAULTS[fault]
    if fault in ("exit", "sys_exit", "hang_in_checkpoint"):
        mark = fault_step_of(run, rank)
        said = f"exit code {mark['exit_code']}" if "exit_code" in mark else cause
        check_culprit(run, rank, mark["step"], str(phase), said)
    elif phase is not None:
        check_culprit(run, rank, step, phase, cause)
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
        errors = run.cli("errors")
        assert errors["status"] != "failed", errors["verdict"]
    if goodput:
        check_goodput(run, failed=failed)


def launch_two_nodes(folder: Path, *args: str, timeout: float = 150) -> Run:
    """The worker on two launchers (node-a and node-b, 2 ranks each, one rendezvous), run to their end."""
    with two_nodes(folder, *args) as launchers:
        ends = time.monotonic() + timeout
        for launcher in launchers:
            launcher.wait(timeout=max(ends - time.monotonic(), 1))
        returncode = max(launcher.returncode for launcher in launchers)
    return Run(folder / "logs" / "job", folder / "truth", returncode, "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--keep", action="store_true", help="keep every job's folder (a wrong one's is always kept)")
    parser.add_argument("--nodes", type=int, choices=(1, 2), default=1, help="2: two launchers of 2 ranks each")
    parser.add_argument("--faults", default="", help=f"comma-separated, to draw from these only: {', '.join(FAULTS)}")
    args = parser.parse_args()
    faults = sorted(FAULTS) if not args.faults else sorted(args.faults.split(","))
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        parser.error(f"unknown fault {', '.join(unknown)}: choose from {', '.join(FAULTS)}")
    draw = random.Random(args.seed)
    wrong = 0
    # Two nodes: the goodput (the ranks' streams only) is checked once the last job is over a minute old. Within
    # a minute a silent rank on another host (node-b is not this machine's name) still counts as running, as it
    # would (docs/analysis.md, "Running jobs"); the launchers' streams, which say it ended, are left out there.
    later: list[tuple[str, Path, Run, bool]] = []
    for _ in range(args.jobs):
        nproc = draw.choice([2, 3, 4]) if args.nodes == 1 else 4
        fault = draw.choice(faults)
        rank = draw.randrange(nproc)
        # A rank can hang loading its very first batch; the slow rank needs steps before it to compare with.
        slow = fault.startswith("slow")
        step = draw.randrange(0 if fault == "hang_data" else 2, 9 if slow else 19)
        every = draw.choice([3, 5, 50])
        if fault in IN_SAVE:
            rank, every = 0, draw.choice([3, 5])
            step = every * draw.randrange(1, 18 // every + 1)  # the save after step ``step - 1``
        extra = ["--checkpoint-every", str(every), "--step-ms", str(draw.choice([10, 30, 60]))]
        if fault.startswith("hang"):
            extra += ["--hang-timeout", draw.choice(["1.5", "0"])]
        elif slow:
            extra += ["--steps", "30"]
        elif FAULTS[fault][1] == "RuntimeError" and draw.random() < 0.3:
            extra += ["--linger", draw.choice(["0.5", "2.0"])]
        job = f"{nproc} ranks, {fault} on rank {rank} at step {step}, {' '.join(extra)}"
        folder = Path(tempfile.mkdtemp(prefix="traintrace-sweep-"))
        began = time.monotonic()
        try:
            faulty = ("--fault", fault, "--fault-rank", str(rank), "--fault-step", str(step), *extra)
            run = launch(folder, nproc, *faulty) if args.nodes == 1 else launch_two_nodes(folder, *faulty)
            check(run, fault, rank, step, goodput=args.nodes == 1)
        except Exception:  # an assertion or anything else: the job's answer is wrong
            wrong += 1
            print(f"WRONG {job} ({folder}):\n{traceback.format_exc(limit=2)}", flush=True)
            continue
        if args.nodes == 2:
            later.append((job, folder, run, FAULTS[fault][2]))
            print(f"right so far {job} ({time.monotonic() - began:.0f} s)", flush=True)
            continue
        print(f"right {job} ({time.monotonic() - began:.0f} s)", flush=True)
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    if later:
        time.sleep(RECENT_S + 1)
    for job, folder, run, failed in later:
        try:
            check_goodput(run, failed=failed)
        except Exception:  # as above
            wrong += 1
            print(f"WRONG {job} ({folder}):\n{traceback.format_exc(limit=2)}", flush=True)
            continue
        print(f"right {job}: goodput", flush=True)
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    print(f"{args.jobs - wrong} of {args.jobs} jobs answered right")
    return min(wrong, 99)


if __name__ == "__main__":
    sys.exit(main())
