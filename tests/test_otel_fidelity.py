"""OpenTelemetry fidelity (issue 13): what reaches a real receiver matches what was recorded.

Each test runs against the loopback receivers built on the official proto stubs
(``tests/otlp_receivers.py``) and reads the job's own files back.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("grpc")

import traintrace as tt
from traintrace.backends.otlp import span_id_for, span_salt
from traintrace.reader import read_file

sys.path.insert(0, str(Path(__file__).parent))
from conftest import read_jsonl
from otlp_receivers import GrpcReceiver, HttpReceiver

ERROR = 2  # Status.StatusCode.STATUS_CODE_ERROR
UNSET = 0


@pytest.fixture
def receiver() -> Iterator[GrpcReceiver]:
    found = GrpcReceiver()
    yield found
    found.stop()


def _dead_endpoint() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def _attrs(message: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in message.attributes:
        kind = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, kind) if kind else None
    return out


def _stream(tmp_path: Path, job: str) -> list[dict[str, Any]]:
    return read_jsonl(tmp_path / "traintrace_logs" / job / "rank0.jsonl")


# ---------------------------------------------------------------- 1. held iterations


def test_events_and_errors_of_an_iteration_held_for_a_tensor_reach_the_iteration(
    receiver: GrpcReceiver, tmp_path: Path
) -> None:
    """loss=tensor holds the iteration's record back; its events and errors are still its own, as in the logs."""
    torch = pytest.importorskip("torch")
    tt.configure(
        job_id="held",
        log_interval=4,
        backends={
            "log": False,
            "otlp_traces": {"endpoint": receiver.endpoint},
            "otlp_logs": {"endpoint": receiver.endpoint},
        },
    )
    with tt.training_loop():
        for step in range(10):
            with tt.training_iteration(step) as it:
                tt.event("batch_ready", {"step": step})
                if step == 6:
                    tt.error(ValueError(f"bad batch {step}"))
                it.add_metrics(loss=torch.tensor(1.0 / (step + 1)))
            tt.flush()  # a writer cycle per step: the held records come out later than their events
    tt.close()

    spans = [span for _, span in receiver.spans()]
    iterations = {_attrs(s)["step"]: s for s in spans if s.name == "iteration"}
    (loop,) = [s for s in spans if s.name == "training_loop"]
    assert sorted(iterations) == list(range(10))
    assert not [e for e in loop.events if e.name in ("batch_ready", "exception")]
    for step, span in iterations.items():
        ready = [e for e in span.events if e.name == "batch_ready"]
        assert [_attrs(e)["step"] for e in ready] == [step]
        assert _attrs(span)["loss"] == pytest.approx(1.0 / (step + 1))  # the tensor, read
    (exception,) = [e for e in iterations[6].events if e.name == "exception"]
    assert _attrs(exception)["exception.message"] == "bad batch 6"
    # The logs link the same error to the same span.
    (error_log,) = [r for _, r in receiver.log_records() if _attrs(r).get("traintrace.kind") == "error"]
    assert error_log.span_id == iterations[6].span_id


# ---------------------------------------------------------------- 2. and 3. errors


def test_exception_events_lie_within_their_span(receiver: GrpcReceiver) -> None:
    """The exception event's time is taken when the error is recorded: never after the span's end."""
    tt.configure(job_id="exc", backends={"file": False, "log": False, "otlp_traces": {"endpoint": receiver.endpoint}})
    for step in range(30):
        try:
            with tt.span("failing", {"step": step}):
                raise RuntimeError("x" * 2000)  # a traceback that takes a while to format
        except RuntimeError:
            pass
    tt.close()
    spans = [span for _, span in receiver.spans() if span.name == "failing"]
    assert len(spans) == 30
    for span in spans:
        (event,) = [e for e in span.events if e.name == "exception"]
        assert span.start_time_unix_nano <= event.time_unix_nano <= span.end_time_unix_nano
        assert span.status.code == ERROR


