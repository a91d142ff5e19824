"""Read the per-rank progress files, and say whether a rank is running, finished, failed or dead.

Each rank that records to a file also keeps ``rankN.progress`` beside its
stream (docs/format.md, "Progress file"): the step and phase it is in, updated
in place by the training thread and kept by the kernel when the rank is killed.
This module reads those files for the launcher, ``traintrace watch`` and the
analysis::

    from traintrace.progress import read_job_progress, stream_state

    for rank, p in read_job_progress("traintrace_logs/myjob").items():
        print(rank, p.step, p.phase, p.in_collective, stream_state(p))

Nothing here raises on a bad file: a torn, short, foreign or garbage file reads
as ``None``.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import struct
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Final

from ._procstat import stat_fields
from ._progress import (
    COUNTER_STEP,
    HOST_AT,
    JOB_AT,
    MAGIC,
    S_ALIVE,
    S_CLOCK_OFFSET,
    S_COLLECTIVE,
    S_COLLECTIVE_T0,
    S_COUNTER,
    S_CREATED,
    S_FIRST_STEP_T0,
    S_ITERATIONS,
    S_LAST_DONE,
    S_LAST_STEP_NS,
    S_MAGIC,
    S_PHASE_T0,
    S_PID,
    S_RANK,
    S_RESTART,
    S_SIZE,
    S_STATE,
    S_STEP,
    S_STEP_T0,
    S_STEPS_DONE,
    S_UPDATED,
    S_VERSION,
    S_WORLD_SIZE,
    SIZE,
    STATE_NAMES,
    SUFFIX,
    phase_name,
    progress_path,
)

__all__ = [
    "DEAD",
    "FAILED",
    "FINISHED",
    "RECENT_S",
    "RUNNING",
    "Progress",
    "find_progress_files",
    "last_progress",
    "pid_alive",
    "process_state",
    "progress_fields",
    "progress_path",
    "read_job_progress",
    "read_progress",
    "stream_state",
]

#: What :func:`stream_state` answers.
RUNNING: Final = "running"
FINISHED: Final = "finished"
FAILED: Final = "failed"
DEAD: Final = "dead"

#: A rank whose progress file changed within this many seconds counts as running
#: when its process cannot be checked (another host).
RECENT_S: Final = 60.0

_SLOTS = 24
_MAX_I64 = (1 << 63) - 1


@dataclasses.dataclass(frozen=True)
class Progress:
    """One rank's progress file, as last written. Times are epoch nanoseconds.

    ``step`` is the step of the iteration the rank is in (or was in last): the
    number given to ``training_iteration(step)``, else the iteration's ordinal
    from 0; None before the first iteration. ``phase`` is the innermost standard
    phase open (``"model_backward"``, ``"collective"``, ...), None outside all.
    ``state`` is ``"running"``, ``"closed"`` (closed cleanly), ``"error"`` (an
    exception ended the program) or ``"terminated"`` (SIGTERM handled).
    ``counter`` grows by one at every update.
    """

    rank: int
    pid: int
    restart: int
    step: int | None
    phase: str | None
    phase_started_ns: int | None
    updated_ns: int
    in_collective: bool
    state: str
    counter: int
    world_size: int = 1
    host: str = ""
    job: str = ""
    #: Iterations started, and completed, by this process.
    iterations: int = 0
    steps_done: int = 0
    #: The step of the last completed iteration, None if none completed.
    step_done: int | None = None
    #: When the current (or last) iteration started, and how long the last completed one took.
    step_started_ns: int | None = None
    last_step_ns: int | None = None
    #: When the rank entered the collective it is in (None when not in one).
    collective_started_ns: int | None = None
    #: The writer thread's last cycle (every ``flush_interval``): the process was alive then. None in a
    #: file written before traintrace 0.2.
    alive_ns: int | None = None
    #: When this process's first iteration started: its initialisation had ended by then. None before the first
    #: iteration, and in a file written before traintrace 0.2.
    first_step_ns: int | None = None
    created_ns: int = 0
    version: int = 1
    path: str = ""

    @property
    def alive_state(self) -> str:
        """:func:`stream_state` of this file alone (no stream records)."""
        return stream_state(self)


def _text(raw: bytes, at: tuple[int, int]) -> str:
    return raw[at[0] : at[1]].split(b"\0", 1)[0].decode("utf-8", "replace")


def _read_stable(path: Path) -> bytes | None:
    """The file's bytes, read until two reads agree (a writer may be storing meanwhile)."""
    previous: bytes | None = None
    for _ in range(5):
        with path.open("rb") as handle:
            raw = handle.read(SIZE)
        if len(raw) < SIZE:
            return None
        if raw == previous:
            return raw
        previous = raw
    return previous


