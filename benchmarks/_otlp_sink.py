"""A counting OTLP/gRPC trace receiver for the benchmarks, run as its own process.

Prints its port on stdout, then writes the number of spans named "iteration"
received so far to the file named by argv[1] after every request.
"""

from __future__ import annotations

import os
import sys
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def main() -> None:
    count_file = Path(sys.argv[1])
    lock = threading.Lock()
    state = {"spans": 0, "requests": 0, "min_start": 0}

    class Traces(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
        def Export(self, request: Any, context: Any) -> Any:
            spans = 0
            earliest = 0
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    spans += sum(1 for span in ss.spans if span.name == "iteration")
                    if ss.spans and not earliest:
                        earliest = ss.spans[0].start_time_unix_nano
            with lock:
                state["spans"] += spans
                state["requests"] += 1
                if earliest and not state["min_start"]:
                    state["min_start"] = earliest
                tmp = count_file.with_suffix(".tmp")
                tmp.write_text(f"{state['spans']} {state['requests']} {state['min_start']}\n")
                os.replace(tmp, count_file)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    sys.stdin.read()  # run until the parent closes our stdin
    server.stop(0)


if __name__ == "__main__":
    main()
