"""Training-thread stalls at a steady 50,000 spans/s on a loaded machine, vs the reference.

A training thread makes one iteration span per 20 µs (50,000 spans/s), each with
a ``loss`` metric, for ``--seconds`` (10 by default), with default settings and
the file backend, while another process spins on the other core. It waits for
each span's due time by spinning in Python (holding the GIL, as a training loop
dispatching work does), so the writer thread has to take the GIL from it, and
every moment the writer keeps it is a moment the training thread stands still.

Each span's latency runs from when it could start (its due time, or the end of
the span before if that was later) to its end: a stall anywhere in the loop
lands in the latency of the span it delays. The modes, each in a child process
of its own (the recording core is chosen at import, the reference library is a
process-wide singleton):

- ``none``: the same loop with an empty context manager: the floor, the
  machine's own stalls (other processes, the hypervisor), which are not
  traintrace's;
- ``native`` / ``pure``: traintrace on the native core and on the pure-Python
  one (``TRAINTRACE_PURE=1``), default settings (statistics on), file backend;
- ``reference``: aidot-training-telemetry with its file backend, the loss as a
  span metric (it cannot keep 50,000 spans/s: it runs late, and its rate says so).

Reported per mode: spans made, the rate reached, drops (``traintrace.stats()``),
latency p50/p99/p99.9/max, and the spans over 1 ms (with the floor's count
beside them: stalls beyond the floor's are the library's).

    bash benchmarks/run.sh bench_stalls.py               # .bench-venv, with the reference
    bash benchmarks/run.sh bench_stalls.py --seconds 3 --modes none,native
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

MODES = ("none", "native", "pure", "reference")
RATE = 50_000
STALL_NS = 1_000_000
WAITS = {"spin": "spinning in Python (GIL held)", "sleep": "sleeping (GIL released)"}


class _Empty:
    __slots__ = ()

    def __enter__(self) -> _Empty:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_metrics(self, **metrics: Any) -> None:
        return None


def fine_sleeps() -> None:
    """Let this thread's short sleeps end on time (Linux: timer slack 1 µs instead of 50 µs)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK: this thread only
    except (OSError, AttributeError):
        pass


def paced(
    seconds: float, rate: int, span: Callable[[int], Any], add_loss: Callable[[Any, float], None], wait: str = "spin"
) -> tuple[array[int], Sched]:
    """Spans at ``rate`` per second for ``seconds``; each span's latency in ns (see the module docstring).

    ``wait``: ``spin`` waits for a span's due time in Python, holding the GIL; ``sleep``
    sleeps (GIL released, as while a step waits for the accelerator).
    """
    sleeping = wait == "sleep"
    if sleeping:
        fine_sleeps()
    sleep = time.sleep
    sched = Sched()
    n = int(seconds * rate)
    period = 1_000_000_000 // rate
    lat = array("q", bytes(8 * n))
    perf = time.perf_counter_ns
    start = perf()
    give_up = start + int(seconds * 1.5e9)  # a library that cannot keep the rate stops here
    prev_end = start
    done = 0
    for i in range(n):
        due = start + i * period
        now = perf()
        if sleeping:
            if now < due:
                sleep((due - now) / 1e9)
        else:
            while now < due:
                now = perf()
        begin = due if due > prev_end else prev_end
        with span(i) as it:
            add_loss(it, 1.0 / (i + 1))
        end = perf()
        lat[i] = end - begin
        prev_end = end
        if not i & 15:
            sched.sample()
        done = i + 1
        if end > give_up:
            break
    elapsed = prev_end - start
    del lat[done:]
    lat.append(elapsed)  # the last entry: the loop's wall time
    return lat, sched


class Sched:
    """The training thread's time, sampled every 16 spans: wall, on a CPU, and waiting for one.

    Linux's ``/proc/<pid>/task/<tid>/schedstat`` gives the thread's time on a CPU and its
    time runnable but not running (another process had the core: the machine's stall).
    What is left of a window's wall time, the thread spent blocked: on the GIL, or in a
    sleep of its own (a wait in ``--wait sleep``, traintrace's hand-over to the writer).
    """

    def __init__(self) -> None:
        self.samples = array("q")
        try:
            self._fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = -1

    def sample(self) -> None:
        if self._fd < 0:
            return
        on_cpu, waiting = os.pread(self._fd, 100, 0).split()[:2]
        self.samples.extend((time.perf_counter_ns(), int(on_cpu), int(waiting)))

    def blocked(self) -> tuple[list[int], list[int]]:
        """Per window: (ns blocked, ns runnable but not running)."""
        s = self.samples
        blocked, preempted = [], []
        for k in range(3, len(s) - 2, 3):
            wall, cpu, wait = s[k] - s[k - 3], s[k + 1] - s[k - 2], s[k + 2] - s[k - 1]
            blocked.append(wall - cpu - wait)
            preempted.append(wait)
        return blocked, preempted


