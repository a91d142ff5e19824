"""Soak: a long run at a realistic rate, checking memory, drops and accounting.

    python benchmarks/soak.py --minutes 10 --out soak_out

A step every 10 ms (data loading, forward, backward and optimizer spans
inside an ``iteration`` span, an event every 10 steps, a checkpoint span every
1000 steps), with the file backend and the log backend (to a log file), the
step statistics, the device sampler and the hang watchdog on.
RSS is sampled every 5 s. At the end the stream is read back and the summary
(one JSON object on stdout, also written to ``<out>/summary.json``) says
whether every step is in the file exactly once, how many records were dropped,
whether the sequence numbers have gaps, and how RSS moved after warm-up.

Exit status 0 when every check passes, 1 otherwise. Kept out of the default
test run: ``pytest -m soak tests/test_reliability_soak.py`` runs it (set
``SOAK_MINUTES`` for a shorter run).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import traintrace as tt
from traintrace.reader import read_file

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Resident set size of this process, from /proc (0 where there is none)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * PAGE
    except OSError:
        return 0


def run(minutes: float, out: Path, period: float) -> dict[str, object]:
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "soak.log"
    handler = logging.FileHandler(log_path)
    records_logger = logging.getLogger("traintrace.soak.records")
    records_logger.addHandler(handler)
    records_logger.setLevel(logging.INFO)
    records_logger.propagate = False
    tt.configure(
        job_id="soak",
        log_dir=str(out),
        backends={
            "file": {"path": "{job}/rank{rank}.jsonl"},
            "log": {"logger": "traintrace.soak.records", "ranks": "all", "verbosity": "info"},
        },
        # The step-time statistics, the device sampler and the hang watchdog, all on.
        statistics=True,
        device_sample_interval=5.0,
        hang_timeout=60.0,
    )
    rec = tt.get_recorder()
    assert rec is not None
    deadline = time.monotonic() + minutes * 60.0
    warmup_until = time.monotonic() + min(60.0, minutes * 60.0 * 0.1)
    samples: list[tuple[float, int]] = []
    next_sample = time.monotonic()
    started = time.monotonic()
    next_tick = started
    step = 0
    late = 0
    with tt.application(), tt.training_loop():
        while time.monotonic() < deadline:
            with tt.training_iteration(step) as it:
                with tt.data_loading():
                    pass
                with tt.forward():
                    total = sum(range(200))
                with tt.backward():
                    total += sum(range(200))
                with tt.optimizer_step():
                    pass
                it.add_metrics(loss=1.0 / (step + 1), tokens=4096, total=total)
                if step % 10 == 0:
                    tt.event("progress", {"step": step, "lr": 1e-3})
                if step % 1000 == 999:
                    with tt.checkpoint_save(current_iteration=step):
                        time.sleep(0.002)
            step += 1
            now = time.monotonic()
            if now >= next_sample:
                samples.append((now - started, rss_bytes()))
                next_sample = now + 5.0
            next_tick += period
            pause = next_tick - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            else:
                late += 1
    elapsed = time.monotonic() - started
    dropped_in_queue = rec.dropped
    tt.close()
    handler.close()
    samples.append((time.monotonic() - started, rss_bytes()))

    stream_path = out / "soak" / "rank0.jsonl"
    result = read_file(stream_path)
    stream = result.streams[0]
    steps_seen: dict[int, int] = {}
    for span in stream.spans("iteration"):
        value = span.get("attrs", {}).get("step")
        if isinstance(value, int):
            steps_seen[value] = steps_seen.get(value, 0) + 1
    missing = [s for s in range(step) if s not in steps_seen]
    duplicated = [s for s, n in steps_seen.items() if n != 1]
    drop_records = stream.of_kind("dropped")
    event_names: dict[str, int] = {}
    for record in stream.of_kind("event"):
        event_names[record["name"]] = event_names.get(record["name"], 0) + 1
    warm = [rss for t, rss in samples if t >= warmup_until - started]
    rss_first = warm[0] if warm else 0
    rss_last = warm[-1] if warm else 0
    with open(log_path, "rb") as handle:
        log_lines = sum(1 for _ in handle)
    summary: dict[str, object] = {
        "minutes": round(elapsed / 60.0, 2),
        "steps": step,
        "steps_in_file": len(steps_seen),
        "steps_missing": len(missing),
        "steps_duplicated": len(duplicated),
        "late_ticks": late,
        "records": len(stream.records) + 1,
        "seq_gaps": stream.gaps(),
        "bad_lines": len(result.bad_lines),
        "closed_cleanly": stream.closed_cleanly,
        "dropped_queue": dropped_in_queue,
        "dropped_records": len(drop_records),
        "file_bytes": stream_path.stat().st_size,
        "log_lines": log_lines,
        "events": event_names,
        "rss_after_warmup_mb": round(rss_first / 2**20, 1),
        "rss_end_mb": round(rss_last / 2**20, 1),
        "rss_max_mb": round(max(r for _, r in samples) / 2**20, 1),
        "rss_growth_after_warmup_mb": round((rss_last - rss_first) / 2**20, 2),
        "rss_samples": len(samples),
    }
    ok = (
        not missing
        and not duplicated
        and not stream.gaps()
        and not result.bad_lines
        and stream.closed_cleanly
        and dropped_in_queue == 0
        and not drop_records
        # "Flat": after warm-up RSS may wobble by allocator noise, not grow with the step count.
        and rss_last - rss_first < 8 * 2**20
    )
    summary["ok"] = ok
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--period-ms", type=float, default=10.0)
    parser.add_argument("--out", default="soak_out")
    args = parser.parse_args()
    summary = run(args.minutes, Path(args.out), args.period_ms / 1000.0)
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
