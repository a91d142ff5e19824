"""The ``traintrace`` command: answers from a job's telemetry files.

    traintrace summary traintrace_logs/myjob        # wall time, goodput, badput, step times
    traintrace ranks traintrace_logs/myjob          # stragglers
    traintrace errors traintrace_logs/myjob         # root cause, last moments of every rank
    traintrace export traintrace_logs/myjob -o trace.json   # Perfetto / chrome://tracing
    traintrace report traintrace_logs/myjob -o report.html  # one offline HTML file
    traintrace query traintrace_logs/myjob "SELECT rank, count(*) FROM steps GROUP BY rank"
    traintrace watch traintrace_logs/myjob          # a running job, live (no extra needed)

Needs the analysis extra: ``pip install 'traintrace[analysis]'``. Definitions
of every figure: docs/analysis.md.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_INTERNAL",
    "EXIT_MISSING_EXTRA",
    "EXIT_OK",
    "EXIT_OUT_OF_MEMORY",
    "EXIT_USAGE",
    "entry",
    "main",
]

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_BAD_INPUT = 3
EXIT_MISSING_EXTRA = 4
EXIT_OUT_OF_MEMORY = 5

EXIT_CODES = f"""exit codes:
  {EXIT_OK}  success (also when the job itself failed: that is an answer, not an error)
  {EXIT_INTERNAL}  unexpected internal error (a bug: please report it with the traceback)
  {EXIT_USAGE}  bad command line, or a query that DuckDB rejects
  {EXIT_BAD_INPUT}  no traintrace records found (no .jsonl files, or none with a traintrace header)
  {EXIT_MISSING_EXTRA}  DuckDB is missing (or older than 1.3): pip install -U 'traintrace[analysis]'
  {EXIT_OUT_OF_MEMORY}  the job needs more memory than DuckDB's limit allows: raise --memory-limit
"""

EXAMPLES = {
    "watch": """examples:
  traintrace watch traintrace_logs/myjob              # live table, refreshed every second
  traintrace watch traintrace_logs/myjob --once       # one snapshot
  traintrace watch traintrace_logs/myjob | tee watch.log   # plain lines when piped
""",
    "summary": """examples:
  traintrace summary traintrace_logs/myjob
  traintrace summary traintrace_logs/myjob/rank0.jsonl traintrace_logs/myjob/rank1.jsonl
  traintrace summary traintrace_logs/myjob --json | jq .goodput
""",
    "ranks": """examples:
  traintrace ranks traintrace_logs/myjob              # the 5 slowest ranks
  traintrace ranks traintrace_logs/myjob --top 20 --windows 20
  traintrace ranks traintrace_logs/myjob --all --json
""",
    "errors": """examples:
  traintrace errors traintrace_logs/myjob
  traintrace errors traintrace_logs/myjob --hang-after 300 --json
""",
    "export": """examples:
  traintrace export traintrace_logs/myjob -o trace.json          # open in ui.perfetto.dev
  traintrace export traintrace_logs/myjob --ranks 0-3,17 --start 600 --end 660 -o window.json
  traintrace export traintrace_logs/myjob --format parquet -o myjob.parquet   # then: traintrace summary myjob.parquet
""",
    "report": """examples:
  traintrace report traintrace_logs/myjob                        # writes traintrace_logs/myjob/report.html
  traintrace report traintrace_logs/myjob -o /tmp/report.html
""",
    "query": """views: records, spans, steps, events, errors, streams (columns in docs/analysis.md)
examples:
  traintrace query traintrace_logs/myjob \\
      "SELECT rank, median(dur)/1e6 AS ms FROM steps GROUP BY rank ORDER BY ms DESC LIMIT 5"
  traintrace query traintrace_logs/myjob "SELECT name, count(*) FROM spans GROUP BY name" --json
""",
}


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's, told the terminal's width: its own lookup imports shutil (and with it bz2 and lzma: 4 ms of a
    small job's command), and argparse makes a formatter for every argument it is given, help asked or not."""

    def __init__(
        self, prog: str, indent_increment: int = 2, max_help_position: int = 24, width: int | None = None
    ) -> None:
        super().__init__(prog, indent_increment, max_help_position, _terminal_columns() - 2 if width is None else width)


