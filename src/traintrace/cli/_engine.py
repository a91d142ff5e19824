"""Loading a job's JSON-lines files into DuckDB, once, and the views the commands share.

One pass of DuckDB's parallel JSON reader materialises the records in a
columnar table (``raw``); every analysis is a query over it. Only the fields
the analyses use are parsed into columns (``attrs`` stays JSON text, parsed
on demand), which keeps a multi-million-record job in a few hundred MB; with
``memory_limit`` set DuckDB spills to its temporary folder beyond that.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from .._format import PROGRESS_SUFFIX, SCHEMA, SCHEMA_VERSION, SQL_COLUMNS
from .._names import EventName, SpanName, SpanStatus

__all__ = ["EXPORT_META", "Job", "LoadError", "MissingExtra", "discover", "find_export", "import_duckdb"]

#: Record fields read into columns (``_format.FIELDS``); everything else a record holds is ignored.
COLUMNS: dict[str, str] = SQL_COLUMNS

#: Attribute fields the analyses read from progress events (``Job.attr_fields``).
ATTR_FIELDS = (
    "step",
    "loss",
    "batch_size",
    "current_iteration",
    "unhandled",
    "consumed_samples",
    "samples",
    "total_samples",
    "consumed_tokens",
    "tokens",
    "total_tokens",
    "samples_per_second",
    "samples_per_sec",
    "throughput_samples",
    "tokens_per_second",
    "tokens_per_sec",
    "mfu",
    "tflops",
    "tflops_per_gpu",
    "last_step",
    "last_completed_step",
)

#: A job whose files hold less than this is small: DuckDB runs its queries on one thread without its costliest
#: optimisers. On a small job a command's fifty-odd statements cost more to plan and to hand between threads
#: than to run (10 records: 137 ms of statements with the defaults, 99 ms so; a 10 MB job the same either way,
#: a 60 MB job 40% slower on one thread).
SMALL_JOB_BYTES = 4 << 20
#: A job whose files hold less than this is tiny: summary, ranks and errors (``Job.open(lean=True)``) plan their
#: statements without any optimiser (10 to 30 ms of a 0.15 to 0.2 s command, same answers; a few thousand records
#: at most, so a join left unoptimised stays small). query and report keep the optimisers a user's SQL may need.
TINY_JOB_BYTES = 256 << 10
#: A job whose files hold more than this share of DuckDB's memory limit is read into a database file in the
#: job's scratch folder, compressed, instead of into memory: its tables would not fit, and DuckDB would spill them
#: to disk uncompressed and read them back on every pass. Compressed (about a tenth of the size on generated jobs:
#: 64 ranks' raw table 534 -> 57 MB), they stay in DuckDB's buffers. The compression costs about 0.2 µs a record,
#: which a job that fits in memory does not repay (128 ranks x 50,000 steps, 1.2 GB of files: summary 3.1 -> 4.4 s),
#: one twice the limit roughly does (256 ranks: summary 9.2 -> 7.6 s, errors 6.0 -> 7.1 s, peak 1.7 -> 0.6 GB),
#: one far beyond it does (512 ranks: summary 25-27 -> 19-22 s, ranks 59 -> 49 s, peak 1.7 -> 1.0 GB).
COMPRESS_ABOVE_SHARE = 2.0
#: The compression methods a compressed job database does without: analysing them (FSST and ZSTD for strings,
#: roaring bitmaps for NULL masks) made its writes 20 to 40% slower, for a table 5 to 15% smaller.
COMPRESSION_SKIPPED = ("fsst", "zstd", "roaring")
#: The optimisers left out on a small job: a third of its planning time (join_order alone 7 ms of the 10 of
#: stream_facts); the filter pushdown that turns a filtered cross product into a join stays on.
SMALL_JOB_SKIPPED_OPTIMIZERS = (
    "join_order",
    "statistics_propagation",
    "expression_rewriter",
    "common_subplan",
    "common_subexpressions",
)


def _skip_optimizers(con: Any, error: type[Exception]) -> None:
    """Leave the :data:`SMALL_JOB_SKIPPED_OPTIMIZERS` this DuckDB knows out of ``con``'s plans (an older one
    lacks some, and refuses a list that names one)."""
    skipped: list[str] = []
    for names in (SMALL_JOB_SKIPPED_OPTIMIZERS, *((name,) for name in SMALL_JOB_SKIPPED_OPTIMIZERS)):
        try:
            con.execute(f"SET disabled_optimizers = '{','.join([*skipped, *names])}'")
        except error:
            continue
        if len(names) > 1:
            return
        skipped.extend(names)


_SIZE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def size_bytes(text: str) -> int | None:
    """A memory size as DuckDB reads it (``1500MB``, ``4GiB``: MB = 1000**2, MiB = 1024**2) in bytes; None for
    anything else (a share such as ``80%``, which DuckDB alone interprets)."""
    match = _SIZE.fullmatch(text)
    if match is None or match.group(2).lower() not in _SIZE_UNITS:
        return None
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


#: DuckDB's memory limit unless --memory-limit says otherwise.
DEFAULT_MEMORY_LIMIT = os.environ.get("TRAINTRACE_MEMORY_LIMIT", "1500MB")

#: Fields stored for every record; the rest of COLUMNS only exist in rare kinds (headers, errors, thread
#: names, drop notes) and are packed into one JSON column for those rows only, so that millions of rows
#: do not carry 17 empty columns (DuckDB keeps in-memory columns uncompressed).
CORE_COLUMNS = (
    "kind",
    "ts",
    "seq",
    "name",
    "id",
    "parent",
    "tid",
    "dur",
    "gpu_dur",
    "gpu_idle",
    "status",
    "span",
    "link",
    "attrs",
)
RARE_KINDS = ("header", "error", "thread", "dropped")
RARE_FIELDS = tuple(k for k in COLUMNS if k not in CORE_COLUMNS)

ITERATION = SpanName.ITERATION
#: Long phases, whose end (however they ended) the hang detection counts from (traintrace._monitor), as an
#: iteration's.
PROGRESS_PHASES = (
    SpanName.CHECKPOINT_SAVE_SYNC,
    SpanName.CHECKPOINT_SAVE_ASYNC,
    SpanName.CHECKPOINT_LOAD,
    SpanName.VALIDATION,
    SpanName.TEST,
    SpanName.DISTRIBUTED_INIT,
    SpanName.DATA_LOADER_INIT,
    SpanName.MODEL_INIT,
    SpanName.OPTIMIZER_INIT,
)
_PLAIN_ITERATION = f"kind = 'span' AND name = '{ITERATION}'"
BIG = 9_000_000_000_000_000_000


def _lost(status: str, end: str, step: str) -> str:
    """SQL: whether an iteration's work was thrown away (docs/analysis.md, ``lost_progress``).

    It did not end ``ok``; or a later stream of the same rank ran its step again (what a restart really
    redid); or, where no later stream says so, a rank of its attempt failed (a restart redoes the steps on
    every rank; a stream still running loses nothing) and the last completed checkpoint that protects it
    does not hold it: by step number where both are known (a checkpoint's ``current_iteration``
    counts the steps it holds), else by time (the iteration ended after the save).
    """
    known = f"{step} IS NOT NULL"
    redone = f"({known} AND f.redo_from IS NOT NULL AND {step} >= f.redo_from)"
    by_step = f"({known} AND f.ckpt_step IS NOT NULL AND {step} >= f.ckpt_step)"
    by_time = f"(NOT ({known} AND f.ckpt_step IS NOT NULL) AND {end} > coalesce(f.ckpt_end, -1))"
    unsaid = f"NOT ({known} AND f.redo_from IS NOT NULL)"
    stopped = "(f.attempt_failed AND NOT f.running)"
    return f"({status} <> 'ok' OR {redone} OR ({stopped} AND {unsaid} AND ({by_step} OR {by_time})))"


class MissingExtra(RuntimeError):
    """The analysis extra (DuckDB) is not installed."""


class LoadError(RuntimeError):
    """No traintrace records could be read from the given paths."""


#: The most ranks a job can have (as ``traintrace.configure`` accepts).
MAX_WORLD_SIZE = 1 << 20
#: Ten years in nanoseconds: a longer duration is a corrupt record.
_MAX_DUR = 10 * 365 * 86400 * 10**9


def _rare_spec() -> str:
    """The rare fields' types, as json_transform takes them."""
    return "{" + ", ".join(f'"{k}":"{COLUMNS[k]}"' for k in RARE_FIELDS) + "}"


def sql_string(text: str) -> str:
    """``text`` as a SQL string literal (quotes doubled: a TMPDIR may hold one)."""
    return "'" + text.replace("'", "''") + "'"


