"""traintrace.cli._analysis: goodput, badput, stragglers and failures against independently computed truths."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings

from tests._examples import examples
from tests.cli_jobs import (
    PAST_ALL_REDUCE,
    S,
    Script,
    clock_ahead,
    expected,
    expected_hang,
    hung_ranks,
    scripts,
    write_framework_job,
    write_job,
)

pytest.importorskip("duckdb")

from traintrace import SpanName
from traintrace.cli import _analysis
from traintrace.cli._engine import Job
from traintrace.cli._render import render_ranks

# The analysis of files written by hand (tests/cli_jobs.py), not by either core: the same in both passes (the two
# tests here that record with the core run in both, marked each_core).
pytestmark = pytest.mark.once


def _open(folder: Path) -> Job:
    return Job.open([folder])


def test_summary_matches_the_script_with_a_failure_and_a_straggler(tmp_path: Path) -> None:
    """Wall time, goodput, every badput category and step statistics equal the script's arithmetic."""
    script = write_job(tmp_path / "job", Script())
    truth = expected(script)
    s = _analysis.summary(_open(tmp_path / "job"))
    assert s["wall_s"] == pytest.approx(truth["wall_s"], rel=1e-9)
    assert s["goodput"] == pytest.approx(truth["goodput"], rel=1e-9)
    for key, value in truth["breakdown"].items():
        assert s["breakdown_s"][key] == pytest.approx(value, abs=1e-6), key
    assert s["breakdown_s"]["other"] == pytest.approx(0.0, abs=1e-6)
    assert sum(s["breakdown_s"].values()) == pytest.approx(s["wall_s"], rel=1e-9)
    assert s["step_time"]["median_s"] == pytest.approx(truth["step_median_s"])
    assert s["step_time"]["max_s"] == pytest.approx(truth["step_max_s"])
    assert s["steps_completed"] == truth["steps_completed"]
    assert s["steps_lost"] == truth["steps_lost"] == 6
    assert s["restarts"] == 1 and s["streams"] == 8 and s["failed_streams"] == 4
    assert s["notes"] == []


def test_summary_of_a_clean_job(tmp_path: Path) -> None:
    """Without a failure nothing is lost and there is no restart time."""
    script = write_job(tmp_path / "job", Script(fail_step=None, fail_rank=None, straggler=None))
    truth = expected(script)
    s = _analysis.summary(_open(tmp_path / "job"))
    assert s["goodput"] == pytest.approx(truth["goodput"], rel=1e-9)
    assert s["breakdown_s"]["lost_progress"] == 0
    assert s["breakdown_s"]["restart_idle"] == pytest.approx(0.0, abs=1e-9)
    assert s["steps_lost"] == 0 and s["failed_streams"] == 0
    assert s["samples"] == 4 * 40 * 8  # batch_size summed over ranks when no progress events exist


def test_ranks_finds_the_straggler_and_its_score(tmp_path: Path) -> None:
    """The slowed rank is the only straggler, with score = its slow-down factor."""
    write_job(tmp_path / "job", Script(straggler=1, straggler_factor=1.5))
    r = _analysis.ranks(_open(tmp_path / "job"), top=2)
    assert r["stragglers"] == [1]
    assert r["top"][0] == 1
    by_rank = {x["rank"]: x for x in r["ranks"]}
    assert by_rank[1]["score"] == pytest.approx(1.5)
    assert by_rank[0]["score"] == pytest.approx(1.0)
    assert by_rank[1]["slow_since_window"] == 0


@pytest.mark.parametrize("noisy", [(), (6, 7), (5, 7), (2, 6, 7)])
def test_ranks_onset_is_not_pulled_earlier_by_noisy_steps_before_it(tmp_path: Path, noisy: tuple[int, ...]) -> None:
    """Rank 1 is 40 ms slower from step 8; a few of its earlier steps are 4-5 ms slow by noise (enough for the
    ratio and floor tests, as on CI's busy 2-core machine): the onset is still step 8."""
    extra = {(1, step): 0.004 + 0.0005 * i for i, step in enumerate(noisy)}
    script = Script(
        ranks=3, steps=30, step_s=0.03, fail_rank=None, fail_step=None, straggler=1, extra_s=extra,
        straggler_from=8, straggler_factor=70 / 30,
    )  # fmt: skip
    write_job(tmp_path / "job", script)
    r = _analysis.ranks(_open(tmp_path / "job"))
    assert r["stragglers"] == [1]
    slow = next(x for x in r["ranks"] if x["rank"] == 1)
    assert slow["slow_in"] == "compute"
    assert slow["slow_since_step"] == 8
    step8 = next(json.loads(line) for line in script.files[1].read_text().splitlines() if '"step":8' in line)
    assert slow["slow_since_ns"] == step8["ts"]


def test_ranks_onset_is_not_moved_to_the_first_step_by_noisy_first_steps(tmp_path: Path) -> None:
    """Rank 1 is 40 ms slower from step 4; two of its first four steps are 5 ms slow by noise (warm-up, a busy
    machine): a change at step 0 classifies as many steps right as one at step 4, and the halfway bar had no
    steps before 0 to take its lower level from (a real Trainer job on a busy machine read step 0)."""
    script = Script(
        ranks=3, steps=30, step_s=0.03, fail_rank=None, fail_step=None, straggler=1,
        extra_s={(1, 0): 0.005, (1, 2): 0.005}, straggler_from=4, straggler_factor=70 / 30,
    )  # fmt: skip
    write_job(tmp_path / "job", script)
    r = _analysis.ranks(_open(tmp_path / "job"))
    assert r["stragglers"] == [1]
    slow = next(x for x in r["ranks"] if x["rank"] == 1)
    assert (slow["slow_in"], slow["slow_since_step"]) == ("compute", 4)


def _stop_after(path: Path, marker: str) -> None:
    """Cut a rank's file after the first line holding ``marker``, as if the rank had stopped there."""
    lines = path.read_text().splitlines(keepends=True)
    cut = next(i for i, line in enumerate(lines) if marker in line)
    path.write_text("".join(lines[: cut + 1]))


def test_a_rank_that_stopped_early_is_not_a_straggler_for_its_last_two_steps(tmp_path: Path) -> None:
    """A busy start slows every rank's first 8 steps by 4 ms; rank 3 stopped after step 9 and its steps 8 and 9
    were slow too (as on CI's oversubscribed machine). Its whole-run median is slow, but no slow-down of at least
    five steps follows any step: not a straggler. Rank 1, 20 ms slower from step 8 of 30, is one."""
    busy = {(rank, step): 0.004 for rank in range(4) for step in range(8)}
    late = {(3, 8): 0.004, (3, 9): 0.004}
    script = Script(
        ranks=4, steps=30, step_s=0.01, straggler=1, straggler_from=8, straggler_factor=3.0, extra_s={**busy, **late},
        fail_rank=None, fail_step=None, checkpoint_every=100,
    )  # fmt: skip
    write_job(tmp_path / "job", script)
    _stop_after(script.files[3], '"step":9,')
    r = _analysis.ranks(_open(tmp_path / "job"))
    by_rank = {x["rank"]: x for x in r["ranks"]}
    assert by_rank[3]["steps"] == 10
    assert by_rank[3]["compute_score"] > 1.1  # the whole-run medians alone would name it
    assert r["stragglers"] == [1], r["stragglers"]
    assert by_rank[1]["slow_since_step"] == 8


