"""traintrace-run and the torchelastic bridge, with real torchrun jobs (gloo on CPU).

The job tests run ``python -m traintrace.launch --standalone --nproc-per-node 2``
on tests/_dist_worker.py, which all-reduces a tensor per step.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import pytest

import traintrace as tt
from traintrace import MemoryBackend, launch
from traintrace.manifest import read_job
from traintrace.publisher import get_default_event_publisher
from traintrace.reader import Stream, read_file

pytest.importorskip("torch")
torch_events = pytest.importorskip("torch.distributed.elastic.events")
torch_metrics = pytest.importorskip("torch.distributed.elastic.metrics")

WORKER = Path(__file__).parent / "_dist_worker.py"
SCHEMA_PATH = Path(__file__).parent.parent / "src/traintrace/schema/record-v1.schema.json"
SCHEMA = json.loads(SCHEMA_PATH.read_text())


# ---------------------------------------------------------------- bridge, in process


@pytest.fixture
def agent_memory() -> Iterator[MemoryBackend]:
    """An agent stream in memory, with the bridge installed in this process."""
    memory = MemoryBackend()
    launch.install_torchelastic_bridge()
    tt._setup.start_stream(tt._config.build_config(backends=[], job_id="agent"), [memory], {"role": "agent"})
    yield memory
    tt.close()


def _flush() -> None:
    get_default_event_publisher().flush()
    tt.flush()


def test_torch_worker_events_become_lifecycle_events(agent_memory: MemoryBackend) -> None:
    """torch's START and FAILED worker events arrive stamped, with the worker's identity."""
    metadata: dict[str, Any] = {
        "run_id": "r1",
        "global_rank": 3,
        "group_rank": 1,
        "worker_id": "4242",
        "role": "trainer",
        "hostname": "h",
        "state": "START",
        "total_run_time": 0,
        "rdzv_backend": "c10d",
        "raw_error": None,
        "metadata": '{"local_rank": [1], "exit_code": [null]}',
        "agent_restarts": 2,
        "duration_ms": None,
    }
    worker = torch_events.EventSource.WORKER
    start = torch_events.Event("torchelastic.worker.status.START", worker, 0, metadata)
    torch_events.record(start, launch.DESTINATION)
    failed_md = {**metadata, "state": "FAILED", "metadata": '{"local_rank": [1], "exit_code": [7]}'}
    failed = torch_events.Event("torchelastic.worker.status.FAILED", worker, 0, failed_md)
    torch_events.record(failed, launch.DESTINATION)
    _flush()
    (started,) = agent_memory.events("worker_start")
    attrs = started["attrs"]
    assert started["ts"] > 0
    assert (attrs["source"], attrs["worker_id"], attrs["rank"], attrs["node_rank"], attrs["restart"]) == (
        "agent",
        1,
        3,
        1,
        2,
    )
    assert attrs["data"]["pid"] == 4242
    assert attrs["data"]["role"] == "trainer"
    (exited,) = agent_memory.events("worker_exit")
    assert exited["attrs"]["exit_code"] == 7


def test_torch_agent_events_and_rendezvous(agent_memory: MemoryBackend) -> None:
    """RENDEZVOUS maps to rendezvous_complete; rendezvous events to start/join."""
    md = {"state": "RENDEZVOUS", "duration_ms": 12.5, "group_rank": 0, "agent_restarts": 0}
    torch_events.record(
        torch_events.Event("torchelastic.worker.status.RENDEZVOUS", torch_events.EventSource.AGENT, 0, md),
        launch.DESTINATION,
    )
    torch_events.construct_and_record_rdzv_event(
        run_id="r1",
        message="The node 'n' attempts to join the next round of the rendezvous 'r1'.",
        node_state=torch_events.NodeState.RUNNING,
        rank=0,
    )
    torch_events.construct_and_record_rdzv_event(
        run_id="r1",
        message="The node 'n' added itself to the participants of round 0 of the rendezvous.",
        node_state=torch_events.NodeState.RUNNING,
    )
    torch_events.construct_and_record_rdzv_event(
        run_id="r1",
        message="The node 'n' updated its keep-alive heartbeat time for the rendezvous 'r1'.",
        node_state=torch_events.NodeState.RUNNING,
    )
    _flush()
    assert agent_memory.events("rendezvous_complete")[0]["attrs"]["data"]["duration_ms"] == 12.5
    assert agent_memory.events("rendezvous_start")[0]["attrs"]["data"]["run_id"] == "r1"
    assert len(agent_memory.events("node_join")) == 1
    assert agent_memory.events("rendezvous_update") == []


def test_torch_metrics_become_events(agent_memory: MemoryBackend) -> None:
    """Metrics are recorded; a per-pass metric only when its value changes."""
    for value in (1, 1, 1, 0):
        torch_metrics.put_metric("workers.default.remaining_restarts", value)
    torch_metrics.put_metric("workers.default.run_total", 1)
    _flush()
    metrics = [r["attrs"]["data"] for r in agent_memory.events("elastic_metric")]
    assert [m["value"] for m in metrics if m["name"].endswith("remaining_restarts")] == [1, 0]
    assert {"group": "torchelastic", "name": "workers.default.run_total", "value": 1} in metrics


class _SignalledOnUse:
    """A value that sends this process SIGTERM when the bridge looks at it: torchrun's handler then raises its
    ``SignalException`` right there, inside the bridge's code, as when the signal comes while the agent's main
    thread runs a handler of ours."""

    def __eq__(self, other: object) -> bool:
        os.kill(os.getpid(), signal.SIGTERM)
        return False

    __hash__ = object.__hash__

    def __str__(self) -> str:
        os.kill(os.getpid(), signal.SIGTERM)
        return "{}"


class _SignalledData(Mapping[str, int]):
    """Event data that sends SIGTERM as ``events.record`` copies it."""

    def __getitem__(self, key: str) -> int:
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        os.kill(os.getpid(), signal.SIGTERM)
        return iter(())

    def __len__(self) -> int:
        return 1


@pytest.fixture
def torchruns_handler() -> Iterator[None]:
    """SIGTERM handled as torchrun's agent handles it once its workers start (its process context's handler, which
    the bridge wraps), for one test."""
    from torch.distributed.elastic.multiprocessing import api as mp_api

    from traintrace.integrations import torchelastic

    launch.install_torchelastic_bridge()
    before = signal.signal(signal.SIGTERM, mp_api._terminate_process_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
        torchelastic._bridge_state.pop("signal", None)


@pytest.mark.usefixtures("torchruns_handler")
@pytest.mark.parametrize("where", ["metric handler", "event handler", "events.record"])
def test_torchruns_signal_is_never_swallowed_by_the_bridge(agent_memory: MemoryBackend, where: str) -> None:
    """SIGTERM to the agent while its main thread is in the bridge's code: torchrun's ``SignalException`` goes
    through (the agent then stops its workers and ends), where a handler that logs and ignores its own errors kept
    the agent running as if no signal had come, and ``job_end`` said none. The bridge notes the signal too."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from traintrace.integrations.torchelastic import signal_received

    with pytest.raises(SignalException):
        if where == "metric handler":
            torch_metrics.put_metric("workers.default.remaining_restarts", _SignalledOnUse())  # type: ignore[arg-type]
        elif where == "event handler":
            logger = torch_events._get_or_create_logger(launch.DESTINATION)
            logger.info(_SignalledOnUse())
        else:
            tt.events.record(tt.events.EventType.JOB_START, data=_SignalledData(), source="agent")
    assert signal_received() == signal.SIGTERM


