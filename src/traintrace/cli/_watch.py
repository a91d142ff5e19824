"""``traintrace watch <job>``: a job's ranks, live, from its files and progress files.

Every ``--interval`` seconds it reads each rank's progress file (``rankN.progress``:
step, phase, collective, last update) and the new lines of every stream
(``*.jsonl``, tailed from the offset it reached last time: only new lines are
parsed, and only headers, errors, close records and the launcher's worker
failures), then shows per rank: state (running / finished / failed / dead), step,
step time, phase, time since its last progress, whether it is inside a collective,
and a hang or straggler suspicion; errors are printed as they appear. On a
terminal it redraws a table (plain ANSI); piped, it prints plain lines. It ends
when no rank is running, or after one snapshot with ``--once``.

Needs no extra: the standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from ..progress import Progress

# ..progress is imported where used: the other commands build this parser but never watch.

#: A running rank whose writer thread last stamped its progress file this much before the latest stamp of the
#: others stopped responding: its whole process does nothing (stopped, stuck holding the GIL, its host frozen).
UNRESPONSIVE_S = 10.0
#: Bytes read from one stream per refresh at most (the rest is read at the next one).
CHUNK = 8 << 20
_INTERESTING = (b'"kind":"header"', b'"kind":"error"', b'"kind":"close"', b'"worker_failure"')

# ---------------------------------------------------------------- stream tailing


@dataclass
class _Tail:
    """What the watcher remembers of one stream file."""

    offset: int = 0
    rest: bytes = b""
    header: dict[str, Any] | None = None
    closed: bool = False
    failed: bool = False
    mtime_ns: int = 0
    identity: tuple[int, int] = (0, 0)


#: The note of a rank whose writer stopped stamping while the others' did.
NOT_RESPONDING = "NOT RESPONDING"


@dataclass
class RankRow:
    """One rank in a snapshot."""

    rank: int
    state: str
    step: int | None = None
    step_time_s: float | None = None
    phase: str | None = None
    since_s: float | None = None
    in_collective: bool = False
    collective_s: float | None = None
    restart: int = 0
    pid: int | None = None
    note: str = ""
    #: Seconds between its writer's last stamp and the latest stamp of any rank's writer.
    silent_s: float | None = None


@dataclass
class Watcher:
    """Reads a job folder incrementally; :meth:`poll` returns a snapshot and the new errors."""

    folder: Path
    hang_after_s: float = 30.0
    tails: dict[Path, _Tail] = field(default_factory=dict)
    rank_streams: dict[int, Path] = field(default_factory=dict)
    failed_ranks: set[int] = field(default_factory=set)
    world_size: int = 0
    job: str = ""
    # rank -> (wall ns, steps done) at the last refreshes, for the step rate.
    history: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    def poll(self, now_ns: int | None = None) -> tuple[list[RankRow], list[str]]:
        from ..progress import read_job_progress

        now = time.time_ns() if now_ns is None else now_ns
        messages = self._read_streams()
        progress = read_job_progress(self.folder)
        for found in progress.values():
            self.world_size = max(self.world_size, found.world_size)
            self.job = self.job or found.job
        ranks = sorted(set(progress) | set(self.rank_streams) | set(range(self.world_size)))
        rows = [self._row(rank, progress.get(rank), now) for rank in ranks]
        stamps = {rank: p.alive_ns for rank, p in progress.items() if p.alive_ns}
        latest = max(stamps.values(), default=0)
        for row in rows:
            if row.rank in stamps:
                row.silent_s = (latest - stamps[row.rank]) / 1e9
        _mark_suspects(rows, self.hang_after_s)
        for row in rows:
            if row.note.startswith(NOT_RESPONDING):
                row.note = row.note[:-1] + _kernel_says(progress.get(row.rank)) + ")"
        return rows, messages

    # -- streams ------------------------------------------------------------
    def _read_streams(self) -> list[str]:
        messages: list[str] = []
        try:
            paths = sorted(self.folder.rglob("*.jsonl"))
        except OSError:
            return messages
        for path in paths:
            tail = self.tails.setdefault(path, _Tail())
            try:
                info = path.stat()
                identity = (info.st_dev, info.st_ino)
                if identity != tail.identity or info.st_size < tail.offset:
                    # A new file at this path: start over.
                    tail.offset, tail.rest, tail.identity = 0, b"", identity
                    tail.header, tail.closed, tail.failed = None, False, False
                tail.mtime_ns = info.st_mtime_ns
                if info.st_size == tail.offset:
                    continue
                with path.open("rb") as handle:
                    handle.seek(tail.offset)
                    data = handle.read(CHUNK)
            except OSError:
                continue
            tail.offset += len(data)
            data = tail.rest + data
            cut = data.rfind(b"\n") + 1
            tail.rest = data[cut:]
            for line in data[:cut].splitlines():
                if any(marker in line for marker in _INTERESTING):
                    messages.extend(self._record(path, tail, line))
        return messages

    def _record(self, path: Path, tail: _Tail, line: bytes) -> list[str]:
        try:
            record = json.loads(line)
        except ValueError:
            return []
        if not isinstance(record, dict):
            return []
        kind = record.get("kind")
        if kind == "header":
            tail.header, tail.closed, tail.failed = record, False, False
            self.job = self.job or str(record.get("job") or "")
            rank = record.get("rank")
            if record.get("role") != "agent" and "parent_pid" not in record and isinstance(rank, int):
                self.rank_streams[rank] = path
                world = record.get("world_size")
                if isinstance(world, int):
                    self.world_size = max(self.world_size, world)
            return []
        rank = (tail.header or {}).get("rank")
        who = f"rank {rank}" if isinstance(rank, int) and (tail.header or {}).get("role") != "agent" else path.name
        if kind == "close":
            tail.closed = True
            return []
        if kind == "error":
            attrs = _mapping(record.get("attrs"))
            if attrs.get("unhandled") is True:
                tail.failed = True
            kind_name = record.get("error_type") or record.get("name") or "error"
            message = str(record.get("message") or "").strip().splitlines()
            return [f"{who}: {kind_name}: {message[0] if message else ''}"[:300]]
        if kind == "event" and record.get("name") == "worker_failure":
            attrs = _mapping(record.get("attrs"))
            data = _mapping(attrs.get("data"))
            dead = attrs.get("rank")
            if isinstance(dead, int):
                self.failed_ranks.add(dead)
            parts = [f"rank {dead} died (launcher): exit code {attrs.get('exit_code')}"]
            if data.get("signal"):
                parts.append(str(data["signal"]))
            if data.get("last_step") is not None:
                parts.append(f"at step {data['last_step']} in {data.get('last_phase') or '-'}")
            return [", ".join(parts)]
        return []

    # -- rows ---------------------------------------------------------------
    def _row(self, rank: int, progress: Progress | None, now: int) -> RankRow:
        from ..progress import stream_state

        path = self.rank_streams.get(rank)
        tail = self.tails.get(path) if path is not None else None
        state = stream_state(
            progress,
            closed=bool(tail and tail.closed),
            failed=bool(tail and tail.failed),
            header=tail.header if tail else None,
            last_write_ns=tail.mtime_ns if tail else None,
            now_ns=now,
        )
        if progress is None and tail is None:
            return RankRow(rank, "waiting", note="no file yet")
        row = RankRow(rank, state)
        if tail is not None and tail.header is not None:
            row.restart = int(tail.header.get("restart") or 0)
            row.pid = tail.header.get("pid") if isinstance(tail.header.get("pid"), int) else None
        if progress is None:
            row.note = "no progress file"
            return row
        row.step, row.phase, row.restart, row.pid = progress.step, progress.phase, progress.restart, progress.pid
        row.since_s = max(0.0, (now - progress.updated_ns) / 1e9)
        row.in_collective = progress.in_collective
        if progress.collective_started_ns is not None:
            row.collective_s = max(0.0, (now - progress.collective_started_ns) / 1e9)
        row.step_time_s = self._step_time(rank, progress, now)
        return row

    def _step_time(self, rank: int, progress: Progress, now: int) -> float | None:
        """Seconds per step over the recent refreshes (steps completed / time), else the last step's."""
        seen = self.history.setdefault(rank, [])
        if not seen or seen[-1][1] != progress.steps_done:
            seen.append((progress.updated_ns, progress.steps_done))
            del seen[:-10]
        first, last = seen[0], seen[-1]
        if last[1] > first[1] and last[0] > first[0]:
            return (last[0] - first[0]) / 1e9 / (last[1] - first[1])
        return progress.last_step_ns / 1e9 if progress.last_step_ns else None


