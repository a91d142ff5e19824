"""Concurrency: threads at full speed, asyncio tasks, forked DataLoader workers, and
configure()/close() racing with recording threads."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import traintrace as tt
from tests._reliability import run_script, schema_errors, write_script
from traintrace.backends import BaseBackend, MemoryBackend
from traintrace.reader import read_file

THREADS = 8
SECONDS = float(os.environ.get("RELIAB_THREAD_SECONDS", "10"))


class CheckingBackend(BaseBackend):
    """Checks the stream as it arrives, keeping only counters (the run is millions of records).

    Sequence numbers must run on without a gap or repeat; a thread's inner spans must have
    that thread's current outer span as parent; its events the inner span.
    """

    def __init__(self) -> None:
        self.next_seq = 1
        self.problems: list[str] = []
        self.outer: dict[int, tuple[int, int]] = {}  # thread -> (outer id, i)
        self.inner: dict[int, int] = {}  # thread -> inner id
        self.counts: dict[tuple[int, str], int] = {}
        self.tid_of: dict[int, int] = {}  # OS tid -> thread number
        self.last_i: dict[int, int] = {}

    def _problem(self, text: str) -> None:
        if len(self.problems) < 20:
            self.problems.append(text)

    def write(self, records: Sequence[Any]) -> None:
        for r in records:
            seq = r["seq"]
            if seq != self.next_seq:
                self._problem(f"seq {seq} where {self.next_seq} was due")
            self.next_seq = seq + 1
            kind = r["kind"]
            if kind in ("span", "start"):
                attrs = r.get("attrs") or {}
                t = attrs.get("t")
                if r["name"] == "outer":
                    self.tid_of[r["tid"]] = t
                    i = attrs["i"]
                    if i != self.last_i.get(t, -1) + 1:
                        self._problem(f"thread {t}: outer {i} after {self.last_i.get(t)}")
                    self.last_i[t] = i
                    self.outer[t] = (r["id"], i)
                elif r["name"] == "inner":
                    t = self.tid_of.get(r["tid"])
                    if t is None or r["parent"] != self.outer[t][0]:
                        self._problem(f"inner {r['id']} has parent {r['parent']}, not its thread's outer")
                    else:
                        self.inner[t] = r["id"]
                else:
                    continue
                self.counts[(t, r["name"])] = self.counts.get((t, r["name"]), 0) + 1
            elif kind == "event" and r["name"] == "tick":  # not the sampler's device_properties
                t = self.tid_of.get(r["tid"])
                if t is None or r["span"] != self.inner.get(t) or r["attrs"]["i"] != self.outer[t][1]:
                    self._problem(
                        f"event {r['seq']} (span {r['span']}, i {r['attrs']['i']}, thread {t}) is not in its "
                        f"thread's inner span {self.inner.get(t)} (outer {self.outer.get(t)})"
                    )
                self.counts[(t, "event")] = self.counts.get((t, "event"), 0) + 1  # type: ignore[index]


@pytest.mark.slow
def test_eight_threads_for_ten_seconds_lose_and_duplicate_nothing() -> None:
    """8 threads recording nested spans and events as fast as they can for 10 s (blocking
    queue): sequence numbers run on without gaps, every span and event arrives once, and
    every record's parent is in its own thread."""
    checker = CheckingBackend()
    rec = tt.configure(job_id="threads", backends={}, extra_backends=[checker], blocking=True, queue_size=8192)
    made = [0] * THREADS
    stop = threading.Event()

    def work(t: int) -> None:
        i = 0
        while not stop.is_set():
            with tt.span("outer", {"t": t, "i": i}):
                with tt.span("inner"):
                    tt.event("tick", {"i": i})
            i += 1
        made[t] = i

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(SECONDS)
    finally:
        stop.set()
    for thread in threads:
        thread.join(60)
    tt.close()
    assert rec.dropped == 0
    assert checker.problems == []
    for t in range(THREADS):
        for name in ("outer", "inner", "event"):
            assert checker.counts.get((t, name), 0) == made[t], (t, name)
    print(f"8 threads, {SECONDS:.0f}s: {sum(made)} iterations, {checker.next_seq - 1} records, nothing lost")


