"""Random real faulty jobs, each checked against the truth its workers wrote: a sweep to run by hand.

    .venv/bin/python -m tests.fault_sweep --seed 1 --jobs 25

Each job is tests/diag_worker.py under traintrace-run (gloo on CPU, 2 to 4 ranks) with one fault drawn at
random: an exception in a phase (data loading, forward, backward, optimizer, between phases), SIGKILL,
SIGSEGV, an exit with a code (``os._exit`` or ``sys.exit``), a hang in compute or in a collective (hang
detection on or off), or a rank slow in compute from some step on. The faulty rank, the step, the checkpoint
interval, the step time and how long a failed rank lingers are drawn too. Checked as tests/test_diagnosis.py
checks its fixed cases: ``errors`` names the rank, step, phase and cause the worker's own marks say; ``ranks``
names the slow rank, its part and its first slow step; goodput within a point of the marks' and the steps
completed and lost. A line per job; the exit status is the number of jobs whose answer was wrong (at most
99). It takes 10 to 20 s a job on a 2-core machine: not part of the suite, whose fixed cases cover every fault.
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

from tests.test_diagnosis import Run, check_culprit, check_goodput, fault_step_of, launch

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
    "slow_compute": (None, "", False),
}


def check(run: Run, fault: str, rank: int, step: int) -> None:
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
    check_goodput(run, failed=failed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--keep", action="store_true", help="keep every job's folder (a wrong one's is always kept)")
    args = parser.parse_args()
    draw = random.Random(args.seed)
    wrong = 0
    for _ in range(args.jobs):
        nproc = draw.choice([2, 3, 4])
        fault = draw.choice(sorted(FAULTS))
        rank = draw.randrange(nproc)
        step = draw.randrange(2, 9 if fault == "slow_compute" else 19)
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
            run = launch(folder, nproc, "--fault", fault, "--fault-rank", str(rank), "--fault-step", str(step), *extra)
            check(run, fault, rank, step)
        except Exception:  # an assertion or anything else: the job's answer is wrong
            wrong += 1
            print(f"WRONG {job} ({folder}):\n{traceback.format_exc(limit=2)}", flush=True)
            continue
        print(f"right {job} ({time.monotonic() - began:.0f} s)", flush=True)
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    print(f"{args.jobs - wrong} of {args.jobs} jobs answered right")
    return min(wrong, 99)


if __name__ == "__main__":
    sys.exit(main())