def parse_progress(raw: bytes, path: str = "") -> Progress | None:
    """A :class:`Progress` from a file's bytes; None when they are not a progress file."""
    try:
        if len(raw) < SIZE:
            return None
        slots = struct.unpack_from(f"<{_SLOTS}q", raw)
        if slots[S_MAGIC] != MAGIC or slots[S_VERSION] < 1 or slots[S_SIZE] < SIZE:
            return None
        rank, pid, world_size, restart = slots[S_RANK], slots[S_PID], slots[S_WORLD_SIZE], slots[S_RESTART]
        state = STATE_NAMES.get(slots[S_STATE])
        if state is None or not (0 <= rank < world_size) or pid <= 0 or restart < 0 or slots[S_COUNTER] < 0:
            return None
        offset = slots[S_CLOCK_OFFSET]

        def wall(mono: int) -> int | None:
            return mono + offset if mono > 0 else None

        iterations = max(slots[S_ITERATIONS], 0)
        steps_done = max(slots[S_STEPS_DONE], 0)
        step: int | None = slots[S_STEP]
        if step is not None and step < 0:
            step = iterations - 1 if iterations > 0 else None
        # The last completed iteration (steps numbered consecutively): the current one once it
        # has ended ok, else as many steps before it as iterations started since the last that did.
        # Files before slot 17 was kept: the current one once slot 21 has caught up with slot 16.
        last_done = slots[S_LAST_DONE]
        step_done: int | None = None
        if step is not None and 0 < last_done <= iterations:
            step_done = step - (iterations - last_done)
        elif step is not None and steps_done > 0 and last_done == 0:
            step_done = step if steps_done >= iterations else step - 1
        phase = phase_name(slots[S_COUNTER])
        phase_started = wall(slots[S_PHASE_T0]) if phase is not None else None
        updated = max(slots[S_UPDATED], slots[S_PHASE_T0], slots[S_STEP_T0])
        in_collective = slots[S_COLLECTIVE] > 0
        last_step = slots[S_LAST_STEP_NS]
        return Progress(
            rank=rank,
            pid=pid,
            restart=restart,
            step=step,
            phase=phase,
            phase_started_ns=phase_started,
            updated_ns=wall(updated) or slots[S_CREATED],
            in_collective=in_collective,
            state=state,
            counter=slots[S_COUNTER] // COUNTER_STEP,
            world_size=world_size,
            host=_text(raw, HOST_AT),
            job=_text(raw, JOB_AT),
            iterations=iterations,
            steps_done=steps_done,
            step_done=step_done,
            step_started_ns=wall(slots[S_STEP_T0]),
            last_step_ns=last_step if last_step > 0 else None,
            collective_started_ns=wall(slots[S_COLLECTIVE_T0]) if in_collective else None,
            alive_ns=wall(slots[S_ALIVE]),
            first_step_ns=wall(slots[S_FIRST_STEP_T0]),
            created_ns=slots[S_CREATED],
            version=slots[S_VERSION],
            path=path,
        )
    except Exception:  # noqa: BLE001 - garbage reads as None, never raises
        return None


def read_progress(path: str | os.PathLike[str]) -> Progress | None:
    """Read one progress file; None if it is missing, short, torn beyond repair or not one."""
    try:
        raw = _read_stable(Path(path))
    except (OSError, ValueError):
        return None
    if raw is None:
        return None
    return parse_progress(raw, os.fspath(path))


def find_progress_files(job_dir: str | os.PathLike[str]) -> list[Path]:
    """The progress files of a job folder (``<log_dir>/<job>``), sorted by name."""
    try:
        root = Path(job_dir)
        return sorted(p for p in root.glob(f"*{SUFFIX}") if not p.name.startswith(".") and p.is_file())
    except OSError:
        return []


