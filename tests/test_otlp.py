"""The OTLP backends against real receivers on loopback (gRPC and HTTP/protobuf)."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("grpc")

import traintrace as tt
from traintrace.backends.otlp import span_id_for, span_salt, trace_id_for
from traintrace.backends.otlp._common import flatten_attrs

sys.path.insert(0, str(Path(__file__).parent))
from otlp_receivers import GrpcReceiver, HttpReceiver

ERROR = 2  # Status.StatusCode.STATUS_CODE_ERROR in the protocol


@pytest.fixture
def grpc_receiver() -> Iterator[GrpcReceiver]:
    receiver = GrpcReceiver()
    yield receiver
    receiver.stop()


@pytest.fixture
def http_receiver() -> Iterator[HttpReceiver]:
    receiver = HttpReceiver()
    yield receiver
    receiver.stop()


def _configure(backends: dict[str, Any], **settings: Any) -> tt.Recorder:
    settings.setdefault("job_id", "otlp-test")
    return tt.configure(backends={"file": False, "log": False, **backends}, **settings)


def _train(steps: int = 5, fail_checkpoint: bool = True) -> None:
    with tt.application():
        with tt.training_loop():
            for step in range(steps):
                with tt.training_iteration(step) as it:
                    tt.event("batch_ready", {"size": 32})
                    it.add_metrics(loss=1.0 / (step + 1), opt={"lr": 0.1, "betas": [0.9, 0.99]}, note=None)
            if fail_checkpoint:
                try:
                    with tt.checkpoint_save(path="/ckpt"):
                        raise ValueError("disk full")
                except ValueError:
                    pass


def _attrs(message: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in message.attributes:
        value = kv.value
        kind = value.WhichOneof("value")
        if kind == "array_value":
            out[kv.key] = [getattr(v, v.WhichOneof("value")) for v in value.array_value.values]
        else:
            out[kv.key] = getattr(value, kind) if kind else None
    return out


def _by_name(spans: list[tuple[Any, Any]]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for _, span in spans:
        out.setdefault(span.name, []).append(span)
    return out


def test_grpc_traces_nest_carry_attributes_and_errors(grpc_receiver: GrpcReceiver) -> None:
    """Spans reach a gRPC collector as one trace, nested, timed in ns, with errors as status ERROR."""
    _configure({"otlp_traces": {"endpoint": grpc_receiver.endpoint, "protocol": "grpc"}})
    before = time.time_ns()
    _train()
    after = time.time_ns()
    tt.close()

    spans = grpc_receiver.spans()
    names = _by_name(spans)
    assert len(names["iteration"]) == 5
    main, loop = names["main_function"][0], names["training_loop"][0]
    trace_id = trace_id_for("otlp-test", 0).to_bytes(16, "big")
    for _, span in spans:
        assert span.trace_id == trace_id
        assert before <= span.start_time_unix_nano <= span.end_time_unix_nano <= after
    assert main.parent_span_id == b""
    assert loop.parent_span_id == main.span_id
    assert all(it.parent_span_id == loop.span_id for it in names["iteration"])
    assert len({span.span_id for _, span in spans}) == len(spans)

    first = min(names["iteration"], key=lambda s: s.start_time_unix_nano)
    attrs = _attrs(first)
    assert attrs["step"] == 0 and attrs["loss"] == 1.0
    assert attrs["opt.lr"] == 0.1 and attrs["opt.betas"] == [0.9, 0.99]
    assert "note" not in attrs
    assert [e.name for e in first.events] == ["batch_ready"]
    assert _attrs(first.events[0]) == {"size": 32}
    assert first.start_time_unix_nano <= first.events[0].time_unix_nano <= first.end_time_unix_nano

    checkpoint = names["checkpoint_save_sync"][0]
    assert checkpoint.status.code == ERROR
    assert "ValueError" in checkpoint.status.message
    (exception,) = [e for e in checkpoint.events if e.name == "exception"]
    details = _attrs(exception)
    assert details["exception.type"] == "ValueError"
    assert details["exception.message"] == "disk full"
    assert "disk full" in details["exception.stacktrace"]
    assert "Traceback" in details["exception.stacktrace"]
    assert main.status.code != ERROR  # the exception was caught inside

    resource = _attrs(spans[0][0])
    assert resource["service.name"] == "otlp-test"
    assert resource["service.instance.id"] == "otlp-test/rank0/restart0"
    assert resource["host.name"] == socket.gethostname()
    assert resource["process.pid"] == os.getpid()
    assert resource["traintrace.rank"] == 0
    assert resource["traintrace.world_size"] == 1
    assert resource["traintrace.restart_count"] == 0
    assert resource["telemetry.sdk.language"] == "python"


def test_all_ranks_of_a_run_share_one_trace(grpc_receiver: GrpcReceiver) -> None:
    """Two ranks of one run export to one trace id; a restart starts a new trace."""
    endpoint = {"otlp_traces": {"endpoint": grpc_receiver.endpoint, "protocol": "grpc"}}
    for rank, restart in ((0, 0), (1, 0), (0, 1)):
        _configure(endpoint, job_id="shared", rank=rank, world_size=2, restart_count=restart)
        with tt.span("work"):
            pass
        tt.close()
    spans = grpc_receiver.spans()
    assert len(spans) == 3
    by_rank = {(_attrs(r)["traintrace.rank"], _attrs(r)["traintrace.restart_count"]): s for r, s in spans}
    assert by_rank[0, 0].trace_id == by_rank[1, 0].trace_id == trace_id_for("shared", 0).to_bytes(16, "big")
    assert by_rank[0, 1].trace_id == trace_id_for("shared", 1).to_bytes(16, "big")
    assert by_rank[0, 0].span_id != by_rank[1, 0].span_id


def test_http_traces_logs_and_metrics(http_receiver: HttpReceiver) -> None:
    """One run to an HTTP/protobuf collector: spans, correlated logs and the training metrics."""
    endpoint = {"endpoint": http_receiver.endpoint, "protocol": "http/protobuf"}
    memory = tt.MemoryBackend(verbosity=int(tt.Verbosity.INFO))
    _configure(
        {"otlp_traces": endpoint, "otlp_logs": endpoint, "otlp_metrics": {**endpoint, "export_interval": 60}},
        extra_backends=[memory],
    )
    before = time.time_ns()
    _train()
    after = time.time_ns()
    with tt.checkpoint_save_async() as save:
        pass
    with tt.checkpoint_save_finalization(save):
        pass
    tt.close()

    spans = _by_name(http_receiver.spans())
    assert len(spans["iteration"]) == 5
    final = spans["checkpoint_save_finalization"][0]
    assert [link.span_id for link in final.links] == [spans["checkpoint_save_async"][0].span_id]

    logs = http_receiver.log_records()
    kinds = [_attrs(record)["traintrace.kind"] for _, record in logs]
    assert kinds[0] == "header" and kinds[-1] == "close"
    user_events = [r for _, r in logs if "name=batch_ready" in r.body.string_value]
    assert len(user_events) == 5
    trace_id = trace_id_for("otlp-test", 0).to_bytes(16, "big")
    assert all(record.trace_id == trace_id for _, record in logs)
    (error,) = [record for _, record in logs if _attrs(record)["traintrace.kind"] == "error"]
    assert error.severity_text == "ERROR"
    assert _attrs(error)["exception.type"] == "ValueError"
    assert error.span_id == spans["checkpoint_save_sync"][0].span_id
    events = user_events
    assert {e.span_id for e in events} == {s.span_id for s in spans["iteration"]}
    assert all(before <= e.time_unix_nano <= after for e in events)
    assert "name=batch_ready" in events[0].body.string_value
    # The logs backend sees what an INFO backend sees, nothing more, nothing less.
    assert len(logs) == len(memory.records) + 1

    metrics = http_receiver.metric_points()
    iteration = metrics["traintrace.iteration.duration"][-1].histogram.data_points[0]
    assert iteration.count == 5 and iteration.sum > 0
    assert metrics["traintrace.iterations"][-1].sum.data_points[0].as_int == 5
    # The gauge holds the last loss seen: the loop-end progress event's, when statistics add one.
    progress = memory.events("training_iterations")
    last_loss = progress[-1]["attrs"].get("loss", 0.2) if progress else 0.2
    assert metrics["traintrace.loss"][-1].gauge.data_points[0].as_double == pytest.approx(last_loss)
    (errors,) = metrics["traintrace.errors"][-1].sum.data_points
    assert errors.as_int == 1 and _attrs(errors) == {"error.type": "ValueError"}
    checkpoints = metrics["traintrace.checkpoint.duration"][-1].histogram.data_points
    assert {_attrs(p)["traintrace.span.name"] for p in checkpoints} >= {"checkpoint_save_sync"}
    assert metrics["traintrace.iteration.duration"][-1].unit == "s"


def test_a_long_span_is_exported_once_with_events_from_both_sides_of_a_flush(
    grpc_receiver: GrpcReceiver,
) -> None:
    """A span written as start and end records still becomes one span, events included."""
    _configure({"otlp_traces": {"endpoint": grpc_receiver.endpoint, "protocol": "grpc"}})
    with tt.span("long", {"phase": "a"}) as long:
        tt.event("early")
        tt.flush()
        tt.event("late")
        long.add_metrics(result=3)
    tt.close()
    (span,) = [s for _, s in grpc_receiver.spans()]
    assert [e.name for e in span.events] == ["early", "late"]
    assert _attrs(span)["phase"] == "a" and _attrs(span)["result"] == 3


def test_otel_environment_variables_are_honoured(http_receiver: HttpReceiver, monkeypatch: pytest.MonkeyPatch) -> None:
    """OTEL_EXPORTER_OTLP_* pick where and how; OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES apply."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", http_receiver.endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=ml%20team")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "trainer")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test,team=ml")
    _configure({"otlp_traces": {}}, job_name="resnet")
    with tt.span("work"):
        pass
    tt.close()
    ((resource, _),) = http_receiver.spans()
    attrs = _attrs(resource)
    assert attrs["service.name"] == "trainer"
    assert attrs["deployment.environment"] == "test" and attrs["team"] == "ml"
    assert attrs["traintrace.job.name"] == "resnet"
    assert http_receiver.headers_seen[0].get("x-tenant") == "ml team"