def test_a_rank_is_slow_in_its_checkpoints_only_when_half_its_saves_are(tmp_path: Path) -> None:
    """Saves take 5 ms. Rank 1's every save takes 300 ms, rank 2's two of three take 40 ms: stragglers.
    Rank 5 saved twice, one of them 7 ms late (a busy disk, as on CI): not a straggler. Rank 4's every save is 3 ms
    late, 1.6 times the others' but less than one 10 ms step: not a straggler either."""
    extra = {(1, 10): 0.295, (1, 20): 0.295, (1, 30): 0.295, (2, 10): 0.035, (2, 30): 0.035, (5, 20): 0.007}
    extra |= {(4, 10): 0.003, (4, 20): 0.003, (4, 30): 0.003}
    script = Script(
        ranks=6, steps=30, step_s=0.01, straggler=None, fail_rank=None, fail_step=None, checkpoint_every=10,
        save_s=0.005, save_extra_s=extra,
    )  # fmt: skip
    write_job(tmp_path / "job", script)
    # Rank 5 stopped after its second save (it failed there, say): two saves, not three.
    _stop_after(script.files[5], '"current_iteration":20')
    r = _analysis.ranks(_open(tmp_path / "job"))
    by_rank = {x["rank"]: x for x in r["ranks"]}
    assert sorted(r["stragglers"]) == [1, 2], r["stragglers"]
    assert by_rank[1]["slow_in"] == by_rank[2]["slow_in"] == "checkpoint_save"
    # The figure compared is the lower median of the rank's own saves (this script's own arithmetic).
    assert by_rank[1]["checkpoint_save_median_s"] == pytest.approx(0.300)
    assert by_rank[2]["checkpoint_save_median_s"] == pytest.approx(0.040)
    assert by_rank[5]["checkpoint_save_median_s"] == pytest.approx(0.005)
    assert by_rank[4]["checkpoint_save_median_s"] == pytest.approx(0.008)
    assert not any(by_rank[rank]["straggler"] for rank in (0, 3, 4, 5))


def test_errors_names_the_first_error_and_what_each_rank_was_doing(tmp_path: Path) -> None:
    """Root cause: the failing rank's exception; the killed ranks show their open iteration span."""
    write_job(tmp_path / "job", Script(fail_rank=3, fail_step=25))
    e = _analysis.errors(_open(tmp_path / "job"))
    assert e["first_error"]["rank"] == 3
    assert e["first_error"]["error_type"] == "RuntimeError"
    assert "illegal memory access" in e["first_error"]["message"]
    assert "Traceback" in e["first_error"]["stack"]
    assert e["error_count"] == 1 and e["groups"][0]["ranks"] == "3"
    # the last streams are the restarted, cleanly closed ones
    assert {r["state"] for r in e["ranks"]} == {"closed"}


def test_errors_of_a_job_that_died(tmp_path: Path) -> None:
    """Without a restart, the killed ranks' open spans (the step they were in) are listed."""
    script = Script(fail_rank=0, fail_step=12)
    write_job(tmp_path / "job", script)
    for path in script.files.values():  # cut each file after its first stream
        text = path.read_text()
        second = text.find('"kind":"header"', 10)
        path.write_text(text[: text.rfind("\n", 0, second) + 1])
    e = _analysis.errors(_open(tmp_path / "job"), hang_after_s=3600)
    by_rank = {r["rank"]: r for r in e["ranks"]}
    assert by_rank[0]["state"] == "error"
    assert by_rank[1]["state"] == "ended abruptly"
    open_names = [s["name"] for s in by_rank[1]["open_spans"]]
    assert open_names == ["main_function", "training_loop", "iteration"]
    assert by_rank[1]["last_record"]["kind"] == "start"
    assert e["hang_suspects"] == []


def test_missing_ranks_and_a_cut_last_line_are_reported(tmp_path: Path) -> None:
    """A rank without a file and a truncated last line become notes; the rest is still analysed."""
    script = write_job(tmp_path / "job", Script(world_size=6, fail_step=None, fail_rank=None))
    with script.files[1].open("a") as handle:
        handle.write('{"seq":999,"kind":"span","ts":1,"na')
    job = _open(tmp_path / "job")
    s = _analysis.summary(job)
    assert s["ranks_missing"] == "4-5"
    assert any("cut short" in n and "rank1.jsonl" in n for n in s["notes"])
    assert any("missing entirely" in n for n in s["notes"])
    assert s["steps_completed"] == 40


def test_hang_suspect_from_a_rank_that_stopped_early(tmp_path: Path) -> None:
    """A rank whose stream stops long before the others' ends is a hang suspect."""
    script = write_job(tmp_path / "job", Script(fail_step=None, fail_rank=None, straggler=None, steps=200))
    lines = script.files[2].read_text().splitlines(keepends=True)
    script.files[2].write_text("".join(lines[:60]))  # rank 2 wrote nothing after its ~55th step
    e = _analysis.errors(_open(tmp_path / "job"), hang_after_s=5)
    assert e["hang_suspects"] == [2]


def test_lost_progress_follows_the_last_completed_checkpoint(tmp_path: Path) -> None:
    """Failing right after a checkpoint loses one step; failing right before the next loses a whole interval."""
    early = expected(write_job(tmp_path / "a", Script(fail_step=20, checkpoint_every=10)))
    late = expected(write_job(tmp_path / "b", Script(fail_step=29, checkpoint_every=10)))
    s_early = _analysis.summary(_open(tmp_path / "a"))
    s_late = _analysis.summary(_open(tmp_path / "b"))
    assert s_early["steps_lost"] == 1 and s_late["steps_lost"] == 10
    assert s_early["breakdown_s"]["lost_progress"] == pytest.approx(early["breakdown"]["lost_progress"])
    assert s_late["breakdown_s"]["lost_progress"] == pytest.approx(late["breakdown"]["lost_progress"])


def _append(path: Path, *records: dict[str, object]) -> None:
    import json

    with path.open("a") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")


@pytest.mark.parametrize("signalled", ["SIGHUP", None])
def test_a_finished_job_whose_launcher_got_a_signal_after_its_ranks_ended(
    tmp_path: Path, signalled: str | None
) -> None:
    """Every rank finished and closed its stream; then the launcher alone got SIGHUP (the terminal closed as the
    job ended: a real Lightning job whose ranks had exited when the signal came, only traintrace-run was left). The
    training is healthy and the verdict says so, and that the launcher got the signal: it exits 1, and the
    scheduler reads the job as failed (before, the verdict said only ``healthy: 3 ranks finished``)."""
    from tests.cli_jobs import T0

    write_job(tmp_path / "job", Script(ranks=3, fail_step=None, fail_rank=None, straggler=None))
    header = {"seq": 0, "kind": "header", "ts": T0 - 10**9, "schema": "traintrace", "schema_version": 1}
    end = {"seq": 1, "kind": "event", "ts": T0 + 3600 * 10**9, "name": "job_end", "span": 0, "tid": 1}
    data = {"error_type": "SignalException", "signal": signalled} if signalled else {}
    _append(
        tmp_path / "job" / "agent.jsonl",
        {**header, "job": "scripted", "source": "agent", "host": "h", "pid": 1},
        {**end, "attrs": {"exit_code": 1 if signalled else 0, "data": data}},
    )
    job = _open(tmp_path / "job")
    try:
        errors = _analysis.errors(job)
    finally:
        job.close()
    assert errors["status"] == "healthy", errors["verdict"]
    assert errors["verdict"].startswith("healthy: 3 ranks finished; last step "), errors["verdict"]
    then = "; then the launcher got SIGHUP from outside"
    assert errors["verdict"].endswith(then) == (signalled is not None), errors["verdict"]


