"""The culprit rules of ``cli/_diagnosis`` on hand-made rank states: the edge cases the real faults in
``test_diagnosis.py`` do not reach (every rule there is also shown on a real torchrun job)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from traintrace.cli._diagnosis import (
    ABORTED,
    RankState,
    _aborted_waiting,
    _cause,
    _copied_progress,
    _culprit,
    _disk_phrase,
    _diverged_first,
    _error_line,
    _first_line,
    _lost_node,
    _node_ended,
    _non_finite_phrase,
    _same_failure,
    _sentence,
    _stuck_alongside,
    _terminated_by,
    _unresponsive,
)

S = 1_000_000_000
T0 = 1_800_000_000 * S
#: The first sign of trouble: a collective timed out 10 s in.
TIMEOUT = {"ts": T0 + 10 * S, "error_type": "RuntimeError", "message": "Timed out waiting 6000ms", "stack": None}


def state(rank: int, **fields: Any) -> RankState:
    return RankState(rank=rank, restart=0, stream=rank, **fields)


def test_a_rank_whose_own_collective_failed_alone_is_not_named_a_hang() -> None:
    """Only the rank behind timed out in its collective: nothing says the others waited for it."""
    states = [
        state(0, state="error", step=6, in_collective=True, consequence=TIMEOUT, stopped_ns=T0 + 10 * S),
        state(1, state="terminated", step=7, phase="model_forward", stopped_ns=T0 + 11 * S),
        state(2, state="terminated", step=7, phase="model_forward", stopped_ns=T0 + 11 * S),
    ]
    culprit, rule = _culprit(states)
    assert rule != "hang: the rank the collectives timed out on" and all(s.hang is None for s in states)
    assert culprit is None or culprit.rank != 0


@pytest.mark.parametrize(
    ("waited_s", "how", "consequence"),
    [
        (3.0, {"signal": "SIGABRT", "exit_code": -6, "state": "killed"}, True),
        (3.0, {"state": "ended", "fault_stacks": f"{ABORTED}\n\nCurrent thread ..."}, True),
        (0.2, {"signal": "SIGABRT", "exit_code": -6, "state": "killed"}, False),  # a crash in the collective
        (3.0, {"signal": "SIGKILL", "exit_code": -9, "state": "killed"}, False),  # not an abort
        (3.0, {"state": "ended"}, False),  # no record of how it ended
    ],
    ids=["aborted by the launcher's view", "aborted by faulthandler's", "a crash", "killed", "ended"],
)
def test_a_rank_aborted_after_waiting_in_a_collective_is_a_consequence(
    waited_s: float, how: dict[str, Any], consequence: bool
) -> None:
    """NCCL's watchdog aborts (SIGABRT, no exception) a rank whose collective timed out: a rank aborted a second
    or more after it entered its collective, until its last sign of life, waited; one aborted at once crashed."""
    st = state(0, in_collective=True, since_ns=T0, alive_ns=T0 + int(waited_s * S), step=4, phase="model_backward")
    for name, value in how.items():
        setattr(st, name, value)
    _aborted_waiting(st)
    assert (st.consequence is not None) is consequence, st
    if consequence:
        assert st.state == "error" and st.signal == "SIGABRT"
        assert _cause(st) == (
            f"failed as a consequence: SIGABRT: aborted after waiting {waited_s:.1f} s in a collective "
            "(a watchdog's timeout, as NCCL's)"
        )
        stopped = T0 + int((waited_s + 1) * S)  # torchrun's SIGTERM, after the abort
        waiting = state(1, step=4, phase="model_forward", state="terminated", signal="SIGTERM", stopped_ns=stopped)
        culprit, rule = _culprit([st, waiting])
        assert culprit is waiting and rule == "hang: the rank the collectives timed out on", rule
    else:
        assert st.state == how["state"]


def test_a_rank_ahead_of_the_waiting_ranks_is_not_named() -> None:
    """A rank outside any collective at a later step than the ranks that timed out did not hold them up."""
    states = [
        state(0, state="error", step=6, in_collective=True, consequence=TIMEOUT, stopped_ns=T0 + 10 * S),
        state(1, state="terminated", step=8, phase="model_forward", stopped_ns=T0 + 11 * S),
    ]
    assert _culprit(states) == (None, "unknown")


def test_a_timeout_says_its_rank_waited_in_a_collective_no_span_recorded() -> None:
    """Frameworks whose collectives are not recorded (DDP's all-reduce inside backward, under the Lightning or
    HF callback): the ranks that failed with a timeout waited in one, and the rank at their step outside any
    is named."""
    states = [
        state(0, state="error", step=6, phase="model_backward", consequence=TIMEOUT, stopped_ns=T0 + 10 * S),
        state(1, state="running", step=6, phase="data_loading", last_progress_ns=T0, stopped_ns=T0 + 12 * S),
        state(2, state="error", step=6, phase="model_backward", consequence=TIMEOUT, stopped_ns=T0 + 10 * S),
    ]
    culprit, rule = _culprit(states)
    assert rule == "hang: the rank the collectives timed out on"
    assert culprit is states[1] and culprit.hang is not None
    assert "not in a collective when rank 0's collective failed" in culprit.hang["message"]
    # A rank that also timed out is a waiter, not the one they waited for.
    states = [
        state(0, state="error", step=6, phase="model_backward", consequence=TIMEOUT, stopped_ns=T0 + 10 * S),
        state(1, state="error", step=6, phase="model_forward", consequence=TIMEOUT, stopped_ns=T0 + 10 * S),
    ]
    assert _culprit(states) == (None, "unknown")


def test_the_rank_waited_for_is_named_when_the_teardown_fails_it_too() -> None:
    """Under torchrun the rank that hung is then stopped with SIGTERM, and Lightning's handler, broadcasting it,
    may fail first: "Connection closed by peer", after the others' timeout. That is the teardown, not a
    collective it waited in; a timeout of its own, even a later one, makes it a waiter."""
    closed = {
        "ts": T0 + 12 * S,
        "error_type": "RuntimeError",
        "message": "[pair.cc:553] Connection closed by peer [127.0.0.1]:9607",
        "stack": None,
    }
    states = [
        state(0, state="error", step=3, phase="model_backward", consequence=TIMEOUT, stopped_ns=T0 + 10 * S),
        state(1, state="error", step=3, phase="data_loading", consequence=closed, last_progress_ns=T0),
    ]
    culprit, rule = _culprit(states)
    assert rule == "hang: the rank the collectives timed out on"
    assert culprit is states[1] and culprit.hang is not None
    assert culprit.hang["message"].startswith("not in a collective when rank 0's collective failed")
    # How it ended is said after the hang, as a signal would be.
    assert _cause(culprit).endswith(
        "; then failed as a consequence: RuntimeError: Connection closed by peer [127.0.0.1]:9607"
    )
    later_timeout = {**TIMEOUT, "ts": T0 + 12 * S}
    states = [
        state(0, state="error", step=3, phase="model_backward", consequence=TIMEOUT, stopped_ns=T0 + 10 * S),
        state(1, state="error", step=3, phase="data_loading", consequence=later_timeout, last_progress_ns=T0),
    ]
    assert _culprit(states) == (None, "unknown")
    # Closed before the others timed out: it failed first, by what it says (not this rule).
    early = {**closed, "ts": T0 + 5 * S}
    states = [
        state(0, state="error", step=3, phase="model_backward", consequence=TIMEOUT, stopped_ns=T0 + 10 * S),
        state(1, state="error", step=3, phase="data_loading", consequence=early, last_progress_ns=T0),
    ]
    assert _culprit(states)[1] != "hang: the rank the collectives timed out on"


def test_at_the_same_step_the_rank_in_an_earlier_phase_is_behind() -> None:
    """Both ranks reported a hang at the same step, neither in a recorded collective: the one still loading its
    batch holds up the one in backward (whose all-reduce waits for it), whichever finished its last step first."""
    hang = {"ts": T0 + 5 * S, "message": "no progress", "stack": None, "from_ns": T0}
    states = [
        state(0, state="hung", step=3, phase="model_backward", hang=hang, last_progress_ns=T0 - 2),
        state(1, state="hung", step=3, phase="data_loading", hang=hang, last_progress_ns=T0),
    ]
    culprit, rule = _culprit(states)
    assert rule == "hang: the rank behind" and culprit is states[1]


def test_errors_that_are_the_ranks_own_termination() -> None:
    """A loader worker killed by SIGTERM, or a peer gone while Lightning's SIGTERM handler broadcasts (or a loader
    worker found gone then): the rank was terminated; a worker killed otherwise (the OOM killer's SIGKILL) or a peer
    gone in backward is not."""
    worker = "DataLoader worker (pid 16274) is killed by signal: Terminated. "
    handler = '  File ".../signal_connector.py", line 118, in _sigterm_notifier_fn\n    dist.broadcast(t, src=0)\n'
    peer = "Connection closed by peer [127.0.0.1]:44683"

    def error(message: str, stack: str | None = None) -> dict[str, Any]:
        return {"ts": T0, "name": "exception", "error_type": "RuntimeError", "message": message, "stack": stack}

    assert _terminated_by(error(worker))
    assert _terminated_by(error(peer, handler))
    assert not _terminated_by(error("DataLoader worker (pid 16274) is killed by signal: Killed. "))
    assert not _terminated_by(error(peer, '  File "model.py", line 3, in backward\n'))
    assert not _terminated_by(error("ValueError: bad sigterm value", handler))  # not a communication error
    # The handler's broadcast failed, and while that was handled the loader found its worker gone (the same
    # SIGTERM ended it): a real torchrun job's race (CI), read as rank 1's own first exception before.
    exited = "DataLoader worker (pid(s) 23435) exited unexpectedly"
    assert _terminated_by(error(exited, handler + "RuntimeError: " + peer + "\n"))
    assert not _terminated_by(error(exited, '  File "train.py", line 9, in <module>\n'))  # the OOM killer's, say


def test_before_the_loop_two_quiet_ranks_name_nobody() -> None:
    """With two ranks whose collective did not fail, which one held the others up is not known."""
    states = [
        state(0, state="error", phase="model_initialization", consequence=TIMEOUT, stopped_ns=T0 + 10 * S),
        state(1, state="terminated", phase="model_initialization", stopped_ns=T0 + 11 * S),
        state(2, state="terminated", phase="model_initialization", stopped_ns=T0 + 11 * S),
    ]
    assert _culprit(states) == (None, "unknown")


def test_killed_together_needs_every_rank_dead_and_nobody_warned() -> None:
    dead = [state(r, state="ended", step=7, phase="model_forward", stopped_ns=T0 + r * 1_000_000) for r in range(3)]
    assert _culprit(dead) == (None, "killed together")
    assert _sentence(None, dead).startswith("killed from outside: all 3 ranks were cut off")
    # One rank saw its peer go first (a timeout): not together; the rank that stopped first is named.
    warned = [*dead[:2], state(2, state="error", step=7, consequence=TIMEOUT, stopped_ns=T0 + 6 * S)]
    culprit, rule = _culprit(warned)
    assert rule == "died first" and culprit is not None and culprit.rank == 0


def test_a_rank_that_closed_after_the_others_failed_did_not_leave_early() -> None:
    states = [
        state(0, state="error", step=6, in_collective=True, consequence=TIMEOUT, stopped_ns=T0 + 10 * S),
        state(1, state="closed", step=7, stopped_ns=T0 + 20 * S),
    ]
    _, rule = _culprit(states)
    assert rule != "left early" and not states[1].left_early


def test_the_same_failure_compares_rank_step_phase_and_cause() -> None:
    error = {"ts": 1, "error_type": "RuntimeError", "message": "x", "stack": None}
    a = state(1, state="error", step=7, phase="model_backward", error=error)
    assert _same_failure(a, state(1, state="error", step=7, phase="model_backward", error=dict(error, ts=9)))
    assert not _same_failure(a, state(1, state="error", step=7, phase="model_forward", error=error))
    assert not _same_failure(a, state(2, state="error", step=7, phase="model_backward", error=error))
    assert not _same_failure(a, None)


def killed(rank: int, *, waiting: bool, since_s: float, alive_s: float, step: int = 7, **fields: Any) -> RankState:
    """A rank of a job killed from outside, as its progress file tells it (times in seconds after T0)."""
    return state(
        rank,
        state=fields.pop("state", "ended"),
        step=step,
        phase=fields.pop("phase", "model_backward" if waiting else "model_forward"),
        in_collective=waiting,
        since_ns=T0 + int(since_s * S),
        alive_ns=T0 + int(alive_s * S),
        last_step_ns=fields.pop("last_step_ns", 30_000_000),
        **fields,
    )


def test_killed_while_waiting_names_the_one_rank_the_others_waited_for() -> None:
    stuck = [killed(0, waiting=True, since_s=1.01, alive_s=61), killed(1, waiting=False, since_s=1, alive_s=61)]
    culprit, rule = _culprit(stuck)
    assert rule == "killed while waiting for a rank" and culprit is not None and culprit.rank == 1
    assert culprit.stuck_ns == 60 * S
    assert _sentence(culprit, stuck).startswith(
        "rank 1 hung in forward at step 7, not in a collective: no progress for 60 s when the whole job was killed"
    )


def test_killed_while_waiting_needs_a_long_wait_on_every_side_and_one_rank_behind() -> None:
    def rule(states: list[RankState]) -> str:
        return _culprit(states)[1]

    # Killed 0.5 s after the phases began: ranks in lockstep, a phase apart, prove nothing.
    assert rule(
        [killed(0, waiting=True, since_s=1, alive_s=1.5), killed(1, waiting=False, since_s=1, alive_s=1.5)]
    ) == ("killed together")
    # Slow steps (10 s each): 60 s is six steps, not a hang.
    slow = {"last_step_ns": 10 * S}
    assert (
        rule(
            [
                killed(0, waiting=True, since_s=1, alive_s=61, **slow),
                killed(1, waiting=False, since_s=1, alive_s=61, **slow),
            ]
        )
        == "killed together"
    )
    # The waiting rank's own file says it moved 0.2 s before the kill.
    assert rule(
        [killed(0, waiting=True, since_s=60.8, alive_s=61), killed(1, waiting=False, since_s=1, alive_s=61)]
    ) == ("killed together")
    # Two ranks outside a collective in different places: which one held the others is not known.
    two = [
        killed(0, waiting=True, since_s=1, alive_s=61),
        killed(1, waiting=False, since_s=1, alive_s=61),
        killed(2, waiting=False, since_s=1, alive_s=61, phase="data_loading"),
    ]
    assert rule(two) == "killed together"
    # ...or in the same place, one of them only just arrived there: it was moving.
    two = [
        killed(0, waiting=True, since_s=1, alive_s=61),
        killed(1, waiting=False, since_s=1, alive_s=61),
        killed(2, waiting=False, since_s=60.9, alive_s=61),
    ]
    assert rule(two) == "killed together"
    # The rank outside the collectives is a step ahead of them: it did not hold them up.
    assert rule(
        [killed(0, waiting=True, since_s=1, alive_s=61), killed(1, waiting=False, since_s=1, alive_s=61, step=8)]
    ) == ("killed together")
    # A file from before the writer's stamp (no alive time): nothing to measure with.
    old = [killed(0, waiting=True, since_s=1, alive_s=61), killed(1, waiting=False, since_s=1, alive_s=61)]
    old[1].alive_ns = None
    assert rule(old) == "killed together"


def terminated(rank: int, at_s: float, **fields: Any) -> RankState:
    fields = {"step": 7, "phase": "model_forward", "signal_ns": T0 + int(at_s * S), **fields}
    return state(rank, state="terminated", signal="SIGTERM", stopped_ns=T0 + int(at_s * S), **fields)


def test_terminated_together_needs_the_signal_at_once_or_the_launchers_word() -> None:
    together = [terminated(0, 10.0), terminated(1, 10.02), terminated(2, 10.01)]
    assert _culprit(together) == (None, "terminated together")
    assert _sentence(None, together).startswith(
        "terminated by SIGTERM from outside: all 3 ranks got the signal at once, none failed first"
    )
    # One rank signalled from outside; the launcher stopped the others 0.3 s later: that rank is named.
    one_first = [terminated(0, 10.3), terminated(1, 10.3), terminated(2, 10.0)]
    culprit, rule = _culprit(one_first)
    assert rule == "died first" and culprit is not None and culprit.rank == 2
    # The launcher says it got SIGTERM itself: together however late a rank stuck in C code handled it, even
    # one the launcher had to kill.
    told = [terminated(0, 10.0, launcher_signal="SIGTERM"), terminated(1, 12.0, launcher_signal="SIGTERM")]
    told.append(state(2, state="killed", signal="SIGKILL", step=7, stopped_ns=T0 + 40 * S, launcher_signal="SIGTERM"))
    assert _culprit(told) == (None, "terminated together")
    assert _sentence(None, told).startswith("terminated by SIGTERM from outside: the launcher and all 3 ranks")
    # Rank 2 signalled alone in forward; the others, in backward's all-reduce, record that their peer is gone
    # 48 ms later (a consequence, when they stopped), then the launcher's SIGTERM 12 ms after: rank 2 is named
    # (the consequence came before their own signal: it is no part of the signal's handling).
    gone = {"ts": T0 + int(10.048 * S), "error_type": "RuntimeError", "message": "Connection closed by peer"}
    waiting = {"in_collective": True, "phase": "model_backward", "since_ns": T0 + 9 * S, "consequence": gone}
    peer_gone = [terminated(r, 10.048, signal_ns=T0 + int(10.06 * S), **waiting) for r in (0, 1)]
    culprit, rule = _culprit([*peer_gone, terminated(2, 10.0)])
    assert rule == "died first" and culprit is not None and culprit.rank == 2
    # The same handled the other way round (their signals first, then the peer's loss, as a handler does):
    # together, as before.
    handled = [terminated(r, 10.06, **(waiting | {"consequence": gone | {"ts": T0 + int(10.07 * S)}})) for r in (0, 1)]
    assert _culprit([*handled, terminated(2, 10.0)]) == (None, "terminated together")
    # With no error recorded, a rank blocked in a collective may handle the whole job's signal late; but where
    # its host's launcher recorded the end and got no signal itself, the signals were not the scheduler's.
    blocked = {k: v for k, v in waiting.items() if k != "consequence"}
    late = [terminated(0, 10.06, **blocked), terminated(1, 10.06, **blocked), terminated(2, 10.0)]
    assert _culprit(late) == (None, "terminated together")
    for s in late:
        s.launcher_unsignalled = True
    culprit, rule = _culprit(late)
    assert rule == "died first" and culprit is not None and culprit.rank == 2
    # Every rank died of the signal the launcher got and passed on, none handling it (SIGQUIT; SIGHUP where nothing
    # of traintrace's ran): the launcher's word, not a kill from outside (read as the scheduler's, the OOM killer's
    # or a lost node's before).
    quit_ = [state(0, state="killed", signal="SIGQUIT", step=7, stopped_ns=T0 + 10 * S, launcher_signal="SIGQUIT")]
    quit_ += [state(r, state="ended", step=7, stopped_ns=T0 + 10 * S, launcher_signal="SIGQUIT") for r in (1, 2)]
    assert _culprit(quit_) == (None, "terminated together")
    assert _sentence(None, quit_).startswith("terminated by SIGQUIT from outside: the launcher and all 3 ranks")
    for s in quit_:
        s.launcher_signal = None
    assert _culprit(quit_) == (None, "killed together")
    # A rank that raised first is the culprit whatever came after.
    raised = [
        *together[:2],
        state(2, state="error", step=7, error=TIMEOUT | {"error_type": "ValueError"}, stopped_ns=T0),
    ]
    assert _culprit(raised)[1] == "first exception"


def test_a_running_job_waiting_on_a_rank_is_said_without_calling_it_a_hang() -> None:
    """Live, a rank the others wait for may be saving a checkpoint: the sentence says who and how long."""
    live = [
        state(
            0,
            state="running",
            step=7,
            phase="model_backward",
            in_collective=True,
            since_ns=T0 + S + S // 100,
            alive_ns=T0 + 6 * S,
            last_step_ns=30_000_000,
        ),
        state(
            1,
            state="running",
            step=7,
            phase="checkpoint_save_sync",
            since_ns=T0 + S,
            alive_ns=T0 + 6 * S,
            last_step_ns=30_000_000,
        ),
    ]
    culprit, _ = _culprit(live)
    assert culprit is None  # the running branch of diagnose() asks _waited_on itself
    from traintrace.cli._diagnosis import _waited_on

    waited_on = _waited_on(live)
    assert waited_on is not None and waited_on.rank == 1
    assert _sentence(waited_on, live).startswith(
        "running, waiting on rank 1: in a checkpoint save at step 7, not in a collective, for 5 s; rank 0 was waiting"
    )


def live(rank: int, step: int | None, phase: str, *, since_s: float, waiting: bool = False) -> RankState:
    """A rank of a running job, its writer's last stamp 40 s after T0, as its progress file tells it."""
    return state(
        rank,
        state="running",
        step=step,
        phase=phase,
        in_collective=waiting,
        since_ns=T0 + int(since_s * S),
        alive_ns=T0 + 40 * S,
        last_step_ns=30_000_000 if step else None,
    )


def test_no_collective_recorded_the_rank_behind_in_the_step_is_waited_on() -> None:
    """The Lightning and Hugging Face callbacks record no collective: DDP's all-reduce waits inside backward. A
    rank in forward while the others sit in backward of the same step (or a step behind them) is waited on, once
    every rank has been still for ten steps; not when a rank is outside a step's phases, nor with a collective
    recorded (the other rules decide then)."""
    from traintrace.cli._diagnosis import _waited_on

    ranks = [live(0, 3, "model_backward", since_s=9), live(1, 3, "model_forward", since_s=8)]
    ranks.append(live(2, 3, "model_backward", since_s=9.5))
    waited_on = _waited_on(ranks)
    assert waited_on is not None and (waited_on.rank, waited_on.stuck_ns, waited_on.stuck_with) == (1, 32 * S, [])
    assert _sentence(waited_on, ranks) == (
        "running, waiting on rank 1: in forward at step 3, not in a collective, for 32 s; "
        "ranks 0 and 2 were in backward at step 3"
    )
    # Stuck in its optimizer step while the others wait in the next step's backward.
    ahead = [live(0, 4, "model_backward", since_s=9), live(1, 3, "optimizer_update", since_s=8)]
    assert (_waited_on(ahead) or state(-1)).rank == 1
    # Two ranks of a node at the same place, behind the others: named together.
    node = [live(r, 3, "data_loading", since_s=8) for r in (2, 3)] + [live(0, 3, "model_backward", since_s=9)]
    waited_on = _waited_on(node)
    assert waited_on is not None and (waited_on.rank, waited_on.stuck_with) == (2, [3])
    # Moving a moment ago: a step takes 30 ms, ten of them 0.3 s, and at least 1 s.
    assert _waited_on([live(0, 3, "model_backward", since_s=39.5), live(1, 3, "model_forward", since_s=8)]) is None
    # Someone outside a step's phases (a save the others may wait for at a barrier).
    assert _waited_on([live(0, 3, "checkpoint_save_sync", since_s=8), live(1, 3, "model_backward", since_s=8)]) is None
    # A rank in a recorded collective: the existing rules decide (two ranks outside at different places: none).
    mixed = [live(0, 3, "model_backward", since_s=9, waiting=True), live(1, 3, "model_forward", since_s=8)]
    mixed.append(live(2, 3, "data_loading", since_s=8))
    assert _waited_on(mixed) is None


def test_before_any_step_the_rank_loading_its_first_batch_is_waited_on() -> None:
    """No rank has begun a step (the Trainer fetches a step's batch, and gathers its token count, before the
    step begins): the one rank in data loading outside the gather is waited on, without a step; not when a rank
    is still outside the training loop."""
    from traintrace.cli._diagnosis import _waited_on

    ranks = [live(0, None, "data_loading", since_s=8)]
    ranks += [live(r, None, "data_loading", since_s=8.5, waiting=True) for r in (1, 2)]
    waited_on = _waited_on(ranks)
    assert waited_on is not None and (waited_on.rank, waited_on.step) == (0, None)
    assert _sentence(waited_on, ranks).startswith("running, waiting on rank 0: in data loading, not in a collective,")
    ranks[1] = live(1, None, "model_initialization", since_s=8.5)
    assert _waited_on(ranks) is None


def test_killed_while_every_rank_waits_names_the_one_a_step_behind() -> None:
    behind = killed(0, waiting=True, since_s=1, alive_s=61, step=6)
    ahead = [killed(r, waiting=True, since_s=1.05, alive_s=61) for r in (1, 2)]
    culprit, rule = _culprit([behind, *ahead])
    assert rule == "killed while waiting for a rank" and culprit is behind
    assert _sentence(culprit, [behind, *ahead]).startswith(
        "rank 0 hung inside a collective in backward at step 6: no progress for 60 s when the whole job was killed"
    )
    # Two ranks at the lowest step: which one the others wait for is not known.
    tie = [behind, killed(1, waiting=True, since_s=1, alive_s=61, step=6), ahead[1]]
    assert _culprit(tie) == (None, "killed together")


def _reraised_from_a_worker(exc: BaseException) -> BaseException:
    """The exception a DataLoader re-raises in the training process for one its worker caught (torch's own
    wrapper, as the loader uses it)."""
    import sys

    torch_utils = pytest.importorskip("torch._utils")
    try:
        raise exc
    except BaseException:
        wrapper = torch_utils.ExceptionWrapper(sys.exc_info(), where="in DataLoader worker process 0")
    try:
        wrapper.reraise()
    except BaseException as reraised:
        return reraised
    raise AssertionError("reraise() returned")


@pytest.mark.parametrize(
    ("original", "expected"),
    [
        (ValueError("corrupt sample 24"), "corrupt sample 24 (in DataLoader worker process 0)"),
        (ValueError("bad row\nsecond line"), "bad row (in DataLoader worker process 0)"),
        (KeyError("label"), "'label' (in DataLoader worker process 0)"),
    ],
    ids=["value", "two-lines", "key"],
)
def test_an_error_from_a_loader_worker_says_the_original_exception(original: BaseException, expected: str) -> None:
    reraised = _reraised_from_a_worker(original)
    assert str(reraised).startswith("Caught ")  # what the record's message holds: the wrapper's text
    assert _error_line(type(reraised).__name__, str(reraised)) == expected


def test_an_ordinary_message_gives_its_first_line() -> None:
    assert _error_line("RuntimeError", "boom\nmore") == "boom"
    assert _error_line("ValueError", "Caught nothing here") == "Caught nothing here"
    assert _error_line("ValueError", None) == ""


@pytest.mark.parametrize(
    ("error_type", "message", "expected"),
    [
        ("torch.OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total)", True),
        ("RuntimeError", "CUDA error: out of memory", True),
        ("MemoryError", "", True),
        ("RuntimeError", "std::bad_alloc", True),
        ("RuntimeError", "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", True),
        ("OSError", "[Errno 12] Cannot allocate memory", True),
        ("RuntimeError", "injected failure in forward on rank 1 at step 7", False),
        ("RuntimeError", "Connection closed by peer", False),
    ],
)
def test_allocation_failures_read_as_out_of_memory(error_type: str, message: str, expected: bool) -> None:
    error = {"ts": T0, "error_type": error_type, "message": message, "stack": None}
    culprit = state(1, state="error", step=7, phase="model_forward", error=error, stopped_ns=T0)
    assert culprit.out_of_memory is expected
    head = _sentence(culprit, [culprit])
    assert head.startswith("rank 1 ran out of memory" if expected else "rank 1 raised"), head


def test_the_memory_phrase_says_what_was_sampled() -> None:
    error = {"ts": T0, "error_type": "torch.OutOfMemoryError", "message": "CUDA out of memory.", "stack": None}
    gpu = {"samples": 1, "last_sample_ts": T0, "gpu_used": 79 << 30, "gpu_total": 80 << 30}
    culprit = state(0, state="error", step=3, phase="model_backward", error=error, memory=gpu)
    assert _sentence(culprit, [culprit]) == (
        "rank 0 ran out of memory (torch.OutOfMemoryError) in backward at step 3; "
        "at its last memory sample: GPU memory 79 GiB of 80 GiB used"
    )
    culprit.memory = None  # no samples (the sampler off): nothing made up
    assert _sentence(culprit, [culprit]) == "rank 0 ran out of memory (torch.OutOfMemoryError) in backward at step 3"


def test_a_killed_rank_on_a_full_host_points_at_the_oom_killer() -> None:
    full = {"samples": 4, "last_sample_ts": T0, "host_used": 95, "host_total": 100}
    killed = state(2, state="killed", signal="SIGKILL", step=5, phase="model_forward", memory=full)
    assert "(95% of the host's memory was used at its last sample: likely the kernel's OOM killer)" in _sentence(
        killed, [killed]
    )
    killed.memory = {**full, "host_used": 60}
    assert "OOM" not in _sentence(killed, [killed])


def test_pytorch_check_prefixes_are_left_out_of_the_cause() -> None:
    message = (
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
        "allocate 67108864 bytes. Error code 12 (Cannot allocate memory)"
    )
    assert _first_line(message).startswith("DefaultCPUAllocator: can't allocate memory: you tried to allocate")


def test_a_full_disk_is_said_only_when_it_was_full() -> None:
    error = {"ts": T0, "error_type": "RuntimeError", "message": "unexpected pos 1920 vs 1812", "stack": None}
    saving = state(0, state="error", step=15, phase="checkpoint_save_sync", error=error)
    saving.disk = {"full": True, "free": 0, "total": 2 << 20, "path": "/c/step15.pt", "last_checkpoint_size": 703 << 10}
    assert _sentence(saving, [saving]) == (
        "rank 0 raised RuntimeError in a checkpoint save at step 15; the checkpoint's file system was full: "
        "0 B free of 2.0 MiB, less than the last checkpoint took (703 KiB)"
    )
    assert _cause(saving).endswith("(the checkpoint's file system was full)")
    # The error alone said so (no statvfs reading: the path was not given).
    assert _disk_phrase({"full": True}) == "; the checkpoint's file system was full (no space left on the device)"
    saving.disk = {"full": False, "free": 40 << 30, "total": 100 << 30, "path": "/c", "last_checkpoint_size": None}
    assert "full" not in _sentence(saving, [saving]) and "full" not in _cause(saving)


def diverged(rank: int, step: int, **info: Any) -> RankState:
    facts = {"metric": "loss", "value": "NaN", "step": step, "ranks_at_first": [rank], "first_steps": {}}
    return state(rank, state="diverged", step=step, non_finite={**facts, **info})


@pytest.mark.parametrize(
    ("error_type", "message", "step", "first"),
    [
        ("FloatingPointError", "loss is nan at step 8", 8, True),
        ("RuntimeError", "Function 'MseLossBackward0' returned nan values in its 0th output.", 8, True),
        ("ValueError", "non-finite loss", 7, True),
        ("RuntimeError", "Loss is inf", 9, True),
        ("FloatingPointError", "loss is nan", 6, False),  # before the loss went bad: not from it
        ("RuntimeError", "injected failure in forward", 8, False),  # another cause
        ("RuntimeError", "information lost", 8, False),  # 'inf' inside a word is not infinity
    ],
)
def test_a_failure_comes_from_the_non_finite_loss_only_when_its_error_says_so(
    error_type: str, message: str, step: int, first: bool
) -> None:
    error = {"ts": T0, "error_type": error_type, "message": message, "stack": None}
    failed = state(0, state="error", step=step, error=error)
    assert _diverged_first(diverged(1, 7), failed) is first
    assert _diverged_first(diverged(1, 7), state(0, state="killed", step=8, signal="SIGKILL")) is False


def test_the_non_finite_phrase_names_who_followed_and_who_recorded_none() -> None:
    one = diverged(1, 7, value="Infinity", first_steps={"0": 8, "1": 7, "2": 8, "3": 9}, finite_ranks=[4])
    assert _non_finite_phrase(one) == (
        "rank 1's loss became Infinity at step 7, the first non-finite value "
        "(ranks 0 and 2 followed at step 8; rank 3 followed at step 9; rank 4 recorded none)"
    )
    two = diverged(1, 7, ranks_at_first=[1, 2], first_steps={"1": 7, "2": 7})
    assert _non_finite_phrase(two) == "the loss of ranks 1 and 2 became NaN at step 7, the first non-finite value"
    assert _cause(two) == "its loss became NaN at step 7"


@pytest.mark.parametrize(
    ("fields", "expected_s"),
    [
        # Stopped, then the launcher's SIGKILL after its SIGTERM's grace: 36 s after the writer's last stamp.
        ({"state": "killed", "alive_ns": T0, "stopped_ns": T0 - S // 2, "launcher_seen_ns": T0 + 36 * S}, 36),
        # The OOM killer: the launcher sees it end within the flush interval.
        ({"state": "killed", "alive_ns": T0, "stopped_ns": T0, "launcher_seen_ns": T0 + S}, None),
        ({"state": "killed", "alive_ns": T0, "stopped_ns": T0, "launcher_seen_ns": T0 + 10 * S - 1}, None),
        ({"state": "killed", "alive_ns": T0, "stopped_ns": T0, "launcher_seen_ns": T0 + 10 * S}, 10),
        # Its last record is later than the stamp (no progress file): the later sign of life counts.
        ({"state": "killed", "alive_ns": None, "stopped_ns": T0 + 30 * S, "launcher_seen_ns": T0 + 36 * S}, None),
        # It answered SIGTERM (its handler ran): it was responsive.
        ({"state": "terminated", "alive_ns": T0, "stopped_ns": T0, "launcher_seen_ns": T0 + 36 * S}, None),
        # No launcher's view, or no sign of life at all: nothing to compare.
        ({"state": "killed", "alive_ns": T0, "stopped_ns": T0, "launcher_seen_ns": None}, None),
        ({"state": "killed", "alive_ns": None, "stopped_ns": None, "launcher_seen_ns": T0 + 36 * S}, None),
    ],
)
def test_a_killed_rank_stopped_responding_only_long_before_the_launcher_saw_it_end(
    fields: dict[str, Any], expected_s: int | None
) -> None:
    st = state(1, step=7, phase="model_forward", signal="SIGKILL", exit_code=-9, **fields)
    _unresponsive(st)
    assert (None if st.unresponsive_ns is None else st.unresponsive_ns // S) == expected_s
    cause = _cause(st)
    assert cause.startswith("stopped responding") == (expected_s is not None), cause
    if expected_s is not None:
        others = [state(0, state="error", step=7, phase="model_backward", in_collective=True, consequence=TIMEOUT)]
        assert _sentence(st, [st, *others]).startswith(
            f"rank 1 stopped responding in forward at step 7: its process, traintrace's writer thread included, "
            f"did nothing for {expected_s} s until the launcher killed it (SIGKILL)"
        )


def test_a_cause_unclear_names_the_first_sign_in_a_sentence_that_reads() -> None:
    """No rule names a culprit: the first sign of trouble, its cause in parentheses whatever its form."""
    states = [
        state(0, state="error", step=6, in_collective=True, consequence=TIMEOUT, stopped_ns=T0 + 10 * S),
        state(1, state="running", step=8, phase="model_forward", stopped_ns=T0 + 11 * S),
    ]
    assert _culprit(states) == (None, "unknown")
    assert _sentence(None, states).startswith(
        "failed, cause unclear: the first sign is on rank 0 (failed as a consequence: RuntimeError: Timed out "
        "waiting 6000ms), waiting in a collective at step 6; "
    ), _sentence(None, states)


def test_ranks_stuck_at_the_same_place_are_named_together_with_their_node() -> None:
    """Both ranks of node-b stuck in data loading at step 7 (its file system stopped answering) while node-a's
    waited: both are named, and the node, in every rule that names a hung rank."""
    hosts = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}

    def job(**fields: Any) -> list[RankState]:
        return [
            *(killed(r, waiting=True, since_s=1, alive_s=61, host=hosts[r], **fields) for r in (0, 1)),
            *(killed(r, waiting=False, since_s=1, alive_s=61, host=hosts[r], phase="data_loading") for r in (2, 3)),
        ]

    states = job()
    culprit, rule = _culprit(states)
    assert rule == "killed while waiting for a rank" and culprit is not None
    assert (culprit.rank, culprit.stuck_with, culprit.stuck_ns) == (2, [3], 60 * S)
    assert _sentence(culprit, states) == (
        "ranks 2 and 3 (every rank of node node-b) hung in data loading at step 7, not in a collective: no progress "
        "for 60 s when the whole job was killed from outside; ranks 0 and 1 were waiting in a collective in "
        "backward at step 7"
    )
    # A whole job killed from outside lost no node, though every host's ranks stopped together.
    assert _lost_node(None, states) is None  # type: ignore[arg-type]  # decided before the job is read

    # Hang reports: the rank behind, and the one beside it.
    report = {"ts": T0 + 5 * S, "message": "no progress for 1.7s", "stack": None, "from_ns": None}
    states = job()
    for s in states:
        s.state, s.hang = "hung", dict(report)
    culprit, rule = _culprit(states)
    assert rule == "hang: the rank behind" and culprit is not None and culprit.stuck_with == [3]
    assert _sentence(culprit, states).startswith("ranks 2 and 3 (every rank of node node-b) hung in data loading")

    # The collectives' timeouts, no hang report: both are marked hung from the first timeout.
    states = job()
    for s in states[:2]:
        s.state, s.consequence, s.stopped_ns = "error", TIMEOUT, TIMEOUT["ts"]
    for s in states[2:]:  # the launcher ended them after the others failed
        s.state, s.signal, s.stopped_ns = "terminated", "SIGTERM", T0 + 12 * S
    culprit, rule = _culprit(states)
    assert rule == "hang: the rank the collectives timed out on" and culprit is not None
    assert culprit.stuck_with == [3] and states[3].hang is not None and states[3].hang["ts"] == TIMEOUT["ts"]


@pytest.mark.parametrize("failing_rank_ahead_s", [0.0, 0.08])
@pytest.mark.parametrize(("ranks", "per_host", "failing"), [(8, 2, 5), (4, 2, 3), (6, 5, 5), (3, 2, 2)])
def test_a_rank_that_raised_in_a_job_torn_down_silently_is_not_a_lost_node(
    tmp_path: Path, failing_rank_ahead_s: float, ranks: int, per_host: int, failing: int
) -> None:
    """Hosts of two ranks (four, or two), or a host of five and one of the failing rank alone (or of two and
    one): one rank raises in step 25 and every other rank stops in that step without a trace (SIGKILLed by a
    scheduler or launcher, or sitting in a collective's C code where no signal handler runs). The other hosts'
    ranks stopped silently at that moment: the job was torn down around the exception, no node was lost, and the
    culprit is the exception, whether the others' last records came 50 ms before it (their step's start) or 30
    ms after it (its timeline 80 ms ahead). Every one of these read "node node0 was lost" before (the generated
    64-rank job too; the layouts with the failing rank alone on its host until a later fix, found by
    ``test_random_scripted_jobs``)."""
    from tests.cli_jobs import Script, write_job
    from traintrace.cli import _analysis
    from traintrace.cli._engine import Job

    ahead = {(failing, 0): -failing_rank_ahead_s}
    script = Script(ranks=ranks, ranks_per_host=per_host, fail_rank=failing, straggler=None, extra_s=ahead)
    write_job(tmp_path, script)
    assert script.fail_step is not None
    job = Job.open([tmp_path], lean=True)
    try:
        errors = _analysis.errors(job)
    finally:
        job.close()
    assert errors["rule"] == "first exception" and errors.get("lost_node") is None, errors["verdict"]
    culprit = errors["culprit"]
    assert (culprit["rank"], culprit["step"], culprit["error"]["error_type"]) == (
        failing,
        script.fail_step,
        "RuntimeError",
    )
    assert errors["verdict"].startswith(
        f"restart 0 failed: rank {failing} raised RuntimeError in a step (between phases) at step {script.fail_step}"
    ), errors["verdict"]


def test_the_node_is_said_only_of_a_group_in_a_job_of_several_hosts() -> None:
    def stuck(host_of: dict[int, str]) -> str:
        states = [killed(0, waiting=True, since_s=1, alive_s=61, host=host_of[0])]
        states += [killed(r, waiting=False, since_s=1, alive_s=61, host=host_of[r]) for r in (1, 2)]
        culprit, _ = _culprit(states)
        assert culprit is not None
        return _sentence(culprit, states).split(" hung ", 1)[0]

    assert stuck({0: "a", 1: "a", 2: "a"}) == "ranks 1 and 2"  # one host: nothing to tell
    assert stuck({0: "a", 1: "b", 2: "b"}) == "ranks 1 and 2 (every rank of node b)"
    assert stuck({0: "b", 1: "b", 2: "b"}) == "ranks 1 and 2"
    assert stuck({0: "a", 1: "b", 2: "c"}) == "ranks 1 and 2"  # two hosts: no node to suspect
    states = [killed(r, waiting=r == 0, since_s=1, alive_s=61, host="a" if r < 2 else "b") for r in range(4)]
    culprit, _ = _culprit(states)
    assert culprit is None or culprit.rank != 0  # ranks 1, 2, 3 outside: 1 on a, 2 and 3 on b
    states[0].host = states[1].host = "b"
    states[2].host = states[3].host = "b"
    states.append(killed(4, waiting=True, since_s=1, alive_s=61, host="a"))
    culprit, _ = _culprit(states)
    assert culprit is not None and _sentence(culprit, states).startswith("ranks 1, 2 and 3 (all on node b) hung")


def test_a_rank_with_an_error_of_its_own_is_not_stuck_alongside() -> None:
    """At the culprit's place but with an error (it raised) or a timeout (it waited): not stuck with it."""
    culprit = killed(1, waiting=False, since_s=1, alive_s=61)
    raised = killed(2, waiting=False, since_s=1, alive_s=61, state="error", error={"ts": T0, "error_type": "E"})
    waited = killed(3, waiting=False, since_s=1, alive_s=61, consequence=TIMEOUT)
    elsewhere = killed(4, waiting=False, since_s=1, alive_s=61, step=8)
    same = killed(5, waiting=False, since_s=1, alive_s=61)
    assert [s.rank for s in _stuck_alongside(culprit, [culprit, raised, waited, elsewhere, same])] == [5]
    assert culprit.stuck_with == [5]


def test_a_node_ended_from_outside_is_one_whose_launcher_alone_got_a_signal() -> None:
    """node-b's launcher got SIGTERM and stopped its ranks at 10 s; node-a's then failed on their collectives."""

    def job() -> list[RankState]:
        late = {**TIMEOUT, "ts": T0 + 12 * S}
        return [
            *(state(r, state="error", consequence=late, host="node-a", stopped_ns=T0 + 12 * S) for r in (0, 1)),
            *(
                state(
                    r,
                    state="terminated",
                    signal="SIGTERM",
                    host="node-b",
                    launcher_signal="SIGTERM",
                    stopped_ns=T0 + 10 * S,
                )
                for r in (2, 3)
            ),
        ]

    ended = _node_ended(job())
    assert ended is not None and (ended["host"], ended["ranks"], ended["signal"]) == ("node-b", [2, 3], "SIGTERM")
    assert ended["culprit"].rank == 2 and ended["stopped_ns"] == T0 + 10 * S
    # Every launcher got it: the whole job's (rule 2's), no node's.
    states = job()
    for st in states[:2]:
        st.launcher_signal = "SIGTERM"
    assert _node_ended(states) is None
    # One host: nothing to single out.
    states = job()
    for st in states:
        st.host = "node-b"
    assert _node_ended(states) is None
    # node-a's ranks were in trouble first (a timeout at 9 s): the signal came after, not the cause.
    states = job()
    states[0].consequence = {**TIMEOUT, "ts": T0 + 9 * S}
    assert _node_ended(states) is None
    # A rank of node-b had raised before the signal: rule 1 names it.
    states = job()
    states[3].error = {"ts": T0 + 9 * S, "error_type": "ValueError", "message": "bad", "stack": None}
    assert _node_ended(states) is None
    # A rank whose host is not known: nothing said of nodes.
    states = job()
    states[0].host = None
    assert _node_ended(states) is None


def test_the_launchers_copy_of_a_progress_file_reads_as_the_file() -> None:
    """What ``traintrace-run`` copied into ``worker_failure`` stands in for a file a restart rewrote; a value of
    the wrong type reads as unknown, and without ``last_progress_ns`` there is no copy."""
    copy = _copied_progress(
        {
            "last_step": 14,
            "last_step_done": 14,
            "last_phase": "checkpoint_save_sync",
            "in_collective": False,
            "last_progress_ns": T0,
            "alive_ns": T0 + S,
            "phase_started_ns": "soon",
        },
        rank=0,
        restart=0,
    )
    assert copy is not None
    assert (copy.step, copy.step_done, copy.phase, copy.in_collective) == (14, 14, "checkpoint_save_sync", False)
    assert (copy.updated_ns, copy.alive_ns, copy.phase_started_ns, copy.last_step_ns) == (T0, T0 + S, None, None)
    assert _copied_progress({"last_step": 3, "last_phase": "model_forward"}, rank=0, restart=0) is None
    hostile = _copied_progress({"last_progress_ns": T0, "last_phase": 7, "in_collective": "yes"}, rank=0, restart=0)
    assert hostile is not None and (hostile.phase, hostile.in_collective, hostile.step) == (None, False, None)


def test_a_killed_rank_the_others_waited_for_reads_as_hung_then_killed() -> None:
    """Named by the others' timeouts (a hang attached to it), then killed by the launcher: the sentence says it
    hung, and how it ended is in its cause (it read ``rank 1 was hang: stopped making progress ...``)."""
    hang = {"ts": T0 + 10 * S, "message": "not in a collective when rank 0's collective failed", "stack": None}
    states = [
        state(0, state="error", step=7, phase="model_backward", in_collective=True, consequence=TIMEOUT),
        state(1, state="killed", signal="SIGKILL", exit_code=-9, step=7, phase="model_forward", hang=hang),
    ]
    sentence = _sentence(states[1], states)
    assert sentence.startswith("rank 1 hung in forward at step 7"), sentence
    assert "was hang" not in sentence
    assert _cause(states[1]).endswith("; then killed")