def sql_list(values: Sequence[str] | Sequence[int]) -> str:
    """A SQL list literal of strings or integers.

    Written into the statement rather than passed as a parameter: DuckDB converts a list parameter with code
    that first imports ``decimal``, ``uuid`` (and ``platform``) and ``datetime``, 5 ms of a command's start.
    """
    return "[" + ", ".join(sql_string(v) if isinstance(v, str) else str(int(v)) for v in values) + "]"


#: The oldest DuckDB the command runs on: read_json's file_index column came with 1.3 (the analysis extra's floor;
#: 1.3 to 2.0 answer alike on the benchmark's jobs).
MIN_DUCKDB = (1, 3)


def import_duckdb() -> ModuleType:
    """DuckDB's engine: its C extension module ``_duckdb`` where the package ships it as one.

    The ``duckdb`` package re-exports that module after importing its Python layers (the relational API, its
    version read through ``importlib.metadata``): about 100 ms, two thirds of a command's start on a small job.
    The command needs only ``connect``, ``Error`` and ``__version__``, which the extension holds; it is used
    when it lies beside the installed package (not a stray module of that name), else the package itself.
    """
    from importlib.util import find_spec

    missing = MissingExtra("the traintrace command needs DuckDB: pip install 'traintrace[analysis]'")
    try:
        package = find_spec("duckdb")
        engine = find_spec("_duckdb") if package is not None else None
    except (ImportError, ValueError):
        raise missing from None
    if package is None:
        raise missing
    beside = (
        engine is not None
        and engine.origin is not None
        and package.origin is not None
        and Path(engine.origin).parent == Path(package.origin).parent.parent
    )
    engine_module: ModuleType | None = None
    if beside:
        try:
            import _duckdb

            if all(hasattr(_duckdb, name) for name in ("connect", "Error", "__version__")):
                engine_module = _duckdb
        except ImportError:
            pass
    if engine_module is None:
        try:
            import duckdb
        except ImportError:
            raise missing from None
        engine_module = duckdb
    version = str(getattr(engine_module, "__version__", ""))
    if _version_tuple(version) < MIN_DUCKDB:
        floor = ".".join(map(str, MIN_DUCKDB))
        raise MissingExtra(
            f"the traintrace command needs DuckDB {floor} or later (this environment has {version or 'an unknown'}"
            "): pip install -U 'traintrace[analysis]'"
        )
    return engine_module


