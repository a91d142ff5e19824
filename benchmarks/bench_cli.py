"""Time the traintrace command on synthetic jobs against a json.loads loop and DuckDB itself, in the same run.

    python benchmarks/bench_cli.py [--ranks 1,4,16,64] [--iterations 20000] [--dir /tmp/traintrace-bench]
                                   [--engine spark] [--compare-readers]

For each number of ranks, writes the job with benchmarks/gen_job.py (unless it is already there), then
runs, each as its own process so that wall time and peak memory (ru_maxrss from wait4) are end to end:

* a baseline that only parses every line with ``json.loads``;
* DuckDB's own single scan: one ``read_ndjson`` query (schema detected by DuckDB) computing what summary
  computes from the iterations (count, time and quantiles per rank and status, last step);
* ``traintrace summary``, ``ranks``, ``errors`` on the JSON-lines folder (with ``--compare-readers``, also
  with DuckDB's ``read_json`` instead of the native scanner, ``TRAINTRACE_READER=duckdb``);
* ``traintrace export --format parquet`` once, then ``summary``, ``ranks``, ``errors`` on the export;
* with ``--export``, ``export`` (chrome) of all ranks and of 4 ranks;
* with ``--engine spark``, ``summary``, ``ranks``, ``errors`` with ``--engine spark`` on the folder and on the
  export (checking that they answer as DuckDB does);
* with ``--written-steps N``, the same on a one-rank job that traintrace itself writes (the demo's loop without
  the model, six spans a step: mostly phase spans, where gen_job writes iterations).

The fixed cost is ``traintrace summary`` of a one-rank job of 10 iterations (best of five, bytecode cached as
in an installed package), beside Python's start, ``import duckdb`` and a DuckDB connection alone. Prints
records/s, the ratio to the baseline and to DuckDB's scan, peak RSS, and writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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

# DuckDB reading the files once, as a user would write it, with the aggregation summary needs.
DUCKDB_SCAN = """
import sys, duckdb
rows = duckdb.sql(f\"\"\"
    SELECT kind, name, status, count(*), sum(dur), quantile_cont(dur, [0.5, 0.9, 0.99]), max(ts), max(seq),
           max(try_cast(attrs->>'step' AS BIGINT)), sum(try_cast(attrs->>'batch_size' AS BIGINT))
    FROM read_ndjson('{sys.argv[1]}/*.jsonl') GROUP BY ALL
\"\"\").fetchall()
print(sum(r[3] for r in rows))
"""

# The floor under any DuckDB command: Python, DuckDB's import, a connection and one statement.
CONNECT = "import duckdb; duckdb.connect(':memory:').execute('SELECT 1').fetchall()"
#: The same with DuckDB's engine module alone, which is what the command imports (cli/_engine.py, import_duckdb).
ENGINE_CONNECT = (
    "try:\n    import _duckdb as engine\nexcept ImportError:\n    import duckdb as engine\n"
    "engine.connect(':memory:').execute('SELECT 1').fetchall()"
)


def run(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float, str, float]:
    """(wall seconds, peak RSS in MB, stdout, CPU seconds) of one child process."""
    started = time.perf_counter()
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={**os.environ, **env} if env else None
    )
    assert proc.stdout is not None
    out = proc.stdout.read().decode()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{argv} failed with {proc.returncode}")
    return elapsed, usage.ru_maxrss / 1024, out, usage.ru_utime + usage.ru_stime


def job(folder: Path, ranks: int, iterations: int, checkpoint_every: int) -> int:
    from gen_job import generate

    marker = folder / ".complete"
    if not marker.exists():
        started = time.perf_counter()
        records = generate(folder, ranks, iterations, checkpoint_every)
        marker.write_text(str(records))
        print(f"generated {records:,} records in {time.perf_counter() - started:.1f} s")
    return int(marker.read_text())


# A job traintrace itself writes: the demo's loop without the model (a wait for the batch, the iteration and
# its four phases, the loss), one rank. Its records are mostly phase spans, unlike gen_job's iterations.
WRITTEN = """
import sys
import traintrace as tt
tt.configure(job_id="written", log_dir=sys.argv[1], blocking=True)
with tt.application():
    with tt.training_loop(num_epochs=1):
        for step in range(int(sys.argv[2])):
            with tt.data_loading():
                pass
            with tt.training_iteration(step) as it:
                with tt.zero_grad():
                    pass
                with tt.forward():
                    pass
                with tt.backward():
                    pass
                with tt.optimizer_step():
                    pass
                it.add_metrics(loss=1.0 / (step + 1), batch_size=32)
tt.close()
"""


def written_job(folder: Path, steps: int) -> tuple[Path, int]:
    """The job's folder (``folder/written``, as traintrace names it) and its number of records."""
    marker = folder / ".complete"
    if not marker.exists():
        shutil.rmtree(folder, ignore_errors=True)
        started = time.perf_counter()
        run([sys.executable, "-c", WRITTEN, str(folder), str(steps)])
        records = sum(sum(1 for _ in p.open("rb")) for p in (folder / "written").glob("*.jsonl"))
        marker.write_text(str(records))
        print(f"traintrace wrote {records:,} records in {time.perf_counter() - started:.1f} s")
    return folder / "written", int(marker.read_text())


def bench(folder: Path, records: int, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    cli = [sys.executable, "-m", "traintrace.cli"]
    results: dict[str, dict[str, float]] = {}
    if not args.skip_baseline:
        wall, rss, out, cpu = run([sys.executable, "-c", BASELINE, str(folder)])
        assert int(out) == records, (out, records)
        results["json.loads loop"] = {"seconds": wall, "peak_mb": rss, "cpu_s": cpu}
        wall, rss, out, cpu = run([sys.executable, "-c", DUCKDB_SCAN, str(folder)])
        results["duckdb read_ndjson scan"] = {"seconds": wall, "peak_mb": rss, "cpu_s": cpu}
    parquet = folder.parent / (folder.name + ".parquet")
    shutil.rmtree(parquet, ignore_errors=True)
    commands: dict[str, list[str]] = {}
    envs: dict[str, dict[str, str]] = {}
    for command in ("summary", "ranks", "errors"):
        commands[command] = [*cli, command, str(folder), "--json", "--quiet"]
        if args.compare_readers:  # DuckDB's read_json instead of the native scanner, in the same run
            commands[f"{command} (read_json)"] = commands[command]
            envs[f"{command} (read_json)"] = {"TRAINTRACE_READER": "duckdb"}
    commands["export --format parquet"] = [*cli, "export", str(folder), "--format", "parquet", "-o", str(parquet), "-q"]
    for command in ("summary", "ranks", "errors"):
        commands[f"{command} (parquet)"] = [*cli, command, str(parquet), "--json", "--quiet"]
    if args.engine == "spark":
        # The same commands on Spark (local mode, every core, a JVM started per command as a user would).
        for command in ("summary", "ranks", "errors"):
            commands[f"{command} (spark)"] = [*commands[command], "--engine", "spark"]
            commands[f"{command} (parquet, spark)"] = [*commands[f"{command} (parquet)"], "--engine", "spark"]
    if args.export:
        trace = folder.parent / (folder.name + "-trace.json")
        commands["export (all ranks)"] = [*cli, "export", str(folder), "-o", str(trace), "--quiet"]
        commands["export (4 ranks)"] = [*cli, "export", str(folder), "--ranks", "0-3", "-o", str(trace), "--quiet"]
    answers: dict[str, Any] = {}
    for name, argv in commands.items():
        wall, rss, out, cpu = run(argv, envs.get(name))
        results[name] = {"seconds": wall, "peak_mb": rss, "cpu_s": cpu}
        if name.startswith(("summary", "ranks", "errors")):
            answers[name] = json.loads(out)
    for command in ("summary", "ranks", "errors"):
        for other in (f"{command} (parquet)", f"{command} (read_json)"):
            if other not in answers:
                continue
            # DuckDB's parallel sums (the step-time stddev, samples per second) differ in the last bits from
            # run to run: compared to 9 significant digits, as for Spark.
            a, b = _rounded(answers[command]), _rounded(answers[other])
            assert a == b, f"{other}: answers differently"
        for other in (f"{command} (spark)", f"{command} (parquet, spark)"):
            if other in answers:
                assert _rounded(answers[command]) == _rounded(answers[other]), f"{other}: answers differently"
    summary = answers["summary"]
    print(
        f"  summary says: goodput {summary['goodput']:.3f}, steps {summary['steps_completed']:,}, "
        f"lost {summary['steps_lost']}"
    )
    base = results.get("json.loads loop", {}).get("seconds")
    scan = results.get("duckdb read_ndjson scan", {}).get("seconds")
    print(
        f"{'command':26} {'seconds':>8} {'records/s':>12} {'vs json.loads':>14} {'vs duckdb':>10} "
        f"{'CPU s':>7} {'peak MB':>8}"
    )
    for name, figures in results.items():
        rate = records / figures["seconds"]
        figures["records_per_s"] = rate
        ratio = f"{base / figures['seconds']:.1f}x" if base else "-"
        vs_scan = f"{scan / figures['seconds']:.2f}x" if scan else "-"
        print(
            f"{name:26} {figures['seconds']:8.2f} {rate:12,.0f} {ratio:>14} {vs_scan:>10} {figures['cpu_s']:7.2f} "
            f"{figures['peak_mb']:8.0f}"
        )
    return results


def _print_scaling(jobs: dict[int, Any]) -> None:
    """Records/s of each command at every rank count, with its ratios to the two baselines of the same job:
    a cost linear in records shows as a flat row."""
    counts = sorted(jobs)
    names = [
        n
        for n in (
            "summary",
            "ranks",
            "errors",
            "summary (read_json)",
            "ranks (read_json)",
            "errors (read_json)",
            "summary (parquet)",
        )
        if n in jobs[counts[0]]["results"]
    ]
    print(
        "\nrecords/s (x json.loads loop, x duckdb scan) by ranks: "
        + ", ".join(f"{r} ranks {jobs[r]['records']:,} records" for r in counts)
    )
    for name in names:
        cells = []
        for r in counts:
            results = jobs[r]["results"]
            mine = results[name]["seconds"]
            base = results.get("json.loads loop", {}).get("seconds")
            scan = results.get("duckdb read_ndjson scan", {}).get("seconds")
            ratios = f" ({base / mine:.1f}x, {scan / mine:.2f}x)" if base and scan else ""
            cells.append(f"{jobs[r]['records'] / mine:>10,.0f}{ratios}")
        print(f"  {name:18} " + "  ".join(cells))
    print("  peak MB: " + ", ".join(f"{r} ranks {jobs[r]['results']['summary']['peak_mb']:.0f}" for r in counts))


def _rounded(value: Any) -> Any:
    """Floats to 9 significant digits (the engines' parallel sums differ in the last bits)."""
    if isinstance(value, float):
        return float(f"{value:.9g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="1,4,16,64", help="comma-separated rank counts (default 1,4,16,64)")
    parser.add_argument("--iterations", type=int, default=20_000, help="iterations per rank (default 20,000)")
    parser.add_argument("--checkpoint-every", type=int, default=2000)
    parser.add_argument("--dir", default=None, help="folder for the jobs (default /tmp)")
    parser.add_argument(
        "--written-steps",
        type=int,
        default=0,
        help="also a one-rank job traintrace writes itself, this many steps of six spans (default: none)",
    )
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--export", action="store_true", help="also time export --format chrome")
    parser.add_argument(
        "--compare-readers",
        action="store_true",
        help="also time summary, ranks and errors with DuckDB's read_json (TRAINTRACE_READER=duckdb)",
    )
    parser.add_argument(
        "--engine",
        choices=["duckdb", "spark"],
        default="duckdb",
        help="spark: also time summary, ranks and errors with --engine spark (needs traintrace[spark] and Java)",
    )
    args = parser.parse_args()
    root = Path(args.dir or "/tmp")
    cli = [sys.executable, "-m", "traintrace.cli"]
    tiny = root / "traintrace-bench-1x10"
    job(tiny, 1, 10, 5)
    # An installed package has its bytecode compiled (pip does it): with PYTHONDONTWRITEBYTECODE set, as on
    # some CI machines, every child would compile traintrace's sources again and the fixed cost would time that.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    run([*cli, "summary", str(tiny), "--json", "--quiet"])  # writes the bytecode caches
    start = min(run([sys.executable, "-c", "pass"])[0] for _ in range(5))
    imports = min(run([sys.executable, "-c", "import duckdb"])[0] for _ in range(5))
    connect = min(run([sys.executable, "-c", CONNECT])[0] for _ in range(5))
    engine = min(run([sys.executable, "-c", ENGINE_CONNECT])[0] for _ in range(5))
    fixed = min(run([*cli, "summary", str(tiny), "--json", "--quiet"])[0] for _ in range(5))
    # By default DuckDB's read_json reads a job this small (the scanner repays its start from about 16 MB).
    scanner_reader = {"TRAINTRACE_READER": "native"}
    fixed_scanner = min(run([*cli, "summary", str(tiny), "--json", "--quiet"], scanner_reader)[0] for _ in range(5))
    print(
        f"fixed cost: traintrace summary of 10 records {fixed:.3f} s ({fixed_scanner:.3f} s with the scanner; "
        f"python start-up alone {start:.3f} s, python + import duckdb {imports:.3f} s, + a connection and one "
        f"query {connect:.3f} s; the same with DuckDB's engine module alone, as the command imports it, {engine:.3f} s)"
    )
    load = os.getloadavg()
    print(f"{os.cpu_count()} CPUs, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    everything: dict[str, Any] = {
        "fixed_cost_s": fixed,
        "fixed_cost_scanner_s": fixed_scanner,
        "python_start_s": start,
        "python_import_duckdb_s": imports,
        "python_duckdb_connect_s": connect,
        "python_duckdb_engine_connect_s": engine,
        "cpus": os.cpu_count(),
        "jobs": {},
    }
    for ranks in (int(r) for r in args.ranks.split(",")):
        folder = root / f"traintrace-bench-{ranks}x{args.iterations}"
        records = job(folder, ranks, args.iterations, args.checkpoint_every)
        size = sum(p.stat().st_size for p in folder.glob("*.jsonl"))
        print(f"job: {ranks} ranks x {args.iterations:,} iterations, {records:,} records, {size / 1e6:,.0f} MB")
        results = bench(folder, records, args)
        everything["jobs"][ranks] = {"records": records, "bytes": size, "results": results}
    if args.written_steps:
        folder, records = written_job(root / f"traintrace-bench-written-{args.written_steps}", args.written_steps)
        size = sum(p.stat().st_size for p in folder.glob("*.jsonl"))
        print(f"job written by traintrace: {args.written_steps:,} steps, {records:,} records, {size / 1e6:,.0f} MB")
        everything["written"] = {"records": records, "bytes": size, "results": bench(folder, records, args)}
    everything["load_average_after"] = os.getloadavg()
    _print_scaling(everything["jobs"])
    out_file = root / f"traintrace-bench-{args.iterations}-results.json"
    out_file.write_text(json.dumps(everything, indent=2))
    print(f"figures written to {out_file}")


if __name__ == "__main__":
    main()