def test_launcher_stream_and_progress_events(tmp_path: Path) -> None:
    """agent.jsonl is the launcher, not a rank; training_iterations counters feed samples, tokens and MFU."""
    from tests.cli_jobs import T0

    script = write_job(tmp_path / "job", Script(fail_step=None, fail_rank=None, straggler=None))
    agent = tmp_path / "job" / "agent.jsonl"
    _append(
        agent,
        {
            "seq": 0,
            "kind": "header",
            "ts": T0 - 10**9,
            "schema": "traintrace",
            "schema_version": 1,
            "job": "scripted",
            "source": "agent",
            "host": "h",
            "pid": 1,
        },
        {
            "seq": 1,
            "kind": "event",
            "ts": T0 - 10**8,
            "name": "worker_start",
            "span": 0,
            "tid": 1,
            "attrs": {"ranks": [0, 1, 2, 3]},
        },
        {"seq": 2, "kind": "event", "ts": T0 + 10**9, "name": "worker_restart", "span": 0, "tid": 1},
    )
    for rank, path in script.files.items():
        _append(
            path,
            {
                "seq": 90,
                "kind": "event",
                "ts": T0 + 2 * 10**9,
                "name": "training_iterations",
                "span": 0,
                "tid": 7,
                "attrs": {
                    "consumed_samples": 1280,
                    "consumed_tokens": 655360,
                    "mfu": 0.41,
                    "samples_per_second": 300.0 + rank,
                    "tokens_per_second": 153600.0,
                    "last_step": 39,
                },
            },
        )
    job = _open(tmp_path / "job")
    s = _analysis.summary(job)
    assert s["ranks_seen"] == 4 and s["ranks_missing"] == ""
    assert s["samples"] == 1280 and s["tokens"] == 655360 and s["last_step"] == 39
    assert s["mfu"] == pytest.approx(0.41) and s["samples_per_second"] == pytest.approx(300.0)
    assert s["wall_s"] > expected(script)["wall_s"]  # the launcher started a second earlier
    e = _analysis.errors(job)
    assert [x["name"] for x in e["launcher_events"]] == ["worker_start", "worker_restart"]
    assert {r["rank"] for r in e["ranks"]} == {0, 1, 2, 3}


def _write_rank(
    path: Path, rank: int, spans: list[tuple[str, int, int, int, int]], end_ms: int, world_size: int = 2
) -> None:
    """A rank's stream by hand: ``spans`` as (name, id, parent, start, end) in ms after T0 (``iteration`` spans get
    a step), inside a training loop (id 1), then a clean close."""
    from tests.cli_jobs import T0

    ms = 1_000_000
    header = {"seq": 0, "kind": "header", "ts": T0, "schema": "traintrace", "schema_version": 1, "job": "j"}
    records: list[dict[str, object]] = [{**header, "rank": rank, "world_size": world_size, "restart": 0, "host": "h"}]
    steps = 0
    for name, span, parent, start, end in spans:
        record = {"kind": "span", "ts": T0 + start * ms, "dur": (end - start) * ms, "name": name, "id": span}
        if name == "iteration":
            record["attrs"] = {"step": steps}
            steps += 1
        records.append({**record, "parent": parent, "tid": 7, "status": "ok"})
    loop = {"kind": "span", "ts": T0, "dur": end_ms * ms, "name": "training_loop", "id": 1, "parent": 0, "tid": 7}
    records += [{**loop, "status": "ok"}, {"kind": "close", "ts": T0 + end_ms * ms, "records": len(records) + 2}]
    path.parent.mkdir(parents=True, exist_ok=True)
    _append(path, *({"seq": i, **r} for i, r in enumerate(records)))


def _steps(first: int, count: int, start_ms: int, first_id: int) -> list[tuple[str, int, int, int, int]]:
    """``count`` 10 ms steps 1 ms apart from ``start_ms``."""
    return [("iteration", first_id + k, 1, start_ms + 11 * k, start_ms + 11 * k + 10) for k in range(count)]


def test_a_rank_between_its_steps_while_rank_0_saves_waited_for_the_save(tmp_path: Path) -> None:
    """Rank 0 saves for 100 ms after its 10th step; rank 1 waits for it between its steps, outside every span (a
    barrier): that wait is checkpoint save time, not ``other``. Rank 1 in a step of its own that began long before
    the save and ended long after it (a phase of it inside, as with gradient accumulation) did not wait."""
    _write_rank(tmp_path / "a" / "rank0.jsonl", 0, [*_steps(0, 10, 0, 10), ("checkpoint_save_sync", 99, 1, 109, 209),
                *_steps(10, 10, 210, 20)], 320)  # fmt: skip
    _write_rank(tmp_path / "a" / "rank1.jsonl", 1, [*_steps(0, 10, 0, 10), *_steps(10, 10, 210, 20)], 320)
    s = _analysis.summary(_open(tmp_path / "a"))
    # Rank 1's gap 109 to 210 ms held the save's end at 209: 100 ms of it beyond its usual 1 ms gap, all overlap.
    assert s["breakdown_s"]["checkpoint_save"] == pytest.approx((0.100 + 0.100) / 2, abs=1e-9), s["breakdown_s"]
    assert s["breakdown_s"]["productive"] == pytest.approx(0.200, abs=1e-9)
    long_step = [("iteration", 13, 1, 33, 600), ("data_loading", 50, 13, 420, 425)]
    _write_rank(tmp_path / "b" / "rank0.jsonl", 0, [*_steps(0, 30, 0, 100), ("checkpoint_save_sync", 99, 1, 330, 430),
                *_steps(30, 10, 601, 200)], 720)  # fmt: skip
    _write_rank(tmp_path / "b" / "rank1.jsonl", 1, [*_steps(0, 3, 0, 10), *long_step, *_steps(4, 10, 601, 20)], 720)
    s = _analysis.summary(_open(tmp_path / "b"))
    assert s["breakdown_s"]["checkpoint_save"] == pytest.approx(0.100 / 2, abs=1e-9), s["breakdown_s"]


def test_ranks_not_in_lockstep_are_both_named_though_two_of_them_end_their_steps_together(tmp_path: Path) -> None:
    """Three ranks that do not wait for one another, each fetching its batch before its step: rank 0 in 1 ms, then
    a 10 ms step; rank 1 in 1 ms, then 39 ms of compute; rank 2 in 30 ms, then a 10 ms step. Ranks 1 and 2 keep the
    same pace and phase, so rank 2's late fetch ends inside each step of rank 1 and their steps end together, as when
    rank 1 waited in forward for that batch (DDP's broadcast of a model's buffers). Rank 0's steps end apart from
    theirs: they are not in lockstep, and rank 1 is slow in its own compute (the suite's five independent processes,
    ranks 1 and 2 so slowed, read ``[0, 2]`` once, their steps ending together by chance)."""

    def steps(fetch_ms: int, step_ms: int) -> list[tuple[str, int, int, int, int]]:
        spans = []
        for k in range(30):
            start = k * (fetch_ms + step_ms + 1)
            spans += [("data_loading", 10 + 2 * k, 1, start, start + fetch_ms)]
            spans += [("iteration", 11 + 2 * k, 1, start + fetch_ms, start + fetch_ms + step_ms)]
        return spans

    for rank, fetch_ms, step_ms in ((0, 1, 10), (1, 1, 39), (2, 30, 10)):
        _write_rank(tmp_path / f"rank{rank}.jsonl", rank, steps(fetch_ms, step_ms), 30 * 41, world_size=3)
    r = _analysis.ranks(_open(tmp_path))
    by_rank = {x["rank"]: x for x in r["ranks"]}
    assert sorted(r["stragglers"]) == [1, 2], (r["stragglers"], r["notes"])
    assert (by_rank[1]["slow_in"], by_rank[2]["slow_in"]) == ("compute", "data_loading")
    assert by_rank[1]["slow_since_step"] == by_rank[2]["slow_since_step"] == 0


def test_manifest_world_size_reveals_ranks_that_never_wrote(tmp_path: Path) -> None:
    """A manifest.json saying 6 ranks, with files for 4: ranks 4-5 are reported missing."""
    import json

    write_job(tmp_path / "job", Script(fail_step=None, fail_rank=None))
    (tmp_path / "job" / "manifest.json").write_text(json.dumps({"schema": "traintrace-manifest", "world_size": 6}))
    s = _analysis.summary(_open(tmp_path / "job"))
    assert s["ranks_missing"] == "4-5"


