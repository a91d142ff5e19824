"""The per-rank progress file: where a rank is, kept by the kernel when the rank is killed.

Beside each rank's stream ``rankN.jsonl`` the recorder keeps ``rankN.progress``,
a small fixed-layout binary file (see docs/format.md, "Progress file"), mapped
into memory and updated in place by the training thread when an iteration or a
standard phase starts or stops: a handful of 8-byte stores into a
``memoryview``, no system call, no allocation beyond the clock reading the span
makes anyway. The pages belong to the kernel's page cache, so the last values
survive ``SIGKILL``, a segfault or the OOM killer, although the stream's last
flush interval does not.

This module holds the writer side (opened by ``configure()``, closed by
``close()``, detached in a forked child). The reader side is
:mod:`traintrace.progress`.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from ._format import PROGRESS_SUFFIX
from ._names import SpanName

if TYPE_CHECKING:
    from ._identity import Identity
    from ._recorder import Recorder

log = logging.getLogger("traintrace.lib")

#: The file's suffix, replacing the stream's (``rank0.jsonl`` -> ``rank0.progress``).
SUFFIX: Final = PROGRESS_SUFFIX
#: ``b"TTPROGR\\0"`` read as a little-endian int64 (a reader on another byte order sees garbage).
MAGIC: Final = int.from_bytes(b"TTPROGR\0", "little")
VERSION: Final = 1
#: The file's size in bytes.
SIZE: Final = 512

# Slots: int64 each, at byte offset 8 * slot.
S_MAGIC: Final = 0
S_VERSION: Final = 1
S_SIZE: Final = 2
S_PID: Final = 3
S_RANK: Final = 4
S_WORLD_SIZE: Final = 5
S_RESTART: Final = 6
S_STATE: Final = 7
#: The update word: update counter * 256 + phase code (one store per update for both).
S_COUNTER: Final = 8
S_STEP: Final = 9
S_PHASE_T0: Final = 11
S_UPDATED: Final = 12
S_COLLECTIVE: Final = 13
S_CLOCK_OFFSET: Final = 14
S_CREATED: Final = 15
S_ITERATIONS: Final = 16
#: Slot 16's count when the last iteration that ended ``ok`` started: which iteration completed last.
S_LAST_DONE: Final = 17
S_STEP_T0: Final = 18
S_LAST_STEP_NS: Final = 19
S_COLLECTIVE_T0: Final = 20
S_STEPS_DONE: Final = 21
#: The writer thread's last cycle (every ``flush_interval``, records or not): the process was alive then.
S_ALIVE: Final = 22
#: When this process's first iteration started: a killed rank's initialisation ended by then, its end record lost.
S_FIRST_STEP_T0: Final = 23
#: The phase code's bits in the update word; the counter counts in steps of this.
PHASE_BITS: Final = 8
COUNTER_STEP: Final = 1 << PHASE_BITS
PHASE_MASK: Final = COUNTER_STEP - 1
#: Byte ranges of the text fields (UTF-8, NUL-padded).
HOST_AT: Final = (256, 320)
JOB_AT: Final = (320, 384)

STATE_RUNNING: Final = 1
STATE_CLOSED: Final = 2
STATE_ERROR: Final = 3
STATE_TERMINATED: Final = 4
STATE_NAMES: Final = {
    STATE_RUNNING: "running",
    STATE_CLOSED: "closed",
    STATE_ERROR: "error",
    STATE_TERMINATED: "terminated",
}

#: Phase codes: the index in this tuple. Code 0 is "no phase"; new names are only ever appended.
PHASE_NAMES: Final[tuple[str, ...]] = (
    "",
    SpanName.APPLICATION,
    SpanName.DISTRIBUTED_INIT,
    SpanName.DATA_LOADER_INIT,
    SpanName.MODEL_INIT,
    SpanName.OPTIMIZER_INIT,
    SpanName.TRAINING_LOOP,
    SpanName.ITERATION,
    SpanName.DATA_LOADING,
    SpanName.FORWARD,
    SpanName.BACKWARD,
    SpanName.ZERO_GRAD,
    SpanName.OPTIMIZER_STEP,
    SpanName.VALIDATION,
    SpanName.TEST,
    SpanName.CHECKPOINT_SAVE_SYNC,
    SpanName.CHECKPOINT_SAVE_ASYNC,
    SpanName.CHECKPOINT_SAVE_FINALIZATION,
    SpanName.CHECKPOINT_LOAD,
    SpanName.COLLECTIVE,
)
PHASE_CODES: Final[dict[str, int]] = {name: code for code, name in enumerate(PHASE_NAMES) if name}
ITERATION_CODE: Final = PHASE_CODES[SpanName.ITERATION]
COLLECTIVE_CODE: Final = PHASE_CODES[SpanName.COLLECTIVE]


def phase_name(word: int) -> str | None:
    """The phase in an update word (``S_COUNTER``): None for none, ``phase#N`` for a code this version lacks."""
    code = word % COUNTER_STEP
    if code == 0:
        return None
    return PHASE_NAMES[code] if code < len(PHASE_NAMES) else f"phase#{code}"