def _terminal_columns() -> int:
    """The width ``shutil.get_terminal_size`` gives: ``$COLUMNS``, else the terminal's, else 80."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or 80


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="traintrace",
        description="Answers from a training job's traintrace files: where the time went (goodput), "
        "which rank is slow, what failed first, a timeline and an HTML report.",
        epilog="examples:\n"
        + "\n".join(EXAMPLES[k].split("\n", 1)[1].rstrip() for k in ("summary", "ranks", "errors", "report"))
        + "\n\n"
        + EXIT_CODES,
        formatter_class=_HelpFormatter,
    )
    from traintrace import __version__

    parser.add_argument("--version", action="version", version=f"traintrace {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            help=help_text,
            description=help_text,
            epilog=EXAMPLES[name] + "\n" + EXIT_CODES,
            formatter_class=_HelpFormatter,
        )
        p.add_argument(
            "paths",
            nargs="+" if name != "query" else 1,
            metavar="PATH",
            help="a job folder (searched recursively for *.jsonl) or files",
        )
        p.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
        p.add_argument(
            "--cache",
            action="store_true",
            help="keep a finished job's tables in $TRAINTRACE_CACHE_DIR (default ~/.cache/traintrace) and reuse "
            "them while the files are unchanged",
        )
        if name in ("summary", "ranks", "errors"):
            p.add_argument(
                "--engine",
                choices=["duckdb", "spark"],
                default="duckdb",
                help="duckdb (default, embedded) or spark: the same analysis as Spark SQL, for jobs beyond one "
                "machine; reads local paths or object-storage URLs (needs pip install 'traintrace[spark]' and Java)",
            )
        p.add_argument("--threads", type=_count(1, 1024), default=None, help="DuckDB threads (default: all cores)")
        p.add_argument(
            "--memory-limit",
            default=None,
            type=_memory,
            help="DuckDB memory limit (default 1500MB, or $TRAINTRACE_MEMORY_LIMIT); "
            "beyond it DuckDB spills to a temporary folder",
        )
        return p

    p = add("summary", "wall time, time by phase, goodput and badput, steps, throughput, step-time statistics")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")

    p = add("ranks", "stragglers: per-rank step-time median/p90/p99, score against the job median, over time")
    p.add_argument("--top", type=_count(1), default=5, help="how many of the slowest ranks to show (default 5)")
    p.add_argument("--windows", type=_count(1, 100_000), default=10, help="time windows for 'slow since' (default 10)")
    p.add_argument(
        "--threshold",
        type=_finite,
        default=1.1,
        help="score (rank median / job median) from which a rank is a straggler (default 1.1)",
    )
    p.add_argument("--all", action="store_true", help="show every rank")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")

    p = add("errors", "failures: first error (root cause), grouped errors, each rank's last record and open spans")
    p.add_argument(
        "--hang-after",
        type=_finite,
        default=60.0,
        help="a rank that stopped writing this many seconds before the others is a hang suspect",
    )
    p.add_argument("--no-stack", action="store_true", help="do not print the first error's stack")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")

    p = add("export", "a timeline in Trace Event Format (Perfetto, chrome://tracing), or the records as Parquet")
    p.add_argument(
        "--format",
        choices=["chrome", "parquet"],
        default="chrome",
        help="chrome: one Trace Event Format file; parquet: a folder of Parquet files, one rank=N folder per rank, "
        "that every command (and Spark) reads like the job folder (docs/format.md)",
    )
    p.add_argument("-o", "--output", default=None, help="file to write (default trace.json); with parquet, the folder")
    p.add_argument("--ranks", default=None, help="ranks to keep, e.g. 0-3,17")
    p.add_argument("--start", type=_finite, default=None, help="seconds after the job start to begin at")
    p.add_argument("--end", type=_finite, default=None, help="seconds after the job start to end at")
    p.add_argument("--json", action="store_true", help="print what was written as JSON")

    p = add("report", "one self-contained HTML file with charts (works offline)")
    p.add_argument("-o", "--output", default=None, help="file to write (default: <first folder>/report.html)")
    p.add_argument("--windows", type=_count(1, 100_000), default=60, help="time buckets in the charts (default 60)")
    p.add_argument("--json", action="store_true", help="print where it was written as JSON")

    p = add("query", "SQL (DuckDB dialect) over the job's records")
    p.add_argument("sql", help="the query; views: records, spans, steps, events, errors, streams")
    p.add_argument("--json", action="store_true", help="print rows as a JSON list of objects")
    p.add_argument("--limit", type=_count(0), default=1000, help="most rows to print in a table (default 1000)")

    # Defined here, not in _watch: building the parser would import it (and its dataclasses) for every command.
    p = sub.add_parser(
        "watch",
        help="a running job, live: per-rank step, step time, phase, hangs and errors as they happen",
        description="A job, live, from its files and progress files: per-rank step, step time, phase, "
        "time since the last progress, collectives, hang and straggler suspicions, errors as they appear.",
        epilog=EXAMPLES["watch"] + "\n" + EXIT_CODES,
        formatter_class=_HelpFormatter,
    )
    p.add_argument("paths", nargs=1, metavar="PATH", help="the job folder (<log_dir>/<job>)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument(
        "--hang-after",
        type=float,
        default=30.0,
        help="seconds without progress after which a rank is a hang suspect (default 30)",
    )
    p.add_argument("--json", action="store_true", help="with --once: the snapshot as JSON")
    return parser


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            item = v
            if k == "attrs" and isinstance(v, str):
                try:
                    item = json.loads(v)
                except ValueError:
                    pass
            out[k] = _jsonable(item)
        return out
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(_jsonable(data), indent=2) + "\n")


def _print_export(data: dict[str, Any], *, as_json: bool) -> None:
    """What ``export --format chrome`` wrote, with or without DuckDB."""
    if as_json:
        _print_json(data)
    else:
        print(
            terminal_safe(f"wrote {data['events']['total']:,} trace events to {data['path']} ")
            + "(open it in https://ui.perfetto.dev or chrome://tracing)"
        )


_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def terminal_safe(text: str) -> str:
    """``text`` with control characters shown as ``\\x1b`` (escape sequences, ``\\r``, bidi overrides).

    Record text reaches the terminal through tables and messages; raw, a name
    could clear the screen, hide lines behind ``\\r`` or plant an OSC-8 link.
    """
    return _CONTROL.sub(_escape, text)


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 256 else f"\\u{code:04x}"


class _SafeStream(io.TextIOBase):
    """A text stream that escapes control characters on their way to ``target``."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def write(self, text: str) -> int:
        self._target.write(terminal_safe(text))
        return len(text)

    def flush(self) -> None:
        self._target.flush()

    def isatty(self) -> bool:
        return bool(self._target.isatty())

    def fileno(self) -> int:
        return int(self._target.fileno())