def _version_tuple(version: str) -> tuple[int, ...]:
    """``1.3.2`` -> (1, 3); a version it cannot read is taken as new enough (a development build, say)."""
    parts = version.split(".")
    try:
        return (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return (1 << 30,)


def enable_arrow_scan(engine: ModuleType) -> None:
    """Let ``engine`` (from :func:`import_duckdb`) scan Arrow streams, the native scanner's columns.

    The scan adapts what it reads through the ``duckdb._sources`` modules, which the package's ``__init__``
    hands to the extension (``_set_arrow_sources``) after importing all its other layers (about 90 ms). Those
    modules need only the standard library: they are imported on their own (about 15 ms), beneath a stand-in for
    the package that is removed at once, so that a later ``import duckdb`` runs the package's ``__init__`` as
    usual (and finds the same modules). Where that is not possible (another DuckDB), the package is imported.
    """
    if getattr(engine, "__name__", "") != "_duckdb" or "duckdb" in sys.modules:
        return  # the package is (or is being) imported: it sets the scan up itself
    hand_over = getattr(engine, "_set_arrow_sources", None)
    if hand_over is not None:
        import importlib
        from importlib.util import find_spec

        before = set(sys.modules)
        try:
            spec = find_spec("duckdb")
            if spec is not None and spec.submodule_search_locations:
                stand_in = ModuleType("duckdb")
                stand_in.__path__ = list(spec.submodule_search_locations)
                sys.modules["duckdb"] = stand_in
                try:
                    sources = importlib.import_module("duckdb._sources")
                finally:
                    del sys.modules["duckdb"]
                hand_over(sources)
                return
        except Exception:  # noqa: BLE001 - another layout of the package: import it whole
            for name in set(sys.modules) - before:
                if name.startswith("duckdb."):
                    del sys.modules[name]
    import duckdb  # noqa: F401


#: The metadata file of a Parquet export (``traintrace export --format parquet``); Spark and DuckDB
#: skip names starting with an underscore when they list the folder.
EXPORT_META = "_traintrace.json"
EXPORT_FORMAT = "traintrace-parquet"
EXPORT_VERSION = 1


#: Bumped whenever the tables a cache file holds change meaning.
CACHE_VERSION = 5  # 2: raw has the plain column; 3: other and spans_small have no column a; 4: spans_small a view;
# 5: headers holds the last run of the job only (all_headers every stream)


def cache_folder() -> Path:
    """Where ``--cache`` keeps finished jobs: $TRAINTRACE_CACHE_DIR, else $XDG_CACHE_HOME/traintrace."""
    explicit = os.environ.get("TRAINTRACE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "traintrace"


def find_export(paths: Sequence[str | os.PathLike[str]]) -> Path | None:
    """The Parquet export named by ``paths`` (one folder holding :data:`EXPORT_META`), else None."""
    if len(paths) == 1:
        folder = Path(paths[0])
        if (folder / EXPORT_META).is_file():
            return folder
    return None


def read_attempts(folders: Iterable[Path]) -> dict[tuple[int, int], Any]:
    """(rank, restart) -> that attempt's progress file in ``folders`` (the latest one written, where several)."""
    found_in: dict[tuple[int, int], Any] = {}
    names = sorted({str(folder) for folder in folders})
    try:
        # The reading module imports the writing side's (sockets, logging): only where there are files.
        if any(p.name.endswith(PROGRESS_SUFFIX) for folder in names for p in Path(folder).iterdir()):
            from ..progress import find_progress_files, read_progress

            for path in (p for folder in names for p in find_progress_files(folder)):
                found = read_progress(path)
                if found is None:
                    continue
                key = (found.rank, found.restart)
                known = found_in.get(key)
                if known is None or found.created_ns > known.created_ns:
                    found_in[key] = found
    except Exception:  # noqa: BLE001 - a progress file is a hint, never a failure
        return {}
    return found_in


#: Phases a rank runs before its first iteration: what its progress file's first iteration proves ended.
BEFORE_THE_LOOP = (
    SpanName.DISTRIBUTED_INIT,
    SpanName.DATA_LOADER_INIT,
    SpanName.MODEL_INIT,
    SpanName.OPTIMIZER_INIT,
    SpanName.CHECKPOINT_LOAD,
)


def new_runs(headers: Iterable[Sequence[Any]]) -> list[int]:
    """Where a file's streams (``(path, start_ts, restart, pid, ...)`` each) begin a new run of the job: the start
    of each file's last stream whose restart number is no higher than the one before it in the file, from another
    process (a second ``configure()`` in one process is no new run)."""
    by_file: dict[str, list[tuple[int, int, Any]]] = {}
    for path, start, restart, pid, *_ in headers:
        by_file.setdefault(str(path), []).append((int(start), int(restart or 0), pid))
    news = []
    for streams in by_file.values():
        streams.sort(key=lambda s: s[0])
        found = [now[0] for before, now in itertools.pairwise(streams) if now[1] <= before[1] and now[2] != before[2]]
        if found:
            news.append(found[-1])
    return news


def last_run_start(streams: Iterable[Sequence[Any]]) -> int | None:
    """Where a folder holds more than one run of a job (its files' streams, ``(path, start_ts, restart, pid,
    end_ts)`` each), the start of the last run, else None.

    A job run again under the same id (plain torchrun's default id is its master address and port) appends to
    the same files: a stream whose restart number is no higher than the stream before it in its file, from another
    process, begins a new run there (``new_runs``). Read as one job, a run that finished after one that failed read
    as failed, the ranks' states of both mixed. Runs follow one another: the last begins where nothing of the
    runs before it still ran, the latest such point at or before the start of each file's last new run (the
    launcher's stream, before its workers', is in it; a rank missing from the last run has its last new run in an
    earlier one)."""
    streams = list(streams)
    news = new_runs(streams)
    if not news:
        return None
    spans = [(int(start), max(int(start if end is None else end), int(start))) for _, start, _, _, end in streams]
    quiet: list[int] = []  # the starts before which every stream begun earlier had ended
    ran_until: int | None = None
    for start, end in sorted(spans):
        if ran_until is None or ran_until < start:
            quiet.append(start)
        ran_until = end if ran_until is None else max(ran_until, end)
    return max(max(q for q in quiet if q <= first) for first in news)


def own_progress(progress: Any, pid: Any) -> Any:
    """``progress`` (a progress file as read), or None where another process than ``pid`` wrote it."""
    if progress is None or (isinstance(pid, int) and getattr(progress, "pid", pid) != pid):
        return None
    return progress


def lived_until(progress: Any, end_ns: int, pid: Any) -> tuple[int, int | None]:
    """For a stream that ended without its close record at ``end_ns`` (its last record), from its attempt's
    progress file (``read_attempts``; None: none): when its rank last showed life (the writer stamps the file
    every flush interval, records or not; at the latest its first iteration's start), and that first iteration's
    start where it came after the stream's end (then a phase before the loop left open ended there). Spans left
    open end at the first, save those before the loop where the second is given. On the stream's host's clock.
    A file another process wrote (not ``pid``, the stream's: a job run again under the same restart number) says
    nothing of this one."""
    if own_progress(progress, pid) is None:
        return end_ns, None
    alive = int(getattr(progress, "alive_ns", None) or 0)
    first = int(getattr(progress, "first_step_ns", None) or 0)
    return max(end_ns, alive, first), (first if first > end_ns else None)


def discover(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """The .jsonl files named by ``paths``: files as given, folders searched recursively."""
    found: list[Path] = []
    for item in paths:
        path = Path(item)
        if path.is_dir():
            found.extend(sorted(p for p in path.rglob("*.jsonl") if p.is_file()))
        elif path.is_file():
            found.append(path)
        else:
            raise LoadError(f"{path}: no such file or folder")
    unique: dict[str, Path] = {}
    for path in found:
        unique.setdefault(str(path.resolve()), path)
    return [Path(p) for p in unique]


class ScratchFolder:
    """A new private folder (mode 0700, a random name) for DuckDB's temporary files, removed by :meth:`cleanup`
    or when this object goes.

    ``tempfile.TemporaryDirectory`` without importing it: tempfile and what it imports (random, shutil with bz2
    and lzma) cost 5 ms of a small job's command. The same places: the folder ``$TMPDIR``, ``$TEMP`` or ``$TMP``
    names, else ``/tmp``, ``/var/tmp``, ``/usr/tmp``; tempfile's own search (and its error) where none will do.
    """

    def __init__(self, prefix: str) -> None:
        bases = [os.environ[name] for name in ("TMPDIR", "TEMP", "TMP") if os.environ.get(name)]
        if os.name == "posix":
            bases += ["/tmp", "/var/tmp", "/usr/tmp"]
        self.name = ""
        for base in bases:
            for _attempt in range(10):
                path = Path(base).absolute() / (prefix + os.urandom(6).hex())
                try:
                    path.mkdir(0o700)
                except FileExistsError:
                    continue
                except OSError:
                    break
                self.name = str(path)
                break
            if self.name:
                break
        if not self.name:
            import tempfile

            self.name = tempfile.mkdtemp(prefix=prefix)
        self._finalizer = weakref.finalize(self, _remove_folder, self.name)

    def cleanup(self) -> None:
        self._finalizer()


def _remove_folder(path: str) -> None:
    try:
        Path(path).rmdir()  # empty unless DuckDB spilled, or the job was read through links or copies
    except FileNotFoundError:
        pass
    except OSError:
        import shutil

        shutil.rmtree(path, ignore_errors=True)


@dataclass
class FileCheck:
    path: str
    size: int
    truncated_last_line: bool


def check_tail(path: Path) -> FileCheck:
    """Whether the file's last line is cut short (a killed writer); reads only the last 64 KiB."""
    size = path.stat().st_size
    truncated = False
    if size:
        with path.open("rb") as handle:
            handle.seek(max(0, size - 65536))
            tail = handle.read()
        if not tail.endswith(b"\n"):
            last = tail.rsplit(b"\n", 1)[-1]
            try:
                json.loads(last)
            except ValueError:
                truncated = True
    return FileCheck(str(path), size, truncated)


@dataclass
class Job:
    """A job's records, loaded into an in-process DuckDB database.

    ``notes`` collects what the reader had to tolerate (cut lines, lost
    records, missing ranks), for the commands to print.
    """

    paths: list[Path]
    progress: bool = False
    threads: int | None = None
    memory_limit: str | None = None
    #: Keep only what summary, ranks and errors read (no attrs text of plain iteration records).
    lean: bool = False
    con: Any = None
    notes: list[str] = field(default_factory=list)
    files: list[FileCheck] = field(default_factory=list)
    load_seconds: float = 0.0
    record_count: int = 0
    _tmp: Any = None
    manifest_world_size: int = 0
    _progress_cache: dict[int, Any] | None = None
    _attempts_cache: dict[tuple[int, int], Any] | None = None
    #: The files that hold a header (of any run).
    header_paths: set[str] = field(default_factory=set)
    #: Where the folder holds several runs of the job: the last one's start (``last_run_start``); the streams of
    #: earlier runs, not read.
    last_run_start_ns: int | None = None
    earlier_run_streams: int = 0
    #: The hosts' clock offsets, once computed (``_diagnosis.host_clocks``).
    clocks: dict[str, Any] | None = None
    #: The size of the files the cache key was made from (-1: not made).
    _source_bytes: int = -1
    #: A Parquet export being read instead of JSON-lines files.
    export: Path | None = None
    #: Records dropped for an impossible duration (when the job was exported, for an export).
    ignored_spans: int = 0
    #: The cache file the tables came from or went to (``cache=True``), if any; ``cached``: came from.
    cache_path: Path | None = None
    cached: bool = False
    #: Who read the records into the raw table: ``native`` (traintrace's scanner, with DuckDB's reader for the
    #: lines it left), ``duckdb`` (read_json), ``parquet`` (an export), ``cache``; empty before loading.
    reader: str = ""
    #: Why the scanner was not used although built (DuckDB could not take its stream, say), for tests and bug reports.
    reader_error: str = ""
    #: Where DuckDB keeps the tables: ``memory``, or ``compressed`` (a database file in the scratch folder, for a job
    #: larger than :data:`COMPRESS_ABOVE_SHARE` of the memory limit); empty before loading.
    storage: str = ""

    @classmethod
    def open(
        cls,
        paths: Sequence[str | os.PathLike[str]],
        *,
        progress: bool = False,
        threads: int | None = None,
        memory_limit: str | None = None,
        lean: bool = False,
        cache: bool = False,
    ) -> Job:
        """Read the files into DuckDB; raises LoadError when nothing readable is there.

        ``lean``: drop the attributes of plain iteration records (all but ``step`` and ``batch_size``),
        which summary, ranks and errors never read; export, report and query need them.
        ``cache``: keep a finished job's tables in a DuckDB file under :func:`cache_folder`, keyed by the
        files' paths, sizes and modification times, and open that instead of reading the files again.
        """
        export = find_export(paths)
        if export is not None:
            job = cls([], progress, threads, memory_limit, lean=lean, export=export)
        else:
            files = discover(paths)
            if not files:
                raise LoadError("no .jsonl files found in " + ", ".join(str(p) for p in paths))
            job = cls(files, progress, threads, memory_limit, lean=lean)
            job.manifest_world_size = _manifest_world_size(paths)
        if cache:
            job.lean = False  # one cache serves every command
            key = job._cache_key()
            if job._open_cache(key):
                return job
            job._load()
            job._write_cache(key)
            return job
        job._load()
        return job

    # ------------------------------------------------------------ cache

    def _cache_key(self) -> str:
        """A digest of what the answers depend on: the files (path, size, mtime), the versions, the manifest."""
        import hashlib

        from .._version import __version__

        duckdb = import_duckdb()
        if self.export is not None:
            names = [self.export / EXPORT_META, *sorted(p for p in self.export.rglob("*.parquet") if p.is_file())]
        else:
            names = list(self.paths)
        stats = []
        self._source_bytes = 0
        for path in names:
            st = path.stat()
            stats.append([str(path.resolve()), st.st_size, st.st_mtime_ns])
            self._source_bytes += st.st_size
        text = json.dumps([CACHE_VERSION, __version__, duckdb.__version__, self.manifest_world_size, stats])
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def _open_cache(self, key: str) -> bool:
        path = cache_folder() / f"{key}.duckdb"
        if not path.is_file():
            return False
        started = time.perf_counter()
        self.con = con = self._connect(small=self._source_bytes < SMALL_JOB_BYTES)
        try:
            con.execute(f"ATTACH {sql_string(str(path))} AS cached (READ_ONLY)")
            meta = json.loads(con.execute("SELECT meta FROM cached.main.job_meta").fetchone()[0])
            tables = con.execute(
                "SELECT table_name FROM duckdb_tables() WHERE database_name = 'cached' AND table_name <> 'job_meta'"
            ).fetchall()
        except Exception:  # noqa: BLE001 - a damaged or foreign cache file is ignored, and rewritten
            con.close()
            self.con = None
            return False
        for (table,) in tables:
            con.execute(f'CREATE VIEW "{table}" AS SELECT * FROM cached.main."{table}"')
        self._spans_view()
        self._iterations_view()
        self.files = [FileCheck(f["path"], f["size"], f["truncated_last_line"]) for f in meta["files"]]
        self.paths = [Path(f.path) for f in self.files]
        self.notes = list(meta["notes"])
        self.record_count = int(meta["records"])
        self.manifest_world_size = int(meta["world_size"])
        self.ignored_spans = int(meta["ignored_spans"])
        self.cache_path = path
        self.cached = True
        self.reader = "cache"
        self.load_seconds = time.perf_counter() - started
        return True

    def _write_cache(self, key: str) -> None:
        """Keep the tables of a finished job (no stream still running); a failure to write is only a miss."""
        if self.con.execute("SELECT count(*) FROM running_streams").fetchone()[0]:
            return
        folder = cache_folder()
        path = folder / f"{key}.duckdb"
        meta = {
            "files": [
                {"path": f.path, "size": f.size, "truncated_last_line": f.truncated_last_line} for f in self.files
            ],
            "notes": self.notes,
            "records": self.record_count,
            "world_size": self.manifest_world_size,
            "ignored_spans": self.ignored_spans,
        }
        partial = folder / f".{key}.{os.getpid()}.partial"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            partial.unlink(missing_ok=True)
            self.con.execute(f"ATTACH {sql_string(str(partial))} AS cache_out")
            try:
                # "memory", or the compressed database file's name ("job")
                source = self.con.execute("SELECT current_database()").fetchone()[0]
                for (table,) in self.con.execute(
                    "SELECT table_name FROM duckdb_tables() WHERE database_name = $db AND NOT temporary", {"db": source}
                ).fetchall():
                    self.con.execute(
                        f'CREATE TABLE cache_out.main."{table}" AS SELECT * FROM "{source}".main."{table}"'
                    )
                self.con.execute("CREATE TABLE cache_out.main.job_meta AS SELECT $m AS meta", {"m": json.dumps(meta)})
            finally:
                self.con.execute("DETACH cache_out")
            partial.replace(path)
            self.cache_path = path
        except Exception as exc:  # noqa: BLE001 - a cache that cannot be written is a miss next time, no more
            partial.unlink(missing_ok=True)
            self.notes.append(f"cache not written ({exc})")

    # ------------------------------------------------------------ loading

    def _connect(self, small: bool = False, source_bytes: int = 0, tiny: bool = False) -> Any:
        """A DuckDB database for the job's tables; ``small``: for a job under :data:`SMALL_JOB_BYTES`; ``tiny``: no
        optimiser at all (:data:`TINY_JOB_BYTES`).

        In memory, unless the job's files (``source_bytes``) hold more than :data:`COMPRESS_ABOVE_SHARE` of the
        memory limit: then a database file in the scratch folder, whose tables DuckDB compresses as it writes them.
        """
        duckdb = import_duckdb()
        self._tmp = ScratchFolder("traintrace-duckdb-")
        limit = self.memory_limit or DEFAULT_MEMORY_LIMIT
        config: dict[str, Any] = {
            "preserve_insertion_order": False,
            # Past this DuckDB spills to the temporary folder instead of growing: memory stays bounded.
            "memory_limit": limit,
            "temp_directory": self._tmp.name,
        }
        if self.threads:
            config["threads"] = self.threads
        elif small:
            config["threads"] = 1
        limit_bytes = size_bytes(limit)
        compressed = not small and limit_bytes is not None and source_bytes > COMPRESS_ABOVE_SHARE * limit_bytes
        database = str(Path(self._tmp.name) / "job.duckdb") if compressed else ":memory:"
        con = duckdb.connect(database, config=config)
        self.storage = "compressed" if compressed else "memory"
        if compressed:
            try:
                con.execute(f"SET disabled_compression_methods = '{','.join(COMPRESSION_SKIPPED)}'")
            except duckdb.Error:  # an older DuckDB that lacks one of them: it analyses them too, a little slower
                pass
        if tiny:
            con.execute("SET enable_optimizer = false")
        elif small:
            _skip_optimizers(con, duckdb.Error)
        # Progress is tracked (query_progress) but never printed by DuckDB itself: ours goes to stderr.
        # Off unless shown: in a Jupyter kernel DuckDB refuses the setting without ipywidgets.
        try:
            shown = "true" if self.progress else "false"
            con.execute(f"SET enable_progress_bar = {shown}; SET enable_progress_bar_print = false")
        except duckdb.Error:
            self.progress = False
        return con

    def _load(self) -> None:
        started = time.perf_counter()
        reads: list[str] = []
        if self.export is None:
            self.files = [check_tail(p) for p in self.paths]
        else:
            reads = self._read_export()
        scan = self._scanner() if self.export is None else None
        if scan is not None:
            # The scanner's threads read the first batches while DuckDB is imported and connected (50 to 100 ms).
            try:
                scan.start()
            except (OSError, RuntimeError) as exc:
                self.reader_error = str(exc)
                scan = None
        source_bytes = sum(f.size for f in self.files)
        self.con = con = self._connect(
            small=source_bytes < SMALL_JOB_BYTES,
            source_bytes=source_bytes,
            tiny=self.lean and source_bytes < TINY_JOB_BYTES,
        )
        rare_sql = f"""
            CREATE TABLE rare AS SELECT file, kind, ts, seq, unnest(json_transform(rare, '{_rare_spec()}'))
            FROM raw WHERE rare IS NOT NULL
        """
        with self._progress_while("reading"):
            # A file is named by its place in the list read (8 bytes per row, not the path).
            paths = sql_list([str(f.path) for f in self.files])
            con.execute(
                f"CREATE TABLE files AS SELECT unnest(range(len({paths})))::BIGINT AS file, unnest({paths}) AS path"
            )
            if scan is not None and self._load_scanned(scan):
                self.reader = "native"
            elif self.export is None:
                con.execute("DROP TABLE IF EXISTS raw")
                files = sql_list(self._names_to_read())
                con.execute(self._select_json("CREATE TABLE raw AS", "file_index::BIGINT", files))
                self.reader = "duckdb"
            else:
                con.execute(self._select_export(), {"files": reads})
                self.reader = "parquet"
            # A duration beyond ten years (9e18 from a bad record_span, say) would overflow ts + dur.
            bad = con.execute(
                f"DELETE FROM raw WHERE (dur IS NULL AND kind IN ('span', 'end')) OR dur < 0 OR dur > {_MAX_DUR}"
            ).fetchone()
            self.ignored_spans += int(bad[0]) if bad and bad[0] else 0
            if self.ignored_spans:
                self.notes.append(
                    f"{self.ignored_spans} spans without a possible duration (none, negative, over ten years) ignored"
                )
            con.execute(rare_sql)
            self.record_count = int(con.execute("SELECT count(*) FROM raw").fetchone()[0])
            self._build_tables()
        if self.record_count == 0:
            raise LoadError("no traintrace records in " + ", ".join(f.path for f in self.files))
        self.load_seconds = time.perf_counter() - started
        self._collect_notes()

    def _select_parts(self) -> tuple[str, str, str]:
        """The columns every source gives alike: the core ones but attrs, the rare kinds, the packed rare fields."""
        names = ", ".join(f'"{k}"' for k in CORE_COLUMNS if k != "attrs")
        rare_kinds = ", ".join(f"'{k}'" for k in RARE_KINDS)
        packed = "{" + ", ".join(f"'{k}': \"{k}\"" for k in RARE_FIELDS) + "}"
        return names, rare_kinds, packed

    def _lean_attrs(self) -> str:
        # Plain iteration records are nearly every record: the two attributes the analyses read from them
        # become typed columns in the scan; their attrs text is kept only when a command shows it (lean=False).
        return f"CASE WHEN {_PLAIN_ITERATION} THEN NULL ELSE attrs END" if self.lean else "attrs"

    def _select_json(self, into: str, file: str, files: str = "$files") -> str:
        """``into`` (``CREATE TABLE raw AS``, ``INSERT INTO raw BY NAME``) the rows of read_json(``files``)."""
        names, rare_kinds, packed = self._select_parts()
        columns = "{" + ", ".join(f"'{k}': '{v}'" for k, v in COLUMNS.items()) + "}"
        step = f"CASE WHEN {_PLAIN_ITERATION} THEN try_cast(attrs->>'step' AS BIGINT) END"
        batch_size = f"CASE WHEN {_PLAIN_ITERATION} THEN try_cast(attrs->>'batch_size' AS BIGINT) END"
        return (
            f"{into} SELECT {file} AS file, {names}, {self._lean_attrs()} AS attrs, {step} AS step, "
            f"{batch_size} AS batch_size, CASE WHEN kind IN ({rare_kinds}) THEN to_json({packed}) END AS rare, "
            f"{_PLAIN_ITERATION} AS plain FROM read_json({files}, format='newline_delimited', columns={columns}, "
            "ignore_errors=true, maximum_object_size=67108864) WHERE kind IS NOT NULL"
        )

    def _select_export(self) -> str:
        """The raw table from a Parquet export (``export --format parquet``): the same columns, typed."""
        names, rare_kinds, packed = self._select_parts()
        return (
            f"CREATE TABLE raw AS SELECT file, {names}, ({self._lean_attrs()})::JSON AS attrs, step, batch_size, "
            f"CASE WHEN kind IN ({rare_kinds}) THEN to_json({packed}) END AS rare, {_PLAIN_ITERATION} AS plain "
            "FROM read_parquet($files, hive_partitioning=true, hive_types={'rank': 'BIGINT'}) WHERE kind IS NOT NULL"
        )

    def _scanner(self) -> Any:
        """traintrace's own scanner over the files (``_reader.scanner``), or None where DuckDB reads them."""
        from ._reader import scanner

        try:
            return scanner(self.paths, CORE_COLUMNS, RARE_KINDS, lean=self.lean, threads=self.threads)
        except (OSError, ValueError, TypeError) as exc:  # DuckDB's reader then reads, and says what is wrong
            self.reader_error = str(exc)
            return None

    def _load_scanned(self, scan: Any) -> bool:
        """The raw table from the scanner's stream, and the lines it left to DuckDB read by read_json: the same
        rows as read_json of the files gives. False (nothing created) if DuckDB could not take the stream."""
        con = self.con
        names, _, _ = self._select_parts()
        try:
            enable_arrow_scan(import_duckdb())
            con.register("_traintrace_scan", scan)
            try:
                # The scanner gives attrs as written; json() writes it as DuckDB's reader does (minified, numbers
                # and escapes normalised). The rare fields come as a JSON object of their literals: typed, then
                # written as read_json's path writes them. Only where there are any: json_transform costs about
                # 0.2 µs for each row even when its argument is NULL (a third of this statement's time).
                con.execute(
                    f"CREATE TABLE raw AS SELECT file, {names}, json(attrs) AS attrs, step, batch_size, "
                    f"CASE WHEN rare IS NOT NULL THEN to_json(json_transform(rare, '{_rare_spec()}')) END AS rare, "
                    f"{_PLAIN_ITERATION} AS plain FROM _traintrace_scan"
                )
            finally:
                con.unregister("_traintrace_scan")
            deferred = scan.deferred()
        except Exception as exc:  # noqa: BLE001 - an older DuckDB without the Arrow stream interface, say
            self.reader_error = str(exc)
            return False
        if deferred:
            # Lines the scanner could not be sure of (cut, not JSON, unusual values): DuckDB's own reader decides,
            # from copies in the scratch folder, one per job file (a blank first line: no byte-order mark to skip).
            order = sorted(deferred)
            copies = []
            for index in order:
                copy = Path(self._tmp.name) / f"deferred{index}.jsonl"
                copy.write_bytes(b"\n" + deferred[index])
                copies.append(str(copy))
            con.execute(
                self._select_json("INSERT INTO raw BY NAME", "list_extract($index::BIGINT[], file_index::BIGINT + 1)"),
                {"files": copies, "index": order},
            )
        return True

    def _read_export(self) -> list[str]:
        """The Parquet files of the export, after taking the job's description from its metadata file."""
        assert self.export is not None
        meta_path = self.export / EXPORT_META
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
            if meta.get("format") != EXPORT_FORMAT or meta.get("version") != EXPORT_VERSION:
                raise LoadError(f"{meta_path}: not a traintrace Parquet export this version reads")
            self.files = [
                FileCheck(str(f["path"]), int(f["size"]), bool(f["truncated_last_line"])) for f in meta["files"]
            ]
            self.manifest_world_size = int(meta.get("world_size") or 0)
            self.ignored_spans = int(meta.get("ignored_spans") or 0)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise LoadError(f"{meta_path}: unreadable export metadata ({exc})") from None
        self.paths = [Path(f.path) for f in self.files]
        parts = sorted(str(p) for p in self.export.rglob("*.parquet") if p.is_file())
        if not parts:
            raise LoadError(f"{self.export}: no .parquet files in the export")
        return parts

    def _names_to_read(self) -> list[str]:
        """The paths DuckDB reads: a file whose name has glob characters (``rank*.jsonl``) is
        read through a link with a plain name, so it is read once, not as a pattern."""
        reads: list[str] = []
        for index, check in enumerate(self.files):
            path = str(Path(check.path).resolve())
            if any(ch in path for ch in "*?[]{}"):
                link = Path(self._tmp.name) / f"file{index}.jsonl"
                link.symlink_to(path)
                path = str(link)
            reads.append(path)
        return reads

    @property
    def scratch(self) -> str:
        """The job's private temporary folder (DuckDB spills there; export writes its pieces there)."""
        return str(self._tmp.name)

    def restrict_external_access(self) -> None:
        """From now on no query may read or write files outside :attr:`scratch`, nor load extensions."""
        folder = sql_string(self.scratch.rstrip("/") + "/")
        self.con.execute(f"SET allowed_directories = [{folder}]")
        self.con.execute("SET enable_external_access = false")

    def attr_fields(self, attrs: str) -> str:
        """SQL: a struct of the ``ATTR_FIELDS`` of the JSON column ``attrs``, each as ``->>`` gives it.

        For the few records that hold such figures (progress events), in the query that reads them: built for
        every record in ``other`` it took half of that table's time on a job with phase spans, for nothing.
        One extraction of the list of keys parses each document once instead of once per key. The Spark engine
        extracts them one by one.
        """
        keys = ", ".join(f"'{f}'" for f in ATTR_FIELDS)
        return (
            "{"
            + ", ".join(f"'{f}': json_extract_string({attrs}, [{keys}])[{i}]" for i, f in enumerate(ATTR_FIELDS, 1))
            + "}"
        )

    def _build_tables(self) -> None:
        con = self.con
        # One row per stream (process start). A record belongs to the stream whose header precedes it in
        # time in the same file (restarts append); records before a file's first header go to that header.
        con.execute(
            f"""
            CREATE TABLE all_headers AS
            SELECT *, CASE WHEN row_number() OVER w = 1 THEN {-BIG} ELSE start_ts END AS lo,
                   coalesce(lead(start_ts) OVER w, {BIG}) AS hi,
                   lead(start_ts) OVER w AS next_start
            FROM (
                SELECT file, path, ts AS start_ts, rank, world_size, coalesce(restart, 0) AS restart, job,
                       job_name, host, pid,
                       (rank IS NULL OR coalesce(source, role, '') = 'agent'
                        OR regexp_matches(path, '(^|/)agent[^/]*\\.jsonl$')) AS is_agent,
                       row_number() OVER (ORDER BY path, ts) AS stream
                FROM rare JOIN files USING (file) WHERE kind = 'header'
                      AND schema = '{SCHEMA}' AND schema_version = {SCHEMA_VERSION}
            )
            WINDOW w AS (PARTITION BY file ORDER BY start_ts)
            """
        )
        # The streams of the folder's last run of the job (``last_run_start``): an earlier run's records stay in
        # the files, and are not read.
        seen = con.execute("SELECT path, start_ts, restart, pid, stream FROM all_headers").fetchall()
        self.header_paths = {str(row[0]) for row in seen}
        since = None
        if new_runs(seen):  # where each stream ended, then: a pass over the records, for such a folder only
            ends = dict(
                con.execute(
                    "SELECT h.stream, max(r.ts + coalesce(r.dur, 0)) FROM raw r JOIN all_headers h "
                    "ON r.file = h.file AND r.ts >= h.lo AND r.ts < h.hi GROUP BY h.stream"
                ).fetchall()
            )
            since = last_run_start((path, ts, again, pid, ends.get(number)) for path, ts, again, pid, number in seen)
        self.last_run_start_ns, self.earlier_run_streams = since, 0
        if since is None:
            con.execute("CREATE TABLE headers AS SELECT * FROM all_headers")
        else:
            con.execute(f"CREATE TABLE headers AS SELECT * FROM all_headers WHERE start_ts >= {int(since)}")
            self.earlier_run_streams = sum(1 for row in seen if int(row[1]) < since)
        con.execute(
            """
            CREATE TABLE other AS
            SELECT h.stream, h.rank AS stream_rank, h.restart AS stream_restart, h.is_agent,
                   r.* EXCLUDE (rare, step, batch_size, plain), x.error_type, x.message, x.stack, x.thread_name,
                   x.count, x.reason, x.source, x.role
            FROM raw r JOIN headers h ON r.file = h.file AND r.ts >= h.lo AND r.ts < h.hi
            LEFT JOIN rare x ON x.file = r.file AND x.ts = r.ts AND x.kind = r.kind AND x.seq IS NOT DISTINCT FROM r.seq
            WHERE NOT r.plain AND r.kind <> 'header'
            """
        )
        # Spans other than plain iteration records: complete ones, and start/end pairs merged by id (a table of
        # their own; spans_small is a view of both, see _spans_view).
        con.execute(
            """
            CREATE TABLE span_pairs AS
            SELECT s.file, s.stream, s.stream_rank AS rank, s.stream_restart AS restart, s.is_agent, s.name, s.id,
                   s.parent, s.tid, s.link, s.ts, e.dur, e.gpu_dur, e.gpu_idle, coalesce(e.status, 'open') AS status,
                   CASE WHEN e.attrs IS NULL THEN s.attrs WHEN s.attrs IS NULL THEN e.attrs
                        ELSE json_merge_patch(s.attrs, e.attrs) END AS attrs,
                   e.id IS NULL AS open, NULL::BIGINT AS seq
            FROM (SELECT * FROM other WHERE kind = 'start') s
            LEFT JOIN (SELECT * FROM other WHERE kind = 'end') e ON s.stream = e.stream AND s.id = e.id
            """
        )
        self._spans_view()
        # Where each stream ends, counting its plain iteration records (aggregated, not copied).
        con.execute(
            """
            CREATE TABLE streams AS
            SELECT h.* EXCLUDE (lo, hi),
                   greatest(h.start_ts, coalesce(e.end_ts, h.start_ts), coalesce(i.end_ts, h.start_ts)) AS end_ts,
                   coalesce(e.n, 0) + coalesce(i.n, 0) + 1 AS records,
                   greatest(coalesce(e.max_seq, 0), coalesce(i.max_seq, 0)) + 1 AS seq_span,
                   coalesce(e.closed, false) AS closed, coalesce(e.errors, 0) AS errors,
                   coalesce(e.dropped, 0) AS dropped, e.last_ts, i.ok_ts, i.ok_end, i.ok_step, i.first_step
            FROM headers h
            LEFT JOIN (
                SELECT stream, max(ts + CASE WHEN kind = 'span' THEN coalesce(dur, 0) ELSE 0 END) AS end_ts,
                       count(*) AS n, max(seq) AS max_seq,
                       bool_or(kind = 'close') AS closed, count(*) FILTER (kind = 'error') AS errors,
                       sum(count) FILTER (kind = 'dropped' AND reason = 'queue_full') AS dropped,
                       max(ts) AS last_ts
                FROM other GROUP BY stream
            ) e USING (stream)
            LEFT JOIN (
                SELECT h.stream, max(r.ts + coalesce(r.dur, 0)) AS end_ts, count(*) AS n, max(r.seq) AS max_seq,
                       -- the last completed plain iteration, for the diagnosis (in this pass, not one more)
                       max(r.ts) FILTER (r.status = 'ok') AS ok_ts,
                       max(r.ts + r.dur) FILTER (r.status = 'ok') AS ok_end,
                       arg_max(r.step, r.ts) FILTER (r.status = 'ok') AS ok_step,
                       min(r.step) AS first_step  -- for what a later stream redid
                FROM raw r JOIN headers h ON r.file = h.file AND r.ts >= h.lo AND r.ts < h.hi
                WHERE r.plain
                GROUP BY h.stream
            ) i USING (stream)
            """
        )
        self._stream_facts()
        # Iterations: plain records (a view over the big table: no copy) and start/end pairs, each marked
        # lost or not (docs/analysis.md).
        con.execute(
            f"""
            CREATE TABLE iterations_small AS
            SELECT f.stream, f.rank, f.restart, s.ts, s.dur, s.status,
                   {_lost("s.status", "s.ts + s.dur", "try_cast(s.attrs->>'step' AS BIGINT)")} AS lost,
                   s.attrs, s.tid, NULL::BIGINT AS seq, s.id, s.parent, s.file, s.gpu_dur, s.gpu_idle,
                   try_cast(s.attrs->>'step' AS BIGINT) AS step,
                   try_cast(s.attrs->>'batch_size' AS BIGINT) AS batch_size
            FROM spans_small s JOIN stream_facts f USING (stream)
            WHERE s.name = '{ITERATION}' AND NOT s.is_agent AND NOT s.open
            """
        )
        self._iterations_view()

    def _spans_view(self) -> None:
        # A view, not a copy: on a job with phase spans (forward, backward, ...: five records a step) the complete
        # spans are most of `other`, and copying them cost as much as building `other` (0.1 s of 0.9 on a
        # 900,000-record file); a pass over the view reads `other` with one more test (kind).
        self.con.execute(
            """
            CREATE VIEW spans_small AS
            SELECT file, stream, stream_rank AS rank, stream_restart AS restart, is_agent, name, id, parent,
                   tid, link, ts, dur, gpu_dur, gpu_idle, status, attrs, false AS open, seq
            FROM other WHERE kind = 'span'
            UNION ALL
            SELECT * FROM span_pairs
            """
        )

    def _iterations_view(self) -> None:
        self.con.execute(
            f"""
            CREATE VIEW iterations AS
            SELECT f.stream, f.rank, f.restart, r.ts, r.dur, r.status,
                   {_lost("r.status", "r.ts + r.dur", "r.step")} AS lost,
                   r.attrs, r.tid, r.seq, r.id, r.parent, r.file, r.gpu_dur, r.gpu_idle, r.step, r.batch_size
            FROM raw r JOIN stream_facts f ON r.file = f.file AND r.ts >= f.lo AND r.ts < f.hi
            WHERE r.plain AND NOT f.is_agent
            UNION ALL
            SELECT * FROM iterations_small
            """
        )

    def _stream_facts(self) -> None:
        """Per stream: did it fail, is it still running, the job's last completed checkpoint, any hang.

        A checkpoint protects every rank's progress (docs/analysis.md): when only some ranks save (the
        replicated model saved by rank 0), the latest save of any of them counts for all ranks of that
        restart; when every rank saves (its shard; a save started counts), each rank's own latest completed
        save counts for it.
        """
        hang = f"'{EventName.HANG_SUSPECTED}'"
        ok = SpanStatus.OK
        sync, async_ = SpanName.CHECKPOINT_SAVE_SYNC, SpanName.CHECKPOINT_SAVE_ASYNC
        final = SpanName.CHECKPOINT_SAVE_FINALIZATION
        failed = f"'{SpanStatus.ERROR}', '{SpanStatus.TERMINATED}'"
        outer = f"'{SpanName.APPLICATION}', '{SpanName.TRAINING_LOOP}', '{SpanName.ITERATION}'"
        progress = ", ".join(f"'{name}'" for name in PROGRESS_PHASES)
        errors, restarted = self._running_streams()
        # A statement's planning costs DuckDB about as much as running it on a small job (this one: 13 ms of a
        # 0.2 s command): the parts for hangs and for restarts are left out where the streams show none (no
        # error record; no rank with a second stream), their columns NULL as they would come out.
        hangs = f"""
            , hang AS (
                -- A hang that ended (hang_resolved after the last report) is time in whatever it happened in.
                SELECT h.stream, h.hang_ts FROM (
                    SELECT stream, min(ts) AS hang_ts, max(ts) AS last_ts FROM other
                    WHERE kind = 'error' AND (name IN ({hang}) OR error_type IN ({hang})) GROUP BY stream) h
                WHERE NOT EXISTS (SELECT 1 FROM other o WHERE o.stream = h.stream AND o.kind = 'event'
                                  AND o.name = '{EventName.HANG_RESOLVED}' AND o.ts >= h.last_ts)
            ), hang_raw AS (
                -- Where each hang began: the end of the stream's last iteration before its hang_suspected record.
                SELECT hang.stream, max(r.ts + r.dur) AS iter_end
                FROM hang JOIN headers h USING (stream)
                JOIN raw r ON r.file = h.file AND r.ts >= h.lo AND r.ts < h.hi
                WHERE r.plain AND r.ts + r.dur <= hang.hang_ts
                GROUP BY hang.stream
            ), hang_pairs AS (
                -- Or of the last progress other than an iteration, as the hang detection measures it: the end of a
                -- long phase (a checkpoint save or load, validation, test, initialisation), however it ended (the
                -- plain limit counts from there), the training loop's start.
                SELECT hang.stream,
                       max(CASE WHEN s.name = '{SpanName.TRAINING_LOOP}'
                                 AND (s.open OR s.ts + s.dur > hang.hang_ts) THEN s.ts
                                ELSE s.ts + s.dur END) AS iter_end
                FROM hang JOIN spans_small s USING (stream)
                WHERE (s.name = '{SpanName.TRAINING_LOOP}' AND s.ts <= hang.hang_ts)
                   OR (NOT s.open AND s.ts + s.dur <= hang.hang_ts
                       AND s.name IN ('{ITERATION}', {progress}))
                GROUP BY hang.stream
            )"""
        hang_ts = "hang.hang_ts"
        hang_from = """CASE WHEN hang.hang_ts IS NOT NULL
                   THEN greatest(coalesce(hr.iter_end, 0), coalesce(hp.iter_end, 0), s.start_ts) END AS hang_from"""
        hang_joins = (
            "LEFT JOIN hang USING (stream) LEFT JOIN hang_raw hr USING (stream) LEFT JOIN hang_pairs hp USING (stream)"
        )
        if not errors:
            hangs, hang_joins = "", ""
            hang_ts, hang_from = "NULL::BIGINT AS hang_ts", "NULL::BIGINT AS hang_from"
        redos = f"""
            , pair_first AS (
                SELECT stream, min(try_cast(attrs->>'step' AS BIGINT)) AS first_step FROM spans_small
                WHERE name = '{SpanName.ITERATION}' GROUP BY stream
            ), redo AS (
                -- The first step any later stream of the same rank ran: that stream redid every step from it on.
                SELECT stream, min(first_step) OVER (
                           PARTITION BY rank ORDER BY start_ts ROWS BETWEEN 1 FOLLOWING AND UNBOUNDED FOLLOWING
                       ) AS redo_from
                FROM (SELECT s.stream, s.rank, s.start_ts,
                             CASE WHEN p.first_step IS NULL THEN s.first_step
                                  WHEN s.first_step IS NULL THEN p.first_step
                                  ELSE least(s.first_step, p.first_step) END AS first_step
                      FROM streams s LEFT JOIN pair_first p USING (stream) WHERE NOT s.is_agent) x
            )"""
        redo_column, redo_join = "redo.redo_from", "LEFT JOIN redo USING (stream)"
        if not restarted:
            redos, redo_column, redo_join = "", "NULL::BIGINT AS redo_from", ""
        self.con.execute(
            f"""
            CREATE TABLE stream_facts AS
            WITH ck AS (
                SELECT stream, max(ts + dur) AS ckpt_end,
                       -- the steps the latest save holds, when every save says (else NULL: the time rule)
                       CASE WHEN count(*) = count(try_cast(attrs->>'current_iteration' AS BIGINT))
                            THEN max(try_cast(attrs->>'current_iteration' AS BIGINT)) END AS ckpt_step
                FROM spans_small
                WHERE status = '{ok}' AND (name IN ('{sync}', '{final}')
                      OR (name = '{async_}' AND NOT EXISTS (
                          SELECT 1 FROM spans_small f WHERE f.name = '{final}')))
                GROUP BY stream
            ), saving AS (
                SELECT DISTINCT stream FROM spans_small
                WHERE name IN ('{sync}', '{async_}', '{final}')
            ), attempt AS (
                SELECT s.restart, count(*) AS ranks, count(v.stream) AS savers, max(ck.ckpt_end) AS any_end,
                       CASE WHEN count(ck.stream) = count(ck.ckpt_step) THEN max(ck.ckpt_step) END AS any_step
                FROM streams s LEFT JOIN ck USING (stream) LEFT JOIN saving v USING (stream)
                WHERE NOT s.is_agent GROUP BY s.restart
            ), bad AS (
                SELECT DISTINCT stream FROM spans_small
                WHERE status IN ({failed}) AND name IN ({outer})
            ){redos}{hangs}
            SELECT s.stream, s.file, s.rank, s.restart, s.start_ts, s.end_ts, s.closed, s.is_agent, s.next_start,
                   (NOT s.closed AND r.stream IS NULL) OR bad.stream IS NOT NULL AS failed,
                   -- a rank of the attempt failed: a restart redoes what its checkpoint does not hold on every rank
                   bool_or((NOT s.closed AND r.stream IS NULL) OR bad.stream IS NOT NULL)
                       OVER (PARTITION BY s.restart, s.is_agent) AS attempt_failed,
                   r.stream IS NOT NULL AND NOT s.closed AS running,
                   CASE WHEN a.savers = a.ranks THEN ck.ckpt_end ELSE a.any_end END AS ckpt_end,
                   CASE WHEN a.savers = a.ranks THEN ck.ckpt_step ELSE a.any_step END AS ckpt_step,
                   {redo_column}, {hang_ts}, h.lo, h.hi, {hang_from}
            FROM streams s JOIN headers h USING (stream)
            LEFT JOIN attempt a ON a.restart = s.restart AND NOT s.is_agent
            LEFT JOIN ck USING (stream) LEFT JOIN bad USING (stream) LEFT JOIN running_streams r USING (stream)
            {hang_joins} {redo_join}
            """
        )

    def _running_streams(self) -> tuple[bool, bool]:
        """The streams whose process is still running (docs/analysis.md, "Running jobs"), as a table; returns
        whether any stream has an error record, and whether any rank has more than one stream (a restart)."""
        every = self.con.execute(
            """
            SELECT s.stream, s.path, s.rank, s.restart, s.host, s.pid, s.start_ts, s.closed, s.errors,
                   s.end_ts, s.next_start IS NULL AS last, s.is_agent
            FROM streams s
            """
        ).fetchall()
        rows = [row[:-1] for row in every if not row[-1]]
        any_errors = any(row[8] for row in every)
        restarted = len({row[2] for row in rows}) < len(rows)
        # A launcher that ended (its stream closed, or its job_end written) had stopped its workers first: no
        # rank of its host that started while it ran is running, however recent its last record (a remote host's
        # processes cannot be looked up; a whole multi-node job terminated a second ago is not running).
        from .._lifecycle import EventType

        launchers_done = self.con.execute(
            "SELECT host, start_ts, end_ts FROM streams WHERE is_agent AND (closed OR stream IN "
            f"(SELECT stream FROM other WHERE is_agent AND kind = 'event' AND name = '{EventType.JOB_END.value}'))"
        ).fetchall()
        running: list[int] = []
        now = time.time_ns()
        for stream, _path, rank, restart, host, pid, start_ts, closed, errors, end_ts, last in rows:
            if closed or not last:
                continue
            if any(
                h is not None and h == host and None not in (began, ended, start_ts) and began <= start_ts <= ended
                for h, began, ended in launchers_done
            ):
                continue
            # Only a stream without a close record needs the progress files (and their module's imports).
            p = self.progress_files().get(rank)
            if p is not None and getattr(p, "restart", restart) != restart:
                p = None
            # "Wrote recently" is the stream's last record, not the file's time (a copied file is new);
            # a record from the future (beyond clock skew) is a made-up job, never a running one.
            last_write = end_ts if end_ts <= now + RECENT_S * 1e9 else 0
            header = {"pid": pid, "host": host, "ts": start_ts}
            if _stream_state(p, bool(errors), header, last_write, now) == "running":
                running.append(int(stream))
        self._create_stream_list("running_streams", running)
        return any_errors, restarted

    def _create_stream_list(self, name: str, streams: list[int]) -> None:
        """A one-column table ``stream`` of the given stream numbers (the Spark engine builds it its own way)."""
        self.con.execute(f"CREATE TABLE {name} AS SELECT unnest({sql_list(streams)}::BIGINT[]) AS stream")

    def progress_files(self) -> dict[int, Any]:
        """rank -> the rank's progress file (``traintrace.progress``), for the folders of the job's files: its
        latest attempt's."""
        if self._progress_cache is None:
            latest: dict[int, Any] = {}
            for (rank, _), found in sorted(self.progress_of_attempts().items()):
                latest[rank] = found
            self._progress_cache = latest
        return self._progress_cache

    def progress_of_attempts(self) -> dict[tuple[int, int], Any]:
        """(rank, restart) -> that attempt's progress file: a restart keeps the file of the attempt before it
        (``rank0.restart0.progress``) where no launcher of traintrace's copied it."""
        if self._attempts_cache is None:
            self._attempts_cache = read_attempts(Path(f.path).parent for f in self.files)
        return self._attempts_cache

    def _collect_notes(self) -> None:
        for check in self.files:
            if check.truncated_last_line:
                self.notes.append(f"{check.path}: last line cut short (writer killed?); skipped")
        lost = self.con.execute(
            "SELECT count(*), sum(seq_span - records), sum(dropped) FROM streams WHERE seq_span > records"
        ).fetchone()
        if lost and lost[0]:
            self.notes.append(
                f"{lost[1]} records missing by sequence number in {lost[0]} stream(s) "
                f"({int(lost[2] or 0)} reported dropped by the writer; the rest unreadable lines)"
            )
        for path in (f.path for f in self.files if f.size and f.path not in self.header_paths):
            self.notes.append(f"{path}: no traintrace header; its records are ignored")
        if self.last_run_start_ns is not None:
            began = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self.last_run_start_ns / 1e9))
            self.notes.append(
                f"the folder holds more than one run of this job (restart numbers begin again): the answers are "
                f"about the last, begun {began} UTC; {self.earlier_run_streams} stream(s) of earlier runs are not read"
            )
        missing = self.missing_ranks()
        if missing:
            self.notes.append(f"ranks missing entirely (no file): {compress_ranks(missing)}")

    def missing_ranks(self) -> list[int]:
        row = self.con.execute("SELECT max(world_size) FROM headers WHERE NOT is_agent").fetchone()
        world = max(int(row[0]) if row and row[0] is not None else 0, self.manifest_world_size)
        # A header claiming more ranks than any job has (1e9) is corrupt: never list them all.
        world = min(world, MAX_WORLD_SIZE)
        rows = self.con.execute("SELECT DISTINCT rank FROM headers WHERE NOT is_agent").fetchall()
        seen = {int(r[0]) for r in rows}
        return [r for r in range(world) if r not in seen]

    def close(self) -> None:
        """Remove the scratch folder (DuckDB's spilled tables, a compressed database); the connection stays open
        until this object goes (the command exits without waiting for DuckDB's teardown, see ``cli.entry``).
        The Spark engine releases its cached views."""
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # ------------------------------------------------------------ helpers

    def rows(self, sql: str, params: Sequence[Any] | dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        with self._progress_while("analysing"):
            result: list[tuple[Any, ...]] = self.con.execute(sql, params or []).fetchall()
        return result

    def one(self, sql: str, params: Sequence[Any] | dict[str, Any] | None = None) -> tuple[Any, ...]:
        rows = self.rows(sql, params)
        return rows[0] if rows else ()

    def dicts(self, sql: str, params: Sequence[Any] | dict[str, Any] | None = None) -> list[dict[str, Any]]:
        with self._progress_while("analysing"):
            cursor = self.con.execute(sql, params or [])
            names = [d[0] for d in cursor.description]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def _progress_while(self, what: str) -> _Progress:
        return _Progress(self, what)

    def create_query_views(self) -> None:
        """The documented views for ``traintrace query`` (docs/analysis.md)."""
        self.con.execute(
            f"""
            CREATE OR REPLACE VIEW records AS
            SELECT x.* EXCLUDE (file), p.path AS file FROM (
            SELECT stream, stream_rank AS rank, stream_restart AS restart, is_agent AS agent,
                   * EXCLUDE (stream, stream_rank, stream_restart, is_agent)
            FROM other
            UNION ALL BY NAME
            SELECT stream, rank, restart, false AS agent, 'span' AS kind, '{ITERATION}' AS name, ts, seq, dur,
                   status, attrs, tid, id, parent, file
            FROM iterations WHERE seq IS NOT NULL
            ) x LEFT JOIN files p USING (file);
            CREATE OR REPLACE VIEW spans AS
            SELECT x.* EXCLUDE (file), p.path AS file FROM (
            SELECT rank, restart, stream, name, id, parent, tid, ts, dur, ts + dur AS end_ts, status, attrs, file,
                   gpu_dur, gpu_idle
            FROM spans_small WHERE NOT is_agent
            UNION ALL
            SELECT rank, restart, stream, '{ITERATION}', id, parent, tid, ts, dur, ts + dur, status, attrs, file,
                   gpu_dur, gpu_idle
            FROM iterations WHERE seq IS NOT NULL  -- start/end pairs are in spans_small already
            ) x LEFT JOIN files p USING (file);
            CREATE OR REPLACE VIEW steps AS
            SELECT x.* EXCLUDE (file), p.path AS file FROM (
            SELECT rank, restart, stream, try_cast(attrs->>'step' AS BIGINT) AS step, ts, dur, ts + dur AS end_ts,
                   status, lost, try_cast(attrs->>'loss' AS DOUBLE) AS loss, attrs, file
            FROM iterations
            ) x LEFT JOIN files p USING (file);
            CREATE OR REPLACE VIEW events AS
            SELECT x.* EXCLUDE (file), p.path AS file FROM (
            SELECT stream_rank AS rank, stream_restart AS restart, is_agent AS agent, stream, name, ts, span, tid,
                   attrs, file
            FROM other WHERE kind = 'event'
            ) x LEFT JOIN files p USING (file);
            CREATE OR REPLACE VIEW errors AS
            SELECT x.* EXCLUDE (file), p.path AS file FROM (
            SELECT stream_rank AS rank, stream_restart AS restart, is_agent AS agent, stream, name, ts, span, tid,
                   error_type, message, stack, attrs, file
            FROM other WHERE kind = 'error'
            ) x LEFT JOIN files p USING (file);
            """
        )


class _Progress:
    """Prints how far DuckDB has got on stderr, when a terminal is watching and it takes over a second."""

    DELAY = 1.0
    TICK = 0.25

    def __init__(self, job: Job, what: str) -> None:
        self.job = job
        self.what = what
        self.done = threading.Event()
        self.thread: threading.Thread | None = None
        self.shown = False

    def __enter__(self) -> _Progress:
        if self.job.progress:
            self.thread = threading.Thread(target=self._run, name="traintrace-progress", daemon=True)
            self.thread.start()
        return self

    def _run(self) -> None:
        started = time.monotonic()
        if self.done.wait(self.DELAY):
            return
        size = sum(f.size for f in self.job.files)
        while not self.done.wait(self.TICK):
            try:
                fraction = float(self.job.con.query_progress())
            except Exception:  # noqa: BLE001 - progress is best effort
                fraction = -1.0
            shown = f" {fraction:5.1f}%" if fraction >= 0 else ""
            sys.stderr.write(
                f"\r{self.what} {len(self.job.files)} files ({size / 1e6:,.0f} MB){shown} "
                f"{time.monotonic() - started:5.1f} s"
            )
            sys.stderr.flush()
            self.shown = True

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        if self.thread is not None:
            self.thread.join()
        if self.shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


#: A stream that wrote this recently, on a host whose processes cannot be checked, is running.
RECENT_S = 60.0


def _stream_state(progress: Any, errors: bool, header: dict[str, Any], last_write_ns: int, now_ns: int) -> str:
    """running / finished / failed / dead for a stream without a close record."""
    from ..progress import stream_state

    return stream_state(
        progress,
        closed=False,
        failed=errors,
        header=header,
        last_write_ns=last_write_ns or None,
        now_ns=now_ns,
        recent_s=RECENT_S,
    )


def _manifest_world_size(paths: Sequence[str | os.PathLike[str]]) -> int:
    """world_size from a job folder's manifest.json (written by rank 0 or traintrace-run), 0 if none."""
    best = 0
    for item in paths:
        manifest = Path(item) / "manifest.json"
        if not manifest.is_file():
            continue
        try:
            value = json.loads(manifest.read_text()).get("world_size")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            best = max(best, value)
    return best


def compress_ranks(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"``."""
    parts: list[str] = []
    values = sorted(set(ranks))
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ",".join(parts)


def parse_ranks(text: str) -> list[int]:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]``; raises ValueError on bad input."""
    out: list[int] = []
    for piece in text.split(","):
        part = piece.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            if int(hi) - int(lo) > MAX_WORLD_SIZE:
                raise ValueError(f"{part}: more than {MAX_WORLD_SIZE} ranks")
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    return out