def _child(mode: str, seconds: float, rate: int, folder: str, wait: str) -> dict[str, Any]:
    result: dict[str, Any] = {"mode": mode, "wait": wait}
    if mode == "none":
        empty = _Empty()
        lat, sched = paced(seconds, rate, lambda i: empty, lambda it, value: None, wait)
    elif mode in ("native", "pure"):
        import traintrace as tt

        tt.configure(job_id=f"stalls-{mode}", log_dir=folder, backends={"log": False})
        iteration = tt.training_iteration
        try:
            with tt.training_loop():
                lat, sched = paced(seconds, rate, iteration, lambda it, value: it.add_metrics(loss=value), wait)
            stats = tt.stats()
        finally:
            tt.close()
        result["dropped"] = stats.get("dropped")
        result["core"] = stats.get("core")
    else:
        import logging

        from training_telemetry import FileBackendConfig, Provider, TelemetryConfig
        from training_telemetry.context import timed_span, training
        from training_telemetry.spans import SpanName
        from training_telemetry.verbosity import Verbosity

        config = TelemetryConfig(
            backends=[
                FileBackendConfig(output_file_path=str(Path(folder) / "reference"), verbosity=Verbosity.PROFILING)
            ],
            log_level=logging.ERROR,
        )
        Provider._instance = Provider(config)
        Provider._config = config
        with training():
            lat, sched = paced(
                seconds,
                rate,
                lambda i: timed_span(SpanName.ITERATION),
                lambda span, value: span.add_metric("loss", value),
                wait,
            )
        result["dropped"] = None  # the reference does not count losses
    elapsed = lat.pop()
    ordered = sorted(lat)
    count = len(ordered)

    def pct(q: float) -> int:
        return ordered[min(count - 1, int(q * count))]

    result.update(
        spans=count,
        rate=count / (elapsed / 1e9) if elapsed else 0.0,
        p50=pct(0.5),
        p99=pct(0.99),
        p999=pct(0.999),
        max=ordered[-1],
        over_1ms=sum(1 for v in lat if v > STALL_NS),
        over_5ms=sum(1 for v in lat if v > 5 * STALL_NS),
    )
    blocked, preempted = sched.blocked()
    if blocked:
        result.update(
            blocked_max=max(blocked),
            blocked_over_1ms=sum(1 for v in blocked if v > STALL_NS),
            preempted_over_1ms=sum(1 for v in preempted if v > STALL_NS),
        )
    return result


def _busy(seconds: float) -> subprocess.Popen[bytes]:
    """A process spinning on the other core (the last CPU this process may use)."""
    code = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass\n"
    child = subprocess.Popen([sys.executable, "-c", code])
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) > 1:
        os.sched_setaffinity(child.pid, {cpus[-1]})
    return child


def _run_child(mode: str, seconds: float, rate: int, wait: str) -> dict[str, Any] | None:
    env = {**os.environ, "TRAINTRACE_PURE": "1" if mode == "pure" else "0"}
    with tempfile.TemporaryDirectory(prefix="traintrace-stalls-") as folder:
        command = [sys.executable, __file__, "--child", mode, "--seconds", str(seconds), "--rate", str(rate)]
        command += ["--wait", wait]
        result = subprocess.run([*command, "--folder", folder], capture_output=True, text=True, env=env, check=False)
    if result.returncode != 0:
        if mode == "reference" and "training_telemetry" in result.stderr:
            return None
        raise RuntimeError(f"{mode} run failed:\n{result.stderr[-2000:]}")
    row: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return row


LABELS = {
    "none": "floor: no telemetry (empty with)",
    "native": "traintrace, native core",
    "pure": "traintrace, pure-Python core",
    "reference": "reference (aidot), file backend",
}


def print_rows(rows: list[dict[str, Any]], seconds: float, rate: int, wait: str) -> None:
    print(
        f"{rate:,} iteration spans/s with a loss metric for {seconds:g} s, waiting by {WAITS[wait]}, "
        "a busy process on another core; "
        f"load {os.getloadavg()[0]:.1f}, cpus {os.cpu_count()}"
    )
    head = f"{'mode':<34} {'spans':>8} {'spans/s':>8} {'dropped':>8} {'p50 µs':>7} {'p99 µs':>7}"
    head += f" {'p99.9 µs':>9} {'max ms':>7} {'>1 ms':>6} {'>5 ms':>6}"
    print(f"{head} {'blocked>1ms':>11} {'max':>6} {'preempted>1ms':>13}")
    floor = next((r for r in rows if r["mode"] == "none"), None)
    for row in rows:
        dropped = "" if row.get("dropped") is None else f"{row['dropped']:,}"
        print(
            f"{LABELS[row['mode']]:<34} {row['spans']:>8,} {row['rate']:>8,.0f} {dropped:>8} "
            f"{row['p50'] / 1e3:>7.1f} {row['p99'] / 1e3:>7.1f} {row['p999'] / 1e3:>9.1f} "
            f"{row['max'] / 1e6:>7.2f} {row['over_1ms']:>6} {row['over_5ms']:>6} "
            f"{row.get('blocked_over_1ms', ''):>11} {row.get('blocked_max', 0) / 1e6:>6.2f} "
            f"{row.get('preempted_over_1ms', ''):>13}"
        )
    if floor is not None:
        for row in rows:
            if row["mode"] != "none":
                excess = max(row["over_1ms"] - floor["over_1ms"], 0)
                print(f"{LABELS[row['mode']]}: {excess} spans over 1 ms beyond the floor's {floor['over_1ms']}")
    print(
        "blocked: windows of 16 spans in which the training thread was off a CPU over 1 ms without being "
        "runnable (waiting for the GIL or sleeping), the longest; preempted: runnable over 1 ms, waiting "
        "for a core (the machine's)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rate", type=int, default=RATE, help="spans per second (50,000)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: " + ", ".join(MODES))
    parser.add_argument("--wait", choices=tuple(WAITS), default="spin", help="how the loop waits for a span's time")
    parser.add_argument("--no-busy", action="store_true", help="no busy process on the other core")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.seconds, args.rate, args.folder, args.wait)))
        return
    modes = [m for m in args.modes.split(",") if m]
    busy = None if args.no_busy else _busy(len(modes) * (args.seconds * 1.5 + 10) + 30)
    rows: list[dict[str, Any]] = []
    try:
        for mode in modes:
            row = _run_child(mode, args.seconds, args.rate, args.wait)
            if row is None:
                print(f"{LABELS[mode]}: not installed (pip install aidot-training-telemetry)")
            else:
                rows.append(row)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    print_rows(rows, args.seconds, args.rate, args.wait)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