def test_traintrace_variables_configure_the_backend(
    grpc_receiver: GrpcReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TRAINTRACE_BACKENDS_OTLP_TRACES_* turn the backend on and point it at a collector."""
    monkeypatch.setenv("TRAINTRACE_BACKENDS_OTLP_TRACES_ENDPOINT", grpc_receiver.endpoint)
    monkeypatch.setenv("TRAINTRACE_BACKENDS_OTLP_TRACES_PROTOCOL", "grpc")
    monkeypatch.setenv("TRAINTRACE_BACKENDS_OTLP_TRACES_SERVICE_NAME", "from-env")
    _configure({})
    with tt.span("work"):
        pass
    tt.close()
    ((resource, _),) = grpc_receiver.spans()
    assert _attrs(resource)["service.name"] == "from-env"


def test_receiver_killed_mid_run_neither_blocks_nor_raises(grpc_receiver: GrpcReceiver) -> None:
    """The collector dies halfway: training goes on, every span is accounted for, exit is bounded."""
    rec = _configure(
        {
            "otlp_traces": {
                "endpoint": grpc_receiver.endpoint,
                "protocol": "grpc",
                "timeout": 1.0,
                "close_timeout": 1.0,
                "batch_size": 16,
                "export_interval": 0.05,
            }
        }
    )
    backend = rec.backend("otlp_traces")
    assert backend.fast  # spans encoded by traintrace, sent as bytes through the official exporter
    with tt.training_loop():
        for step in range(400):
            with tt.training_iteration(step):
                pass
            if step == 200:
                tt.flush()
                deadline = time.monotonic() + 10
                while backend.sender.exported < 150 and time.monotonic() < deadline:
                    time.sleep(0.01)
                grpc_receiver.stop()
            elif step % 50 == 0:
                tt.flush()
    received = len(grpc_receiver.spans())
    started = time.monotonic()
    tt.close()
    closing = time.monotonic() - started
    stats = backend.stats()
    assert received >= 150
    # A batch in flight when the receiver stops can arrive and still count as failed on our side.
    assert stats["exported"] + stats["failed"] >= received
    assert stats["exported"] + stats["failed"] + stats["dropped"] + stats["abandoned"] == 401
    assert stats["failed"] + stats["abandoned"] > 0
    # close_timeout (1 s) bounds the wait for the dead collector; the margin is for a loaded machine.
    assert closing < 1.0 + 4.0


def test_collector_never_reachable_keeps_memory_bounded() -> None:
    """With nothing listening, at most max_queue spans are held; the rest are dropped and counted."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    rec = _configure(
        {
            "otlp_traces": {
                "endpoint": f"http://127.0.0.1:{port}",
                "protocol": "grpc",
                "timeout": 0.5,
                "close_timeout": 0.5,
                "max_queue": 64,
                "batch_size": 16,
            }
        }
    )
    backend = rec.backend("otlp_traces")
    most = 0
    for step in range(2000):
        with tt.training_iteration(step):
            pass
        if step % 100 == 99:
            tt.flush()
            most = max(most, backend.sender.queued)
    tt.close()
    stats = backend.stats()
    assert most <= 64
    assert stats["dropped"] > 0
    assert stats["exported"] == 0
    assert stats["failed"] + stats["dropped"] + stats["abandoned"] == 2000