@pytest.mark.usefixtures("torchruns_handler")
def test_the_agents_signal_is_noted_even_where_torch_swallows_its_exception() -> None:
    """A ``logging`` handler writing when the signal comes swallows what the signal's handler raised (its
    ``handleError``): ``traintrace-run`` still writes the signal the agent got in ``job_end``."""
    from traintrace.integrations.torchelastic import signal_received

    assert signal_received() is None
    swallowing = logging.StreamHandler(_SignalledOnUse())  # type: ignore[arg-type]
    swallowing.stream = types.SimpleNamespace(write=lambda _: str(_SignalledOnUse()), flush=lambda: None)
    logger = logging.getLogger("test_the_agents_signal")
    logger.addHandler(swallowing)
    logger.propagate = False
    try:
        logging.raiseExceptions, raised = False, logging.raiseExceptions
        logger.warning("a line as the signal comes")
    finally:
        logging.raiseExceptions = raised
        logger.removeHandler(swallowing)
    assert signal_received() == signal.SIGTERM


def test_a_user_chosen_handler_is_kept() -> None:
    """With --event-log-handler console, torch's console handler stays and ours is added beside it."""
    from torch.distributed.elastic.events import handlers

    console = handlers.get_logging_handler("console")
    launch.install_torchelastic_bridge("console")
    assert handlers.get_logging_handler("console") is console
    logger = torch_events._get_or_create_logger("console")
    assert console in logger.handlers
    assert any(isinstance(h, launch.TorchEventHandler) for h in logger.handlers)


