"""Lifecycle event cost on the caller's thread: traintrace.events.record vs torch's.

    .venv/bin/python benchmarks/bench_events.py

Both record the same worker-exit event in the same process. torch's
``record(event, "null")`` serialises the event to JSON before the null
handler drops it; traintrace's appends a tuple for its writer thread (here
writing a real file) and for the subscriber thread. Each figure is the
median over rounds of 2,000 calls, with the writer drained between rounds
so that the queue never fills; the machine is noisy, so compare the ratio.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable

import traintrace as tt
from traintrace import events
from traintrace.publisher import get_default_event_publisher

DATA = {"epoch": 10, "loss": 0.01}
CALLS = 2000
ROUNDS = 30


def measure(call: Callable[[], None], drain: Callable[[], object] = lambda: None) -> tuple[float, float]:
    samples = []
    for _ in range(ROUNDS):
        start = time.perf_counter_ns()
        for _ in range(CALLS):
            call()
        samples.append((time.perf_counter_ns() - start) / CALLS)
        drain()
    return min(samples), statistics.median(samples)


def writer_cpu_per_event(call: Callable[[], None], drain: Callable[[], object]) -> float | None:
    """Microseconds of the writer thread's CPU per event (Linux), over ROUNDS x CALLS events."""
    recorder = tt.get_recorder()
    thread = getattr(getattr(recorder, "_pipeline", None), "_thread", None)
    if thread is None or thread.ident is None or not hasattr(time, "pthread_getcpuclockid"):
        return None
    clock = time.pthread_getcpuclockid(thread.ident)
    drain()
    before = time.clock_gettime(clock)
    for _ in range(ROUNDS):
        for _ in range(CALLS):
            call()
        drain()
    return (time.clock_gettime(clock) - before) / (ROUNDS * CALLS) * 1e6


def main() -> None:
    from torch.distributed.elastic import events as torch_events

    def torch_record() -> None:
        event = torch_events.Event(
            "torchelastic.worker.status.SUCCEEDED",
            torch_events.EventSource.WORKER,
            metadata={"worker_id": 0, "exit_code": 0, "epoch": 10, "loss": 0.01},
        )
        torch_events.record(event, "null")

    def ours() -> None:
        events.record(events.EventType.WORKER_EXIT, worker_id=0, exit_code=0, data=DATA)

    def drain() -> None:
        get_default_event_publisher().flush()
        tt.flush()

    results: dict[str, tuple[float, float]] = {}
    results["torch.distributed.elastic.events.record (null destination)"] = measure(torch_record)
    results["traintrace events.record, not configured"] = measure(ours)
    with tempfile.TemporaryDirectory() as folder:
        tt.configure(log_dir=folder, job_id="bench")  # default backends: the file and the log
        results["traintrace events.record, file backend"] = measure(ours, drain)
        writer_us = writer_cpu_per_event(ours, drain)
        publisher = get_default_event_publisher()
        subscription = publisher.subscribe(events.EventType.WORKER_EXIT, on_event=lambda e: None)
        results["traintrace events.record, file backend + 1 subscriber"] = measure(ours, drain)
        publisher.unsubscribe(subscription)
        tt.close()
    width = max(len(name) for name in results)
    print(f"{'operation':<{width}}  {'min ns':>8}  {'median ns':>9}")
    for name, (low, median) in results.items():
        print(f"{name:<{width}}  {low:8.0f}  {median:9.0f}")
    if writer_us is not None:
        caller_us = results["traintrace events.record, file backend"][1] / 1000
        print(
            f"writer thread CPU per event (default backends: file + log): {writer_us:.2f} us; "
            f"with the caller's median: {caller_us + writer_us:.2f} us"
        )
    torch_median = results["torch.distributed.elastic.events.record (null destination)"][1]
    ours_median = results["traintrace events.record, file backend"][1]
    print(f"torch / traintrace (file backend), medians: {torch_median / ours_median:.1f}x")


if __name__ == "__main__":
    main()
