"""The ``traintrace`` command's answers as Python objects, for notebooks.

::

    from traintrace import analysis
    job = analysis.open("traintrace_logs/my-run")
    job                      # in Jupyter: the summary as a table
    job.summary().goodput    # 0.93
    job.ranks()              # a DataFrame, slowest first: the `ranks` command's table
    job.errors().first_error
    job.sql("SELECT rank, median(dur)/1e6 AS ms FROM steps GROUP BY rank")

The answers are the command's (the same engine, the same numbers). Tables are
pandas DataFrames, or Polars ones when only Polars is installed. Needs DuckDB
(``pip install 'traintrace[analysis]'``) and pandas or Polars. See
docs/integrations/notebooks.md.
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Errors", "JobAnalysis", "Summary", "open"]


def _frame(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> Any:
    """A DataFrame of ``rows``: pandas when installed, else Polars."""
    try:
        import pandas

        return pandas.DataFrame(list(rows), columns=list(columns) if columns and not rows else None)
    except ImportError:
        pass
    try:
        import polars

        return polars.DataFrame(list(rows)) if rows else polars.DataFrame({c: [] for c in columns or ()})
    except ImportError:
        raise ImportError("traintrace.analysis tables need pandas or Polars: pip install pandas") from None


def _table_html(rows: Sequence[tuple[str, Any]], title: str) -> str:
    cells = "".join(
        f"<tr><th style='text-align:left'>{html.escape(str(k))}</th><td>{html.escape(_show(v))}</td></tr>"
        for k, v in rows
    )
    return f"<div><strong>{html.escape(title)}</strong><table>{cells}</table></div>"


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if value is None:
        return "—"
    return str(value)


@dataclass
class Summary:
    """``traintrace summary``: wall time, goodput and where the time went. ``raw`` holds every field."""

    verdict: str | None
    status: str | None
    job: str | None
    wall_s: float
    goodput: float | None
    breakdown_s: dict[str, float]
    steps_completed: int | None
    steps_lost: int | None
    step_time: dict[str, Any]
    samples_per_second: float | None
    tokens_per_second: float | None
    mfu: float | None
    notes: list[str]
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Summary:
        return cls(
            verdict=data.get("verdict"),
            status=data.get("status"),
            job=data.get("job"),
            wall_s=float(data.get("wall_s") or 0.0),
            goodput=data.get("goodput"),
            breakdown_s=dict(data.get("breakdown_s") or {}),
            steps_completed=data.get("steps_completed"),
            steps_lost=data.get("steps_lost"),
            step_time=dict(data.get("step_time") or {}),
            samples_per_second=data.get("samples_per_second"),
            tokens_per_second=data.get("tokens_per_second"),
            mfu=data.get("mfu"),
            notes=list(data.get("notes") or []),
            raw=data,
        )

    def _rows(self) -> list[tuple[str, Any]]:
        rows: list[tuple[str, Any]] = [
            ("verdict", self.verdict),
            ("job", self.job),
            ("wall time (s)", self.wall_s),
            ("goodput", None if self.goodput is None else f"{self.goodput:.1%}"),
            ("steps completed", self.steps_completed),
            ("steps lost", self.steps_lost),
            ("median step (s)", self.step_time.get("median_s")),
            ("p90 step (s)", self.step_time.get("p90_s")),
            ("samples/s", self.samples_per_second),
            ("tokens/s", self.tokens_per_second),
            ("MFU", None if self.mfu is None else f"{self.mfu:.1%}"),
        ]
        rows += [(f"time: {k} (s)", v) for k, v in self.breakdown_s.items() if v]
        return rows

    def _repr_html_(self) -> str:
        return _table_html(self._rows(), f"traintrace summary: {self.job}")


@dataclass
class Errors:
    """``traintrace errors``: the first error (root cause), errors grouped, each rank's last state."""

    verdict: str | None
    status: str | None
    culprit: dict[str, Any] | None
    first_error: dict[str, Any] | None
    error_count: int
    groups: Any  # DataFrame
    ranks: Any  # DataFrame
    hang_suspects: list[Any]
    raw: dict[str, Any] = field(repr=False)

    def _repr_html_(self) -> str:
        first = self.first_error
        if first is None:
            verdict = html.escape(self.verdict or "none recorded")
            return f"<div><strong>traintrace errors</strong>: {verdict}</div>"
        rows = [
            ("verdict", self.verdict),
            ("errors", self.error_count),
            ("first", f"{first.get('error_type')}: {first.get('message')}"),
            ("rank", first.get("rank")),
            ("in span", first.get("in_span")),
            ("step", first.get("step")),
            ("hang suspects", ", ".join(str(h) for h in self.hang_suspects) or None),
        ]
        stack = html.escape(str(first.get("stack") or ""))
        return _table_html(rows, "traintrace errors") + f"<pre>{stack}</pre>"