def _count(minimum: int, maximum: int | None = None) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {value}")
        return value

    return parse


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


_MEMORY = re.compile(r"\s*\d+(\.\d+)?\s*(b|kb|mb|gb|tb|kib|mib|gib|tib)?\s*", re.IGNORECASE)


def _memory(text: str) -> str:
    if not _MEMORY.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected a size such as 1500MB or 4GiB, got {text!r}")
    return text.strip()


def entry() -> None:
    """The ``traintrace`` command itself (the console script, ``python -m traintrace.cli``): :func:`main`, then
    the process ends without the interpreter's finalisation.

    Tearing down the interpreter and DuckDB's database after the answer is printed took 15 ms of a small job's
    0.2 s. What that teardown would do that matters is done first: the output is flushed, and the job's scratch
    folder was removed by ``Job.close``. A run that started other threads or a JVM (``watch``, ``--engine spark``)
    exits the usual way.
    """
    code = main()
    if "pyspark" in sys.modules or _other_threads_running():
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BrokenPipeError:
            pass  # the reader went away: what main answered stands (it treats a closed pipe the same)
        except (OSError, ValueError):
            sys.exit(code)  # the interpreter's own exit reports the stream it could not write (status 120)
    os._exit(code)


def _other_threads_running() -> bool:
    threading = sys.modules.get("threading")
    return threading is not None and threading.active_count() > 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit code (see ``EXIT_CODES``)."""
    args = _parser().parse_args(argv)
    stdout = sys.stdout
    if args.command != "watch":  # watch draws the screen itself, with its own escape codes
        # stdout carries record text; stderr our progress line (its own \r) and messages, escaped where printed.
        sys.stdout = _SafeStream(stdout)
    try:
        if args.command == "watch":
            from ._watch import run as watch

            return watch(args)
        return _run(args)
    except BrokenPipeError:
        try:
            stdout = Path(os.devnull).open("w")  # noqa: SIM115 - silence the interpreter's own flush
        except OSError:
            pass
        return EXIT_OK
    finally:
        sys.stdout = stdout


def _run(args: argparse.Namespace) -> int:
    from ._engine import Job, LoadError, MissingExtra, parse_ranks

    progress = not args.quiet and sys.stderr.isatty()
    if getattr(args, "engine", "duckdb") == "spark":
        return _run_spark(args)

    try:
        job = Job.open(
            args.paths,
            progress=progress,
            threads=args.threads,
            memory_limit=args.memory_limit,
            lean=args.command in ("summary", "ranks", "errors"),
            cache=args.cache,
        )
    except MissingExtra as exc:
        if args.command == "export" and args.format == "chrome":  # writing JSON does not need DuckDB
            return _export_without_duckdb(args)
        print(terminal_safe(f"traintrace: {exc}"), file=sys.stderr)
        return EXIT_MISSING_EXTRA
    except LoadError as exc:
        print(terminal_safe(f"traintrace: {exc}"), file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as exc:
        if not _out_of_memory(exc):
            raise
        return _say_out_of_memory(exc, args.memory_limit)
    if args.command != "query":
        # Everything is loaded: the analyses need no file access of DuckDB's (outputs are written by Python).
        job.restrict_external_access()
    try:
        return _dispatch(args, job, parse_ranks)
    except Exception as exc:  # noqa: BLE001 - turned into an exit code
        duckdb = sys.modules.get("_duckdb") or sys.modules.get("duckdb")  # whichever import_duckdb loaded
        if _out_of_memory(exc):
            return _say_out_of_memory(exc, args.memory_limit)
        if args.command == "query" and duckdb is not None and isinstance(exc, duckdb.Error):
            print(terminal_safe(f"traintrace: query failed: {exc}"), file=sys.stderr)
            return EXIT_USAGE
        import traceback

        traceback.print_exc()
        print("traintrace: internal error (exit 1); please report it with the traceback above", file=sys.stderr)
        return EXIT_INTERNAL
    finally:
        job.close()


def _out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is DuckDB's: out of memory under its limit."""
    duckdb = sys.modules.get("_duckdb") or sys.modules.get("duckdb")
    oom = getattr(duckdb, "OutOfMemoryException", None)
    return isinstance(oom, type) and isinstance(exc, oom)