def _kernel_says(progress: Progress | None) -> str:
    """What the kernel says of an unresponsive rank's process on this host (``errors`` says the same), or ""."""
    import socket

    from ..progress import process_state

    if progress is None or not progress.pid or progress.host != socket.gethostname():
        return ""
    state = process_state(progress.pid, progress.created_ns)
    if state == "T":
        return f"; stopped, state T: kill -CONT {progress.pid} resumes it"
    if state == "t":
        return "; stopped by a debugger, state t"
    if state is not None:
        return f"; alive, state {state}, running no Python: py-spy dump --native --pid {progress.pid}"
    return ""


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _mark_suspects(rows: list[RankRow], hang_after_s: float) -> None:
    """Hang: no progress for ``hang_after_s`` while others progress (or, when every rank is
    stalled, the stalled ranks outside a collective); straggler: a step time 20% above the
    others' median, or two steps or more behind."""
    from ..progress import RUNNING

    running = [r for r in rows if r.state == RUNNING and r.since_s is not None]
    silent = [r for r in running if r.silent_s is not None and r.silent_s >= UNRESPONSIVE_S]
    for row in silent:
        row.note = f"{NOT_RESPONDING}: no sign of life for {row.silent_s:.0f}s (its process, writer included)"
    running = [r for r in running if r not in silent]
    stalled = [r for r in running if r.since_s is not None and r.since_s >= hang_after_s]
    moving = [r for r in running if r not in stalled]
    if stalled:
        suspects = stalled if moving else [r for r in stalled if not r.in_collective]
        if not suspects:  # every rank waits in a collective: the one that entered it last
            suspects = [min(stalled, key=lambda r: r.collective_s or 0.0)]
        for row in suspects:
            row.note = f"HANG? no progress for {row.since_s:.0f}s"
        for row in stalled:
            if row not in suspects and row.in_collective:
                row.note = "waiting in collective"
    steps = [r.step for r in running if r.step is not None]
    times = [r.step_time_s for r in running if r.step_time_s]
    if len(running) < 2:
        return
    import statistics  # not at module level: it is part of every command's start-up

    top = max(steps, default=None)
    for row in running:
        if row.note:
            continue
        others = [r.step_time_s for r in running if r is not row and r.step_time_s]
        if row.step_time_s and others and len(times) >= 2 and row.step_time_s > 1.2 * statistics.median(others):
            row.note = f"slow: {row.step_time_s / statistics.median(others):.1f}x the others' step time"
        elif top is not None and row.step is not None and top - row.step >= 2:
            row.note = f"behind: {top - row.step} steps"