@pytest.mark.subprocess
def test_console_protocol_prints_spans(tmp_path: Path) -> None:
    """protocol=console writes spans to stdout with the SDK's console exporter."""
    import subprocess

    script = (
        "import traintrace as tt\n"
        "tt.configure(job_id='c', backends={'file': False, 'log': False,\n"
        "    'otlp_traces': {'protocol': 'console'}})\n"
        "with tt.span('visible'):\n    pass\n"
        "tt.close()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRAINTRACE_"))}
    done = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert '"name": "visible"' in done.stdout


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"protocol": "zipkin"}, "backends.otlp_traces.protocol"),
        ({"headers": "no-equals-sign"}, "backends.otlp_traces.headers"),
        ({"max_queue": 0}, "backends.otlp_traces.max_queue"),
        ({"close_timeout": -1}, "backends.otlp_traces.close_timeout"),
        ({"compression": "brotli"}, "backends.otlp_traces.compression"),
    ],
)
def test_bad_settings_name_the_field(settings: dict[str, Any], field: str) -> None:
    """A bad OTLP setting raises ConfigError naming it, at configure()."""
    with pytest.raises(tt.ConfigError, match=field.replace(".", r"\.")):
        _configure({"otlp_traces": settings})


def test_bad_protocol_from_otel_environment_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unsupported OTEL_EXPORTER_OTLP_PROTOCOL is reported at configure()."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(tt.ConfigError, match="protocol"):
        _configure({"otlp_logs": {}})