def _say_out_of_memory(exc: BaseException, limit: str | None) -> int:
    from ._engine import DEFAULT_MEMORY_LIMIT

    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    print(
        terminal_safe(
            f"traintrace: the job needs more memory than DuckDB's limit ({limit or DEFAULT_MEMORY_LIMIT}) allows: "
            "raise --memory-limit or TRAINTRACE_MEMORY_LIMIT (DuckDB spills its tables to a temporary folder, but "
            f"each step's working set must fit; ranks needs the most). {first}"
        ),
        file=sys.stderr,
    )
    return EXIT_OUT_OF_MEMORY


def _run_spark(args: argparse.Namespace) -> int:
    """summary, ranks or errors with ``--engine spark`` (docs/analysis.md, "Engines: DuckDB and Spark")."""
    from ._engine import LoadError, MissingExtra, parse_ranks

    if args.cache:
        print("traintrace: --cache applies to --engine duckdb only", file=sys.stderr)
        return EXIT_USAGE
    from ._spark import SparkJob, SparkUnavailable  # imports nothing optional until a job is opened

    try:
        job = SparkJob.open(args.paths, lean=True)
    except MissingExtra as exc:
        print(terminal_safe(f"traintrace: {exc}"), file=sys.stderr)
        return EXIT_MISSING_EXTRA
    except SparkUnavailable as exc:
        print(terminal_safe(f"traintrace: {exc}"), file=sys.stderr)
        return EXIT_USAGE
    except LoadError as exc:
        print(terminal_safe(f"traintrace: {exc}"), file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        return _dispatch(args, job, parse_ranks)
    except Exception:  # noqa: BLE001 - turned into an exit code
        import traceback

        traceback.print_exc()
        print("traintrace: internal error (exit 1); please report it with the traceback above", file=sys.stderr)
        return EXIT_INTERNAL
    finally:
        job.close()


def _export_without_duckdb(args: argparse.Namespace) -> int:
    from ._engine import LoadError, parse_ranks
    from ._export_plain import export_chrome_plain

    try:
        ranks = parse_ranks(args.ranks) if args.ranks else None
    except ValueError:
        print(f"traintrace: --ranks: not a rank list: {args.ranks!r} (e.g. 0-3,17)", file=sys.stderr)
        return EXIT_USAGE
    try:
        data = export_chrome_plain(
            args.paths, args.output or "trace.json", ranks=ranks, start_s=args.start, end_s=args.end
        )
    except (OSError, ValueError, LoadError) as exc:
        print(f"traintrace: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    _print_export(data, as_json=args.json)
    return EXIT_OK


def _dispatch(args: argparse.Namespace, job: Any, parse_ranks: Any) -> int:
    from . import _analysis, _render

    command = args.command
    if command == "summary":
        data = _analysis.summary(job)
        _print_json(data) if args.json else sys.stdout.write(_render.render_summary(data))
    elif command == "ranks":
        data = _analysis.ranks(job, top=args.top, windows=args.windows, threshold=args.threshold)
        _print_json(data) if args.json else sys.stdout.write(_render.render_ranks(data, args.all))
    elif command == "errors":
        data = _analysis.errors(job, hang_after_s=args.hang_after)
        _print_json(data) if args.json else sys.stdout.write(_render.render_errors(data, not args.no_stack))
    elif command == "export" and args.format == "parquet":
        from ._export import export_parquet

        if args.ranks or args.start is not None or args.end is not None:
            print("traintrace: --ranks, --start and --end apply to --format chrome only", file=sys.stderr)
            return EXIT_USAGE
        try:
            data = export_parquet(job, args.output or "trace.parquet")
        except (OSError, ValueError) as exc:
            print(terminal_safe(f"traintrace: {exc}"), file=sys.stderr)
            return EXIT_BAD_INPUT
        if args.json:
            _print_json(data)
        else:
            where = f"{data['partitions']} rank folders under {data['path']}"
            print(terminal_safe(f"wrote {data['records']:,} records in {where}"))
    elif command == "export":
        from ._export import export_chrome

        try:
            ranks = parse_ranks(args.ranks) if args.ranks else None
        except ValueError:
            print(terminal_safe(f"traintrace: --ranks: not a rank list: {args.ranks!r} (e.g. 0-3,17)"), file=sys.stderr)
            return EXIT_USAGE
        data = export_chrome(job, args.output or "trace.json", ranks=ranks, start_s=args.start, end_s=args.end)
        _print_export(data, as_json=args.json)
    elif command == "report":
        from ._report import write_report

        output = args.output or str(_default_report_path(args.paths))
        path = write_report(job, output, windows=args.windows)
        if args.json:
            _print_json({"path": str(path)})
        else:
            print(f"report written to {path}")
    elif command == "query":
        job.create_query_views()
        cursor = job.con.execute(args.sql)
        names = [d[0] for d in cursor.description] if cursor.description else []
        if args.json:
            _print_json([dict(zip(names, row, strict=True)) for row in cursor.fetchall()])
        else:
            from ._render import table

            rows = cursor.fetchmany(args.limit)
            sys.stdout.write(table(names, rows, "l" * len(names)) + "\n")
            more = cursor.fetchone()
            if more is not None:
                print(terminal_safe(f"(first {args.limit} rows shown; --limit N for more)"), file=sys.stderr)
        for note in job.notes:
            print(terminal_safe(f"note: {note}"), file=sys.stderr)
    return EXIT_OK


def _default_report_path(paths: Sequence[str]) -> Path:
    first = Path(paths[0])
    folder = first if first.is_dir() else first.parent
    return folder / "report.html"
