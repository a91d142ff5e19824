"""Real OTLP receivers on loopback for the tests: gRPC (official service stubs) and HTTP/protobuf.

Each keeps every request it decoded, so a test can assert on spans, logs and metrics.
"""

from __future__ import annotations

import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Received:
    """What a receiver decoded, by signal."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.traces: list[Any] = []
        self.logs: list[Any] = []
        self.metrics: list[Any] = []

    def spans(self) -> list[tuple[Any, Any]]:
        """(resource, span) for every span received."""
        with self.lock:
            requests = list(self.traces)
        return [
            (rs.resource, span)
            for request in requests
            for rs in request.resource_spans
            for ss in rs.scope_spans
            for span in ss.spans
        ]

    def log_records(self) -> list[tuple[Any, Any]]:
        with self.lock:
            requests = list(self.logs)
        return [
            (rl.resource, record)
            for request in requests
            for rl in request.resource_logs
            for sl in rl.scope_logs
            for record in sl.log_records
        ]

    def metric_points(self) -> dict[str, list[Any]]:
        """Metric name -> every metric message received with that name."""
        with self.lock:
            requests = list(self.metrics)
        out: dict[str, list[Any]] = {}
        for request in requests:
            for rm in request.resource_metrics:
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        out.setdefault(metric.name, []).append(metric)
        return out


class GrpcReceiver(Received):
    """An OTLP/gRPC collector on 127.0.0.1 built from the opentelemetry-proto service stubs.

    With ``credentials`` (``grpc.ssl_server_credentials``) it speaks TLS only.
    """

    def __init__(self, port: int = 0, credentials: Any = None) -> None:
        super().__init__()
        import grpc

        receiver = self
        self.metadata_seen: list[dict[str, str]] = []

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
            def Export(self, request: Any, context: Any) -> Any:
                with receiver.lock:
                    receiver.traces.append(request)
                    receiver.metadata_seen.append(dict(context.invocation_metadata()))
                return trace_service_pb2.ExportTraceServiceResponse()

        class Logs(logs_service_pb2_grpc.LogsServiceServicer):  # type: ignore[misc]
            def Export(self, request: Any, context: Any) -> Any:
                with receiver.lock:
                    receiver.logs.append(request)
                return logs_service_pb2.ExportLogsServiceResponse()

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):  # type: ignore[misc]
            def Export(self, request: Any, context: Any) -> Any:
                with receiver.lock:
                    receiver.metrics.append(request)
                return metrics_service_pb2.ExportMetricsServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), self.server)
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(Logs(), self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), self.server)
        if credentials is None:
            self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        else:
            self.port = self.server.add_secure_port(f"127.0.0.1:{port}", credentials)
        self.scheme = "http" if credentials is None else "https"
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(0).wait(5)


class HttpReceiver(Received):
    """An OTLP/HTTP (protobuf) collector on 127.0.0.1 built on http.server.

    With ``ssl_context`` (a server-side ``ssl.SSLContext``) it serves HTTPS only.
    """

    def __init__(self, ssl_context: Any = None) -> None:
        super().__init__()
        receiver = self
        kinds = {
            "/v1/traces": (
                trace_service_pb2.ExportTraceServiceRequest,
                trace_service_pb2.ExportTraceServiceResponse,
                receiver.traces,
            ),
            "/v1/logs": (
                logs_service_pb2.ExportLogsServiceRequest,
                logs_service_pb2.ExportLogsServiceResponse,
                receiver.logs,
            ),
            "/v1/metrics": (
                metrics_service_pb2.ExportMetricsServiceRequest,
                metrics_service_pb2.ExportMetricsServiceResponse,
                receiver.metrics,
            ),
        }

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(length)
                kind = kinds.get(self.path)
                if kind is None or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_response(404)
                    self.end_headers()
                    return
                if self.headers.get("Content-Encoding") == "gzip":
                    import gzip

                    body = gzip.decompress(body)
                request_type, response_type, store = kind
                request = request_type.FromString(body)
                with receiver.lock:
                    store.append(request)
                    receiver.headers_seen.append(dict(self.headers))
                payload = response_type().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                return None

        self.headers_seen: list[dict[str, str]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.scheme = "http"
        if ssl_context is not None:
            self.server.socket = ssl_context.wrap_socket(self.server.socket, server_side=True)
            self.scheme = "https"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
