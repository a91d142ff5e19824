"""Random real faulty Lightning and Hugging Face Trainer jobs, each checked against the truth its script wrote: a
sweep to run by hand.

    .venv/bin/python -m tests.integration_sweep --seed 1 --jobs 10 [--framework lightning|transformers]

Each job is tests/_lightning_ddp_run.py (2 or 3 ranks, 1 to 3 epochs of 4 steps, recorded by the
``TraintraceCallback``) or tests/_hf_ddp_run.py (a tiny GPT-2, 2 or 3 ranks, 8 steps, a save every 2, recorded by
the ``TraintraceTrainerCallback``) under torchrun or traintrace-run, gloo on CPU, with one fault drawn at random on
a random rank and step: an exception in the training step (Lightning) or the loss (the Trainer), in the backward
pass (a gradient hook), in the optimizer's step, in a validation step (Lightning) or a checkpoint save (the
Trainer), or in the DataLoader's worker; SIGKILL or a hang there; a read in the DataLoader's worker that never
returns; a batch whose loss overflows (Lightning: the job diverges); the scheduler's SIGTERM to every process at
once (``term``: no culprit); a straggler, 60 ms slower from a random step on
in its training step or loss (``slow``) or fetching its batches (``slow_data``), at every step or every 2nd or
3rd only. In 40% of the Lightning jobs a ModelCheckpoint saves every 2 or 3 steps, 20 or 80 MB, rank 0 writing
while the others wait at the barrier; where such a job ends well, ``summary``'s checkpoint save time is checked
against the script's notes of the saves and writes. The callbacks time the phases between the frameworks' hooks
and methods, so where a rank was comes from its progress file and the spans the callback ends, not from spans
opened around the code as tests/fault_sweep.py's worker does. Checked: ``errors``
names the faulty rank, the step and phase the script's own truth (``fault.json``, ``started<rank>.txt``, the losses,
written without traintrace) says, and the cause; the status; every other rank in the verdict; for a straggler,
``ranks`` names it alone, the part and the step its script's notes give (``steps<rank>.jsonl``). With ``--busy N``,
N processes spin on the CPU beside the jobs: a busy host, as CI's is while its other tests run. With ``--nvtx``, the
NVTX backend is on (for Nsight): a span listener, so the callbacks open their spans as they begin, not timed between
hooks and written at their end. A line per job; the
exit status is the number of jobs whose answer was wrong (at most 99). 10 to 40 s a job on a 2-core machine: not
part of the suite, whose fixed cases (tests/test_integrations_lightning.py, tests/test_integrations_transformers.py)
cover the exception, the data faults and the overflow.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests._fault_runs import answers, busy_host, check_checkpoint_save, check_straggler, child_env, say_wrong, tally

HERE = Path(__file__).resolve().parent
LIGHTNING_STEPS_PER_EPOCH = 4
TRAINER_STEPS, TRAINER_SAVE_EVERY = 8, 2

#: Every framework's faults: mode -> the phase the culprit was in.
PHASES: dict[str, str] = {
    "": "model_forward",
    "sigkill": "model_forward",
    "hang": "model_forward",
    "backward": "model_backward",
    "optimizer": "optimizer_update",
    "validation": "validation_loop",
    "save": "checkpoint_save_sync",
    "data": "data_loading",
    "data_hang": "data_loading",
    "inf": "",
    "slow": "compute",
    "slow_data": "data_loading",
    # The scheduler's SIGTERM to every process of the job (its time limit) once the rank began the step: no
    # culprit, no fault of the script's.
    "term": "",
    # Ctrl-C: SIGINT to every process of the job (its terminal's process group) once the rank began the step.
    "int": "",
    # Its terminal closed (an ssh session dropped): SIGHUP to every process of the job.
    "hup": "",
}
#: The modes that signal every process of the job from outside, and their signals.
FROM_OUTSIDE = {"term": signal.SIGTERM, "int": signal.SIGINT, "hup": signal.SIGHUP}
#: Modes whose job ends normally, with one rank slower than the others from the step drawn on.
STRAGGLERS = ("slow", "slow_data")
#: Steps a straggler's job runs past its first slow step (ranks needs five to call it a slow-down).
SLOW_STEPS_AFTER = 7
#: Lightning's faults in the step whose truth is the global step, drawn with gradients accumulated over two batches.
ACCUMULATING = ("", "sigkill", "hang", "backward", "optimizer")
#: What the cause says, when it is not the injected exception's message.
CAUSES = {"sigkill": "killed by SIGKILL", "hang": "hang", "data_hang": "hang"}


@dataclass(frozen=True)
class Framework:
    script: Path
    job: str
    modes: tuple[str, ...]
    #: Words of the exception the training step's fault (mode "") raises.
    step_error: str


FRAMEWORKS = {
    "lightning": Framework(
        HERE / "_lightning_ddp_run.py",
        "ddp-test",
        (
            *(
                "",
                "sigkill",
                "hang",
                "backward",
                "optimizer",
                "validation",
                "data",
                "data_hang",
                "inf",
                "term",
                "int",
                "hup",
            ),
            *STRAGGLERS,
        ),
        "injected failure in training_step",
    ),
    "transformers": Framework(
        HERE / "_hf_ddp_run.py",
        "hf-ddp",
        (
            "",
            "sigkill",
            "hang",
            "backward",
            "optimizer",
            "save",
            "data",
            "data_hang",
            "term",
            "int",
            "hup",
            *STRAGGLERS,
        ),
        "injected failure in compute_loss",
    ),
}


@dataclass(frozen=True)
class Job:
    framework: str
    mode: str
    devices: int
    rank: int
    step: int
    epochs: int
    launcher: bool
    #: Batches a step (gradient accumulation): the Trainer's stragglers' jobs draw 1 or 2, and Lightning's jobs with a
    #: fault in the step (each batch an iteration of the same global step; the fault in the step's last batch).
    accum: int = 1
    #: A straggler slow at every N-th step (batch) from its first only.
    every: int = 1
    #: Lightning: a ModelCheckpoint every N steps (0: none), rank 0 writing ``save_mb`` MB while the others wait.
    save_every: int = 0
    save_mb: int = 0
    #: Lightning: a BatchNorm layer, whose buffers DDP broadcasts from rank 0 before each forward.
    batch_norm: bool = False

    def __str__(self) -> str:
        epochs = f", {self.epochs} epochs" if self.framework == "lightning" else ""
        if self.accum > 1:
            epochs = f", {self.accum} batches a step"
        if self.every > 1:
            epochs += f", slow every {self.every} steps"
        if self.save_every:
            epochs += f", {self.save_mb} MB saved every {self.save_every} steps"
        if self.batch_norm:
            epochs += ", BatchNorm"
        how = "traintrace-run" if self.launcher else "torchrun"
        fault = self.mode or "training_step"
        return f"{self.framework}: {self.devices} ranks, {fault} on rank {self.rank} at step {self.step}{epochs}, {how}"


def draw_job(draw: random.Random, framework: str, modes: list[str]) -> Job:
    job = _draw_fault(draw, framework, modes)
    if framework == "lightning" and draw.random() < 0.4:  # rank 0 saves; the others wait at the barrier
        job = dataclasses.replace(job, save_every=draw.choice([2, 3]), save_mb=draw.choice([20, 80]))
    if framework == "lightning" and draw.random() < 0.3:  # buffers: rank 0 waits in forward for a late rank
        job = dataclasses.replace(job, batch_norm=True)
    return job


def _draw_fault(draw: random.Random, framework: str, modes: list[str]) -> Job:
    mode = draw.choice([m for m in modes if m in FRAMEWORKS[framework].modes])
    devices = draw.choice([2, 3])
    rank = draw.randrange(devices)
    epochs, launcher = draw.choice([1, 2, 3]), draw.random() < 0.5
    if mode in STRAGGLERS:  # a few fast steps, then enough slow ones (the Trainer's steps: see run_job)
        epochs = draw.choice([3, 4])
        steps = LIGHTNING_STEPS_PER_EPOCH * epochs if framework == "lightning" else TRAINER_STEPS + SLOW_STEPS_AFTER
        step = draw.randrange(1, steps - SLOW_STEPS_AFTER + 1)
        accum = draw.choice([1, 2]) if framework == "transformers" else 1
        every = draw.choice([1, 1, 2, 3])
        return Job(framework, mode, devices, rank, step, epochs, launcher, accum, every)
    if framework == "transformers":
        if mode == "save":  # the save after step N - 1 (the Trainer's global step is N then)
            step = TRAINER_SAVE_EVERY * draw.randrange(1, TRAINER_STEPS // TRAINER_SAVE_EVERY + 1)
        elif mode.startswith("data"):  # a batch of the first epoch: 64 samples over the ranks, 4 a batch
            step = draw.randrange(1, 64 // devices // 4)
        else:
            step = draw.randrange(0, TRAINER_STEPS - 1)
    elif mode == "validation":  # the pass after an epoch (the one before training is a sanity check)
        epochs = max(epochs, 2)
        step = LIGHTNING_STEPS_PER_EPOCH * draw.randrange(1, epochs)
    elif mode.startswith("data"):  # the loader's worker counts its samples from each epoch's start
        epochs, step = 1, draw.randrange(1, LIGHTNING_STEPS_PER_EPOCH)
    elif mode in ACCUMULATING and draw.random() < 0.3:
        epochs = max(epochs, 2)  # two steps an epoch
        step = draw.randrange(0, LIGHTNING_STEPS_PER_EPOCH * epochs // 2)
        return Job(framework, mode, devices, rank, step, epochs, launcher, accum=2)
    else:
        step = draw.randrange(0, LIGHTNING_STEPS_PER_EPOCH * epochs)
    return Job(framework, mode, devices, rank, step, epochs, launcher)


def run_job(folder: Path, job: Job, *, nvtx: bool = False) -> dict[str, Any] | None:
    """The script under torchrun, or under traintrace-run (torchrun with the launcher's own stream). A hang is read
    while the job runs (``errors``, returned), 5 s after the fault; then the job goes on until the collectives'
    timeout ends it or, where none does (the Trainer's), 30 s after the fault the whole job is killed. ``nvtx``: the
    NVTX backend on (a span listener: the callbacks open their spans as they begin)."""
    framework = FRAMEWORKS[job.framework]
    start = (
        [sys.executable, "-m", "traintrace.launch"] if job.launcher else [str(Path(sys.executable).parent / "torchrun")]
    )
    command = [*start, "--standalone", "--nproc-per-node", str(job.devices), str(framework.script), str(folder)]
    command += [str(job.step), *([job.mode] if job.mode else [])]
    env = child_env(
        DDP_TIMEOUT_S="10",
        FAULT_RANK=str(job.rank),
        EPOCHS=str(job.epochs),
        DEVICES=str(job.devices),
        HF_HUB_OFFLINE="1",
        MAX_STEPS=str(TRAINER_STEPS + SLOW_STEPS_AFTER if job.mode in STRAGGLERS else TRAINER_STEPS),
        GRAD_ACCUM=str(job.accum),
        ACCUMULATE=str(job.accum if job.framework == "lightning" else 1),
        SLOW_EVERY=str(job.every),
        SAVE_EVERY=str(job.save_every),
        SAVE_MB=str(job.save_mb),
        **({"TRAINTRACE_BACKENDS_NVTX_ENABLED": "1"} if nvtx else {}),
        BATCH_NORM="1" if job.batch_norm else "0",
    )
    env.update(TRAINTRACE_LOG_DIR=str(folder / "logs"), TRAINTRACE_JOB_ID=framework.job)
    live: dict[str, Any] | None = None
    with (folder / "output.txt").open("w") as output:
        process = subprocess.Popen(
            command, env=env, cwd=folder, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 300
            fault = folder / "fault.json"
            began = folder / f"started{job.rank}.txt"
            while job.mode in FROM_OUTSIDE and process.poll() is None and time.monotonic() < deadline:
                text = began.read_text().strip() if began.exists() else ""
                if text.isdigit() and int(text) >= job.step:  # (empty while the script rewrites it)
                    reached = signal_job(folder, FROM_OUTSIDE[job.mode])
                    (folder / "signalled.json").write_text(json.dumps(reached))
                    break
                time.sleep(0.005)
            while job.mode.endswith("hang") and process.poll() is None and time.monotonic() < deadline:
                if fault.exists():
                    time.sleep(5.0)
                    if process.poll() is None:
                        live, _ = answers(folder / "logs" / framework.job)
                        process.wait(timeout=25)
                    break
                time.sleep(0.1)
            process.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            kill_job(folder, process)  # the scheduler's kill
        finally:
            if process.poll() is None:
                kill_job(folder, process)
            (folder / "release").write_text("")
    return live


def signal_job(folder: Path, sig: int) -> list[str]:
    """``sig`` to every process started with the job's folder in its command line (the launcher, the ranks and
    their DataLoader workers), at once; the command lines of those it reached."""
    reached = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            line = cmdline.read_bytes()
            if str(folder).encode() in line:
                os.kill(int(cmdline.parent.name), sig)
                reached.append(line.replace(b"\0", b" ").decode(errors="replace"))
        except (OSError, ValueError):  # gone meanwhile
            pass
    return reached


def kill_job(folder: Path, launcher: subprocess.Popen[bytes]) -> None:
    """SIGKILL to every process of the job at once, as a scheduler ends a job: the launcher and each process
    started with the job's folder in its command line (the ranks, in sessions of their own, and their DataLoader
    workers)."""
    os.killpg(launcher.pid, signal.SIGKILL)
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(folder).encode() in cmdline.read_bytes():
                os.kill(int(cmdline.parent.name), signal.SIGKILL)
        except (OSError, ValueError):  # gone meanwhile
            pass
    launcher.wait()


def first_non_finite(notes: Path) -> float:
    """The first step whose loss a rank noted as not finite (infinity when none was)."""
    losses = [json.loads(line) for line in notes.read_text().splitlines() if line.strip()]
    return min((n["step"] for n in losses if not math.isfinite(n["loss"])), default=math.inf)


def check(folder: Path, job: Job, live: dict[str, Any] | None = None) -> str:
    """The answer of ``errors`` when the job ended, or the one read while it ran (``live``)."""
    framework = FRAMEWORKS[job.framework]
    assert job.mode == "inf" or job.mode in FROM_OUTSIDE or (folder / "fault.json").exists(), (
        "the premise: the fault was injected"
    )
    saved = ""
    if job.save_every and job.mode in (*STRAGGLERS, "inf"):  # jobs that end well: every save noted
        truth = check_checkpoint_save(folder, answers(folder / "logs" / framework.job)[1], job.devices)
        saved = f"; checkpoint save {truth:.3f} s a rank"
    if job.mode in STRAGGLERS:
        data = check_straggler(folder, folder / "logs" / framework.job, job.mode, job.devices)
        (culprit,) = (r for r in data["ranks"] if r["rank"] == job.rank)
        slow = f"stragglers {data['stragglers']}: slow in {culprit['slow_in']} since step {culprit['slow_since_step']}"
        return slow + saved
    errors = live if live is not None else answers(folder / "logs" / framework.job)[0]
    if job.mode in FROM_OUTSIDE:
        signalled = FROM_OUTSIDE[job.mode].name
        reached = folder / "signalled.json"
        lines = json.loads(reached.read_text()) if reached.exists() else None
        if lines is not None and not [
            line for line in lines if "traintrace.launch" not in line and "torchrun" not in line
        ]:
            # The signal came at the job's last step, after every rank had ended (a busy host delayed this
            # process's look at the note): only the launcher got it. The training finished.
            assert errors["status"] == "healthy", errors["verdict"]
            if job.launcher:  # plain torchrun leaves no record of the signal it got
                then = f"; then the launcher got {signalled} from outside"
                assert errors["verdict"].endswith(then), errors["verdict"]
            return str(errors["verdict"])
        assert errors["culprit"] is None and errors["rule"] == "terminated together", errors["verdict"]
        assert errors["status"] == "failed", errors["verdict"]
        assert errors["verdict"].startswith(f"terminated by {signalled} from outside"), errors["verdict"]
        for state in errors["rank_states"]:  # the last step it began, by its own notes, or the next it prepared
            note = folder / f"started{state['rank']}.txt"
            text = note.read_text() if note.exists() else None
            began = int(text) if text else -1  # none: fetching its first batch
            allowed: tuple[int | None, ...] = (began, began + 1) if began >= 0 else (None, 0)
            if text == "":
                # The signal came as the rank rewrote the note at a step's start (emptied, not yet written): that
                # step is the one after its last note of a step begun, or the same (another batch of it).
                steps = (folder / f"steps{state['rank']}.jsonl").read_text().splitlines()
                last = json.loads(steps[-1])["step"] if steps else -1
                allowed = (last, last + 1, last + 2) if last >= 0 else (None, 0, 1)
            assert state["step"] in allowed, (state["rank"], state["step"], began, errors["verdict"])
        return str(errors["verdict"])
    culprit = errors["culprit"]
    assert culprit is not None, errors["verdict"]
    rank = job.rank
    step: int | None = job.step
    if job.mode == "inf":
        # The first loss that is not finite, by each rank's own notes of its losses: the faulty rank's at the step
        # drawn, the others' after it (the all-reduce spreads NaN to their weights).
        first = {r: first_non_finite(folder / f"losses{r}.jsonl") for r in range(job.devices)}
        assert first[rank] == step and all(first[r] > step for r in first if r != rank), first
        assert (errors["status"], culprit["rank"], culprit["step"]) == ("diverged", rank, step), errors["verdict"]
        return str(errors["verdict"]) + saved
    truth: dict[str, Any] = json.loads((folder / "fault.json").read_text())
    assert truth["rank"] == rank, truth  # the premise: the fault went where drawn
    if job.framework == "transformers" and job.mode.startswith("data"):
        # The Trainer fetches a step's batch ahead of it: the step the rank never began, by its own notes. Before
        # any rank began one, no record says which step the batch was for.
        began = folder / f"started{rank}.txt"
        step = int(began.read_text()) + 1 if began.exists() else 0
        if not list(folder.glob("started*.txt")):
            step = None
    else:
        assert truth["step"] == step, truth
    cause = CAUSES.get(job.mode, "injected")
    if job.mode == "sigkill" and not job.launcher:  # torchrun alone leaves no record of how a rank ended
        cause = "ended without a close record"
    if not job.mode:
        cause = framework.step_error
    if live is not None:  # read while the others wait for it, before any report or timeout
        cause = "the others wait for it"
    assert (culprit["rank"], culprit["step"], culprit["phase"]) == (rank, step, PHASES[job.mode]), errors["verdict"]
    assert cause in culprit["cause"], culprit["cause"]
    if live is not None:
        assert (errors["status"], errors["rule"]) == ("running", "waiting on a rank"), errors["verdict"]
        assert errors["verdict"].startswith(f"running, waiting on rank {rank}: "), errors["verdict"]
    else:
        assert errors["status"] == "failed", errors["verdict"]
        assert errors["verdict"].startswith(f"rank {rank} "), errors["verdict"]
    if job.mode.endswith("hang") and live is None:  # a timeout ended it, or the whole job was killed
        assert errors["rule"].startswith(("hang", "killed while waiting for a rank")), errors["rule"]
    said = errors["verdict"].split(";", 1)[1] if ";" in errors["verdict"] else ""
    for other in range(job.devices):
        if other != rank:
            assert str(other) in said, errors["verdict"]
    return str(errors["verdict"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=10)
    parser.add_argument("--framework", choices=(*FRAMEWORKS, "both"), default="both")
    parser.add_argument("--keep", action="store_true", help="keep every job's folder (a wrong one's is always kept)")
    parser.add_argument("--busy", type=int, default=0, help="that many processes spinning beside the jobs")
    parser.add_argument(
        "--nvtx", action="store_true", help="the NVTX backend on: a span listener, so the callbacks' spans are live"
    )
    parser.add_argument("--modes", default="", help=f"comma-separated, to draw from these only: {', '.join(PHASES)}")
    args = parser.parse_args()
    modes = list(PHASES) if not args.modes else args.modes.split(",")
    unknown = [m for m in modes if m not in PHASES]
    if unknown:
        parser.error(f"unknown mode {', '.join(unknown)}: choose from {', '.join(PHASES)} ('' is the training step)")
    frameworks = list(FRAMEWORKS) if args.framework == "both" else [args.framework]
    frameworks = [f for f in frameworks if set(modes) & set(FRAMEWORKS[f].modes)]
    if not frameworks:
        parser.error("no framework has those modes")
    with busy_host(args.busy):
        return sweep(args, frameworks, modes)


def sweep(args: argparse.Namespace, frameworks: list[str], modes: list[str]) -> int:
    """The jobs ``args`` ask for, of ``frameworks`` with a fault drawn from ``modes``; the number of wrong answers."""
    draw = random.Random(args.seed)
    wrong = 0
    for _ in range(args.jobs):
        job = draw_job(draw, draw.choice(frameworks), modes)
        folder = Path(tempfile.mkdtemp(prefix="traintrace-integration-sweep-"))
        began = time.monotonic()
        try:
            live = run_job(folder, job, nvtx=args.nvtx)
            verdict = check(folder, job)
            if live is not None:
                verdict = f"{check(folder, job, live)}; at the end: {verdict}"
        except Exception:  # an assertion or anything else: the job's answer is wrong
            wrong += 1
            say_wrong(job, folder)
            continue
        print(f"right {job} ({time.monotonic() - began:.0f} s): {verdict}", flush=True)
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    return tally(args.jobs, wrong)


if __name__ == "__main__":
    sys.exit(main())