def test_missing_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without OpenTelemetry installed, configure() says which extra to install."""
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.resources", None)
    with pytest.raises(tt.ConfigError, match=r"traintrace\[otel\]"):
        _configure({"otlp_metrics": {}})


def test_identifiers_are_deterministic_and_distinct() -> None:
    """Trace ids depend on job and restart only; span ids on the process and the span."""
    assert trace_id_for("j", 0) == trace_id_for("j", 0) != trace_id_for("j", 1)
    assert trace_id_for("j", 0) != trace_id_for("k", 0)
    assert 0 < trace_id_for("j", 0) < 1 << 128
    a, b = span_salt("j", 0, 0, "h", 1), span_salt("j", 0, 1, "h", 2)
    ids = {span_id_for(a, n) for n in range(1, 10_000)} | {span_id_for(b, n) for n in range(1, 10_000)}
    assert len(ids) == 19_998
    assert all(0 < i < 1 << 64 for i in ids)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)


@given(st.dictionaries(st.text(max_size=6), _json, max_size=6))
def test_flattened_attributes_are_valid_opentelemetry_values(attrs: dict[str, Any]) -> None:
    """Any JSON-safe record attrs flatten to values OpenTelemetry accepts without dropping."""
    from opentelemetry.attributes import BoundedAttributes

    out: dict[str, Any] = {}
    flatten_attrs(attrs, out)
    for key, value in out.items():
        assert isinstance(key, str)
        if isinstance(value, tuple):
            assert len({type(v) for v in value}) <= 1
            assert all(type(v) in (str, bool, int, float) for v in value)
        else:
            assert type(value) in (str, bool, int, float)
        if type(value) is int:
            assert -(1 << 63) <= value < 1 << 63
    bounded = BoundedAttributes(attributes=out)
    assert len(bounded) == len(out)


class _Recording:
    """A span exporter that keeps what it is given (OpenTelemetry's export interface)."""

    def __init__(self) -> None:
        self.batches: list[Any] = []

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        self.batches.append(list(spans))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def test_a_backlogged_writer_still_sends_and_counts_late_events() -> None:
    """Without flush() (the writer never idle), spans go out past a window; late events are counted."""
    from traintrace.backends.otlp._traces import _WINDOW, OtlpTracesBackend

    exporter = _Recording()
    backend = OtlpTracesBackend(exporter, batch_size=512, export_interval=0.05)
    backend.open({"job": "w", "restart": 0, "rank": 0, "host": "h", "pid": 1})
    total = 3 * _WINDOW
    backend.write(
        [
            {"seq": i, "kind": "span", "ts": 1000 + i, "name": "s", "id": i, "parent": 0, "tid": 1, "dur": 1,
             "status": "ok"}
            for i in range(1, total + 1)
        ]
    )  # fmt: skip
    backend.write([{"seq": total + 1, "kind": "event", "ts": 5, "name": "late", "span": 1, "tid": 1}])
    backend.write([{"seq": total + 2, "kind": "event", "ts": 6, "name": "fresh", "span": total, "tid": 1}])
    assert len(backend._done) == _WINDOW
    backend.close()
    spans = [span for batch in exporter.batches for span in batch]
    assert len(spans) == total
    assert backend.stats()["unattached_events"] == 1
    (last,) = [s for s in spans if s.attributes["traintrace.span.id"] == total]
    assert [e.name for e in last.events] == ["fresh"]


@pytest.mark.subprocess
def test_process_exit_is_bounded_when_the_collector_is_unreachable(tmp_path: Path) -> None:
    """A job whose collector never answers still exits (through atexit) within its close timeouts."""
    import subprocess

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = f"""
import traintrace as tt
dead = {{"endpoint": "http://127.0.0.1:{port}", "timeout": 5, "close_timeout": 1}}
tt.configure(job_id="dead", backends={{"file": False, "log": False, "otlp_traces": dead,
             "otlp_logs": dead, "otlp_metrics": {{**dead, "export_interval": 0.2}}}})
with tt.training_loop():
    for step in range(2000):
        with tt.training_iteration(step) as it:
            it.add_metrics(loss=1.0)
print("trained")
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRAINTRACE_"))}
    # The timeout is the assertion: three backends at close_timeout=1 s each, plus start-up.
    done = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        capture_output=True,
        text=True,
        timeout=45,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "trained" in done.stdout


def test_logs_body_can_be_json() -> None:
    """body=json puts the record itself, as JSON, in the log body."""
    import json

    from opentelemetry.sdk._logs.export import LogRecordExportResult

    from traintrace.backends.otlp._logs import OtlpLogsBackend

    class Keep:
        def __init__(self) -> None:
            self.records: list[Any] = []

        def export(self, batch: Any) -> Any:
            self.records.extend(batch)
            return LogRecordExportResult.SUCCESS

        def shutdown(self) -> None:
            return None

    exporter = Keep()
    backend = OtlpLogsBackend(exporter, body="json")
    backend.open({"seq": 0, "kind": "header", "ts": 1, "job": "j", "rank": 0, "restart": 0, "host": "h", "pid": 1})
    backend.write([{"seq": 1, "kind": "event", "ts": 2, "name": "hello", "span": 0, "tid": 1, "attrs": {"x": 1}}])
    backend.close()
    bodies = [json.loads(r.log_record.body) for r in exporter.records]
    assert [b["kind"] for b in bodies] == ["header", "event"]
    assert bodies[1]["attrs"] == {"x": 1}
    assert exporter.records[1].log_record.span_id == 0


def test_metrics_count_drops_errors_and_throughput() -> None:
    """Dropped records, errors, iterations and throughput reach their instruments."""
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult

    from traintrace.backends.otlp._metrics import OtlpMetricsBackend

    class Keep(MetricExporter):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.points: dict[str, list[Any]] = {}

        def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> Any:
            for rm in metrics_data.resource_metrics:
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        self.points.setdefault(metric.name, []).extend(metric.data.data_points)
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return True

        def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
            return None

    exporter = Keep()
    backend = OtlpMetricsBackend(exporter, export_interval=60)
    backend.open({"job": "m", "rank": 0, "restart": 0, "host": "h", "pid": 1})
    backend.write(
        [
            {"seq": 1, "kind": "span", "ts": 1, "name": "iteration", "id": 1, "parent": 0, "tid": 1,
             "dur": 250_000_000, "status": "ok", "attrs": {"step": 0, "tokens_per_second": 1234.5}},
            {"seq": 2, "kind": "dropped", "ts": 2, "count": 7, "total": 7, "reason": "queue_full"},
            {"seq": 3, "kind": "error", "ts": 3, "name": "exception", "span": 1, "tid": 1,
             "error_type": "torch.OutOfMemoryError", "message": "m", "stack": "s"},
            {"seq": 4, "kind": "event", "ts": 4, "name": "training_iterations", "span": 0, "tid": 1,
             "attrs": {"loss": 2.5}},
        ]
    )  # fmt: skip
    backend.close()
    points = exporter.points
    assert points["traintrace.dropped"][-1].value == 7
    assert dict(points["traintrace.dropped"][-1].attributes) == {"reason": "queue_full"}
    assert dict(points["traintrace.errors"][-1].attributes) == {"error.type": "torch.OutOfMemoryError"}
    assert points["traintrace.throughput.tokens"][-1].value == 1234.5
    assert points["traintrace.loss"][-1].value == 2.5
    iteration = points["traintrace.iteration.duration"][-1]
    assert iteration.count == 1 and iteration.sum == pytest.approx(0.25)
