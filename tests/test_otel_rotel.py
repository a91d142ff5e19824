"""A realistic job's telemetry through a real collector (rotel, from PyPI) into a receiver.

The job runs in its own process and writes down, outside traintrace, where it
emitted each event and error. The test then checks what the receiver got
against that truth and against the job's own file: the whole span tree, every
event's span, every error's span status, and that the spans recorded equal the
spans delivered plus the losses the file counts.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("grpc")
pytest.importorskip("rotel")

import traintrace as tt
from traintrace.backends.otlp import span_id_for, span_salt, trace_id_for
from traintrace.reader import read_file

sys.path.insert(0, str(Path(__file__).parent))
from otlp_receivers import GrpcReceiver

ERROR = 2  # Status.StatusCode.STATUS_CODE_ERROR

JOB = r"""
import json, sys, threading
import torch
import traintrace as tt

endpoint, truth_path = sys.argv[1], sys.argv[2]
truth = {"events": [], "errors": []}
tt.configure(
    job_id="rotel-job",
    log_interval=5,
    backends={
        "file": {"verbosity": "profiling"},
        "log": False,
        "otlp_traces": {"endpoint": endpoint, "verbosity": "profiling"},
        "otlp_logs": {"endpoint": endpoint},
    },
)

def note(label, span, step):
    truth["events"].append({"label": label, "span": span, "step": step})
    tt.event(label, {"label": label})

with tt.application():
    with tt.model_init():
        note("model_built", "model_initialization", None)
    with tt.training_loop():
        for step in range(24):
            with tt.training_iteration(step) as it:
                with tt.data_loading():
                    note(f"batch_{step}", "data_loading", step)
                with tt.forward():
                    loss = torch.tensor(2.0 / (step + 1))
                with tt.backward():
                    if step % 7 == 3:
                        try:
                            raise FloatingPointError(f"overflow at {step}")
                        except FloatingPointError as exc:
                            tt.error(exc)  # recorded, handled: the step goes on
                            truth["errors"].append(
                                {"message": f"overflow at {step}", "span": "model_backward", "step": step}
                            )
                with tt.optimizer_step():
                    pass
                note(f"stepped_{step}", "iteration", step)
                it.add_metrics(loss=loss.detach(), tokens=4096)
            if step % 10 == 9:
                try:
                    with tt.checkpoint_save(step=step):
                        note(f"saving_{step}", "checkpoint_save_sync", step)
                        if step == 19:
                            raise OSError(f"disk full at {step}")
                except OSError:
                    truth["errors"].append(
                        {"message": f"disk full at {step}", "span": "checkpoint_save_sync", "step": step}
                    )
        with tt.validation():
            note("validated", "validation_loop", None)

    def background():
        with tt.span("upload", {"step": 99}):
            note("uploaded", "upload", 99)

    worker = threading.Thread(target=background)
    worker.start()
    worker.join()