def test_hang_time_from_a_hang_suspected_error(tmp_path: Path) -> None:
    """Hang = from the last completed step before hang_suspected to the end of that stream."""
    import json

    script = write_job(tmp_path / "job", Script(fail_step=None, fail_rank=None, straggler=None))
    lines = script.files[2].read_text().splitlines(keepends=True)
    keep = next(i for i, line in enumerate(lines) if '"step":22,' in line)
    last = json.loads(lines[keep])
    hang_ts = last["ts"] + last["dur"] + 5 * 10**9
    error = {
        "seq": 999,
        "kind": "error",
        "ts": hang_ts,
        "name": "hang_suspected",
        "span": 0,
        "tid": 7,
        "message": "no progress for 5.0s",
        "stack": "Thread 7:\n  File x",
        "attrs": {"last_step": 22},
    }
    script.files[2].write_text("".join(lines[: keep + 1]) + json.dumps(error) + "\n")
    job = _open(tmp_path / "job")
    s = _analysis.summary(job)
    assert s["breakdown_s"]["hang"] == pytest.approx(5.0 / 4)
    assert sum(s["breakdown_s"].values()) == pytest.approx(s["wall_s"], rel=1e-9)
    assert 2 in _analysis.errors(job)["hang_suspects"]


def test_a_job_that_died_before_its_first_step(tmp_path: Path) -> None:
    """No iteration at all: every analysis still answers, and the error is the root cause."""
    import json

    folder = tmp_path / "job"
    folder.mkdir()
    header = {
        "seq": 0,
        "kind": "header",
        "ts": 10**18,
        "schema": "traintrace",
        "schema_version": 1,
        "job": "x",
        "rank": 0,
        "world_size": 2,
        "restart": 0,
        "host": "h",
        "pid": 1,
    }
    error = {
        "seq": 1,
        "kind": "error",
        "ts": 10**18 + 10**9,
        "name": "exception",
        "span": 0,
        "tid": 1,
        "error_type": "ImportError",
        "message": "no module named <b>x</b>",
        "stack": "Traceback",
    }
    (folder / "rank0.jsonl").write_text(json.dumps(header) + "\n" + json.dumps(error) + "\n")
    job = _open(folder)
    s = _analysis.summary(job)
    assert s["goodput"] == 0 and s["step_time"] is None and s["ranks_missing"] == "1"
    assert _analysis.ranks(job)["stragglers"] == []
    assert _analysis.errors(job)["first_error"]["error_type"] == "ImportError"


