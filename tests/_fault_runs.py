"""Helpers for the tests that run a real training script in subprocesses and ask the command about it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parent.parent / "src"


def child_env(**extra: str) -> dict[str, str]:
    """This environment without traintrace settings or a rank's identity, with the checkout's sources first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINTRACE_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def run(command: list[str], cwd: Path, **extra_env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, env=child_env(**extra_env), cwd=cwd, capture_output=True, text=True, check=False, timeout=240
    )


def start(command: list[str], cwd: Path, **extra_env: str) -> subprocess.Popen[bytes]:
    """Start ``command`` with its output in ``cwd/output.txt``: a process the job leaves running (a hung rank)
    would keep open the pipes that a capture waits on."""
    with (cwd / "output.txt").open("w") as output:
        return subprocess.Popen(command, env=child_env(**extra_env), cwd=cwd, stdout=output, stderr=subprocess.STDOUT)


def answers(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """What ``traintrace errors`` and ``traintrace summary`` say of the job in ``folder``."""
    from traintrace.cli import _analysis
    from traintrace.cli._engine import Job

    job = Job.open([folder], lean=True)  # as the two commands load it
    try:
        return _analysis.errors(job), _analysis.summary(job)
    finally:
        job.close()


def check_checkpoint_save(out: Path, summary: dict[str, Any], ranks: int) -> float:
    """``summary``'s checkpoint save time (the mean over the ranks) of a Lightning job that saved on rank 0 alone
    (tests/_lightning_ddp_run.py with ``SAVE_EVERY``), against the script's own notes: each rank lost, at each
    save, the time rank 0 wrote (``writes0.jsonl``) from when it entered ModelCheckpoint's collective before the
    save (``exists<rank>.jsonl``) to the end of its ``Trainer.save_checkpoint`` call (``saves<rank>.jsonl``): rank 0
    its writes, the others their wait at the barrier, and the time a busy machine kept them from reaching it while
    rank 0 wrote: from the collective on, the ranks do nothing but the save. (From the collective's end, as this read
    before, left out the time a rank was kept in that collective while rank 0, out of it, wrote: on a host with a
    busy loop beside the job, rank 1 left it 25 to 37 ms into each write, and the truth missed a third of its loss.)
    Within 2 ms a save and 5%. Returns the truth, in seconds."""
    import json

    def intervals(name: str, rank: int) -> list[tuple[int, int]]:
        lines = (out / f"{name}{rank}.jsonl").read_text().splitlines()
        return [(note["t0"], note["t1"]) for note in map(json.loads, lines)]

    def held(rank: int) -> list[tuple[int, int]]:
        """Each save's stretch: from the start of the collective before it (where noted) to the call's end."""
        let_go = [t0 for t0, _ in intervals("exists", rank)] if (out / f"exists{rank}.jsonl").exists() else []
        saves = intervals("saves", rank)
        ends = [0, *(b1 for _, b1 in saves)]  # the collective after the save before
        pairs = zip(ends, saves, strict=False)
        return [(max([t for t in let_go if a < t <= b0], default=b0), b1) for a, (b0, b1) in pairs]

    writes = intervals("writes", 0)
    assert writes and not list(out.glob("writes[1-9]*.jsonl")), "the premise: rank 0 alone wrote"
    lost = [
        sum(max(0, min(b1, w1) - max(b0, w0)) for b0, b1 in held(rank) for w0, w1 in writes) / 1e9
        for rank in range(ranks)
    ]
    truth = sum(lost) / ranks
    read = summary["breakdown_s"]["checkpoint_save"]
    assert abs(read - truth) <= 0.002 * len(writes) + 0.05 * truth, (read, truth, lost, summary["breakdown_s"])
    return truth


def own_times(truth: Path, part: str) -> dict[int, dict[int, int]]:
    """Each rank's own time in ``part`` at each step, in ns, from the workers' notes (``truth``: ``rank<rank>.jsonl``,
    lines of ``step`` and ``<part>_ns``, written without traintrace; a step noted twice, as one of several batches,
    counts their sum)."""
    import json
    from collections import Counter

    own: dict[int, dict[int, int]] = {}
    for path in truth.glob("rank*.jsonl"):
        times: Counter[int] = Counter()
        for note in map(json.loads, path.read_text().splitlines()):
            times[note["step"]] += note[f"{part}_ns"]
        own[int(path.stem[4:])] = dict(times)
    return own


def own_excess(truth: Path, rank: int, part: str) -> dict[int, float]:
    """Each step's excess of ``rank``'s own time in ``part`` over the other ranks' median for the step, in ns."""
    import statistics

    own = own_times(truth, part)
    return {
        step: value - statistics.median(others)
        for step, value in own.get(rank, {}).items()
        if (others := [times[step] for r, times in own.items() if r != rank and step in times])
    }


def slow_by_own_clock(truth: Path, rank: int, part: str, since: int) -> bool:
    """Whether ``rank`` was slow in ``part`` from step ``since`` on by the workers' own clocks (``own_times``): at
    half of those steps or more, 1.1 times the other ranks' median for the same step and 2 ms above it. A rank not
    made slow may have been slow on a busy host; named, this says whether it was."""
    import statistics

    own = own_times(truth, part)
    slow = total = 0
    for step, value in own[rank].items():
        others = [times[step] for r, times in own.items() if r != rank and step in times]
        if step < since or not others:
            continue
        median = statistics.median(others)
        total += 1
        slow += value >= 1.1 * median and value - median >= 2e6
    return total > 0 and slow >= total / 2


def every_nth(steps: list[int]) -> int | None:
    """N where most of the sorted ``steps`` (three quarters of their gaps or more) are N apart, N of 2 or more."""
    import itertools

    gaps = [b - a for a, b in itertools.pairwise(steps)]
    common = max(set(gaps), key=gaps.count) if gaps else 1
    return common if common >= 2 and gaps.count(common) >= 0.75 * len(gaps) else None


def check_straggler(out: Path, logs: Path, mode: str, ranks: int) -> dict[str, Any]:
    """A framework job's straggler (``slow``: its training step's own code, ``slow_data``: its batches), as
    ``traintrace ranks`` names it, against the script's own notes (``fault.json``: the rank and the first slow
    step or batch and when it began; ``steps<rank>.jsonl``: when each step's own code began, every rank).

    The step a slow batch delayed is the first to begin after that batch's fetch began (a loader that fetches
    a batch ahead delays the step before it). The notes also show the premise: data-parallel training evened
    the ranks' step times (each rank's mean step over the same steps within a fifth of the others'), so the step
    time alone cannot tell the straggler. Returns ``ranks``' answer."""
    import json
    import statistics
    from collections import Counter

    from traintrace.cli import _analysis
    from traintrace.cli._engine import Job

    truth = json.loads((out / "fault.json").read_text())
    notes = {r: [json.loads(line) for line in (out / f"steps{r}.jsonl").read_text().splitlines()] for r in range(ranks)}
    late = [n["step"] for n in notes[truth["rank"]] if n["ts"] > truth["ts"]]
    expected = truth["step"] if mode == "slow" else min(late)
    # Slow at every few steps only (SLOW_EVERY): each slow step or batch the script noted.
    slow_notes = out / f"slow{truth['rank']}.jsonl"
    stalls = [json.loads(line) for line in slow_notes.read_text().splitlines()] if slow_notes.exists() else []
    numbers = sorted({n.get("step", n.get("batch")) for n in stalls})  # a step of two batches notes it twice
    every = numbers[1] - numbers[0] if len(numbers) > 1 else 1
    # Stalls noted by batch, steps of several batches (each noted): slow every N-th batch where N is a whole number
    # of steps' batches is slow every N / batches-per-step steps (every 2nd batch of two-batch steps: every step).
    per_step = max(Counter(n["step"] for n in notes[truth["rank"]]).values())
    if stalls and "batch" in stalls[0] and every % per_step == 0:
        every //= per_step
    means = []
    for rank_notes in notes.values():
        began: dict[int, int] = {}  # each step's first note (a step of several batches notes each)
        for n in rank_notes:
            began.setdefault(n["step"], n["ts"])
        after = [ts for step, ts in sorted(began.items()) if step >= expected]
        # The mean over the same steps, not the median: ranks in lockstep note a stall (a save, a busy machine's
        # pause) one step apart, and with saves every other step a median picks a step with a save on one rank and
        # one without on the other (a loaded machine: 87 ms against 111, the means 1,751 and 1,760 ms in all).
        means.append((after[-1] - after[0]) / (len(after) - 1))
    # (A stall at every other step leaves no meaningful mean: the premise is the steady straggler's.)
    assert every > 1 or max(means) < 1.2 * min(means), f"the ranks' steps were not evened: {means}"
    job = Job.open([logs])
    try:
        data = _analysis.ranks(job)
    finally:
        job.close()
    rows = {r["rank"]: r for r in data["ranks"]}
    culprit = rows[truth["rank"]]
    # Only the rank made slow, unless another was slow by its own clock (the script's notes of its work outside
    # backward, ``work/``): on CI's busy host rank 0's own compute once took twice rank 1's (16 ms against 8) while
    # rank 1 was slow fetching its batches, and rank 0 was named slow in compute too.
    assert truth["rank"] in data["stragglers"], data
    for rank in set(data["stragglers"]) - {truth["rank"]}:
        named = rows[rank]
        own = out / "work"
        assert named["slow_in"] == "compute" and own.is_dir(), data
        assert slow_by_own_clock(own, rank, "compute", named["slow_since_step"] or 0), data
    part = "compute" if mode == "slow" else "data_loading"
    assert (culprit["slow_in"], culprit["slow_since_step"]) == (part, expected), culprit
    # The step each slow step or batch delayed (a batch's: the first step to begin after its fetch began).
    began = sorted({n["step"]: n["ts"] for n in reversed(notes[truth["rank"]])}.items(), key=lambda x: x[1])
    delayed = sorted(
        {n["step"] if "step" in n else next((step for step, ts in began if ts > n["ts"]), None) for n in stalls}
        - {None}
    )
    # Found step by step (slow at every few steps, or at fewer than half its steps: its medians are the others'),
    # the steps are those the script's notes say were delayed; a stall every few steps is found that way only.
    # Every N-th step when most of the delayed steps are N apart (docs/analysis.md): a loader that prefetches
    # delays the step before a slow batch's or its own, so every third batch may delay steps 2, 6, 8, 12, 14.
    steps_every = every_nth(delayed)
    # Every step from the first delayed one on (a loader's every other batch, two batches a step): a steady straggler.
    steady = delayed == list(range(delayed[0], max(n["step"] for n in notes[truth["rank"]]) + 1)) if delayed else False
    if (every > 1 and not steady) or "slow_until_step" in culprit:
        seen = (culprit.get("slow_until_step"), culprit.get("slow_steps"), culprit.get("slow_every"))
        own = out / "work"
        if part != "compute" or not own.is_dir():
            assert seen == (delayed[-1], len(delayed), steps_every), (seen, delayed)
            return data
        # Slow in its own step at other steps too, by its own clock (the script's notes, ``work/``), by half the
        # stall it was given or more: the host's doing, read as slow as well. A loaded run here (5 test workers on
        # 2 CPUs): rank 1, slowed at steps 6, 8, 10, 12 and 14, took 68 ms in its forward at step 15 against rank
        # 0's 12.5, and was read slow at 6 steps, to step 15.
        excess = own_excess(own, truth["rank"], "compute")
        given = [excess[step] for step in delayed if step in excess]
        bar = statistics.median(given) / 2 if given else float("inf")
        allowed = sorted({*delayed, *(step for step, e in excess.items() if step >= delayed[0] and e >= bar)})
        allowed_every = {steps_every, every_nth(allowed)}
        assert seen[0] in allowed and seen[0] >= delayed[-1], (seen, delayed, allowed)
        assert len(delayed) <= seen[1] <= len(allowed) and seen[2] in allowed_every, (seen, delayed, allowed)
    return data


@contextlib.contextmanager
def busy_host(processes: int) -> Iterator[None]:
    """``processes`` Python processes spinning on the CPU while the block runs: a busy host, as CI's is while its
    other tests run beside a job (real stragglers' answers there have differed from a quiet machine's)."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def say_wrong(job: object, folder: Path) -> None:
    """A sweep's line for a job whose answer was wrong (an assertion or anything else raised while checking it)."""
    import traceback

    print(f"WRONG {job} ({folder}):\n{traceback.format_exc(limit=2)}", flush=True)


def tally(jobs: int, wrong: int) -> int:
    """A sweep's last line, and its exit status: the number of wrong answers (at most 99)."""
    print(f"{jobs - wrong} of {jobs} jobs answered right")
    return min(wrong, 99)