# ---------------------------------------------------------------- output


def _fmt_s(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 0.001:
        return f"{value * 1e6:.0f}us"
    if value < 1:
        return f"{value * 1000:.0f}ms"
    if value < 120:
        return f"{value:.1f}s"
    return f"{value / 60:.0f}m"


_HEAD = ("rank", "state", "step", "step time", "phase", "since", "collective", "note")


def _cells(row: RankRow) -> tuple[str, ...]:
    collective = f"yes {_fmt_s(row.collective_s)}" if row.in_collective else "no"
    restart = f" (restart {row.restart})" if row.restart else ""
    return (
        str(row.rank),
        row.state + restart,
        "-" if row.step is None else str(row.step),
        _fmt_s(row.step_time_s),
        row.phase or "-",
        _fmt_s(row.since_s),
        collective,
        row.note,
    )


def render_table(job: str, rows: list[RankRow], errors: list[str], color: bool) -> str:
    """The terminal view: a header line, one row per rank, then the latest errors."""
    from ..progress import DEAD, FAILED, FINISHED, RUNNING

    counts = {s: sum(r.state == s for r in rows) for s in (RUNNING, FINISHED, FAILED, DEAD)}
    title = f"traintrace watch {job}  " + "  ".join(f"{n} {s}" for s, n in counts.items() if n)
    title += time.strftime("   %H:%M:%S")
    cells = [_HEAD, *(_cells(r) for r in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(_HEAD))]
    lines = [title, ""]
    for index, cell in enumerate(cells):
        text = "  ".join(value.ljust(widths[i]) for i, value in enumerate(cell)).rstrip()
        if color and index > 0:
            row = rows[index - 1]
            if row.state in (FAILED, DEAD) or row.note.startswith("HANG"):
                text = f"\x1b[31m{text}\x1b[0m"
            elif row.note:
                text = f"\x1b[33m{text}\x1b[0m"
            elif row.state == FINISHED:
                text = f"\x1b[32m{text}\x1b[0m"
        elif color:
            text = f"\x1b[1m{text}\x1b[0m"
        lines.append(text)
    if errors:
        lines += ["", "errors:"] + [f"  {e}" for e in errors[-8:]]
    return "\n".join(lines) + "\n"


def render_lines(rows: list[RankRow]) -> str:
    """The piped view: one ``key=value`` line per rank, prefixed with the time."""
    stamp = time.strftime("%H:%M:%S")
    out = []
    for row in rows:
        fields = [f"rank={row.rank}", f"state={row.state}", f"step={'-' if row.step is None else row.step}",
                  f"step_time={_fmt_s(row.step_time_s)}", f"phase={row.phase or '-'}",
                  f"since={_fmt_s(row.since_s)}", f"collective={'yes' if row.in_collective else 'no'}"]  # fmt: skip
        if row.restart:
            fields.append(f"restart={row.restart}")
        if row.note:
            fields.append(f"note={json.dumps(row.note)}")
        out.append(f"{stamp} " + " ".join(fields))
    return "\n".join(out) + "\n"


def run(args: argparse.Namespace, out: TextIO | None = None, sleep: Callable[[float], None] = time.sleep) -> int:
    """The ``watch`` subcommand; returns the exit code."""
    from ..progress import RUNNING

    stream = out or sys.stdout
    folder = Path(args.paths[0])
    if not folder.is_dir():
        print(f"traintrace: watch needs a job folder; {folder} is not one", file=sys.stderr)
        return 3
    if not args.interval > 0:
        print("traintrace: --interval must be positive", file=sys.stderr)
        return 2
    watcher = Watcher(folder, hang_after_s=args.hang_after)
    tty = stream.isatty() and not args.json
    color = tty and os.environ.get("NO_COLOR") is None
    errors: list[str] = []
    try:
        while True:
            rows, new_errors = watcher.poll()
            errors.extend(new_errors)
            job = watcher.job or folder.name
            if args.once and args.json:
                snapshot = {"job": job, "ranks": [row.__dict__ for row in rows], "errors": errors}
                stream.write(json.dumps(snapshot, indent=2) + "\n")
                return 0
            if tty:
                stream.write("\x1b[H\x1b[2J" + render_table(job, rows, errors, color))
            else:
                for message in new_errors:
                    stream.write(f"{time.strftime('%H:%M:%S')} error {message}\n")
                stream.write(render_lines(rows))
            stream.flush()
            if args.once:
                return 0
            if any(r.state != "waiting" for r in rows) and not any(r.state == RUNNING for r in rows):
                stream.write("no rank is running any more\n")
                return 0
            sleep(args.interval)
    except KeyboardInterrupt:
        return 0
