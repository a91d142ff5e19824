"""OTLP traces and NVTX: traintrace against the reference library and a plain OpenTelemetry span.

All cases run in one invocation, each in its own process, exporting over gRPC to
a counting receiver on loopback (benchmarks/_otlp_sink.py, its own process):

  traintrace   ``with tt.training_iteration(i)`` with the otlp_traces backend
  sdk          ``with tracer.start_as_current_span("iteration")``, TracerProvider +
               BatchSpanProcessor + the OTLP gRPC exporter (the SDK's defaults)
  reference    ``with timed_span(SpanName.ITERATION, verbosity=TRACING)`` from
               aidot-training-telemetry with its OTLP traces backend (gRPC), run
               with the interpreter of a separate venv (--reference-python)

For each: the caller's time per span (median of chunks, flushing between
chunks, untimed), then a paced run (``--rate`` spans/s for ``--seconds``),
reporting spans sent, spans the receiver got, and drops. Then NVTX with no
profiler attached: the listener's cost per span and whole-span costs.

    python benchmarks/bench_otlp.py --reference-python .bench-venv/bin/python

(``python -m venv .bench-venv && .bench-venv/bin/pip install aidot-training-telemetry``.)
Numbers are noisy on shared machines: compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


# ---------------------------------------------------------------- measuring


def chunked(make: Callable[[int], Any], total: int, chunk: int, settle: Callable[[], None]) -> float:
    """Median caller ns per span over chunks of ``chunk`` spans, ``settle()`` untimed between."""
    per: list[float] = []
    step = 0
    for _ in range(max(1, total // chunk)):
        t0 = time.perf_counter_ns()
        for _ in range(chunk):
            with make(step):
                pass
            step += 1
        per.append((time.perf_counter_ns() - t0) / chunk)
        settle()
    return statistics.median(per)


def paced(make: Callable[[int], Any], rate: int, seconds: float) -> dict[str, float]:
    """Open and close ``rate`` spans per second for ``seconds`` (10 ms ticks; stops at the time)."""
    tick = 0.01
    per_tick = max(1, int(rate * tick))
    start = time.perf_counter()
    busy = 0
    sent = 0
    k = 0
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter_ns()
        for _ in range(per_tick):
            with make(sent):
                pass
            sent += 1
        busy += time.perf_counter_ns() - t0
        k += 1
        delay = start + k * tick - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
    elapsed = time.perf_counter() - start
    return {"sent": sent, "achieved_rate": sent / elapsed, "busy_ns_per_span": busy / sent}


def received(count_file: Path, expect: int, wait: float = 30.0) -> int:
    """Spans the sink has counted, once the count stops moving (or reaches ``expect``)."""
    deadline = time.monotonic() + wait
    last, stable_since = -1, time.monotonic()
    while time.monotonic() < deadline:
        try:
            now = int(count_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            now = 0
        if now >= expect:
            return now
        if now != last:
            last, stable_since = now, time.monotonic()
        elif time.monotonic() - stable_since > 3.0:
            return now
        time.sleep(0.1)
    return max(last, 0)


# ---------------------------------------------------------------- cases (child processes)


def case_traintrace(args: argparse.Namespace) -> dict[str, Any]:
    import traintrace as tt

    def configure() -> Any:
        return tt.configure(
            job_id="bench",
            backends={
                "file": False,
                "log": False,
                "otlp_traces": {"endpoint": f"http://127.0.0.1:{args.port}", "protocol": "grpc"},
            },
        )

    rec = configure()
    chunk_ns = chunked(tt.training_iteration, args.spans, 10_000, lambda: tt.flush(10))
    tt.close()
    before = _count(args.count_file)
    rec = configure()
    backend = rec.backend("otlp_traces")
    run = paced(tt.training_iteration, args.rate, args.seconds)
    tt.close(30)
    stats = backend.stats()
    got = received(args.count_file, before + run["sent"]) - before
    return {
        "caller_ns": chunk_ns,
        **run,
        "received": got,
        "dropped_queue": rec.dropped,
        "dropped_exporter": stats["dropped"] + stats["failed"] + stats["abandoned"],
    }


def case_sdk(args: argparse.Namespace) -> dict[str, Any]:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    def setup() -> tuple[Any, Any]:
        provider = TracerProvider()
        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=f"http://127.0.0.1:{args.port}", insecure=True))
        )
        return provider, provider.get_tracer("bench")

    provider, tracer = setup()

    def make(_: int) -> Any:
        return tracer.start_as_current_span("iteration")

    chunk_ns = chunked(make, args.spans, 10_000, provider.force_flush)
    provider.shutdown()
    before = _count(args.count_file)
    provider, tracer = setup()
    run = paced(make, args.rate, args.seconds)
    provider.force_flush()
    provider.shutdown()
    got = received(args.count_file, before + run["sent"]) - before
    return {"caller_ns": chunk_ns, **run, "received": got, "dropped": run["sent"] - got}


def case_reference(args: argparse.Namespace) -> dict[str, Any]:
    import logging

    from training_telemetry import OTLPTracesBackendConfig, Provider, SpanName, TelemetryConfig, Verbosity
    from training_telemetry.context import timed_span

    config = TelemetryConfig(
        backends=[OTLPTracesBackendConfig(exporter="grpc", endpoint=f"http://127.0.0.1:{args.port}")],
        log_level=logging.CRITICAL,
    )
    Provider.set_provider(config)

    def make(_: int) -> Any:
        return timed_span(SpanName.ITERATION, verbosity=Verbosity.TRACING)

    chunk_ns = chunked(make, max(2_000, args.spans // 20), 1_000, lambda: time.sleep(0.3))
    time.sleep(6)  # its batch processor exports every 5 s
    before = _count(args.count_file)
    run = paced(make, args.rate, args.seconds)
    time.sleep(6)
    got = received(args.count_file, before + run["sent"]) - before
    return {"caller_ns": chunk_ns, **run, "received": got, "dropped": run["sent"] - got}


def case_nvtx(args: argparse.Namespace) -> dict[str, Any]:
    import nvtx

    import traintrace as tt
    from traintrace.backends import BaseBackend, NvtxBackend

    out: dict[str, Any] = {}
    domain = nvtx.get_domain("bench")
    attrs = domain.get_event_attributes(message="iteration", color=0x76B900)
    n = 200_000
    t0 = time.perf_counter_ns()
    for _ in range(n):
        domain.push_range(attrs)
        domain.pop_range()
    out["raw_push_pop_ns"] = (time.perf_counter_ns() - t0) / n

    listener = NvtxBackend()
    out["profiler_attached"] = listener.enabled
    span = tt.Span("iteration", {"step": 1}, 3)
    span.tid = 0
    started, stopped = listener.span_started, listener.span_stopped
    t0 = time.perf_counter_ns()
    for _ in range(n):
        started(span)
        stopped(span)
    out["listener_ns_per_span"] = (time.perf_counter_ns() - t0) / n

    class Null(BaseBackend):
        pass

    for label, backends, extra in (
        ("span_without_nvtx_ns", {"file": False, "log": False}, [Null()]),
        ("span_with_nvtx_ns", {"file": False, "log": False, "nvtx": {}}, [Null()]),
    ):
        tt.configure(job_id="bench", backends=backends, extra_backends=extra)
        out[label] = chunked(tt.training_iteration, args.spans, 10_000, lambda: tt.flush(10))
        tt.close()
    out["nvtx_added_ns"] = out["span_with_nvtx_ns"] - out["span_without_nvtx_ns"]
    return out


def case_reference_nvtx(args: argparse.Namespace) -> dict[str, Any]:
    import logging

    from training_telemetry import NVTXBackendConfig, Provider, SpanName, TelemetryConfig, Verbosity
    from training_telemetry.context import timed_span

    Provider.set_provider(TelemetryConfig(backends=[NVTXBackendConfig()], log_level=logging.CRITICAL))

    def make(_: int) -> Any:
        return timed_span(SpanName.ITERATION, verbosity=Verbosity.TRACING)

    return {"span_ns": chunked(make, max(5_000, args.spans // 10), 1_000, lambda: None)}


def _count(count_file: Path) -> int:
    try:
        return int(count_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


CASES = {
    "traintrace": case_traintrace,
    "sdk": case_sdk,
    "reference": case_reference,
    "nvtx": case_nvtx,
    "reference_nvtx": case_reference_nvtx,
}


# ---------------------------------------------------------------- orchestration


def run_case(name: str, python: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    count_file = tmp / f"{name}.count"
    sink = subprocess.Popen(
        [sys.executable, str(HERE / "_otlp_sink.py"), str(count_file)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sink.stdout is not None
        port = sink.stdout.readline().strip()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRAINTRACE_"))}
        env["PYTHONPATH"] = str(ROOT / "src")
        command = [python, __file__, "--case", name, "--port", port, "--count-file", str(count_file)]
        command += ["--spans", str(args.spans), "--rate", str(args.rate), "--seconds", str(args.seconds)]
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, check=False)
        if done.returncode != 0:
            return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"}
        return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]
    finally:
        if sink.stdin:
            sink.stdin.close()
        sink.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=sorted(CASES))
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--count-file", type=Path)
    parser.add_argument("--spans", type=int, default=100_000, help="spans for the per-span cost")
    parser.add_argument("--rate", type=int, default=50_000, help="spans per second in the paced run")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the paced run")
    parser.add_argument("--reference-python", default=str(ROOT / ".bench-venv" / "bin" / "python"))
    parser.add_argument("--json", action="store_true", help="print the results as JSON only")
    parser.add_argument("--only", default="", help="comma-separated cases to run (default: all)")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(CASES[args.case](args)))
        return

    import tempfile

    have_reference = Path(args.reference_python).exists()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        chosen = [c for c in args.only.split(",") if c] or [
            "traintrace",
            "sdk",
            "reference",
            "nvtx",
            "reference_nvtx",
        ]
        for name in ("traintrace", "sdk", "reference", "nvtx", "reference_nvtx"):
            if name not in chosen:
                results[name] = {"error": "not run"}
                continue
            if name.startswith("reference") and not have_reference:
                results[name] = {"error": f"no {args.reference_python}"}
                continue
            python = args.reference_python if name.startswith("reference") else sys.executable
            results[name] = run_case(name, python, args, Path(tmp))
            if not args.json:
                print(f"{name}: {json.dumps(results[name])}", file=sys.stderr)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    report(results, args)


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    tt, sdk, ref = results["traintrace"], results["sdk"], results["reference"]
    print(f"\nOTLP traces over gRPC to a loopback receiver; paced run {args.rate}/s for {args.seconds:g} s")
    print(f"{'':28}{'caller ns/span':>16}{'sent':>10}{'received':>10}{'achieved/s':>12}")
    for label, row in (
        ("traintrace otlp_traces", tt),
        ("OpenTelemetry SDK span", sdk),
        ("reference OTLP", ref),
    ):
        if "error" in row:
            print(f"{label:28}{row['error']}")
            continue
        print(
            f"{label:28}{row['caller_ns']:>16,.0f}{row['sent']:>10,}{row['received']:>10,}"
            f"{row['achieved_rate']:>12,.0f}"
        )
    if "error" not in tt:
        lost_spans = tt["dropped_queue"] // 2 + tt["dropped_exporter"]  # queue items: a start and a stop per span
        print(
            f"traintrace in the paced run: {tt['received'] / tt['sent']:.1%} delivered; "
            f"lost {lost_spans:,} spans, "
            f"all counted ({tt['dropped_queue']:,} queue items, {tt['dropped_exporter']:,} at the exporter); "
            f"caller busy {tt['busy_ns_per_span']:,.0f} ns/span while paced"
        )
        for label, row in (("SDK", sdk), ("reference", ref)):
            if "error" not in row:
                print(f"  {label} / traintrace caller cost: {row['caller_ns'] / tt['caller_ns']:.1f}x")
    nv, ref_nv = results["nvtx"], results["reference_nvtx"]
    if "error" not in nv:
        print("\nNVTX, no profiler attached")
        print(f"  raw domain push+pop, cached attributes: {nv['raw_push_pop_ns']:,.0f} ns")
        print(f"  traintrace listener start+stop per span: {nv['listener_ns_per_span']:,.0f} ns")
        print(
            f"  traintrace span with NVTX: {nv['span_with_nvtx_ns']:,.0f} ns, "
            f"without: {nv['span_without_nvtx_ns']:,.0f} ns (added {nv['nvtx_added_ns']:,.0f} ns)"
        )
        if "error" not in ref_nv:
            ratio = ref_nv["span_ns"] / nv["span_with_nvtx_ns"]
            print(f"  reference span with its NVTX backend: {ref_nv['span_ns']:,.0f} ns", end="")
            print(f" ({ratio:.1f}x traintrace)")


if __name__ == "__main__":
    main()
