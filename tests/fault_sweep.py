"""Random real faulty jobs, each checked against the truth its workers wrote: a sweep to run by hand.

    .venv/bin/python -m tests.fault_sweep --seed 1 --jobs 25

Each job is tests/diag_worker.py under traintrace-run (gloo on CPU, 2 to 4 ranks; with ``--nodes 2``, two
launchers of 2 ranks each on this machine, named node-a and node-b, as tests/test_diagnosis.py's two-node jobs)
with one fault drawn at random: an exception in a phase (data loading, forward, backward, optimizer, between
phases), SIGKILL, SIGSEGV, an exit with a code (``os._exit`` or ``sys.exit``), a hang in compute, in data loading
(from the first batch on) or in a collective (hang detection on or off), or a rank slow in compute from some step
on. The faulty rank, the step, the checkpoint interval, the step time and how long a failed rank lingers are drawn
too. Checked as tests/test_diagnosis.py checks its fixed cases: ``errors`` names the rank, step, phase and cause the
worker's own marks say; ``ranks`` names the slow rank, its part and its first slow step; goodput within a point of
the marks' and the steps completed and lost. A line per job; the exit status is the number of jobs whose answer was
wrong (at most 99). It takes 10 to 20 s a job on a 2-core machine: not part of the suite, whose fixed cases cover
every fault.
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

from tests.test_diagnosis import Run, check_culprit, check_goodput, fault_step_of, launch, two_nodes
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
    "slow_compute": (None, "", False),
}


def check(run: Run, fault: str, rank: int, step: int, goodput: bool = True) -> None:
    phase, cause, failed = FAULTS[fault]
    if fault in ("exit", "sys_exit"):
        mark = fault_step_of(run, rank)
        check_culprit(run, rank, mark["step"], str(phase), f"exit code {mark['exit_code']}")
    elif phase is not None:
        check_culprit(run, rank, step, phase, cause)
    else:
        ranks = run.cli("ranks")
        assert ranks["stragglers"] == [rank], ranks["stragglers"]
        slow = next(r for r in ranks["ranks"] if r["rank"] == rank)
        assert (slow["slow_in"], slow["slow_since_step"]) == ("compute", step), slow
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
    args = parser.parse_args()
    draw = random.Random(args.seed)
    wrong = 0
    # Two nodes: the goodput (the ranks' streams only) is checked once the last job is over a minute old. Within
    # a minute a silent rank on another host (node-b is not this machine's name) still counts as running, as it
    # would (docs/analysis.md, "Running jobs"); the launchers' streams, which say it ended, are left out there.
    later: list[tuple[str, Path, Run, bool]] = []
    for _ in range(args.jobs):
        nproc = draw.choice([2, 3, 4]) if args.nodes == 1 else 4
        fault = draw.choice(sorted(FAULTS))
        rank = draw.randrange(nproc)
        # A rank can hang loading its very first batch; the slow rank needs steps before it to compare with.
        step = draw.randrange(0 if fault == "hang_data" else 2, 9 if fault == "slow_compute" else 19)
        extra = ["--checkpoint-every", str(draw.choice([3, 5, 50])), "--step-ms", str(draw.choice([10, 30, 60]))]
        if fault.startswith("hang"):
            extra += ["--hang-timeout", draw.choice(["1.5", "0"])]
        elif fault == "slow_compute":
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