def progress_path(stream_path: str | os.PathLike[str]) -> Path:
    """The progress file beside the stream at ``stream_path``: ``rank0.jsonl`` -> ``rank0.progress``
    (other names get the suffix added: ``job.rank0`` -> ``job.rank0.progress``)."""
    path = Path(stream_path)
    if path.suffix == ".jsonl":
        return path.with_suffix(SUFFIX)
    return path.with_name(path.name + SUFFIX)


def _text(value: str, size: int) -> bytes:
    data = value.encode("utf-8", "replace")[:size]
    return data + b"\0" * (size - len(data))


def kept_attempt_path(path: Path, restart: int) -> Path:
    """Where an earlier attempt's progress file is kept when a restart opens the rank's:
    ``rank0.progress`` -> ``rank0.restart0.progress``."""
    stem = path.name[: -len(SUFFIX)] if path.name.endswith(SUFFIX) else path.name
    return path.with_name(f"{stem}.restart{restart}{SUFFIX}")


def _keep_earlier_attempt(path: Path, restart: int) -> None:
    """A restart (torchrun's, with no launcher of traintrace's to copy it) would replace the file of the attempt
    before, which alone says where a rank killed there was: that file is moved aside, to its attempt's name, when
    it is an earlier attempt's. The same attempt's file (a second ``configure()``) is replaced, as is a later
    one's (a job run again under the same id). Best effort: the new file is made either way."""
    try:
        with path.open("rb") as old:
            head = old.read(8 * (S_RESTART + 1))
        if len(head) < 8 * (S_RESTART + 1):
            return
        magic = int.from_bytes(head[:8], "little")
        theirs = int.from_bytes(head[8 * S_RESTART : 8 * (S_RESTART + 1)], "little", signed=True)
        if magic == MAGIC and 0 <= theirs < restart:
            path.replace(kept_attempt_path(path, theirs))
    except OSError:
        pass


class ProgressFile:
    """One open, mapped progress file. ``view`` is the int64 view the hot path stores into."""

    def __init__(self, path: Path, identity: Identity, file_mode: int = 0o644) -> None:
        self.path = path
        mono = time.perf_counter_ns()
        wall = time.time_ns()
        initial = bytearray(SIZE)
        slots = memoryview(initial).cast("q")
        slots[S_MAGIC] = MAGIC
        slots[S_VERSION] = VERSION
        slots[S_SIZE] = SIZE
        slots[S_PID] = os.getpid()
        slots[S_RANK] = identity.rank
        slots[S_WORLD_SIZE] = identity.world_size
        slots[S_RESTART] = identity.restart_count
        slots[S_STATE] = STATE_RUNNING
        slots[S_STEP] = -1
        slots[S_UPDATED] = mono
        slots[S_ALIVE] = mono
        slots[S_CLOCK_OFFSET] = wall - mono
        slots[S_CREATED] = wall
        slots.release()
        initial[HOST_AT[0] : HOST_AT[1]] = _text(identity.host, HOST_AT[1] - HOST_AT[0])
        initial[JOB_AT[0] : JOB_AT[1]] = _text(identity.job_id, JOB_AT[1] - JOB_AT[0])
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written in full (real blocks, no sparse hole: a store into a hole on a full disk
        # would be SIGBUS) under a temporary name, then renamed: a reader never sees half.
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), file_mode)
        try:
            written = os.write(fd, bytes(initial))
            if written != SIZE:
                raise OSError(f"short write to {temporary} ({written} of {SIZE} bytes)")
            _keep_earlier_attempt(path, identity.restart_count)
            temporary.replace(path)
            self._map = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            try:
                temporary.unlink()
            except OSError:
                pass
            raise
        finally:
            os.close(fd)
        self._bytes = memoryview(self._map)
        self.view: memoryview = self._bytes.cast("q")

    def set_state(self, state: int, counter: int) -> None:
        try:
            self.view[S_UPDATED] = time.perf_counter_ns()
            self.view[S_STATE] = state
            self.view[S_COUNTER] = counter | (self.view[S_COUNTER] & (COUNTER_STEP - 1))
        except (ValueError, TypeError):
            pass  # already released

    def release(self) -> None:
        """Unmap (the file stays, with its last values)."""
        for view in (self.view, self._bytes):
            try:
                view.release()
            except Exception:  # noqa: BLE001 - a view still exported elsewhere: leave it to the GC
                return
        try:
            self._map.close()
        except Exception:  # noqa: BLE001
            pass