class CountingBackend(BaseBackend):
    def __init__(self) -> None:
        self.events = 0
        self.dropped_notes = 0
        self.seqs_ok = True
        self.next_seq = 1

    def write(self, records: Sequence[Any]) -> None:
        for r in records:
            if r["seq"] != self.next_seq:
                self.seqs_ok = False
            self.next_seq = r["seq"] + 1
            if r["kind"] == "event":
                self.events += 1
            elif r["kind"] == "dropped":
                self.dropped_notes += r["count"]


def test_non_blocking_overflow_is_accounted_exactly() -> None:
    """The default non-blocking queue, made tiny: events written + events dropped = events
    recorded, and `dropped` records say so."""
    counter = CountingBackend()
    rec = tt.configure(job_id="overflow", backends={}, extra_backends=[counter], queue_size=64)
    per_thread = 20000

    def work() -> None:
        for i in range(per_thread):
            tt.event("tick", {"i": i})

    threads = [threading.Thread(target=work) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    dropped = rec.dropped
    tt.close()
    assert counter.seqs_ok
    assert counter.events + dropped == THREADS * per_thread
    assert counter.dropped_notes == dropped


def test_asyncio_tasks_keep_their_own_span_stacks() -> None:
    """Interleaved asyncio tasks: each task's inner spans and events belong to its own outer span."""
    memory = MemoryBackend()
    tt.configure(job_id="tasks", backends={}, extra_backends=[memory])

    async def task(n: int) -> None:
        with tt.span("outer", {"task": n}):
            for i in range(20):
                with tt.span("inner", {"task": n, "i": i}):
                    await asyncio.sleep(0)
                    tt.event("tick", {"task": n})
                await asyncio.sleep(0)

    async def main() -> None:
        await asyncio.gather(*(task(n) for n in range(10)))

    asyncio.run(main())
    tt.close()
    spans = {s["id"]: s for s in memory.spans()}
    outer_of = {s["attrs"]["task"]: s["id"] for s in spans.values() if s["name"] == "outer"}
    inner = [s for s in spans.values() if s["name"] == "inner"]
    assert len(outer_of) == 10 and len(inner) == 200
    for s in inner:
        assert s["parent"] == outer_of[s["attrs"]["task"]]
    for e in memory.events("tick"):
        assert spans[e["span"]]["attrs"]["task"] == e["attrs"]["task"]


LOADER = r"""
import json, os, sys, threading
import torch
from torch.utils.data import DataLoader, Dataset
import traintrace as tt

log_dir = sys.argv[1]
tt.configure(job_id="fork", log_dir=log_dir, fork=sys.argv[2],
             backends={"file": {"path": "rank{rank}.jsonl"}, "log": False}, flush_interval=0.01)

class Numbers(Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, index):
        with tt.span("load_item", {"index": index}):
            tt.event("loaded", {"index": index, "pid": os.getpid()})
        return torch.tensor([float(index)])

stop = threading.Event()
def noise():                      # keep the writer and its locks busy while workers fork
    n = 0
    while not stop.is_set():
        tt.event("noise", {"n": n})
        n += 1
        if n % 200 == 0:
            stop.wait(0.001)
background = threading.Thread(target=noise, daemon=True)
background.start()
seen = []
with tt.training_loop():
    for epoch in range(int(sys.argv[3])):
        loader = DataLoader(Numbers(), batch_size=8, num_workers=2, multiprocessing_context="fork")
        for step, batch in enumerate(loader):
            with tt.training_iteration(step):
                seen.extend(int(x) for x in batch.flatten())
stop.set()
background.join()
tt.close()
print(json.dumps({"pid": os.getpid(), "seen": len(seen)}))
"""


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("fork_mode", ["own_stream", "quiet"])
def test_forked_dataloader_workers_never_deadlock(tmp_path: Path, fork_mode: str) -> None:
    """A real torch DataLoader with 2 forked workers per epoch for 3 epochs while another
    thread records at full speed: no deadlock; with fork='own_stream' each worker writes its
    own stream (parent_pid in its header) holding the items it loaded; with 'quiet', none."""
    pytest.importorskip("torch")
    import json

    script = write_script(tmp_path, "loader.py", LOADER)
    epochs = 3 if fork_mode == "own_stream" else 1
    done = run_script(script, str(tmp_path / "logs"), fork_mode, str(epochs), timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["seen"] == epochs * 64
    logs = tmp_path / "logs"
    assert not list(logs.glob("*.faults.txt"))  # clean exits leave no fault files behind
    main = read_file(logs / "rank0.jsonl")
    assert len(main.streams) == 1 and main.streams[0].closed_cleanly and not main.bad_lines
    workers = sorted(p for p in logs.iterdir() if ".pid" in p.name and p.suffix == ".jsonl")
    if fork_mode == "quiet":
        assert workers == []
        assert not [r for r in main.records() if r.get("name") == "loaded"]
        return
    assert len(workers) == 2 * epochs
    loaded: list[int] = []
    for path in workers:
        result = read_file(path)
        assert len(result.streams) == 1 and not result.bad_lines, path
        stream = result.streams[0]
        assert stream.header["parent_pid"] == summary["pid"]
        assert stream.closed_cleanly, path
        events = [r for r in stream.records if r.get("name") == "loaded"]
        # A worker's spans are its own: none claims a parent from the parent's stream.
        assert {s["parent"] for s in stream.spans("load_item")} == {0}
        assert all(e["attrs"]["pid"] == stream.header["pid"] for e in events)
        loaded.extend(e["attrs"]["index"] for e in events)
        assert not [r for r in stream.records if r.get("name") == "noise"]  # no parent records
        assert not schema_errors([stream.header, *stream.records])
    assert sorted(loaded) == sorted(list(range(64)) * epochs)


@pytest.mark.filterwarnings("ignore::traintrace.TraintraceWarning")
def test_configure_and_close_racing_with_recording_threads(tmp_path: Path) -> None:
    """Four threads record spans, events and errors while the main thread reconfigures and
    closes 25 times: nothing raises, nothing hangs, every file reads back clean."""
    failures: list[BaseException] = []
    stop = threading.Event()

    def work(n: int) -> None:
        try:
            i = 0
            while not stop.is_set():
                with tt.span("outer", {"n": n}):
                    tt.event("tick", {"i": i})
                    span = tt.start("manual")
                    tt.error("soft error", {"i": i})
                    tt.stop(span)
                tt.flush(0.01)
                time.sleep(0.001)
                i += 1
        except BaseException as exc:  # pragma: no cover - the assertion shows it
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    try:
        for round_ in range(25):
            tt.configure(
                job_id="race",
                log_dir=str(tmp_path),
                backends={"file": {"path": f"race{round_}.jsonl"}, "log": False},
                flush_interval=0.005,
            )
            time.sleep(0.01)
            if round_ % 3 == 0:
                tt.close()
    finally:
        stop.set()
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive()
    tt.close()
    assert failures == []
    files = sorted(tmp_path.glob("race*.jsonl"))
    assert len(files) == 25
    for path in files:
        result = read_file(path)
        assert not result.bad_lines and len(result.streams) == 1, path
        stream = result.streams[0]
        assert stream.closed_cleanly and stream.gaps() == [], path
        assert not schema_errors(stream.records[:50])


FORK_DURING_CONFIGURE = """
import os, signal, sys, threading, time, warnings
warnings.simplefilter("ignore")
import traintrace as tt

log_dir = sys.argv[1]
stop = threading.Event()
warm = threading.Event()

def reconfigure():
    while not stop.is_set():
        tt.configure(job_id="busy", log_dir=log_dir, backends={"file": False, "log": False}, statistics=False,
                     handle_sigterm=False, fault_handler=False)
        warm.set()

thread = threading.Thread(target=reconfigure, daemon=True)
thread.start()
# Not before the first configure is done: a fork while that thread imports a module for the
# first time leaves the child waiting on importlib's lock for it (any library's lazy import).
warm.wait(60)
time.sleep(0.05)
hung = 0
for child in range(12):
    pid = os.fork()
    if pid == 0:
        tt.configure(job_id="child", log_dir=log_dir, backends={"file": False, "log": False}, statistics=False,
                     handle_sigterm=False, fault_handler=False)
        tt.close()
        os._exit(0)
    deadline = time.monotonic() + 10
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            hung += 1
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.01)
stop.set()
print("hung", hung, flush=True)
os._exit(0)
"""


@pytest.mark.subprocess
def test_fork_while_another_thread_configures_never_deadlocks_the_child(tmp_path: Path) -> None:
    """A thread keeps calling configure() while the main thread forks 12 children that each
    configure their own recorder: none deadlocks on the lock the other thread held at the fork
    (issue 17, item 10: 30 of 30 did)."""
    script = write_script(tmp_path, "forkconf.py", FORK_DURING_CONFIGURE)
    result = run_script(script, str(tmp_path / "logs"), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["hung", "0"]