tt.close()
with open(truth_path, "w") as handle:
    json.dump(truth, handle)
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _wait_for_port(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[0].decode(errors="replace")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("rotel did not start listening")


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[tuple[str, GrpcReceiver]]:
    """rotel on loopback (gRPC in), forwarding over OTLP/gRPC to a receiver on the official stubs."""
    receiver = GrpcReceiver()
    grpc_port, http_port = _free_port(), _free_port()
    import rotel

    agent = Path(rotel.__file__).parent / "rotel-agent"  # the binary the rotel package runs
    process = subprocess.Popen(
        [str(agent), "start",
         "--otlp-grpc-endpoint", f"127.0.0.1:{grpc_port}", "--otlp-http-endpoint", f"127.0.0.1:{http_port}",
         "--exporter", "otlp", "--otlp-exporter-protocol", "grpc",
         "--otlp-exporter-endpoint", f"http://127.0.0.1:{receiver.port}",
         "--batch-timeout", "50ms",
         "--pid-file", str(tmp_path / "rotel.pid"), "--log-file", str(tmp_path / "rotel.log")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        _wait_for_port(grpc_port, process)
        yield f"http://127.0.0.1:{grpc_port}", receiver
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        receiver.stop()


def _attrs(message: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in message.attributes:
        kind = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, kind) if kind else None
    return out


@pytest.mark.subprocess
def test_a_realistic_job_through_rotel_arrives_whole(collector: tuple[str, GrpcReceiver], tmp_path: Path) -> None:
    pytest.importorskip("torch")
    endpoint, receiver = collector
    truth_path = tmp_path / "truth.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRAINTRACE_"))}
    env["PYTHONPATH"] = str(Path(tt.__file__).resolve().parents[1])  # the traintrace under test
    done = subprocess.run(
        [sys.executable, "-c", JOB, endpoint, str(truth_path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    truth = json.loads(truth_path.read_text())

    stream = read_file(tmp_path / "traintrace_logs" / "rotel-job" / "rank0.jsonl").streams[0]
    header, close = stream.header, stream.records[-1]
    assert close["kind"] == "close"
    recorded = stream.spans()
    losses = sum(close.get("backend_losses", {}).get("otlp_traces", {}).values())

    # rotel forwards in batches: wait until what the job's file says was sent has arrived.
    deadline = time.monotonic() + 60
    while len(receiver.spans()) < len(recorded) - losses and time.monotonic() < deadline:
        time.sleep(0.1)
    spans = [span for _, span in receiver.spans()]
    # Recorded = delivered + counted losses, with nothing delivered twice.
    assert len(spans) + losses == len(recorded)
    assert len({s.span_id for s in spans}) == len(spans)
    assert close["dropped"] == 0 and losses == 0  # a healthy collector loses nothing

    # The whole tree: one trace, each span's parent as the file recorded it.
    salt = span_salt(header["job"], header["restart"], header["rank"], header["host"], header["pid"])
    otel_id = {s["id"]: span_id_for(salt, s["id"]).to_bytes(8, "big") for s in recorded}
    by_id = {s.span_id: s for s in spans}
    trace_id = trace_id_for("rotel-job", 0).to_bytes(16, "big")
    for record in recorded:
        span = by_id[otel_id[record["id"]]]
        assert span.trace_id == trace_id and span.name == record["name"]
        parent = record.get("parent") or 0
        assert span.parent_span_id == (otel_id[parent] if parent else b"")
        assert span.start_time_unix_nano == record["ts"]
        assert span.end_time_unix_nano == record["ts"] + record["dur"]
    # Parentage is per thread: the background thread's span is a root of its own.
    assert sorted(s.name for s in spans if not s.parent_span_id) == ["main_function", "upload"]
    assert {s.name for s in spans} >= {
        "main_function", "model_initialization", "training_loop", "iteration", "data_loading", "model_forward",
        "model_backward", "optimizer_update", "checkpoint_save_sync", "validation_loop", "upload",
    }  # fmt: skip

    def parent_of(span: Any) -> Any:
        return by_id.get(span.parent_span_id)

    def step_of(span: Any) -> Any:
        while span is not None:
            attrs = _attrs(span)
            if "step" in attrs:
                return attrs["step"]
            span = parent_of(span)
        return None

    # Every event in the span the job emitted it in (the job's own notes, not traintrace's).
    where: dict[str, Any] = {}
    for span in spans:
        for event in span.events:
            if event.name != "exception":
                label = _attrs(event).get("label")
                if label is not None:
                    assert label not in where, f"{label} attached twice"
                    where[label] = span
    assert sorted(where) == sorted(e["label"] for e in truth["events"])
    for expected in truth["events"]:
        span = where[expected["label"]]
        assert span.name == expected["span"], expected
        if expected["step"] is not None:
            assert step_of(span) == expected["step"], expected
        assert (
            span.start_time_unix_nano
            <= next(e.time_unix_nano for e in span.events if _attrs(e).get("label") == expected["label"])
            <= span.end_time_unix_nano
        )

    # Every error on its span, which is ERROR; no other span is.
    failed = {}
    for span in spans:
        for event in span.events:
            if event.name == "exception":
                failed[_attrs(event)["exception.message"]] = span
    assert sorted(failed) == sorted(e["message"] for e in truth["errors"])
    for expected in truth["errors"]:
        span = failed[expected["message"]]
        assert span.name == expected["span"] and step_of(span) == expected["step"]
        assert span.status.code == ERROR
        exception = next(e for e in span.events if e.name == "exception")
        assert span.start_time_unix_nano <= exception.time_unix_nano <= span.end_time_unix_nano
    erroneous = {s.span_id for s in spans if s.status.code == ERROR}
    assert erroneous == {s.span_id for s in failed.values()}

    # The logs through the same collector: every error record linked to the same span.
    deadline = time.monotonic() + 30
    errors_in_file = stream.of_kind("error")
    while time.monotonic() < deadline:
        error_logs = [r for _, r in receiver.log_records() if _attrs(r).get("traintrace.kind") == "error"]
        if len(error_logs) >= len(errors_in_file):
            break
        time.sleep(0.1)
    assert len(error_logs) == len(errors_in_file) == len(truth["errors"])
    for log_record in error_logs:
        span = failed[_attrs(log_record)["exception.message"]]
        assert log_record.span_id == span.span_id
