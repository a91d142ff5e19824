"""Core benchmark: traintrace vs the reference library vs the floor, in one process.

Run it with ``bash benchmarks/run.sh`` (creates ``.bench-venv`` with
``aidot-training-telemetry`` from PyPI, orjson and this checkout), or directly
with a Python that has both installed::

    python benchmarks/bench_core.py [--quick] [--json out.json]

Machines here are shared and noisy: read the ratios, not the nanoseconds.
Each figure is the best of several repeats.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import traintrace as tt

Row = dict[str, Any]


class _Empty:
    __slots__ = ()

    def __enter__(self) -> _Empty:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def best_ns_per_op(loop: Callable[[int], None], n: int, repeats: int) -> float:
    """Best-of-``repeats`` nanoseconds per operation of ``loop(n)``."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter_ns()
        loop(n)
        best = min(best, (time.perf_counter_ns() - started) / n)
    return best


def floor_loop(n: int) -> None:
    empty = _Empty()
    for _ in range(n):
        with empty:
            pass


def traintrace_loop(n: int) -> None:
    iteration = tt.training_iteration
    for step in range(n):
        with iteration(step):
            pass


def caller_only(n: int, repeats: int, chunk: int = 10_000) -> float:
    """The caller's own cost: the writer is idle while a chunk is timed, then drains.

    Chunks of 10,000 spans mimic a writer that drains twice a second at 20,000
    steps/s; timing one huge loop would measure the garbage collector walking a
    queue that a running writer never lets grow.
    """
    best = float("inf")
    for _ in range(repeats):
        total = 0
        done = 0
        while done < n:
            tt.flush(60)
            started = time.perf_counter_ns()
            traintrace_loop(chunk)
            total += time.perf_counter_ns() - started
            done += chunk
        best = min(best, total / done)
    tt.flush(60)
    return best


def rss_kb() -> int:
    with Path("/proc/self/status").open() as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


class NullSink(tt.BaseBackend):
    """A backend that takes records and does nothing."""


class SlowSink(tt.BaseBackend):
    """A backend whose every write takes 50 ms."""

    def write(self, records: Sequence[Any]) -> None:
        time.sleep(0.05)


# ---------------------------------------------------------------- reference library


def reference_setup(kind: str, folder: Path) -> Callable[[int], None] | None:
    """A loop of reference iteration spans inside its training span, or None if not installed."""
    try:
        from training_telemetry import FileBackendConfig, Provider, TelemetryConfig
        from training_telemetry.context import timed_span, training
        from training_telemetry.spans import SpanName
        from training_telemetry.verbosity import Verbosity
    except ImportError:
        return None
    import logging

    backends: list[Any] = []
    if kind == "file":
        backends = [FileBackendConfig(output_file_path=str(folder / "reference"), verbosity=Verbosity.PROFILING)]
    config = TelemetryConfig(backends=backends, log_level=logging.ERROR)
    # The reference is a process-wide singleton that refuses a second config;
    # the benchmark swaps its instance to measure two configurations in one run.
    Provider._instance = Provider(config)
    Provider._config = config

    def loop(n: int) -> None:
        with training():
            for _ in range(n):
                with timed_span(SpanName.ITERATION):
                    pass

    return loop


# ---------------------------------------------------------------- the run