class JobAnalysis:
    """One job's files, loaded into DuckDB once; each method answers like the command."""

    def __init__(
        self, paths: Sequence[str | os.PathLike[str]], *, threads: int | None = None, memory_limit: str | None = None
    ) -> None:
        from .cli._engine import Job

        self._job: Any = Job.open(list(paths), progress=False, threads=threads, memory_limit=memory_limit)
        self._views = False
        self._summary: Summary | None = None

    def summary(self) -> Summary:
        """As ``traintrace summary``."""
        from .cli import _analysis

        if self._summary is None:
            self._summary = Summary.from_dict(_analysis.summary(self._job))
        return self._summary

    def ranks(self, *, windows: int = 10, threshold: float = 1.1) -> Any:
        """As ``traintrace ranks --all``: one row per rank (median/p90/p99 step, score, straggler), slowest first."""
        from .cli import _analysis

        data = _analysis.ranks(self._job, top=1_000_000, windows=windows, threshold=threshold)
        rows = sorted(data.get("ranks", []), key=lambda r: -(r.get("score") or 0.0))
        return _frame(rows, ["rank", "steps", "median_s", "p90_s", "p99_s", "score", "straggler"])

    def errors(self, *, hang_after_s: float = 60.0) -> Errors:
        """As ``traintrace errors``."""
        from .cli import _analysis

        data = _analysis.errors(self._job, hang_after_s=hang_after_s)
        return Errors(
            verdict=data.get("verdict"),
            status=data.get("status"),
            culprit=data.get("culprit"),
            first_error=data.get("first_error"),
            error_count=int(data.get("error_count") or 0),
            groups=_frame(data.get("groups") or [], ["name", "error_type", "message", "count", "ranks"]),
            ranks=_frame(data.get("ranks") or [], ["rank", "restart", "state"]),
            hang_suspects=list(data.get("hang_suspects") or []),
            raw=data,
        )

    def sql(self, query: str) -> Any:
        """As ``traintrace query``: SQL over the views records, spans, steps, events, errors, streams."""
        if not self._views:
            self._job.create_query_views()
            self._views = True
        result = self._job.con.sql(query)
        try:
            import pandas  # noqa: F401

            return result.df()
        except ImportError:
            pass
        try:
            import polars  # noqa: F401

            return result.pl()
        except ImportError:
            raise ImportError("traintrace.analysis tables need pandas or Polars: pip install pandas") from None

    def close(self) -> None:
        """Release DuckDB's memory and temporary files."""
        job = self._job
        if job is not None and job.con is not None:
            job.con.close()
        if job is not None and getattr(job, "_tmp", None) is not None:
            job._tmp.cleanup()

    def __enter__(self) -> JobAnalysis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _repr_html_(self) -> str:
        return self.summary()._repr_html_()

    def __repr__(self) -> str:
        s = self.summary()
        goodput = "?" if s.goodput is None else f"{s.goodput:.1%}"
        return f"<traintrace job {s.job!r}: {s.wall_s:.1f} s, goodput {goodput}, {s.steps_completed} steps>"


def open(  # noqa: A001 - the natural name: analysis.open(path)
    path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    threads: int | None = None,
    memory_limit: str | None = None,
) -> JobAnalysis:
    """Load a job folder (or files) for analysis. Raises ``ImportError`` naming the extra without DuckDB."""
    from .cli._engine import LoadError, MissingExtra

    paths = [path] if isinstance(path, str | os.PathLike) else list(path)
    try:
        return JobAnalysis(paths, threads=threads, memory_limit=memory_limit)
    except MissingExtra as exc:
        raise ImportError(str(exc)) from None
    except LoadError as exc:
        raise FileNotFoundError(str(exc)) from None
