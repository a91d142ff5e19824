"""The Spark engine: the same analyses as Spark SQL, for jobs beyond one machine (docs/analysis.md).

There is one definition of every query: the DuckDB SQL the analyses and the engine already run. A
:class:`SparkJob` is a :class:`~traintrace.cli._engine.Job` whose connection translates each statement with
sqlglot (DuckDB dialect in, Spark dialect out) and runs it with ``spark.sql``; ``CREATE TABLE x AS`` becomes a
cached temporary view, ``CREATE VIEW`` a temporary view, ``$name`` parameters Spark's named parameters.
Only loading differs: Spark reads the JSON-lines files (``spark.read.json`` with a schema derived from
``_format.FIELDS``) or the Parquet export (``spark.read.parquet``), from local paths or object storage.

Needs the ``spark`` extra (``pip install 'traintrace[spark]'``: pyspark and sqlglot) and a Java runtime.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from ._engine import (
    ATTR_FIELDS,
    COLUMNS,
    CORE_COLUMNS,
    ITERATION,
    RARE_FIELDS,
    RARE_KINDS,
    FileCheck,
    Job,
    LoadError,
    MissingExtra,
    _manifest_world_size,
    check_tail,
    discover,
    find_export,
)

__all__ = ["SparkJob", "SparkUnavailable", "spark_session", "translate"]

#: Spark types of the record format's SQL types (``_format.FIELDS``).
_SPARK_TYPES = {"VARCHAR": "string", "BIGINT": "bigint", "DOUBLE": "double", "BOOLEAN": "boolean", "JSON": "string"}
#: Durations may be written as JSON numbers with a fraction: read as doubles, rounded to BIGINT as DuckDB does.
_ROUNDED = ("dur", "gpu_dur", "gpu_idle")
#: The duration bound of the DuckDB loader (``_engine._MAX_DUR``).
_MAX_DUR = 10 * 365 * 86400 * 10**9


class SparkUnavailable(RuntimeError):
    """Spark cannot start here (no Java runtime): a configuration error, not a bug."""


def _import_pyspark() -> Any:
    try:
        import pyspark.sql
        import sqlglot  # noqa: F401 - checked here so that the message names the extra
    except ImportError:
        raise MissingExtra("--engine spark needs PySpark and sqlglot: pip install 'traintrace[spark]'") from None
    return pyspark.sql


def spark_session() -> Any:
    """The active Spark session (spark-submit's, a notebook's), else a local one on every core."""
    sql = _import_pyspark()
    active = sql.SparkSession.getActiveSession()
    if active is not None:
        return active
    if not os.environ.get("JAVA_HOME") and shutil.which("java") is None:
        raise SparkUnavailable(
            "--engine spark needs a Java runtime (17 or later): install one, or set JAVA_HOME; "
            "or use the default engine, DuckDB, which needs no Java"
        )
    # Python UDFs (json_merge_patch) run in workers started with this interpreter.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    master = os.environ.get("TRAINTRACE_SPARK_MASTER", "local[*]")
    builder = (
        sql.SparkSession.builder.appName("traintrace")
        .master(master)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
    )
    if master.startswith("local"):
        # A local job is small: a few shuffle partitions, not Spark's 200.
        # Adaptive planning and code generation cost more than they save on the many small statements.
        builder = (
            builder.config("spark.sql.shuffle.partitions", str(max(2, (os.cpu_count() or 2))))
            .config("spark.sql.adaptive.enabled", "false")
            .config("spark.sql.codegen.wholeStage", "false")
        )
    try:
        session = builder.getOrCreate()
    except Exception as exc:  # noqa: BLE001 - the JVM did not start: said plainly, no traceback
        raise SparkUnavailable(f"Spark did not start ({str(exc).splitlines()[0] if str(exc) else exc!r})") from None
    session.sparkContext.setLogLevel("ERROR")
    return session


# ---------------------------------------------------------------- translation


def translate(sql: str) -> list[tuple[str, str | None, bool, str]]:
    """DuckDB SQL -> Spark SQL, one entry per statement: (action, name, if_not_exists, Spark SQL).

    ``action`` is ``table`` (``CREATE [TEMP] TABLE name AS``: a cached view), ``view`` or ``query``.
    """
    import sqlglot
    from sqlglot import exp

    out: list[tuple[str, str | None, bool, str]] = []
    for parsed in sqlglot.parse(sql, read="duckdb"):
        if parsed is None:
            continue
        statement = parsed.transform(_spark_functions)
        if isinstance(statement, exp.Create) and statement.expression is not None:
            kind = str(statement.args.get("kind") or "").upper()
            target = statement.this
            name = target.name if isinstance(target, exp.Table) else target.this.name
            action = "view" if kind == "VIEW" else "table"
            out.append((action, name, bool(statement.args.get("exists")), statement.expression.sql(dialect="spark")))
        else:
            out.append(("query", None, False, statement.sql(dialect="spark")))
    return out


def _spark_functions(node: Any) -> Any:
    """DuckDB functions without a same-named Spark equivalent that sqlglot leaves as they are."""
    from sqlglot import exp

    # quantile_cont(x, q) and median(x): Spark's exact percentile (linear interpolation, as DuckDB's).
    if isinstance(node, exp.PercentileCont) and node.expression is not None:
        return exp.Anonymous(this="percentile", expressions=[node.this, node.expression])
    if isinstance(node, exp.Median):
        return exp.Anonymous(this="percentile", expressions=[node.this, exp.Literal.number(0.5)])
    # max(x, n): the n largest, in descending order.
    if isinstance(node, exp.Max) and node.args.get("count") is not None:
        listed = exp.Anonymous(this="collect_list", expressions=[node.this])
        ordered = exp.Anonymous(this="sort_array", expressions=[listed, exp.false()])
        return exp.Anonymous(this="slice", expressions=[ordered, exp.Literal.number(1), node.args["count"]])
    return node


class _Cursor:
    def __init__(self, names: list[str], rows: list[tuple[Any, ...]]) -> None:
        self.description = [(n,) for n in names] if names else None
        self._rows = rows
        self._at = 0

    def fetchall(self) -> list[tuple[Any, ...]]:
        rows, self._at = self._rows[self._at :], len(self._rows)
        return rows

    def fetchone(self) -> tuple[Any, ...] | None:
        if self._at >= len(self._rows):
            return None
        self._at += 1
        return self._rows[self._at - 1]

    def fetchmany(self, n: int) -> list[tuple[Any, ...]]:
        rows = self._rows[self._at : self._at + n]
        self._at += len(rows)
        return rows


class SparkConnection:
    """What the analyses call on ``job.con`` (``execute(sql, params)``), run by Spark."""

    def __init__(self, spark: Any) -> None:
        self.spark = spark
        self.views: dict[str, Any] = {}  # name -> the cached DataFrame (None for a plain view)

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] | None = None) -> _Cursor:
        args = dict(params) if isinstance(params, dict) else None
        if params and not isinstance(params, dict):
            raise ValueError("the Spark engine takes named parameters only")
        cursor = _Cursor([], [])
        for action, name, if_not_exists, text in translate(sql):
            used = {k: v for k, v in (args or {}).items() if f":{k}" in text} or None
            frame = self.spark.sql(text, args=used)
            if action == "query":
                rows = [tuple(row) for row in frame.collect()]
                cursor = _Cursor(list(frame.columns), rows)
                continue
            assert name is not None
            if if_not_exists and name in self.views:
                continue
            self.register(name, frame, cache=action == "table")
        return cursor

    def register(self, name: str, frame: Any, *, cache: bool) -> None:
        old = self.views.pop(name, None)
        if cache:
            # Materialised now, its plan cut (as DuckDB's CREATE TABLE): later statements read the stored rows
            # instead of planning every table they are built on again.
            frame = frame.localCheckpoint(eager=True)
        frame.createOrReplaceTempView(name)
        if old is not None:
            old.unpersist()
        self.views[name] = frame if cache else None

    def close(self) -> None:
        for name, frame in self.views.items():
            self.spark.catalog.dropTempView(name)
            if frame is not None:
                frame.unpersist()
        self.views.clear()

    def query_progress(self) -> float:
        return -1.0


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7396 JSON merge patch, as DuckDB's json_merge_patch (objects merged recursively, null removes)."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge_patch(out.get(key), value)
    return out


def _json_merge_patch(a: str | None, b: str | None) -> str | None:
    if a is None or b is None:
        return None
    try:
        return json.dumps(_merge_patch(json.loads(a), json.loads(b)), separators=(",", ":"))
    except ValueError:
        return None


def _is_remote(path: str) -> bool:
    return "://" in str(path) and not str(path).startswith("file://")


# ---------------------------------------------------------------- the job


class SparkJob(Job):
    """A job's records in Spark: the tables and analyses of :class:`Job`, each statement run by Spark SQL.

    Local paths work as with DuckDB; object-storage URLs (``s3a://``, ``gs://``, ``abfss://``...) are read
    by Spark itself, without the checks that read files from Python (a cut last line, the manifest's world
    size, progress files: none on object storage).
    """

    spark: Any = None

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
        spark: Any = None,
    ) -> SparkJob:
        del threads, memory_limit, cache  # DuckDB settings; Spark's are its own configuration
        _import_pyspark()
        texts = [str(p) for p in paths]
        remote = [p for p in texts if _is_remote(p)]
        if remote:
            if len(remote) != len(texts):
                raise LoadError("mix of local paths and URLs: give one or the other")
            job = cls([], False, lean=lean)
            job.remote = texts
        else:
            export = find_export(paths)
            if export is not None:
                job = cls([], False, lean=lean, export=export)
            else:
                files = discover(paths)
                if not files:
                    raise LoadError("no .jsonl files found in " + ", ".join(texts))
                job = cls(files, False, lean=lean)
                job.manifest_world_size = _manifest_world_size(paths)
        job.spark = spark if spark is not None else spark_session()
        job._load()
        return job

    remote: list[str] | None = None

    def _connect(self, small: bool = False, source_bytes: int = 0, tiny: bool = False) -> Any:
        """A Spark connection (``small``, ``source_bytes`` and ``tiny`` are DuckDB's: Spark plans and stores its own
        way)."""
        import tempfile

        self._tmp = tempfile.TemporaryDirectory(prefix="traintrace-spark-")
        from pyspark.sql.types import StringType

        self.spark.udf.register("json_merge_patch", _json_merge_patch, StringType())
        return SparkConnection(self.spark)

    def close(self) -> None:
        if isinstance(self.con, SparkConnection):
            self.con.close()

    def restrict_external_access(self) -> None:
        """Nothing to restrict: Spark runs only the analyses' own statements here."""

    def _create_stream_list(self, name: str, streams: list[int]) -> None:
        from pyspark.sql.types import LongType, StructField, StructType

        schema = StructType([StructField("stream", LongType())])
        frame = self.spark.createDataFrame([(int(s),) for s in streams], schema)
        self.con.register(name, frame, cache=False)

    # ------------------------------------------------------------ loading

    def attr_fields(self, attrs: str) -> str:
        return "{" + ", ".join(f"'{f}': {attrs}->>'{f}'" for f in ATTR_FIELDS) + "}"

    def _load(self) -> None:
        started = time.perf_counter()
        self.con = con = self._connect()
        plain_iteration = f"kind = 'span' AND name = '{ITERATION}'"
        attrs = f"CASE WHEN {plain_iteration} THEN NULL ELSE attrs END" if self.lean else "attrs"
        if self.remote is None and self.export is not None:
            self._read_export()  # the job's description, from the export's metadata file
            source = self.spark.read.parquet(str(self.export))
            step, batch_size = "step", "batch_size"
            file_column = "file"
            paths = [f.path for f in self.files]
        else:
            source, paths = self._read_json()
            step = f"CASE WHEN {plain_iteration} THEN try_cast(get_json_object(attrs, '$.step') AS BIGINT) END"
            batch_size = (
                f"CASE WHEN {plain_iteration} THEN try_cast(get_json_object(attrs, '$.batch_size') AS BIGINT) END"
            )
            file_column = "file"
        source.createOrReplaceTempView("_traintrace_source")
        from pyspark.sql.types import LongType, StringType, StructField, StructType

        files = self.spark.createDataFrame(
            [(i, p) for i, p in enumerate(paths)],
            StructType([StructField("file", LongType()), StructField("path", StringType())]),
        )
        con.register("files", files, cache=False)
        core = ", ".join(k for k in CORE_COLUMNS if k != "attrs")
        rare_kinds = ", ".join(f"'{k}'" for k in RARE_KINDS)
        bad = f"(dur IS NULL AND kind IN ('span', 'end')) OR dur < 0 OR dur > {_MAX_DUR}"
        base = self.spark.sql(
            f"SELECT {file_column} AS file, {core}, {attrs} AS attrs, {step} AS step, {batch_size} AS batch_size, "
            f"kind IN ({rare_kinds}) AS rare, {plain_iteration} AS plain, {', '.join(RARE_FIELDS)} "
            "FROM _traintrace_source WHERE kind IS NOT NULL"
        )
        base.createOrReplaceTempView("_traintrace_base")
        counts = self.spark.sql(
            f"SELECT count(*) AS n, coalesce(sum(CASE WHEN {bad} THEN 1 ELSE 0 END), 0) AS bad FROM _traintrace_base"
        ).collect()[0]
        self.ignored_spans += int(counts["bad"])
        if self.ignored_spans:
            self.notes.append(
                f"{self.ignored_spans} spans without a possible duration (none, negative, over ten years) ignored"
            )
        con.register(
            "raw",
            self.spark.sql(
                f"SELECT file, {core}, attrs, step, batch_size, CASE WHEN rare THEN true END AS rare, plain "
                f"FROM _traintrace_base WHERE NOT coalesce({bad}, false)"
            ),
            cache=True,
        )
        con.register(
            "rare",
            self.spark.sql(
                f"SELECT file, kind, ts, seq, {', '.join(RARE_FIELDS)} FROM _traintrace_base "
                f"WHERE rare AND NOT coalesce({bad}, false)"
            ),
            cache=True,
        )
        self.record_count = int(counts["n"]) - int(counts["bad"])
        self._build_tables()
        if self.record_count == 0:
            raise LoadError("no traintrace records in " + ", ".join(f.path for f in self.files))
        self.load_seconds = time.perf_counter() - started
        self._collect_notes()

    def _read_json(self) -> tuple[Any, list[str]]:
        """The JSON-lines files as a DataFrame with a ``file`` column, and the path of each file number."""
        from pyspark.sql import functions as F
        from pyspark.sql.types import StructField, StructType

        types = {k: ("double" if k in _ROUNDED else _SPARK_TYPES[v]) for k, v in COLUMNS.items()}
        schema = StructType([StructField(k, _spark_type(t)) for k, t in types.items()])
        reader = self.spark.read.schema(schema).option("mode", "PERMISSIVE")
        if self.remote is not None:
            frame = reader.option("recursiveFileLookup", "true").option("pathGlobFilter", "*.jsonl").json(self.remote)
        else:
            self.files = [check_tail(p) for p in self.paths]
            frame = reader.json(self._names_to_read())
        frame = frame.withColumn("_path", F.input_file_name())
        for k in _ROUNDED:
            frame = frame.withColumn(k, F.expr(f"try_cast(round({k}) AS BIGINT)"))
        uris = sorted(r[0] for r in frame.select("_path").distinct().collect())
        if self.remote is not None:
            # Spark listed the files: they are numbered in path order, sizes unknown (never 0: see notes).
            self.files = [FileCheck(uri, 1, False) for uri in uris]
            self.paths = [Path(uri) for uri in uris]
            number = {uri: i for i, uri in enumerate(uris)}
        else:
            reads = self._reads
            by_path = {str(Path(r)): i for i, r in enumerate(reads)}
            number = {}
            for uri in uris:
                local = unquote(urlparse(uri).path) if uri.startswith("file:") else uri
                if local in by_path:
                    number[uri] = by_path[local]
        mapping = self.spark.createDataFrame(list(number.items()), "_path string, file bigint")
        frame = frame.join(F.broadcast(mapping), "_path").drop("_path")
        return frame, [f.path for f in self.files]

    #: The paths Spark was given (``_names_to_read``: links for names with glob characters), by file number.
    _reads: tuple[str, ...] = ()

    def _names_to_read(self) -> list[str]:
        self._reads = tuple(super()._names_to_read())
        return list(self._reads)


def _spark_type(name: str) -> Any:
    from pyspark.sql import types

    return {
        "string": types.StringType(),
        "bigint": types.LongType(),
        "double": types.DoubleType(),
        "boolean": types.BooleanType(),
    }[name]