# Recorders with an open progress file, detached in a forked child.
_attached: weakref.WeakSet[Any] = weakref.WeakSet()
_warned = False


def file_stream(recorder: Recorder | None) -> Any:
    """The recorder's file backend (its stream), or None."""
    from .backends._file import FileBackend

    if recorder is None:
        return None
    for route in recorder.routes():
        if isinstance(route.backend, FileBackend):
            return route.backend
    return None


def dead_worker_fields(rank: int, pid: int | None) -> dict[str, Any]:
    """For the launcher: the last step and phase of a dead worker, from its progress file
    in the folder of this process's (the agent's) stream; empty if not found."""
    from ._recorder import get_active
    from .progress import last_progress, progress_fields

    stream = file_stream(get_active())
    if stream is None:
        return {}
    return progress_fields(last_progress(stream.path.parent, rank, pid))


def attach(recorder: Recorder, config: Any, identity: Identity) -> None:
    """Open the progress file beside the recorder's file stream, if any; warn once if impossible."""
    global _warned
    if not getattr(config, "progress_file", True):
        return
    header = recorder.header
    if header.get("role") == "agent" or "parent_pid" in header:
        return  # a launcher agent, or a forked child's own stream: not a rank's training thread
    stream = file_stream(recorder)
    if stream is None:
        return
    path = progress_path(stream.path)
    try:
        opened = ProgressFile(path, identity, stream.file_mode)
    except Exception as exc:  # noqa: BLE001 - a missing progress file never stops recording
        if not _warned:
            _warned = True
            reason = f"{type(exc).__name__}: {exc}"
            log.warning("traintrace: no progress file (%s); recording continues without it", reason)
        return
    recorder._progress_file = opened
    recorder._progress_tid = threading.get_ident()
    recorder._progress = opened.view
    recorder._pipeline.alive_slot = opened.view
    _attached.add(recorder)


def finish(recorder: Recorder, state: int) -> None:
    """Mark the file closed/terminated/error at the recorder's close and unmap it."""
    opened: ProgressFile | None = getattr(recorder, "_progress_file", None)
    recorder._progress = None
    recorder._pipeline.alive_slot = None
    recorder._progress_file = None
    if opened is None:
        return
    if state == STATE_CLOSED and recorder._progress_error:
        state = STATE_ERROR
    opened.set_state(state, next(recorder._progress_seq))
    opened.release()
    _attached.discard(recorder)


def adopt(recorder: Recorder, span: Any) -> bool:
    """A span started on a thread other than the progress file's. The first iteration decides:
    if the configuring thread has run none yet, this thread is the training thread from now on."""
    prog = recorder._progress
    try:
        if prog is not None and span.name == SpanName.ITERATION and prog[S_ITERATIONS] == 0:
            recorder._progress_tid = span.tid
            return True
    except Exception:  # noqa: BLE001
        pass
    return False


def failed(recorder: Recorder, span: Any = None, t0: int = 0) -> None:
    """A store raised. A step that is no int64 (too large): the iteration is kept with step -1.
    Anything else (a released view): stop updating, warn once."""
    global _warned
    prog = recorder._progress
    if prog is not None and span is not None and span.name == SpanName.ITERATION:
        try:
            prog[S_STEP] = -1
            prog[S_STEP_T0] = t0
            started = next(recorder._progress_iterations)
            prog[S_ITERATIONS] = started
            if started == 1:
                prog[S_FIRST_STEP_T0] = t0
            prog[S_PHASE_T0] = t0
            prog[S_COUNTER] = next(recorder._progress_seq) | ITERATION_CODE
            return
        except Exception:  # noqa: BLE001
            pass
    recorder._progress = None
    if not _warned:
        _warned = True
        log.warning("traintrace: the progress file could not be updated; it is no longer kept")


def enter_timed_phase(recorder: Recorder, code: int, t0: int) -> None:
    """A standard phase (``PHASE_CODES``) an integration times between two hooks instead of opening a span (the
    Lightning callback's timed phases): the file says the rank entered it at ``t0``, as the span's start would,
    so that a rank that hangs or dies in it is found there. The next span that starts or stops on the thread
    moves the file on, as after any phase. Two stores; call it from the training thread (a framework's hooks)."""
    prog = recorder._progress
    if prog is not None:
        try:
            prog[S_PHASE_T0] = t0
            prog[S_COUNTER] = next(recorder._progress_seq) | code
        except Exception:  # noqa: BLE001 - never raise into training
            failed(recorder)


def _after_fork_in_child() -> None:
    # The parent's mapping is shared: the child must never write it.
    for recorder in list(_attached):
        recorder._progress = None
        recorder._pipeline.alive_slot = None
        recorder._progress_file = None
    _attached.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