def test_choose_job_id_precedence() -> None:
    """TRAINTRACE_JOB_ID, then --rdzv-id, then the scheduler, then the rendezvous or a new id."""
    args = types.SimpleNamespace(
        rdzv_id="rid", standalone=False, nnodes="2", rdzv_endpoint="host:29400", master_addr="m", master_port=1
    )
    assert launch.choose_job_id(args, {"TRAINTRACE_JOB_ID": "tt", "SLURM_JOB_ID": "9"}) == "tt"
    assert launch.choose_job_id(args, {"SLURM_JOB_ID": "9"}) == "rid"
    args.rdzv_id = "none"
    assert launch.choose_job_id(args, {"SLURM_JOB_ID": "9"}) == "9"
    # The endpoint made a safe folder name; the hash keeps "host:29400" and "host_29400" apart.
    assert re.fullmatch(r"job-host_29400-[0-9a-f]{8}", launch.choose_job_id(args, {}))
    args.nnodes = "1"
    assert launch.choose_job_id(args, {}).startswith("job-2")


# ---------------------------------------------------------------- real torchrun jobs


def _run_job(tmp_path: Path, mode: str, *extra: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    inherited = ("TRAINTRACE_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_", "MASTER_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(inherited)}
    env.update(
        {
            "TT_MODE": mode,
            "TT_CKPT": str(tmp_path / "checkpoint"),
            "TRAINTRACE_LOG_DIR": str(tmp_path / "logs"),
            "TRAINTRACE_BACKENDS_LOG_ENABLED": "0",
            "OMP_NUM_THREADS": "1",
            # torch 2.13 + gloo: restarted workers sometimes read the previous attempt's
            # addresses from the shared rendezvous store; a store per attempt avoids it.
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        }
    )
    command = [
        sys.executable,
        "-m",
        "traintrace.launch",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--monitor-interval",
        "0.2",
        *extra,
        str(WORKER),
    ]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    (job,) = (tmp_path / "logs").iterdir()
    return result, job


def _events(stream: Stream, name: str) -> list[dict[str, Any]]:
    return [r for r in stream.records if r.get("kind") == "event" and r.get("name") == name]


@pytest.mark.subprocess
@pytest.mark.slow
def test_clean_run(tmp_path: Path) -> None:
    """Every rank's file has its identity; the agent stream has the workers' lifecycle."""
    result, job = _run_job(tmp_path, "clean")
    assert result.returncode == 0, result.stderr[-3000:]
    (agent,) = read_file(job / "agent.jsonl").streams
    assert agent.header["role"] == "agent"
    assert agent.closed_cleanly
    for rank in (0, 1):
        (stream,) = read_file(job / f"rank{rank}.jsonl").streams
        header = stream.header
        fields = (header["rank"], header["world_size"], header["local_rank"], header["restart"])
        assert fields == (rank, 2, rank, 0)
        assert header["job"] == agent.header["job"] == job.name
        assert header["launcher"] == "torchelastic"
        assert [s["attrs"]["step"] for s in stream.spans("iteration")] == list(range(6))
        assert stream.closed_cleanly
    names = [r["name"] for r in agent.records if r.get("kind") == "event" and r["name"] != "elastic_metric"]
    assert names[0] == "job_start"
    assert names[-1] == "job_end"
    for expected in ("rendezvous_start", "rendezvous_complete", "ranks_assigned", "agent_exit"):
        assert expected in names
    starts = _events(agent, "worker_start")
    assert sorted(e["attrs"]["rank"] for e in starts) == [0, 1]
    exits = _events(agent, "worker_exit")
    assert sorted((e["attrs"]["rank"], e["attrs"]["exit_code"]) for e in exits) == [(0, 0), (1, 0)]
    for path in job.glob("*.jsonl"):
        for record in read_file(path).streams[0].records:
            jsonschema.validate(record, SCHEMA)
        jsonschema.validate(read_file(path).streams[0].header, SCHEMA)
    info = read_job(job)
    assert info.manifest is not None
    assert (info.manifest["created_by"], info.manifest["world_size"]) == ("agent", 2)
    assert info.manifest["config"]["backends"]["file"]["path"] == "{job}/rank{rank}.jsonl"
    assert info.missing_ranks() == []


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.once  # the launcher's stream under the pure core: test_clean_run, the diagnosis jobs
def test_rank_raises_at_a_known_step(tmp_path: Path) -> None:
    """The failing rank's file has the error and stack; the agent has the failure; rank 0 shows step 3."""
    result, job = _run_job(tmp_path, "raise")
    assert result.returncode != 0
    (failing,) = read_file(job / "rank1.jsonl").streams
    (error,) = failing.of_kind("error")
    assert (error["error_type"], error["message"]) == ("RuntimeError", "boom at step 3")
    assert "_dist_worker.py" in error["stack"]
    assert failing.spans("iteration")[-1]["attrs"]["step"] == 3
    assert failing.spans("iteration")[-1]["status"] == "error"
    (other,) = read_file(job / "rank0.jsonl").streams
    last = other.spans("iteration")[-1]
    assert last["attrs"]["step"] == 3
    assert last["status"] != "ok"
    (agent,) = read_file(job / "agent.jsonl").streams
    failures = {e["attrs"]["rank"]: e for e in _events(agent, "worker_failure")}
    assert failures[1]["attrs"]["exit_code"] == 1
    (end,) = _events(agent, "job_end")
    assert end["attrs"]["exit_code"] == 1
    assert 1 in end["attrs"]["data"]["failed_ranks"]


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.once  # the launcher's stream under the pure core: test_clean_run, the diagnosis jobs
def test_max_restarts_one(tmp_path: Path) -> None:
    """The second attempt's streams say restart 1 and resume at the checkpointed step."""
    result, job = _run_job(tmp_path, "restart", "--max-restarts", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        first, second = read_file(job / f"rank{rank}.jsonl").streams
        assert (first.header["restart"], second.header["restart"]) == (0, 1)
        assert [s["attrs"]["step"] for s in first.spans("iteration")] == [0, 1, 2, 3]
        assert [s["attrs"]["step"] for s in second.spans("iteration")] == [3, 4, 5]
        assert all(s["status"] == "ok" for s in second.spans("iteration"))
    (agent,) = read_file(job / "agent.jsonl").streams
    (restart,) = _events(agent, "worker_restart")
    assert restart["attrs"]["restart"] == 1
    assert restart["attrs"]["data"]["remaining_restarts"] == 0
    second_starts = [e for e in _events(agent, "worker_start") if e["attrs"]["restart"] == 1]
    assert sorted(e["attrs"]["rank"] for e in second_starts) == [0, 1]
    failures = _events(agent, "worker_failure")
    assert any(e["attrs"]["rank"] == 1 and e["attrs"]["restart"] == 0 for e in failures)
    info = read_job(job)
    assert info.restarts == 1
    assert info.ranks(restart=1) == [0, 1]


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.once  # the launcher's stream under the pure core: test_clean_run, the diagnosis jobs
def test_rank_killed_with_sigkill(tmp_path: Path) -> None:
    """A SIGKILLed rank's file reads cleanly up to its last flush; the agent names the signal."""
    result, job = _run_job(tmp_path, "kill")
    assert result.returncode != 0
    parsed = read_file(job / "rank1.jsonl")
    assert parsed.bad_lines == []
    (stream,) = parsed.streams
    assert not stream.closed_cleanly
    assert [s["attrs"]["step"] for s in stream.spans("iteration")] == [0, 1, 2]
    assert stream.spans("training_loop")[0]["status"] == "open"
    (agent,) = read_file(job / "agent.jsonl").streams
    failures = {e["attrs"]["rank"]: e for e in _events(agent, "worker_failure")}
    assert failures[1]["attrs"]["exit_code"] == -9
    assert failures[1]["attrs"]["data"]["signal"] == "SIGKILL"