def test_error_recorded_inside_a_span_makes_it_error(receiver: GrpcReceiver, tmp_path: Path) -> None:
    """tt.error(exc) inside a span gives the span status ERROR with its message (docs/otel.md)."""
    tt.configure(job_id="err", backends={"log": False, "otlp_traces": {"endpoint": receiver.endpoint}})
    with tt.span("outer"):
        with tt.span("loads_shard"):
            try:
                raise KeyError("shard 3")
            except KeyError as exc:
                tt.error(exc)
        with tt.span("message_only"):
            tt.error("checksum mismatch")
        with tt.span("fine"):
            tt.event("ok")
    tt.close()
    spans = {span.name: span for _, span in receiver.spans()}
    assert spans["loads_shard"].status.code == ERROR
    assert "KeyError" in spans["loads_shard"].status.message
    assert spans["message_only"].status.code == ERROR
    assert "checksum mismatch" in spans["message_only"].status.message
    assert spans["fine"].status.code == UNSET
    assert spans["outer"].status.code == UNSET  # the error was handled inside its child
    # The file keeps the span's own ending: it finished normally.
    stream = read_file(tmp_path / "traintrace_logs" / "err" / "rank0.jsonl")
    statuses = {s["name"]: s["status"] for s in stream.spans()}
    assert statuses["loads_shard"] == "ok"


# ---------------------------------------------------------------- 4. and 6. a dead collector


