"""Time the traintrace command on a synthetic job against a plain json.loads loop, in the same run.

    python benchmarks/bench_cli.py [--ranks 64] [--iterations 100000] [--dir /tmp/traintrace-bench]

Writes the job with benchmarks/gen_job.py (unless it is already there), then
runs, each as its own process so that wall time and peak memory (ru_maxrss
from wait4) are end to end: a baseline that only parses every line with
``json.loads``, and ``traintrace summary``, ``ranks``, ``errors`` and
``export``. Prints records/s, the speed-up over the baseline and peak RSS,
and writes the figures as JSON next to the job.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

BASELINE = """
import json, sys
from pathlib import Path
n = 0
for path in sorted(Path(sys.argv[1]).glob("*.jsonl")):
    with path.open("rb") as handle:
        for line in handle:
            json.loads(line)
            n += 1
print(n)
"""


def run(argv: list[str]) -> tuple[float, float, str]:
    """(wall seconds, peak RSS in MB, stdout) of one child process."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    out = proc.stdout.read().decode()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{argv} failed with {proc.returncode}")
    return elapsed, usage.ru_maxrss / 1024, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=100_000)
    parser.add_argument("--checkpoint-every", type=int, default=5000)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--skip-baseline", action="store_true")
    args = parser.parse_args()
    folder = Path(args.dir or f"/tmp/traintrace-bench-{args.ranks}x{args.iterations}")
    from gen_job import generate

    marker = folder / ".complete"
    if not marker.exists():
        started = time.perf_counter()
        records = generate(folder, args.ranks, args.iterations, args.checkpoint_every)
        marker.write_text(str(records))
        print(f"generated {records:,} records in {time.perf_counter() - started:.1f} s")
    records = int(marker.read_text())
    size = sum(p.stat().st_size for p in folder.glob("*.jsonl"))
    print(
        f"job: {args.ranks} ranks x {args.iterations:,} iterations, {records:,} records, {size / 1e9:.2f} GB, "
        f"{os.cpu_count()} CPUs"
    )
    cli = [sys.executable, "-m", "traintrace.cli"]
    results: dict[str, dict[str, float]] = {}
    if not args.skip_baseline:
        wall, rss, out = run([sys.executable, "-c", BASELINE, str(folder)])
        assert int(out) == records, (out, records)
        results["json.loads loop"] = {"seconds": wall, "peak_mb": rss}
    trace = folder.parent / (folder.name + "-trace.json")
    commands = {
        "summary": [*cli, "summary", str(folder), "--json", "--quiet"],
        "ranks": [*cli, "ranks", str(folder), "--json", "--quiet"],
        "errors": [*cli, "errors", str(folder), "--json", "--quiet"],
        "export (all ranks)": [*cli, "export", str(folder), "-o", str(trace), "--quiet"],
        "export (4 ranks)": [*cli, "export", str(folder), "--ranks", "0-3", "-o", str(trace), "--quiet"],
    }
    for name, argv in commands.items():
        wall, rss, out = run(argv)
        results[name] = {"seconds": wall, "peak_mb": rss}
        if name == "summary":
            summary = json.loads(out)
            print(
                f"  summary says: goodput {summary['goodput']:.3f}, steps {summary['steps_completed']:,}, "
                f"lost {summary['steps_lost']}"
            )
    base = results.get("json.loads loop", {}).get("seconds")
    print(f"{'command':22} {'seconds':>8} {'records/s':>12} {'vs json.loads':>14} {'peak MB':>8}")
    for name, figures in results.items():
        rate = records / figures["seconds"]
        figures["records_per_s"] = rate
        ratio = f"{base / figures['seconds']:.1f}x" if base else "-"
        print(f"{name:22} {figures['seconds']:8.2f} {rate:12,.0f} {ratio:>14} {figures['peak_mb']:8.0f}")
    out_file = folder.parent / (folder.name + "-results.json")
    out_file.write_text(
        json.dumps(
            {
                "records": records,
                "bytes": size,
                "ranks": args.ranks,
                "iterations": args.iterations,
                "cpus": os.cpu_count(),
                "results": results,
            },
            indent=2,
        )
    )
    print(f"figures written to {out_file}")


if __name__ == "__main__":
    main()