def run(quick: bool) -> list[Row]:
    n = 20_000 if quick else 100_000
    repeats = 3 if quick else 5
    rows: list[Row] = []
    folder = Path(tempfile.mkdtemp(prefix="traintrace-bench-"))

    floor = best_ns_per_op(floor_loop, n, repeats)
    rows.append({"case": "floor: empty class-based with", "ns": floor})

    rows.append({"case": "traintrace, not configured", "ns": best_ns_per_op(traintrace_loop, n, repeats)})

    tt.configure(
        job_id="bench",
        rank=1,
        world_size=2,
        log_dir=str(folder),
        backends={"file": {"ranks": 0}, "log": False},
    )
    rows.append(
        {"case": "traintrace, backend disabled on this rank", "ns": best_ns_per_op(traintrace_loop, n, repeats)}
    )
    tt.close()

    # The caller's own cost: a queue big enough for one timed loop, writer idle meanwhile.
    tt.configure(
        job_id="bench",
        log_dir=str(folder),
        backends={"log": False},
        queue_size=4 * n,
        flush_interval=3600,
    )
    with tt.training_loop():
        ours = caller_only(n, repeats)
    tt.close()
    rows.append({"case": "traintrace iteration span, file backend (caller's thread)", "ns": ours})

    # The same with the writer running concurrently in the same process (GIL shared).
    tt.configure(job_id="bench", log_dir=str(folder), backends={"log": False}, queue_size=4 * n)
    with tt.training_loop():
        concurrent = best_ns_per_op(traintrace_loop, n, repeats)
    recorder = tt.get_recorder()
    dropped = recorder.dropped if recorder else 0
    tt.close()
    rows.append(
        {
            "case": "traintrace iteration span, file backend, writer running in a tight loop",
            "ns": concurrent,
            "dropped": dropped,
        }
    )

    ref_file = reference_setup("file", folder)
    if ref_file is not None:
        ref_n = max(n // 10, 2000)
        rows.append({"case": "reference iteration span, file backend", "ns": best_ns_per_op(ref_file, ref_n, repeats)})
        ref_none = reference_setup("none", folder)
        assert ref_none is not None
        rows.append({"case": "reference iteration span, no backend", "ns": best_ns_per_op(ref_none, ref_n, repeats)})
    else:
        rows.append({"case": "reference library not installed (pip install aidot-training-telemetry)", "ns": None})

    # Sustained throughput: spans written to disk, the writer's work and the final close included.
    total = 300_000 if quick else 1_000_000
    rows.extend(sustained(folder, total))

    # A slow sink: the caller's cost must not follow the sink's latency.
    tt.configure(job_id="fast", log_dir=str(folder), backends=[], extra_backends=[NullSink()], queue_size=4 * n)
    with tt.training_loop():
        fast_ns = best_ns_per_op(traintrace_loop, n, repeats)
    tt.close()
    tt.configure(job_id="slow", log_dir=str(folder), backends=[], extra_backends=[SlowSink()], queue_size=4 * n)
    with tt.training_loop():
        slow_ns = best_ns_per_op(traintrace_loop, n, repeats)
    slow_rec = tt.get_recorder()
    slow_dropped = slow_rec.dropped if slow_rec else 0
    tt.close(timeout=2)
    rows.append({"case": "sink doing nothing, caller", "ns": fast_ns})
    rows.append({"case": "sink taking 50 ms per write, caller", "ns": slow_ns, "dropped": slow_dropped})

    # Memory over one million iteration spans.
    spans = 200_000 if quick else 1_000_000
    tt.configure(job_id="memory", log_dir=str(folder), backends={"log": False}, blocking=True)
    with tt.training_loop():
        traintrace_loop(20_000)
        tt.flush(60)
        gc.collect()
        before = rss_kb()
        traintrace_loop(spans)
        tt.flush(60)
        gc.collect()
        after = rss_kb()
    tt.close()
    rows.append({"case": f"RSS growth over {spans:,} iteration spans", "kb": after - before})
    shutil.rmtree(folder, ignore_errors=True)
    return rows


def writer_cpu_s() -> float | None:
    """CPU seconds the active recorder's writer thread has used (Linux), or None."""
    recorder = tt.get_recorder()
    thread = getattr(getattr(recorder, "_pipeline", None), "_thread", None)
    if thread is None or thread.ident is None or not hasattr(time, "pthread_getcpuclockid"):
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except OSError:  # the thread has ended
        return None


def process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def core_name() -> str:
    """Which writer encoder runs: ``native`` (traintrace._encode) or ``pure``."""
    from traintrace import _pipeline

    return "native" if getattr(_pipeline, "_native", None) is not None else "pure"


def sustained(folder: Path, total: int, repeats: int = 3) -> list[Row]:
    """Iteration spans to disk as fast as the loop makes them, statistics off and on (default settings).

    Blocking mode: nothing is dropped, so spans/s is what the writer keeps up with.
    Also the CPU per span of the whole process (training thread, writer, close) and
    of the writer thread alone (measured up to the last flush, before close).
    Off and on alternate ``repeats`` times; each row is the repeat with the best throughput
    (a shared machine only ever slows a run down).
    """
    best: dict[bool, Row] = {}
    floor: Row | None = None
    core = core_name()
    for repeat in range(repeats):
        for statistics in (False, True):
            job = f"throughput-{statistics}-{core}-{repeat}"
            tt.configure(job_id=job, log_dir=str(folder), backends={"log": False}, blocking=True, statistics=statistics)
            writer0 = writer_cpu_s()
            cpu0 = process_cpu_s()
            started = time.perf_counter_ns()
            with tt.training_loop():
                traintrace_loop(total)
            tt.flush(120)
            writer1 = writer_cpu_s()
            recorder = tt.get_recorder()
            tt.close()
            elapsed = (time.perf_counter_ns() - started) / 1e9
            cpu = process_cpu_s() - cpu0
            size = (folder / job / "rank0.jsonl").stat().st_size
            shutil.rmtree(folder / job)  # a million spans are 150 MB: on /dev/shm, memory
            row = {
                "case": f"sustained: iteration spans to disk, blocking, incl. writer and close, statistics "
                f"{'on' if statistics else 'off'} ({core} core)",
                "spans_per_s": total / elapsed,
                "cpu_us_per_span": cpu / total * 1e6,
                "writer_us_per_span": None if writer0 is None or writer1 is None else (writer1 - writer0) / total * 1e6,
                "dropped": recorder.dropped if recorder else None,
                "bytes": size,
                "core": core,
                "statistics": statistics,
                "repeats": repeats,
            }
            if statistics not in best or row["spans_per_s"] > best[statistics]["spans_per_s"]:
                best[statistics] = row
        written = write_floor(folder, size, total)
        if floor is None or written["spans_per_s"] > floor["spans_per_s"]:
            floor = written
    assert floor is not None
    return [best[False], best[True], floor]


def write_floor(folder: Path, size: int, spans: int) -> Row:
    """The physical floor under the sustained rows: as many bytes appended to a new file, 1 MiB a write.

    What the kernel costs to take the lines (page cache, file system) whatever writes them: on a
    virtual machine, memory the guest touches for the first time costs far more than it does later.
    """
    chunk = memoryview(b"x" * (1 << 20))
    path = folder / "floor.bin"
    cpu0 = process_cpu_s()
    started = time.perf_counter_ns()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
    try:
        left = size
        while left > 0:
            left -= os.write(fd, chunk[: min(left, len(chunk))])
    finally:
        os.close(fd)
    elapsed = (time.perf_counter_ns() - started) / 1e9
    cpu = process_cpu_s() - cpu0
    path.unlink()
    return {
        "case": "floor: the same bytes appended to a new file, 1 MiB a write",
        "spans_per_s": spans / elapsed,
        "cpu_us_per_span": cpu / spans * 1e6,
        "writer_us_per_span": None,
        "dropped": None,
        "bytes": size,
        "core": "floor",
    }


def sustained_pure(total: int) -> list[Row]:
    """The sustained rows again in a child process with ``TRAINTRACE_PURE=1`` (the pure-Python core)."""
    import subprocess

    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "rows.json"
        env = {**os.environ, "TRAINTRACE_PURE": "1"}
        command = [sys.executable, __file__, "--sustained-only", str(total), "--json", str(out)]
        command += ["--dir", tempfile.gettempdir()]
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
        rows: list[Row] = json.loads(out.read_text())
    return [row for row in rows if row.get("core") != "floor"]


def print_sustained(rows: list[Row]) -> None:
    """Throughput, CPU per span and what statistics cost, per core."""
    print(f"\n{'sustained, default settings':44} {'spans/s':>10} {'CPU us/span':>12} {'writer us/span':>15}  dropped")
    for row in rows:
        if "spans_per_s" not in row:
            continue
        writer = row.get("writer_us_per_span")
        label = f"{row.get('core', '?')} core, statistics {'on' if row.get('statistics') else 'off'}"
        if row.get("core") == "floor":
            label = "floor: os.write of the same bytes (I/O)"
        print(
            f"{label:44} {row['spans_per_s']:10,.0f} {row.get('cpu_us_per_span', float('nan')):12.2f} "
            f"{'' if writer is None else f'{writer:.2f}':>15}  {row.get('dropped')}"
        )
    by_core: dict[str, dict[bool, float]] = {}
    for row in rows:
        if "spans_per_s" in row and row.get("core") != "floor":
            by_core.setdefault(row.get("core", "?"), {})[bool(row.get("statistics"))] = row["spans_per_s"]
    for core, pair in by_core.items():
        if True in pair and False in pair:
            print(f"statistics cost ({core} core): {1 - pair[True] / pair[False]:.0%} of throughput")


def print_table(rows: list[Row]) -> None:
    by_case = {row["case"]: row for row in rows}
    floor = by_case["floor: empty class-based with"]["ns"]
    ours = by_case["traintrace iteration span, file backend (caller's thread)"]["ns"]
    ref = by_case.get("reference iteration span, file backend", {}).get("ns")
    print(f"{'case':78} {'ns/op':>9} {'x floor':>8}  notes")
    for row in rows:
        ns = row.get("ns")
        notes = []
        if "dropped" in row:
            notes.append(f"dropped={row['dropped']}")
        if "spans_per_s" in row:
            notes.append(f"{row['spans_per_s']:,.0f} spans/s, {row['bytes'] / 1e6:.0f} MB")
        if "kb" in row:
            notes.append(f"{row['kb'] / 1024:.1f} MB")
        if ns is None:
            print(f"{row['case']:78} {'':>9} {'':>8}  {' '.join(notes)}")
        else:
            print(f"{row['case']:78} {ns:9.0f} {ns / floor:8.1f}  {' '.join(notes)}")
    if ref:
        print(f"\nreference / traintrace, iteration span with file backend: {ref / ours:.0f}x")
    fast = by_case["sink doing nothing, caller"]["ns"]
    slow = by_case["sink taking 50 ms per write, caller"]["ns"]
    print(f"slow sink / fast sink, caller's cost: {slow / fast:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller counts, for a smoke run")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument(
        "--no-pure", action="store_true", help="skip the sustained rows with the pure-Python core (TRAINTRACE_PURE=1)"
    )
    parser.add_argument(
        "--dir",
        help="where the benchmark writes its files (default: the system's temporary folder); "
        "/dev/shm takes the disk out of the sustained rows",
    )
    parser.add_argument("--sustained-only", type=int, metavar="SPANS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dir:
        tempfile.tempdir = args.dir
    if args.sustained_only:
        rows = sustained(Path(tempfile.mkdtemp(prefix="traintrace-bench-")), args.sustained_only)
        print_sustained(rows)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        return
    from traintrace._recorder import CORE

    print(
        f"python {sys.version.split()[0]}, traintrace {tt.__version__} ({CORE} core; TRAINTRACE_PURE=1 for the other),"
        f" pid {os.getpid()}, cpus {os.cpu_count()}"
    )
    print(f"writer encoder: {core_name()}; load average {os.getloadavg()[0]:.1f} (a loaded machine slows every row)")
    rows = run(args.quick)
    if not args.no_pure and core_name() == "native":
        rows.extend(sustained_pure(300_000 if args.quick else 1_000_000))
    print_table(rows)
    print_sustained(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