def read_job_progress(job_dir: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> dict[int, Progress]:
    """Rank -> its progress, from a job folder (or a list of files); the latest restart wins."""
    paths = [job_dir] if isinstance(job_dir, str | os.PathLike) else list(job_dir)
    files: list[Path] = []
    for given in paths:
        path = Path(given)
        files.extend(find_progress_files(path) if path.is_dir() else [path])
    found: dict[int, Progress] = {}
    for path in files:
        progress = read_progress(path)
        if progress is None:
            continue
        known = found.get(progress.rank)
        if known is None or (progress.restart, progress.created_ns) > (known.restart, known.created_ns):
            found[progress.rank] = progress
    return found


def last_progress(job_dir: str | os.PathLike[str], rank: int, pid: int | None = None) -> Progress | None:
    """The progress file of ``rank`` in a job folder: the one written by ``pid`` if given and found,
    else the rank's latest."""
    best: Progress | None = None
    for path in find_progress_files(job_dir):
        found = read_progress(path)
        if found is None or found.rank != rank:
            continue
        if pid is not None and found.pid == pid:
            return found
        if best is None or (found.restart, found.created_ns) > (best.restart, best.created_ns):
            best = found
    return best


def progress_fields(progress: Progress | None) -> dict[str, Any]:
    """What a lifecycle event carries about a dead rank's last progress (empty if unknown)."""
    if progress is None:
        return {}
    fields: dict[str, Any] = {
        "last_step": progress.step,
        "last_phase": progress.phase,
        "in_collective": progress.in_collective,
        "last_progress_ns": progress.updated_ns,
        "steps_done": progress.steps_done,
        "progress_state": progress.state,
    }
    if progress.step_done is not None:
        fields["last_step_done"] = progress.step_done
    # What the diagnosis reads of a killed rank's file, which a restart rewrites: the launcher's copy outlives it.
    for name in ("phase_started_ns", "collective_started_ns", "alive_ns", "last_step_ns", "first_step_ns"):
        value = getattr(progress, name)
        if value is not None:
            fields[name] = value
    return fields


# ---------------------------------------------------------------- is it running?


def _process_start_ns(pid: int) -> int | None:
    """When process ``pid`` started (epoch ns, Linux /proc), None if unknown."""
    try:
        ticks = int(stat_fields(f"/proc/{pid}/stat")[22 - 3])  # starttime, field 22
        with Path("/proc/stat").open("rb") as handle:
            boot = next(int(line.split()[1]) for line in handle if line.startswith(b"btime"))
        return int((boot + ticks / os.sysconf("SC_CLK_TCK")) * 1e9)
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _zombie(pid: int) -> bool:
    try:
        return stat_fields(f"/proc/{pid}/stat")[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def pid_alive(pid: int, since_ns: int | None = None) -> bool:
    """True if process ``pid`` exists on this host and is not a zombie.

    With ``since_ns`` (when the rank's file was created), a process that started
    more than 2 s after it is another one that reused the pid: not alive.
    """
    if pid <= 0 or pid > _MAX_I64:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, someone else's
    except (OSError, OverflowError, ValueError):
        return False
    if _zombie(pid):
        return False
    if since_ns:
        started = _process_start_ns(pid)
        if started is not None and started > since_ns + 2_000_000_000:
            return False
    return True


def process_state(pid: int, since_ns: int | None = None) -> str | None:
    """The kernel's state of process ``pid`` of this host (the letter of ``/proc/<pid>/stat``: ``R`` running,
    ``S`` sleeping, ``D`` waiting in the kernel, ``T`` stopped, ``t`` stopped by a debugger); None when it is
    gone, a zombie, another process that reused its pid (``since_ns`` as for :func:`pid_alive`), or unreadable
    (not Linux)."""
    if not pid_alive(pid, since_ns):
        return None
    try:
        return stat_fields(f"/proc/{pid}/stat")[0].decode("ascii")
    except (OSError, IndexError, UnicodeDecodeError):
        return None


def stream_state(
    progress: Progress | None,
    *,
    closed: bool = False,
    failed: bool = False,
    header: Mapping[str, Any] | None = None,
    last_write_ns: int | None = None,
    now_ns: int | None = None,
    recent_s: float = RECENT_S,
    this_host: str | None = None,
    alive: Callable[[int, int | None], bool] = pid_alive,
) -> str:
    """Whether a rank is ``"running"``, ``"finished"``, ``"failed"`` or ``"dead"``.

    From what is known of one rank (its progress file, and from its stream:
    ``closed`` when it holds a close record, ``failed`` when an exception ended
    the program, ``header`` the stream's header, ``last_write_ns`` the stream
    file's modification time):

    * ``finished``: closed cleanly (a close record, or the progress file's state
      ``closed``) and no failure;
    * ``failed``: closed after an error (``failed``, or the progress file's state
      ``error`` or ``terminated``);
    * ``running``: not closed, and its process is alive (the pid of the progress
      file, else of the header, checked with ``os.kill(pid, 0)`` when its host is
      this host), or, when the process cannot be checked (another host), its
      progress file or stream changed within ``recent_s`` seconds;
    * ``dead``: not closed and none of the above (killed, crashed, or gone
      silent on another host for longer than ``recent_s``).

    Pure apart from the process check, which ``alive`` replaces (``alive(pid,
    created_ns)``); ``now_ns`` and ``this_host`` default to the clock and this
    host's name.
    """
    state = progress.state if progress is not None else None
    if state in ("error", "terminated"):
        return FAILED
    if closed or state == "closed":
        return FAILED if failed else FINISHED
    header = header or {}
    pid = progress.pid if progress is not None else _as_int(header.get("pid"))
    host = progress.host if progress is not None and progress.host else str(header.get("host") or "")
    since = progress.created_ns if progress is not None else _as_int(header.get("ts"))
    here = this_host if this_host is not None else socket.gethostname()
    if pid and host and host == here:
        return RUNNING if alive(pid, since) else DEAD
    now = time.time_ns() if now_ns is None else now_ns
    latest = max(progress.updated_ns if progress is not None else 0, last_write_ns or 0)
    if latest and now - latest <= recent_s * 1e9:
        return RUNNING
    return DEAD


def _as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
