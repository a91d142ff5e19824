"""The cluster entry point: summary, ranks or errors of a job as JSON, run by ``spark-submit``.

    spark-submit --master yarn --py-files traintrace.zip \\
        "$(python -c 'import traintrace.cli.spark_submit as m; print(m.__file__)')" \\
        summary s3a://bucket/traintrace_logs/myjob [--output s3a-or-local-path.json]

The analysis runs in the session spark-submit configured (master, executors, object-store credentials);
the answer is the JSON ``traintrace <command> --json`` prints, written to stdout or to ``--output`` (a
local path on the driver). docs/analysis.md, "Engines: DuckDB and Spark", has the details.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="traintrace.cli.spark_submit", description="summary, ranks or errors of a job, as JSON, on Spark"
    )
    parser.add_argument("command", choices=["summary", "ranks", "errors"])
    parser.add_argument("paths", nargs="+", help="the job folder, its files or its Parquet export (local or URLs)")
    parser.add_argument("--output", "-o", default=None, help="write the JSON here (on the driver) instead of stdout")
    args = parser.parse_args(argv)

    from pyspark.sql import SparkSession

    # Absolute imports: spark-submit runs this file as a script.
    from traintrace.cli import EXIT_BAD_INPUT, EXIT_OK, _analysis, _jsonable
    from traintrace.cli._engine import LoadError
    from traintrace.cli._spark import SparkJob

    spark = SparkSession.builder.appName(f"traintrace {args.command}").getOrCreate()
    try:
        job = SparkJob.open(args.paths, lean=True, spark=spark)
    except LoadError as exc:
        print(f"traintrace: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        if args.command == "summary":
            data = _analysis.summary(job)
        elif args.command == "ranks":
            data = _analysis.ranks(job)
        else:
            data = _analysis.errors(job)
    finally:
        job.close()
    text = json.dumps(_jsonable(data), indent=2) + "\n"
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