_KILLED_AFTER_ITS_INITIALISATION = """
import json, os, signal, sys, time
import traintrace as tt

truth = {"configured": time.time_ns()}
tt.configure(log_dir=sys.argv[1], job_id="j", flush_interval=60.0)  # nothing written but what flush() writes
# The writer wakes early when records arrive fast (before its queue could fill): two records within microseconds of
# its start read as a fast stream. A pause first keeps its next write a flush interval away.
time.sleep(0.5)
with tt.application():
    truth["init_start"] = time.time_ns()
    with tt.model_init():
        tt.flush()  # the stream ends here: the initialisation's start, not its end
        time.sleep(0.3)
    with tt.optimizer_init():
        time.sleep(0.1)
    truth["init_end"] = time.time_ns()
    with tt.training_loop():
        for step in range(3):
            with tt.training_iteration(step):
                time.sleep(0.02)
    truth["killed"] = time.time_ns()
    with open(sys.argv[2], "w") as out:
        json.dump(truth, out)
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.subprocess
@pytest.mark.each_core
def test_a_rank_killed_within_a_flush_interval_of_its_first_steps_keeps_its_initialisation(tmp_path: Path) -> None:
    """A rank SIGKILLed in the flush interval that holds its initialisation's end and its first steps: its stream
    ends at the initialisation's start. The progress file's first iteration ends it there: `summary` counts the
    script's own initialisation time (not 0 s, nor the rest as idle with no process), the job's wall time reaches
    the first iteration, and the categories still add up to it."""
    from tests._reliability import run_script, write_script

    script = write_script(tmp_path, "killed.py", _KILLED_AFTER_ITS_INITIALISATION)
    truth_path = tmp_path / "truth.json"
    done = run_script(script, str(tmp_path / "logs"), str(truth_path))
    assert done.returncode == -9, done.stderr[-2000:]
    truth = json.loads(truth_path.read_text())
    stream = tmp_path / "logs" / "j" / "rank0.jsonl"
    last = json.loads(stream.read_text().splitlines()[-1])
    assert (last["kind"], last["name"]) == ("start", SpanName.MODEL_INIT)  # the case this test is about
    s = _analysis.summary(_open(tmp_path / "logs" / "j"))
    marked = (truth["init_end"] - truth["init_start"]) / 1e9
    assert s["breakdown_s"]["initialization"] == pytest.approx(marked, abs=0.005), (s["breakdown_s"], marked)
    assert s["breakdown_s"]["restart_idle"] < 0.005, s["breakdown_s"]
    assert sum(s["breakdown_s"].values()) == pytest.approx(s["wall_s"], rel=1e-9)
    assert s["wall_s"] <= (truth["killed"] - truth["configured"]) / 1e9
    assert s["verdict"].startswith("rank 0 "), s["verdict"]


@pytest.mark.each_core
@pytest.mark.parametrize(
    ("failing", "micro_batches"),
    [(0, 1), (3, 2)],
    ids=["the first step", "the second micro-batch of a step, its gradients accumulated"],
)
def test_the_step_of_an_exception_is_the_iteration_it_unwound(tmp_path: Path, failing: int, micro_batches: int) -> None:
    """An exception in forward unwinds its iteration, a plain record after it ends: the culprit's step is that
    iteration's, with the attributes of plain iterations kept or not (the commands' lean load keeps its step as a
    column only). Not the step after the last completed one: there is none at step 0, and with gradients
    accumulated over two micro-batches (an iteration each, the same step) the first one of the failing step
    completed (both read None, and 4, before)."""
    import traintrace as tt

    tt.configure(log_dir=str(tmp_path), job_id="j")
    with tt.application():
        try:
            with tt.training_loop():
                for step in range(failing + 1):
                    for micro in range(micro_batches):
                        with tt.training_iteration(step), tt.forward():
                            if step == failing and micro == micro_batches - 1:
                                raise RuntimeError("a bad batch")
        except RuntimeError:
            pass
    tt.close()
    for lean in (False, True):
        report = _analysis.errors(Job.open([tmp_path / "j"], lean=lean))
        culprit = report["culprit"]
        assert (culprit["step"], culprit["phase"]) == (failing, SpanName.FORWARD), (lean, report["verdict"])
        assert report["verdict"].startswith(f"rank 0 raised RuntimeError in forward at step {failing}")


def test_a_peer_error_before_the_cause_is_a_consequence(tmp_path: Path) -> None:
    """A peer's "connection reset" written before the failing rank's own exception is not the culprit."""
    import json

    script = write_job(tmp_path / "job", Script(fail_rank=3, fail_step=25, straggler=None))
    for path in script.files.values():  # no restart: the job died
        text = path.read_text()
        second = text.find('"kind":"header"', 10)
        path.write_text(text[: text.rfind("\n", 0, second) + 1])
    rank3 = script.files[3].read_text().splitlines()
    cause = next(json.loads(line) for line in rank3 if '"kind":"error"' in line)
    peer = {
        "seq": 998,
        "kind": "error",
        "ts": cause["ts"] - 10**6,
        "name": "exception",
        "span": 0,
        "tid": 7,
        "error_type": "RuntimeError",
        "message": "[gloo] Connection reset by peer",
        "stack": "Traceback",
    }
    with script.files[0].open("a") as handle:
        handle.write(json.dumps(peer) + "\n")
    e = _analysis.errors(_open(tmp_path / "job"), hang_after_s=3600)
    assert e["culprit"]["rank"] == 3 and e["culprit"]["step"] == 25 and e["rule"] == "first exception"
    assert e["first_error"]["rank"] == 3 and not e["first_error"]["consequence"]
    assert [g["consequence"] for g in e["groups"]] == [False, True]
    assert e["verdict"].startswith("rank 3 raised RuntimeError")
    s = _analysis.summary(_open(tmp_path / "job"))
    assert s["status"] == "failed" and s["verdict"] == e["verdict"]
    assert sum(s["breakdown_s"].values()) == pytest.approx(s["wall_s"], rel=1e-9)


def test_a_resolved_hang_is_not_hang_time(tmp_path: Path) -> None:
    """hang_suspected followed by hang_resolved: the steps after it stay productive; the job is healthy."""
    import json

    script = write_job(tmp_path / "job", Script(fail_step=None, fail_rank=None, straggler=None))
    lines = script.files[2].read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if '"step":22,' in line)
    step = json.loads(lines[at])
    report = {
        "seq": 997,
        "kind": "error",
        "ts": step["ts"] + 10**6,
        "name": "hang_suspected",
        "span": 0,
        "tid": 7,
        "message": "no progress for 5.0s",
        "stack": "Thread 7",
        "attrs": {"last_step": 21},
    }
    resumed = {
        "seq": 998,
        "kind": "event",
        "ts": step["ts"] + 2 * 10**6,
        "name": "hang_resolved",
        "span": 0,
        "tid": 7,
        "attrs": {"hang_seconds": 5.0},
    }
    lines[at + 1 : at + 1] = [json.dumps(report) + "\n", json.dumps(resumed) + "\n"]
    script.files[2].write_text("".join(lines))
    truth = expected(script)
    s = _analysis.summary(_open(tmp_path / "job"))
    assert s["breakdown_s"]["hang"] == 0
    assert s["goodput"] == pytest.approx(truth["goodput"], rel=1e-9)
    assert s["status"] == "healthy" and "resolved" in s["verdict"]


def _check_failure(script: Script, e: dict[str, Any]) -> None:
    """errors of a scripted job that failed, against the script."""
    if script.fault == "terminated":
        # Within the clock-skew allowance of each other: nobody went first.
        if script.ranks > 1:
            assert (e["culprit"], e["rule"]) == (None, "terminated together"), e["verdict"]
        return
    c = e["culprit"]
    assert c is not None, e["verdict"]
    if script.fault == "hang":
        _check_hang(script, e)
        return
    assert (c["rank"], c["step"]) == (script.fail_rank, script.fail_step), e["verdict"]
    # The last failed restart's culprit; the earlier ones failed the same way.
    assert (c["restart"], e["same_failure_restarts"]) == (script.fails_again, list(range(script.fails_again)))
    if script.fault == "raise":
        assert (e["rule"], c["error"]["error_type"]) == ("first exception", "RuntimeError"), e["verdict"]
    else:
        assert e["rule"] == "died first" and c["error"] is None, e["verdict"]


def _check_hang(script: Script, e: dict[str, Any]) -> None:
    """errors of a scripted job whose first attempt hung, against the script."""
    c = e["culprit"]
    hung = hung_ranks(script)
    # One of the ranks stuck together (each as far behind), the others named with it.
    assert c["rank"] in hung and sorted([c["rank"], *c["stuck_with"]]) == hung, e["verdict"]
    assert (c["step"], c["restart"], e["same_failure_restarts"]) == (script.fail_step, 0, []), e["verdict"]
    # Reports name the rank behind; without any, the collectives that timed out waiting for it do.
    timed_out = "hang: the rank the collectives timed out on"
    rule = "hang: the rank behind" if script.hang_report_s is not None else timed_out
    phase = "iteration" if script.hang_phase == "collective" else script.hang_phase  # between its phases
    assert (e["rule"], c["phase"]) == (rule, phase), e["verdict"]
    assert c["cause"].startswith("hang: ") and c["error"] is None, c["cause"]
    if len(hung) == 1:
        assert e["verdict"].startswith(f"restart 0 failed: rank {c['rank']} hung "), e["verdict"]
    else:
        said = f"(every rank of node {script.host(c['rank'])}) hung "
        assert e["verdict"].startswith("restart 0 failed: ranks ") and said in e["verdict"], e["verdict"]
    # Each rank stuck with it hung too, in what `errors` says of every rank, not only how its process ended later
    # (the time summary counts as the hang's comes from there).
    for rank in hung:
        state = next(s for s in e["rank_states"] if s["rank"] == rank and s["restart"] == 0)
        assert str(state["cause"]).startswith("hang: "), (rank, state["cause"], e["verdict"])
    # One line says what every other rank was doing: waiting in its collective.
    for other in range(script.ranks):
        if other not in hung:
            state = next(s for s in e["rank_states"] if s["rank"] == other and s["restart"] == 0)
            assert state["in_collective"], (other, e["verdict"])


def _check_stall(script: Script, s: dict[str, Any], e: dict[str, Any]) -> None:
    """A step that stalled on every rank, then went on: no failure, no hang or lost time, the stall in the step."""
    assert (e["culprit"], e["status"]) == (None, "healthy"), e["verdict"]
    n = script.ranks
    reported = script.hang_report_s is not None and script.hang_report_s < script.stall_s
    said = f"(a hang was suspected on {n} rank{'s' if n > 1 else ''} and resolved)"
    assert (said in e["verdict"]) == reported, e["verdict"]
    assert (s["restarts"], s["steps_lost"]) == (0, 0), s
    steps = {r: [script.step_dur_at(r, k) / S for k in range(script.steps)] for r in range(n)}
    saves = script.steps // script.checkpoint_every * script.save_s
    assert s["wall_s"] == pytest.approx(max(script.init_s + sum(d) + saves for d in steps.values()), abs=1e-6)
    assert s["breakdown_s"]["productive"] == pytest.approx(sum(sum(d) for d in steps.values()) / n, abs=1e-6)
    assert (s["breakdown_s"]["hang"], s["breakdown_s"]["lost_progress"]) == (0, 0), s["breakdown_s"]
    stalled = script.fail_step or 0
    assert s["step_time"]["max_s"] == pytest.approx(max(d[stalled] for d in steps.values()))


@pytest.mark.slow
# In the pure pass only the reader differs (DuckDB's, not the scanner), and tests/test_cli_reader.py's random files
# show that both read the same table.
@pytest.mark.once
@settings(max_examples=examples(50), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scripts())
# Rank 5 alone on its host raised; node0's five ranks stopped without a trace: read "node node0 was lost".
@example(Script(ranks=6, ranks_per_host=5, steps=2, step_s=0.05, straggler=None, init_s=0.2, checkpoint_every=1,
                save_s=0.1, load_s=0.1, fail_rank=5, fail_step=0, restart_gap_s=1.0))  # fmt: skip
# Rank 0 hung loading its first batch: named as rank 1 (reported) or "cause unclear" (timed out); its init was hang.
@example(Script(ranks=2, steps=2, step_s=0.05, straggler=None, init_s=0.2, checkpoint_every=1, save_s=0.1, load_s=0.1,
                fail_rank=0, fail_step=0, restart_gap_s=1.0, fault="hang", hang_phase="data_loading",
                hang_report_s=600.0, hang_end="killed"))  # fmt: skip
@example(Script(ranks=3, steps=5, straggler=None, fail_rank=1, fail_step=0, fault="hang", hang_phase="data_loading",
                hang_report_s=None, hang_end="timeout"))  # fmt: skip
# node0's two ranks hung loading their first batch, no report of their own, rank 2's report first: rank 1, named
# with rank 0, was "terminated by SIGTERM" in rank_states, and its 6.5 s of hang counted as data loading.
@example(Script(ranks=3, steps=2, step_s=0.05, straggler=None, init_s=0.2, checkpoint_every=1, save_s=0.1,
                load_s=0.1, fail_rank=0, fail_step=0, restart_gap_s=1.0, ranks_per_host=2, fault="hang",
                hang_phase="data_loading", hang_report_s=1.5, hung_reports=False, hang_end="timeout",
                hang_node=True, stall_s=5.0, collective_timeout_s=6.0))  # fmt: skip
# Rank 2 hung in forward with detection off: its step until torchrun's SIGTERM was "other", not lost progress.
@example(Script(ranks=4, steps=20, straggler=None, checkpoint_every=5, fail_rank=2, fail_step=7, fault="hang",
                hang_phase="model_forward", hang_report_s=None, hang_end="timeout"))  # fmt: skip
def test_random_scripted_jobs(script: Script) -> None:
    """summary, errors and ranks of any scripted job against the script: the culprit's rank, step and restart,
    the rule that named it and the restarts that failed the same way; restarts, steps completed and lost; wall
    time, goodput, every badput category and step statistics by ``expected``'s arithmetic (steps of one length,
    one failure by an exception), and by ``expected_hang``'s for a hang (its phase, the rule and where every other
    rank waited too); the straggler, given enough steps to show it. (600 examples at a time passed when written;
    the example found a wrong lost-node verdict, the hangs a rank hung loading its first batch named wrongly, an
    open iteration's time counted as `other` and initialisation counted as hang time.)"""
    with tempfile.TemporaryDirectory() as folder:
        write_job(Path(folder), script)
        job = _open(Path(folder))
        try:
            s = _analysis.summary(job)
            e = _analysis.errors(job)
            r = _analysis.ranks(job, top=2)
        finally:
            job.close()
    assert s["steps_completed"] == script.steps
    if script.fault == "stall" and script.fail_step is not None:
        _check_stall(script, s, e)
    elif script.fail_step is None:
        assert e["culprit"] is None and e["status"] != "failed", e["verdict"]
        assert (s["restarts"], s["steps_lost"]) == (0, 0)
    else:
        # Every failed attempt started the steps from the last save to the failing one and kept none of them; a
        # hang past the step's all-reduce let the others begin the next one too.
        lost = (script.fail_step % script.checkpoint_every + 1) * (script.fails_again + 1)
        if script.fault == "hang" and script.hang_phase in PAST_ALL_REDUCE:
            lost += 1
        assert (s["restarts"], s["steps_lost"]) == (script.fails_again + 1, lost), s
        _check_failure(script, e)
    if script.ranks >= 3 and script.straggler is not None and script.steps >= 6:
        assert r["stragglers"] == [script.straggler], r["ranks"]
    if script.fault == "hang" and script.fail_step is not None:
        hung = expected_hang(script)
        assert s["wall_s"] == pytest.approx(hung["wall_s"], abs=1e-6)
        assert s["goodput"] == pytest.approx(hung["goodput"], rel=1e-6)
        for key in _analysis.CATEGORIES:
            assert s["breakdown_s"][key] == pytest.approx(hung["breakdown"].get(key, 0.0), abs=1e-6), (key, s)
    if script.extra_s or script.fault != "raise" or script.peers_fail or script.fails_again:
        return  # expected() knows steps of one length, and the failure by an exception
    truth = expected(script)
    # expected() adds seconds to T0 in floats (1.8e9 s): a few hundred nanoseconds off.
    assert s["wall_s"] == pytest.approx(truth["wall_s"], abs=1e-6)
    assert s["goodput"] == pytest.approx(truth["goodput"], rel=1e-6)
    for key, value in truth["breakdown"].items():
        assert s["breakdown_s"][key] == pytest.approx(value, abs=1e-6), (key, s["breakdown_s"])
    assert s["step_time"]["median_s"] == pytest.approx(truth["step_median_s"])
    assert s["step_time"]["max_s"] == pytest.approx(truth["step_max_s"])
    assert (s["steps_completed"], s["steps_lost"]) == (truth["steps_completed"], truth["steps_lost"])


@pytest.mark.parametrize(
    ("slow_rank", "part", "gather"), [(1, "compute", False), (0, "compute", False), (1, "data_loading", False),
                                      (0, "data_loading", True)],
)  # fmt: skip
def test_ranks_names_the_straggler_of_a_job_recorded_between_a_frameworks_hooks(
    tmp_path: Path, slow_rank: int, part: str, gather: bool
) -> None:
    """No collective recorded and every step as long on both ranks: the slow rank is the one slow outside
    backward (or in its waits, less the collectives inside them), from the step the job's script slowed it;
    the waits around each validation pass fed no step and do not outvote the slow ones."""
    write_framework_job(tmp_path / "job", slow_rank, 5, part, gather=gather)
    r = _analysis.ranks(_open(tmp_path / "job"))
    assert r["stragglers"] == [slow_rank], r
    slow = next(x for x in r["ranks"] if x["rank"] == slow_rank)
    assert (slow["slow_in"], slow["slow_since_step"]) == (part, 5)
    assert any("outside backward" in note for note in r["notes"])
    other = next(x for x in r["ranks"] if x["rank"] != slow_rank)
    assert other["compute_median_s"] == pytest.approx(0.004)  # forward and the optimizer's step: its own work
    assert other["data_loading_median_s"] == pytest.approx(0.002)  # one wait a step, any gather taken out


@pytest.mark.parametrize(
    ("slow_rank", "part", "timing", "slow_steps"),
    [
        (1, "compute", (2, 3, 12), [2, 5, 8, 11]),
        (0, "data_loading", (1, 4, 12), [1, 5, 9]),
        (0, "compute", (3, 1, 8), [3, 4, 5, 6, 7]),
    ],
    ids=["compute-every-3rd", "data-every-4th", "compute-for-5-steps"],
)
def test_ranks_names_a_rank_slow_at_some_steps_only(
    tmp_path: Path, slow_rank: int, part: str, timing: tuple[int, int, int], slow_steps: list[int]
) -> None:
    """50 ms slower at every few steps, or for a few steps only: medians as the other rank's, yet the job waited
    50 ms at each of those steps. Named, with the steps the script slowed and what they cost."""
    slow_from, every, until = timing
    write_framework_job(tmp_path / "job", slow_rank, slow_from, part, every=every, until=until)
    r = _analysis.ranks(_open(tmp_path / "job"))
    assert r["stragglers"] == [slow_rank], r
    slow = next(x for x in r["ranks"] if x["rank"] == slow_rank)
    assert slow["slow_in"] == part
    assert (slow["slow_since_step"], slow["slow_until_step"], slow["slow_steps"]) == (
        slow_steps[0],
        slow_steps[-1],
        len(slow_steps),
    )
    assert slow.get("slow_every") == (every if every > 1 else None)
    assert slow["lost_s"] == pytest.approx(0.05 * len(slow_steps))
    assert any(
        f"rank {slow_rank} was slow in {part} at {len(slow_steps)} of its 12 steps only" in n for n in r["notes"]
    )
    text = render_ranks(r)
    assert f"{len(slow_steps)} steps, {slow_steps[0]} to {slow_steps[-1]}" in text


def test_a_rank_stalling_at_some_steps_is_named_though_checkpoint_saves_take_most_of_the_job(tmp_path: Path) -> None:
    """Rank 1 waits 50 ms longer for its batch at every other step from step 2 (5 stalls, 0.25 s); both ranks save
    a checkpoint for 500 ms after every other step (5 saves between their first step's start and last step's end,
    2.5 of those 2.888 s). The stalls are 67% of the 0.372 s the ranks trained (that time less the saves and the
    validation passes): named. It read ``no stragglers`` before: 8.7% of the time with the saves counted, under
    the 10% bar (CI's slow disk made a real Lightning job's 20 MB saves 0.3 s each, and its straggler read so)."""
    write_framework_job(tmp_path / "job", 1, 2, "data_loading", every=2, save_ms=500)
    r = _analysis.ranks(_open(tmp_path / "job"))
    assert r["stragglers"] == [1], r
    slow = next(x for x in r["ranks"] if x["rank"] == 1)
    assert (slow["slow_in"], slow["slow_since_step"], slow["slow_until_step"], slow["slow_every"]) == (
        "data_loading",
        2,
        10,
        2,
    )
    assert slow["lost_s"] == pytest.approx(0.05 * 5)
    # What the share is of, on both ranks (the other waits in backward as long): 12 steps of 8 ms, the 11 waits
    # of 2 ms after the first step began, the stalls, and 2 ms of each of the 2 validation blocks before the last
    # step (10 ms, of which the pass itself 8).
    trained = 12 * 0.008 + 11 * 0.002 + 0.25 + 2 * 0.002
    note = next(n for n in r["notes"] if n.startswith("rank 1 was slow in data_loading at 5 of its 12 steps"))
    assert f"{0.25 / trained:.0%} of its training time" in note, (note, trained)


def test_a_rank_stalling_in_compute_is_named_there_though_its_median_fetch_is_a_little_slower(tmp_path: Path) -> None:
    """Rank 1 is 50 ms slower in forward at every other step from step 2, and from step 6 waits 4 ms longer for each
    batch (a busy host). Its median compute is the other rank's; its median fetch is slower by 4 ms, enough to be
    named by it, from step 6. The stalls held the job up 250 ms, the fetches 24: it is slow in compute, at the steps
    the script slowed (a real Lightning job on a busy host read ``slow in data_loading since step 11`` for such a
    rank)."""
    write_framework_job(tmp_path / "job", 1, 2, "compute", every=2, slow_fetch=(1, 6, 4))
    r = _analysis.ranks(_open(tmp_path / "job"))
    assert r["stragglers"] == [1], r
    slow = next(x for x in r["ranks"] if x["rank"] == 1)
    assert slow["data_loading_score"] > 2  # the premise: its median fetch is slow enough to name it by
    assert (slow["slow_in"], slow["slow_since_step"], slow["slow_until_step"], slow["slow_every"]) == (
        "compute",
        2,
        10,
        2,
    )
    assert slow["lost_s"] == pytest.approx(0.05 * 5)
    assert any("its median data_loading is slower too, by far less" in n for n in r["notes"]), r["notes"]


@pytest.mark.parametrize("ranks", [2, 3])
def test_ranks_does_not_name_a_rank_that_waited_in_forward_for_a_slow_batch(tmp_path: Path, ranks: int) -> None:
    """The last rank fetches its batch 50 ms late every third step from step 1. The others wait for it in
    backward (DDP's all-reduce), but at step 1 in forward: DDP's second step rebuilds its buckets there, a
    broadcast (a real 3-rank Lightning job's ranks 0 and 1 spent 66 and 68 ms in forward at step 1 while rank 2
    loaded its batch). With a busy host's 6 ms at two more of a waiting rank's steps, that rank read as slow in
    compute at 3 steps: with three ranks, rank 1, which waited 1 ms longer than rank 0, as its part was compared
    with the mean of rank 0's wait and rank 2's short forward; with two, rank 0, its wait in forward taken for
    its own work. Only the late rank is named, with the steps the script slowed."""
    late, waiting = ranks - 1, ranks - 2
    busy = {(waiting, 0): 6, (waiting, 5): 6}
    write_framework_job(
        tmp_path / "job", late, 1, "data_loading", every=3, ranks=ranks, wait_in_forward=(1,), busy=busy
    )
    r = _analysis.ranks(_open(tmp_path / "job"))
    assert r["stragglers"] == [late], (r["stragglers"], r["notes"])
    slow = next(x for x in r["ranks"] if x["rank"] == late)
    assert (slow["slow_in"], slow["slow_since_step"], slow["slow_steps"], slow.get("slow_every")) == (
        "data_loading",
        1,
        4,
        3,
    )


@pytest.mark.parametrize(
    ("until", "busy_ms", "busy_steps", "stalls"),
    [(11, 3, (7, 9, 11), (4, 6, 8, 10)), (9, 5, (5, 7, 9), (4, 6, 8))],
    ids=["stalls-half-the-steps", "stalls-fewer"],
)
def test_ranks_describes_stalls_at_some_steps_of_a_rank_whose_medians_are_slower_too(
    tmp_path: Path, until: int, busy_ms: int, busy_steps: tuple[int, ...], stalls: tuple[int, ...]
) -> None:
    """Rank 1 stalls 50 ms in forward every other step from step 4, and a busy host makes three of its other steps
    a few ms slower: its median compute is then slower than rank 0's by more than the noise floor, and from step 4
    on most of its steps pass the first look (real Lightning jobs' rank on a busy machine, slow every other step
    from step 6, read "slow since step 6" or "since step 5" and no more: in CI, and in a loop beside three busy
    processes). With fewer stalls than half the steps from the onset on, the median of those steps' excess is the
    noise's. The answer is the stalls: the steps the script slowed, every other one, from the first to the last."""
    busy = dict.fromkeys(((1, step) for step in busy_steps), busy_ms)
    write_framework_job(tmp_path / "job", 1, 4, "compute", every=2, until=until, busy=busy)
    r = _analysis.ranks(_open(tmp_path / "job"))
    assert r["stragglers"] == [1], (r["stragglers"], r["notes"])
    slow = next(x for x in r["ranks"] if x["rank"] == 1)
    seen = tuple(slow.get(k) for k in ("slow_in", "slow_since_step", "slow_until_step", "slow_steps", "slow_every"))
    assert seen == ("compute", stalls[0], stalls[-1], len(stalls), 2), (seen, r["notes"])
    assert slow["compute_score"] >= 1.1, slow  # the premise: its medians named it too
    said = f"rank 1 was slow in compute at {len(stalls)} of its 12 steps only"
    assert any(n.startswith(said) and n.endswith("its medians are slower too") for n in r["notes"]), r["notes"]


def test_ranks_counts_only_the_stalls_of_a_rank_a_little_slower_at_every_other_step(tmp_path: Path) -> None:
    """Rank 1 stalls 50 ms in forward every other step from step 4, and a busy host makes each of its other 8 steps 2
    to 9 ms slower than rank 0's: the noise passes the first tests at more steps than the stalls, so the median
    excess of its slow steps was the noise's, half of that let 6 of the noisy steps count, and it read slow at 10
    steps, 2 to 11 (a real Lightning DDP fit in CI, slow every other step from step 6, read ``slow since step 1``,
    10 steps, 1 to 15). Its excesses fall into two classes far apart: the stalls, the steps the script slowed."""
    noise = dict(zip((0, 1, 2, 3, 5, 7, 9, 11), (2, 3, 5, 9, 4, 6, 8, 7), strict=True))
    busy = {(1, step): ms for step, ms in noise.items()}
    write_framework_job(tmp_path / "job", 1, 4, "compute", every=2, until=11, busy=busy)
    r = _analysis.ranks(_open(tmp_path / "job"))
    assert r["stragglers"] == [1], (r["stragglers"], r["notes"])
    slow = next(x for x in r["ranks"] if x["rank"] == 1)
    seen = tuple(slow.get(k) for k in ("slow_in", "slow_since_step", "slow_until_step", "slow_steps", "slow_every"))
    assert seen == ("compute", 4, 10, 4, 2), (seen, r["notes"])
    assert slow["lost_s"] == pytest.approx(0.05 * 4)


def test_ranks_names_a_rank_slow_at_more_than_half_its_steps_not_in_a_row(tmp_path: Path) -> None:
    """Rank 1 fetches its batch 50 ms late at steps 3, 5, 6, 8, 9 and 11: half its steps, not one run from some
    step on (a real Trainer job, two batches a step and every third batch slow on a busy host, was slow at steps
    3, 5, 6, 8, 9, 11, 12 and 14 of 15). Its median wait is a slow step's, so the steady test finds it but no step
    from which it stayed slow, and its waits do not sum above its median times its steps; it read ``no
    stragglers``. It is named with the steps the script slowed."""
    slow_at = (3, 5, 6, 8, 9, 11)
    write_framework_job(tmp_path / "job", 1, 3, "data_loading", at=slow_at)
    r = _analysis.ranks(_open(tmp_path / "job"))
    assert r["stragglers"] == [1], (r["stragglers"], r["notes"])
    slow = next(x for x in r["ranks"] if x["rank"] == 1)
    seen = tuple(slow.get(k) for k in ("slow_in", "slow_since_step", "slow_until_step", "slow_steps", "slow_every"))
    assert seen == ("data_loading", 3, 11, 6, None), (seen, r["notes"])
    assert slow["data_loading_score"] >= 1.1, slow  # the premise: its median is a slow step's
    said = "rank 1 was slow in data_loading at 6 of its 12 steps only (steps 3 to 11)"
    assert any(n.startswith(said) and "its median is its slow steps'" in n for n in r["notes"]), r["notes"]


@pytest.mark.parametrize("gather", [False, True], ids=["waits-in-backward", "waits-in-the-token-gather"])
def test_ranks_does_not_name_a_rank_slower_by_less_than_it_waited_for_the_straggler(
    tmp_path: Path, gather: bool
) -> None:
    """Rank 2 of three fetches every batch 50 ms late from step 1; the others wait for it in backward (DDP's
    all-reduce) or in the collective inside their own wait (the Trainer's token-count gather). From step 5 on a
    busy host makes rank 0's forward 3 ms slower: more than the noise floor, so its compute median is slower than
    the others' (a real 3-rank Trainer job on a busy host named rank 0 "slow in compute since step 7", 2.3 ms a
    step, beside its rank 2 that was 120 ms slow loading). It then waited 47 ms for rank 2 at each of those
    steps: it held the job up for nothing. Only rank 2 is named, and a note says why rank 0 is not."""
    busy = {(0, step): 3 for step in range(5, 12)}
    write_framework_job(tmp_path / "job", 2, 1, "data_loading", ranks=3, gather=gather, busy=busy)
    r = _analysis.ranks(_open(tmp_path / "job"))
    assert r["stragglers"] == [2], (r["stragglers"], r["notes"])
    rows = {x["rank"]: x for x in r["ranks"]}
    assert (rows[2]["slow_in"], rows[2]["slow_since_step"]) == ("data_loading", 1)
    assert rows[0]["compute_score"] >= 1.1, rows[0]  # the premise: its medians alone would name it
    said = "rank 0 was slower in compute from step 5 on (3 ms a step above the others' median), but at most"
    assert any(n.startswith(said) for n in r["notes"]), r["notes"]


def test_ranks_does_not_name_a_rank_for_two_slow_steps(tmp_path: Path) -> None:
    """Two slow steps are a hiccup (a busy host), not a straggler, however slow."""
    write_framework_job(tmp_path / "job", 1, 4, "compute", until=6)
    r = _analysis.ranks(_open(tmp_path / "job"))
    assert r["stragglers"] == [], r


#: Two hosts of two ranks in lockstep (a data-parallel job: 100 ms steps), rank 3 on node1 failing at step 25.
SKEWED = {"ranks": 4, "ranks_per_host": 2, "straggler": None, "fail_rank": 3, "fail_step": 25}


@pytest.mark.parametrize(
    ("fault", "ahead_ms", "step"),
    [
        *[("died", 500, 25), ("died", -500, 25), ("raise", 2000, 25), ("raise", -2000, 25), ("hang", 2000, 25)],
        *[("died", 500, 1), ("died", -500, 1)],
    ],
)
def test_errors_names_the_culprit_on_a_host_whose_clock_is_off(
    tmp_path: Path, fault: str, ahead_ms: int, step: int
) -> None:
    """node1's clock runs ahead of node0's (or behind): by its raw times rank 3, killed, stopped after node0's
    ranks saw their collective fail, or node0's ranks stopped before rank 3 raised (read as a lost node). The
    ranks' step order proves the offset (none completed a step before the others began it); the culprit is
    rank 3 at the step scripted, and the offset found is the one written. Failing at step 1 with no restart, one
    step (0) proves it: with three steps asked for, such a job was read on its raw times (a real one in
    `tests/fault_sweep.py --seed 134`)."""
    script = write_job(tmp_path / "job", Script(fault=fault, **{**SKEWED, "fail_step": step}))  # type: ignore[arg-type]
    if step < 3:  # no restart (its steps would prove the offset): the job died there
        for path in script.files.values():
            text = path.read_text()
            second = text.find('"kind":"header"', 10)
            path.write_text(text[: text.rfind("\n", 0, second) + 1])
    clock_ahead(tmp_path / "job", [2, 3], ahead_ms * 1_000_000)
    e = _analysis.errors(_open(tmp_path / "job"))
    assert (e["culprit"]["rank"], e["culprit"]["step"]) == (3, step), e["verdict"]
    assert e["verdict"].startswith("restart 0 failed: rank 3 " if step >= 3 else "rank 3 "), e["verdict"]
    assert e["clock_offsets"]["reference"] == "node0"
    assert e["clock_offsets"]["offsets_s"] == {"node1": pytest.approx(ahead_ms / 1000, abs=0.001)}
    direction = "ahead of" if ahead_ms > 0 else "behind"
    assert any(f"node1's clock ran {abs(ahead_ms) / 1000:.3g} s {direction} node0's" in n for n in e["notes"])


def _records_wall_ns(folder: Path) -> int:
    """The job's wall time by its records as written: the first record's time to the last one's end."""
    starts, ends = [], []
    for path in folder.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if isinstance(record.get("ts"), int):
                starts.append(record["ts"])
                # A span record's time is its start; an ``end`` record's (a span written in two) is its end.
                span = record.get("kind") == "span" and isinstance(record.get("dur"), int)
                ends.append(record["ts"] + (record["dur"] if span else 0))
    return max(ends) - min(starts)


@pytest.mark.parametrize("ahead_ms", [500, -2000])
def test_summary_times_a_job_on_hosts_whose_clocks_differ_on_one_clock(tmp_path: Path, ahead_ms: int) -> None:
    """By the raw times of a job whose node1 runs ahead (or behind), the job lasted as much longer and every rank
    idled that long more (this job's 69.1 s read as 69.6 s, or 71.1 s, its goodput lower). On the reference
    host's clock, the wall time is the job's by its records as written before node1's clock was moved, and the
    goodput and breakdown are the ones of the job on one clock."""
    write_job(tmp_path / "job", Script(fault="died", **SKEWED))  # type: ignore[arg-type]
    truth_wall = _records_wall_ns(tmp_path / "job")
    same_clock = _analysis.summary(_open(tmp_path / "job"))
    clock_ahead(tmp_path / "job", [2, 3], ahead_ms * 1_000_000)
    assert _records_wall_ns(tmp_path / "job") == truth_wall + abs(ahead_ms) * 1_000_000  # the raw times' wall
    s = _analysis.summary(_open(tmp_path / "job"))
    assert s["wall_s"] == pytest.approx(truth_wall / 1e9, abs=1e-6), (s["wall_s"], truth_wall)
    assert s["goodput"] == pytest.approx(same_clock["goodput"], abs=1e-6)
    assert s["breakdown_s"] == pytest.approx(same_clock["breakdown_s"], abs=1e-6)
    assert s["start_ns"] == same_clock["start_ns"] and s["end_ns"] == same_clock["end_ns"]


@pytest.mark.parametrize(
    ("change", "ahead_ms"),
    [("none", 0), ("clock", 30), ("ends", 150), ("straggler", 500)],
    ids=["same-clock", "skew-within-a-step", "later-step-ends", "ranks-not-in-lockstep"],
)
def test_errors_corrects_no_clock_the_records_do_not_prove_off(tmp_path: Path, change: str, ahead_ms: int) -> None:
    """No correction where none is proven: one clock; an offset smaller than a step (the step order allows it,
    as it allows none); a host whose steps end later but begin with the others' (a slow node, a pipeline
    stage); ranks that do not step together (a straggler in a job whose script does not wait for it)."""
    fields = {**SKEWED, "fault": "died"}
    if change == "straggler":
        fields["straggler"] = 2
    write_job(tmp_path / "job", Script(**fields))  # type: ignore[arg-type]
    if ahead_ms:
        clock_ahead(tmp_path / "job", [2, 3], ahead_ms * 1_000_000, ends_only=change == "ends")
    e = _analysis.errors(_open(tmp_path / "job"))
    assert e["clock_offsets"] is None, e["clock_offsets"]
    assert not any("clock ran" in n for n in e["notes"])