def test_close_with_a_dead_collector_closes_and_reports_every_backend(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Three OTLP backends, nothing listening, a tight close budget: each closes, reports and counts."""
    dead = {"endpoint": _dead_endpoint(), "timeout": 5, "close_timeout": 1.0}
    tt.configure(
        job_id="dead",
        close_timeout=1.5,
        backends={
            "log": False,
            "otlp_traces": dead,
            "otlp_logs": dead,
            "otlp_metrics": {**dead, "export_interval": 60},
        },
    )
    with tt.training_loop():
        for step in range(50):
            with tt.training_iteration(step) as it:
                it.add_metrics(loss=1.0)
    caplog.set_level(logging.INFO, logger="traintrace.lib")
    tt.close()
    finals = {name: [r.getMessage() for r in caplog.records if f"traintrace: {name} exported" in r.getMessage()]
              for name in ("otlp_traces", "otlp_logs", "otlp_metrics")}  # fmt: skip
    assert all(len(lines) == 1 for lines in finals.values()), finals
    stats = tt.stats()
    traces, logs = stats["backends"]["otlp_traces"], stats["backends"]["otlp_logs"]
    assert traces["exported"] == 0 and traces["dropped"] + traces["failed"] + traces["abandoned"] == 51
    logs_lost = logs["dropped"] + logs["failed"] + logs["abandoned"]
    assert logs["exported"] == 0 and logs_lost >= 3  # header, loop start and end, ...
    assert stats["backends"]["otlp_metrics"]["failed_exports"] >= 1
    close = _stream(tmp_path, "dead")[-1]
    assert close["kind"] == "close"
    assert sum(close["backend_losses"]["otlp_traces"].values()) == 51
    # The logs backend also loses the notes and close record written after it settled (in stats only).
    assert 3 <= sum(close["backend_losses"]["otlp_logs"].values()) <= logs_lost
    assert close["backend_losses"]["otlp_metrics"]["failed_exports"] >= 1


def test_export_losses_reach_the_file_and_stats(tmp_path: Path) -> None:
    """Spans an OTLP backend could not deliver are counted in the stream's dropped records and close record."""
    tt.configure(
        job_id="lost",
        backends={
            "log": False,
            "otlp_traces": {"endpoint": _dead_endpoint(), "timeout": 0.5, "close_timeout": 0.5, "batch_size": 8,
                            "export_interval": 0.05},
        },
    )  # fmt: skip
    for step in range(40):
        with tt.training_iteration(step):
            pass
        if step % 10 == 9:
            tt.flush()
    tt.close()
    records = _stream(tmp_path, "lost")
    notes = [r for r in records if r["kind"] == "dropped" and r.get("backend") == "otlp_traces"]
    assert notes and all(r["reason"].startswith("export_") for r in notes)
    close = records[-1]
    assert close["kind"] == "close"
    losses = close["backend_losses"]["otlp_traces"]
    assert sum(losses.values()) == 40
    by_reason: dict[str, int] = {}
    for note in notes:
        by_reason[note["reason"]] = by_reason.get(note["reason"], 0) + note["count"]
    assert by_reason == {f"export_{why}": n for why, n in losses.items()}
    stats = tt.stats()
    assert stats["backend_losses"]["otlp_traces"] == losses
    assert stats["records"] == close["records"]


# ---------------------------------------------------------------- 5. and 10. drops in records


def _flood(threads: int, spans: int) -> None:
    def work() -> None:
        for i in range(spans):
            with tt.span("s", {"i": i}):
                tt.event("e")

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def test_queue_drops_are_counted_in_records_and_written(tmp_path: Path) -> None:
    """A tiny queue overflows: what the file lacks is exactly what its dropped records and close record count."""
    tt.configure(job_id="drops", queue_size=16, backends={"log": False})
    threads, per_thread = 2, 20_000
    _flood(threads, per_thread)
    tt.close()
    stream = read_file(tmp_path / "traintrace_logs" / "drops" / "rank0.jsonl").streams[0]
    close = stream.records[-1]
    assert close["kind"] == "close"
    spans = stream.spans("s")
    events = stream.of_kind("event")
    made = 2 * threads * per_thread  # one span and one event each
    missing = made - len(spans) - len(events)
    assert missing > 0, "the queue never overflowed"
    assert all(s["status"] == "ok" for s in spans)  # a span written at all is written whole
    notes = [r for r in stream.records if r["kind"] == "dropped"]
    assert sum(r["count"] for r in notes) == close["dropped"] == missing
    assert notes[-1]["total"] == missing


# ---------------------------------------------------------------- 7. close under backlog


class _SlowDisk(tt.BaseBackend):
    """A backend as slow as a struggling disk: 20 ms per batch."""

    verbosity = 4

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def write(self, records: Any) -> None:
        time.sleep(0.02)
        self.records.extend(records)


def test_close_out_of_time_says_what_it_did_not_write(tmp_path: Path) -> None:
    """A backlog bigger than close's budget: the file ends with a count of what was not written and a close record."""
    slow = _SlowDisk()
    tt.configure(job_id="backlog", queue_size=1_000_000, backends={"log": False}, extra_backends=[slow])
    made = 200_000
    for i in range(made):
        tt.event("e", {"i": i})
    tt.close(timeout=0.5)
    records = _stream(tmp_path, "backlog")
    close = records[-1]
    assert close["kind"] == "close"
    written = [r for r in records if r["kind"] == "event"]
    (abandoned,) = [r for r in records if r["kind"] == "dropped" and r["reason"] == "close_timeout"]
    assert abandoned["count"] > 0
    assert len(written) + abandoned["count"] == made
    assert close["dropped"] == abandoned["count"]
    assert slow.records[-1]["kind"] == "close"


# ---------------------------------------------------------------- 8. request size


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_requests_are_split_by_encoded_size(protocol: str) -> None:
    """Spans and logs with 3,000-character attributes: every request stays under a collector's 4 MiB limit.

    gRPC: traintrace's own encoding, sized exactly (the gRPC receiver refuses more than 4 MiB).
    HTTP: the SDK's encoder, sized by estimate.
    """
    receiver: Any = GrpcReceiver() if protocol == "grpc" else HttpReceiver()
    try:
        attr = "x" * 3000
        target = {"endpoint": receiver.endpoint, "protocol": protocol}
        tt.configure(
            job_id="big",
            backends={"file": False, "log": False, "otlp_traces": target, "otlp_logs": target},
        )
        for i in range(2000):
            with tt.span("big", {"i": i, "blob": attr}):
                pass
        tt.close(timeout=30)
        spans = [span for _, span in receiver.spans()]
        assert len(spans) == 2000
        assert {_attrs(s)["i"] for s in spans} == set(range(2000))
        logs = [r for _, r in receiver.log_records() if _attrs(r).get("traintrace.kind") == "span"]
        assert len(logs) == 2000
        sizes = [request.ByteSize() for request in receiver.traces + receiver.logs]
        assert max(sizes) < 4 * 1024 * 1024
        assert len(receiver.traces) >= 2 and len(receiver.logs) >= 2
    finally:
        receiver.stop()


def test_ids_match_the_file(receiver: GrpcReceiver, tmp_path: Path) -> None:
    """Every span the file has is the receiver's span with the derived id (a sanity check for the tests above)."""
    tt.configure(job_id="ids", backends={"log": False, "otlp_traces": {"endpoint": receiver.endpoint}})
    with tt.training_loop():
        for step in range(3):
            with tt.training_iteration(step):
                pass
    tt.close()
    stream = read_file(tmp_path / "traintrace_logs" / "ids" / "rank0.jsonl").streams[0]
    header = stream.header
    salt = span_salt(header["job"], header["restart"], header["rank"], header["host"], header["pid"])
    expected = {span_id_for(salt, s["id"]).to_bytes(8, "big") for s in stream.spans()}
    assert {span.span_id for _, span in receiver.spans()} == expected


def test_an_event_waits_for_its_held_span_past_a_sibling_released_with_it() -> None:
    """Records in the order the writer releases held iterations: the event goes to its own span.

    Iteration 3 was seen open (its start written), then held at its end; iteration 4
    was held whole. Iteration 4's event arrives while 3 looks open; both are released
    together, 3's end first.
    """
    from opentelemetry.sdk.trace.export import SpanExportResult

    from traintrace.backends.otlp._traces import OtlpTracesBackend

    class Keep:
        def __init__(self) -> None:
            self.spans: list[Any] = []

        def export(self, spans: Any) -> Any:
            self.spans.extend(spans)
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            return None

    exporter = Keep()
    backend = OtlpTracesBackend(exporter)
    backend.open({"job": "w", "restart": 0, "rank": 0, "host": "h", "pid": 1})
    base = {"parent": 1, "tid": 7}
    backend.write([{"seq": 1, "kind": "start", "ts": 10, "name": "training_loop", "id": 1, "parent": 0, "tid": 7}])
    backend.write([{"seq": 2, "kind": "start", "ts": 20, "name": "iteration", "id": 3, **base}])
    backend.write([{"seq": 3, "kind": "event", "ts": 35, "name": "in_4", "span": 4, "tid": 7}])
    backend.write(
        [
            {"seq": 4, "kind": "end", "ts": 29, "name": "iteration", "id": 3, "dur": 9, "status": "ok"},
            {"seq": 5, "kind": "span", "ts": 30, "name": "iteration", "id": 4, "dur": 10, "status": "ok", **base},
        ]
    )
    backend.write([{"seq": 6, "kind": "end", "ts": 50, "name": "training_loop", "id": 1, "dur": 40, "status": "ok"}])
    backend.close()
    events = {span.attributes["traintrace.span.id"]: [e.name for e in span.events] for span in exporter.spans}
    assert events == {1: [], 3: [], 4: ["in_4"]}


def test_under_overload_every_span_is_delivered_or_counted(receiver: GrpcReceiver, tmp_path: Path) -> None:
    """More spans than the writer keeps up with: created = received + counted in the file, exactly."""
    tt.configure(
        job_id="overload",
        queue_size=64,
        backends={"log": False, "otlp_traces": {"endpoint": receiver.endpoint, "close_timeout": 20}},
    )
    threads, per_thread = 2, 15_000

    def work() -> None:
        for i in range(per_thread):
            with tt.span("s", {"i": i}):
                pass

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    tt.close(timeout=30)
    records = _stream(tmp_path, "overload")
    close = records[-1]
    assert close["kind"] == "close"
    written = [r for r in records if r["kind"] in ("span", "start")]
    lost_before = close["dropped"]
    lost_in_export = sum(close.get("backend_losses", {}).get("otlp_traces", {}).values())
    assert lost_before > 0, "the queue never overflowed"
    assert len(written) + lost_before == threads * per_thread
    assert len(receiver.spans()) + lost_in_export == len(written)
