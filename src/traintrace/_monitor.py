"""Background threads: the device/host sampler and the hang watchdog.

Both read what the writer thread already knows (the run's counters, the last
progress, the spans still open) and never touch the training thread.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any, Final

from ._names import EventName, SpanName, Verbosity
from ._recorder import ERROR
from ._sanitize import clip_text

if TYPE_CHECKING:
    from ._pipeline import Pipeline
    from ._recorder import Recorder, Span
    from ._stats import IterationStats

log = logging.getLogger("traintrace.lib")

HANG_SUSPECTED: Final = EventName.HANG_SUSPECTED
HANG_RESOLVED: Final = EventName.HANG_RESOLVED
HANG_EXIT: Final = EventName.HANG_EXIT

#: Default limits of the long phases during which ``hang_timeout`` does not apply.
DEFAULT_PHASE_TIMEOUTS: Final[dict[str, float]] = {
    SpanName.DISTRIBUTED_INIT: 1800.0,
    SpanName.MODEL_INIT: 1800.0,
    SpanName.DATA_LOADER_INIT: 1800.0,
    SpanName.OPTIMIZER_INIT: 1800.0,
    SpanName.CHECKPOINT_SAVE_SYNC: 1800.0,
    SpanName.CHECKPOINT_SAVE_ASYNC: 1800.0,
    SpanName.CHECKPOINT_LOAD: 1800.0,
    SpanName.VALIDATION: 3600.0,
    SpanName.TEST: 3600.0,
}


def _progress_phase(recorder: Any) -> str | None:
    """The standard phase the progress file says the training thread is in: finer than its open spans where an
    integration times phases between hooks without a span (the Lightning callback)."""
    from ._progress import S_COUNTER, phase_name

    prog = getattr(recorder, "_progress", None)
    try:
        return phase_name(int(prog[S_COUNTER])) if prog is not None else None
    except Exception:  # noqa: BLE001 - a released view: no phase
        return None


class _Periodic:
    """A daemon thread that calls ``tick`` every ``period`` seconds until stopped."""

    name = "traintrace-periodic"

    def __init__(self, period: float) -> None:
        self.period = period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, join: float = 0.0) -> None:
        self._stop.set()
        if join and self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(join)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.tick()
            except Exception:
                log.debug("traintrace: %s tick failed", self.name, exc_info=True)

    def tick(self) -> None:
        raise NotImplementedError


def open_spans(pipeline: Pipeline) -> list[Span]:
    """The spans the writer has seen start and not end (read from another thread)."""
    return pipeline.open_spans()


# ---------------------------------------------------------------- sampler


class _Host:
    """This process's CPU and memory, and the host's memory, from /proc or psutil."""

    def __init__(self) -> None:
        self._cpu = time.process_time()
        self._wall = time.monotonic()
        self._psutil: Any = None
        if not Path("/proc/meminfo").exists():
            try:
                import psutil  # type: ignore[import-not-found,import-untyped,unused-ignore]

                self._psutil = psutil
            except ImportError:
                pass

    def sample(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        cpu, wall = time.process_time(), time.monotonic()
        if wall > self._wall:
            out["process_cpu_percent"] = round(100.0 * (cpu - self._cpu) / (wall - self._wall), 2)
        self._cpu, self._wall = cpu, wall
        if self._psutil is not None:
            memory = self._psutil.virtual_memory()
            out["host_memory_total"] = int(memory.total)
            out["host_memory_used"] = int(memory.total - memory.available)
            out["process_rss"] = int(self._psutil.Process().memory_info().rss)
        else:
            meminfo = _read_kv("/proc/meminfo")
            if "MemTotal" in meminfo:
                out["host_memory_total"] = meminfo["MemTotal"]
                out["host_memory_used"] = meminfo["MemTotal"] - meminfo.get("MemAvailable", 0)
            status = _read_kv("/proc/self/status")
            if "VmRSS" in status:
                out["process_rss"] = status["VmRSS"]
        limited = cgroup_memory()
        if limited is not None:
            out["cgroup_memory_used"], out["cgroup_memory_limit"] = limited
        try:
            out["load_average_1m"] = os.getloadavg()[0]
        except (OSError, AttributeError):
            pass
        return out


#: A cgroup v1 ``memory.limit_in_bytes`` at least this large means no limit (the kernel writes 2^63 - 4096).
_NO_CGROUP_LIMIT = 1 << 62


def cgroup_memory(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> tuple[int, int] | None:
    """(used, limit) in bytes of the memory cgroup that limits this process (a container's, a Slurm job's), or
    None where no limit applies or none can be read. The kernel's OOM killer acts at that limit, which may be far
    below the host's memory. Read at each sample: a process may be moved to another cgroup.

    cgroup v2: ``memory.current`` and ``memory.max``; v1: ``memory.usage_in_bytes`` and
    ``memory.limit_in_bytes``. The process's own cgroup first, then its ancestors (the limit may be set above
    it); in a cgroup namespace, where the path is not under the mount, the mount's root.
    """
    try:
        lines = Path(proc_cgroup).read_text(encoding="ascii", errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, controllers, path = [*line.split(":", 2), "", ""][:3]
        if hierarchy == "0" and controllers == "":
            base, used_name, limit_name = Path(root), "memory.current", "memory.max"
            if not (base / "cgroup.controllers").exists():
                base = Path(root) / "unified"
        elif "memory" in controllers.split(","):
            base, used_name, limit_name = Path(root) / "memory", "memory.usage_in_bytes", "memory.limit_in_bytes"
        else:
            continue
        folder = base / path.strip().lstrip("/")
        if not folder.is_dir():
            folder = base
        while True:
            found = _cgroup_limit(folder, used_name, limit_name)
            if found is not None:
                return found
            if folder == base or base not in folder.parents:
                break
            folder = folder.parent
    return None


def _cgroup_limit(folder: Path, used_name: str, limit_name: str) -> tuple[int, int] | None:
    try:
        limit_text = (folder / limit_name).read_text(encoding="ascii").strip()
        if not limit_text.isdigit() or int(limit_text) >= _NO_CGROUP_LIMIT:
            return None  # "max" (v2), or v1's "no limit"
        return int((folder / used_name).read_text(encoding="ascii").strip()), int(limit_text)
    except (OSError, ValueError):
        return None


def _read_kv(path: str) -> dict[str, int]:
    """``Name:  1234 kB`` lines as bytes."""
    out: dict[str, int] = {}
    try:
        with Path(path).open(encoding="ascii", errors="replace") as file:
            for line in file:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    scale = 1024 if len(parts) > 1 and parts[1] == "kB" else 1
                    out[name] = int(parts[0]) * scale
    except OSError:
        pass
    return out


class _Gpu:
    """One GPU through NVML (package ``nvidia-ml-py``, extra ``gpu``)."""

    def __init__(self, local_rank: int) -> None:
        self.reason: str | None = None
        self.name: str | None = None
        self._nvml: Any = None
        self._handle: Any = None
        self._unsupported: set[str] = set()
        self.index: int | None = None
        try:
            import pynvml  # type: ignore[import-not-found,import-untyped,unused-ignore]
        except ImportError:
            self.reason = "NVML bindings not installed (pip install 'traintrace[gpu]')"
            return
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
        except Exception as exc:  # noqa: BLE001 - no driver, no device
            self.reason = f"NVML unavailable: {exc}"
            return
        if count < 1:
            self.reason = "no GPU found by NVML"
            return
        self._nvml = pynvml
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        choice = visible[local_rank % len(visible)] if visible else str(local_rank % count)
        try:
            if choice.isdigit():
                self.index = int(choice) % count
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
            else:
                self._handle = pynvml.nvmlDeviceGetHandleByUUID(choice)
                self.index = int(pynvml.nvmlDeviceGetIndex(self._handle))
            name = pynvml.nvmlDeviceGetName(self._handle)
            self.name = name.decode() if isinstance(name, bytes) else str(name)
        except Exception as exc:  # noqa: BLE001
            self.reason = f"NVML cannot open GPU {choice}: {exc}"
            self._nvml = None

    @property
    def present(self) -> bool:
        return self._nvml is not None

    def _get(self, key: str, read: Any) -> Any:
        if key in self._unsupported:
            return None
        try:
            return read()
        except Exception:  # noqa: BLE001 - NotSupported on this device: stop asking
            self._unsupported.add(key)
            return None

    def sample(self) -> dict[str, Any]:
        nvml, handle = self._nvml, self._handle
        out: dict[str, Any] = {"gpu_index": self.index, "gpu_name": self.name}
        util = self._get("util", lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
        if util is not None:
            out["gpu_utilization"] = int(util.gpu)
            out["memory_utilization"] = int(util.memory)
        memory = self._get("memory", lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        if memory is not None:
            out["memory_usage"] = int(memory.used)
            out["memory_total"] = int(memory.total)
        power = self._get("power", lambda: nvml.nvmlDeviceGetPowerUsage(handle))
        if power is not None:
            out["power_draw"] = power / 1000.0
        temperature = self._get("temperature", lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
        if temperature is not None:
            out["temperature"] = int(temperature)
        clock = self._get("clock", lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM))
        if clock is not None:
            out["clock_rate"] = int(clock)
        errors = self._nvlink_errors()
        if errors is not None:
            out["nvlink_errors"] = errors
        return out

    def _nvlink_errors(self) -> int | None:
        if "nvlink" in self._unsupported:
            return None
        nvml, handle = self._nvml, self._handle
        counters = [
            getattr(nvml, name)
            for name in (
                "NVML_NVLINK_ERROR_DL_REPLAY",
                "NVML_NVLINK_ERROR_DL_RECOVERY",
                "NVML_NVLINK_ERROR_DL_CRC_FLIT",
                "NVML_NVLINK_ERROR_DL_CRC_DATA",
            )
            if hasattr(nvml, name)
        ]
        total = 0
        active = 0
        for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                if not nvml.nvmlDeviceGetNvLinkState(handle, link):
                    continue
            except Exception:  # noqa: BLE001 - no such link
                continue
            active += 1
            for counter in counters:
                try:
                    total += int(nvml.nvmlDeviceGetNvLinkErrorCounter(handle, link, counter))
                except Exception:  # noqa: BLE001
                    continue
        if not active:
            self._unsupported.add("nvlink")
            return None
        return total


class Sampler(_Periodic):
    """Records ``device_properties`` events with the current step, every ``period`` s."""

    name = "traintrace-sampler"

    def __init__(self, recorder: Recorder, stats: IterationStats, period: float, local_rank: int) -> None:
        super().__init__(period)
        self.recorder = recorder
        self.stats = stats
        self.local_rank = local_rank
        self._host: _Host | None = None
        self._gpu: _Gpu | None = None
        self.samples = 0

    def tick(self) -> None:
        recorder = self.recorder
        if recorder.closed:
            self._stop.set()
            return
        if self._host is None:
            self._host = _Host()
            self._gpu = _Gpu(self.local_rank)
            if self._gpu.name:
                self.stats.device_name = self._gpu.name
        attrs: dict[str, Any] = {"step": self.stats.last_step}
        gpu = self._gpu
        if gpu is not None and gpu.present:
            attrs.update(gpu.sample())
        elif gpu is not None and gpu.reason is not None:
            attrs["gpu"] = f"none: {gpu.reason}"
            log.info("traintrace: device sampler records host figures only (%s)", gpu.reason)
            gpu.reason = None  # said once
        attrs.update(self._host.sample())
        self.samples += 1
        recorder.record_event(EventName.DEVICE_PROPERTIES, attrs, int(Verbosity.INFO), 0)


# ---------------------------------------------------------------- watchdog


def thread_stacks(first: set[int] = frozenset()) -> str:  # type: ignore[assignment]
    """The Python stack of every thread, those in ``first`` (idents) first."""
    names = {t.ident: (t.name, t.native_id) for t in threading.enumerate()}
    frames = sys._current_frames()
    me = threading.get_ident()
    order = sorted(frames, key=lambda ident: (ident not in first, ident == me, ident))
    parts: list[str] = []
    for ident in order:
        name, native = names.get(ident, ("?", None))
        parts.append(f'Thread "{name}" (tid {native or ident}):\n')
        parts.extend(traceback.format_stack(frames[ident]))
        parts.append("\n")
    return "".join(parts)


class Watchdog(_Periodic):
    """Records ``hang_suspected`` when nothing progresses for ``timeout`` seconds.

    Progress is an iteration (or a long phase, or ``heartbeat()``) ending, as
    seen by the writer. While a long phase in ``phase_timeouts`` is open, that
    phase's own limit applies instead. With ``exit_after``, the process exits
    with ``exit_code`` when a suspected hang lasts that much longer.
    """

    name = "traintrace-watchdog"

    def __init__(
        self,
        recorder: Recorder,
        stats: IterationStats,
        *,
        timeout: float,
        period: float,
        phase_timeouts: Mapping[str, float],
        exit_after: float | None,
        exit_code: int,
    ) -> None:
        super().__init__(period)
        self.recorder = recorder
        self.pipeline: Pipeline = stats.pipeline
        self.stats = stats
        self.timeout_ns = int(timeout * 1e9)
        self.phase_timeouts_ns = {k: int(v * 1e9) for k, v in phase_timeouts.items()}
        self.exit_after_ns = None if exit_after is None else int(exit_after * 1e9)
        self.exit_code = exit_code
        self.beat = 0
        self.suspected_at: int | None = None
        self._suspected_ref = 0
        self.fired = 0
        # Once a long phase ends, however it ended (an exception leaving a failed model initialisation), the plain
        # limit counts from the first tick that saw it ended, not from the progress before the phase. From that
        # tick, not the last one that saw it open: that one came up to a period before its end, and a report came
        # 0.8 s after the end of a phase with a limit of 1 s.
        self._phase_seen = 0
        self._phase_open = False

    def _reference(self, spans: list[Span]) -> int:
        ref = max(self.stats.last_progress, self.beat)
        for span in spans:
            if span.name == SpanName.TRAINING_LOOP:
                ref = max(ref, span.t0)
        return ref

    def _check(self, now: int) -> tuple[bool, int, int, str | None, list[Span]]:
        """(suspected, reference, limit, phase, open spans)."""
        spans = [s for s in open_spans(self.pipeline) if s.t1 is None]
        ref = self._reference(spans)
        phases = [s for s in spans if s.name in self.phase_timeouts_ns]
        if phases:
            self._phase_open = True
            for span in phases:
                limit = self.phase_timeouts_ns[span.name]
                if now - max(span.t0, ref) > limit:
                    return True, max(span.t0, ref), limit, span.name, spans
            return False, ref, self.timeout_ns, phases[0].name, spans
        if self._phase_open:
            self._phase_open = False
            self._phase_seen = now
        looping = any(s.name == SpanName.TRAINING_LOOP for s in spans)
        if ref == 0 or (self.stats.loop_ended and not looping):
            # Not armed: no loop or progress yet, or the loop is over.
            return False, ref, self.timeout_ns, None, spans
        ref = max(ref, self._phase_seen)
        return now - ref > self.timeout_ns, ref, self.timeout_ns, None, spans

    def tick(self) -> None:
        recorder = self.recorder
        if recorder.closed:
            self._stop.set()
            return
        now = perf_counter_ns()
        if recorder.handling_signal:
            # The user's SIGTERM handler runs (the process is being ended): no hang of training is reported while it
            # does (a 2 s emergency save read as a hang on every rank of a job the scheduler terminated), and the
            # plain limit counts from its end if the process goes on.
            self._phase_open = True
            return
        if self.suspected_at is not None:
            progressed = self._reference(open_spans(self.pipeline)) > self._suspected_ref
            if progressed:
                self._resolved(now)
            elif self.exit_after_ns is not None and now - self.suspected_at > self.exit_after_ns:
                self._exit(now)
            return
        suspected, _, _, _, _ = self._check(now)
        if not suspected:
            return
        # Confirm with everything queued so far written: progress may be in the queue.
        # Held tensors are not read meanwhile: the device may be what hangs.
        self.stats.quiet_flush = True
        recorder.flush(min(5.0, max(self.period, 0.5)))
        now = perf_counter_ns()
        suspected, ref, limit, phase, spans = self._check(now)
        if suspected:
            self._fire(now, ref, limit, phase, spans)
        else:
            self.stats.quiet_flush = False

    def _fire(self, now: int, ref: int, limit: int, phase: str | None, spans: list[Span]) -> None:
        stats = self.stats
        idle = (now - ref) / 1e9
        listed = [
            {
                "name": s.name,
                "id": s.id,
                "open_seconds": round((now - s.t0) / 1e9, 3),
                "tid": getattr(s, "tid", 0),
            }
            for s in sorted(spans, key=lambda s: s.t0)[:64]
        ]
        attrs: dict[str, Any] = {
            "idle_seconds": round(idle, 3),
            "limit_seconds": limit / 1e9,
            "last_step": stats.last_step,
            "completed_steps": stats.completed_steps,
            "open_spans": listed,
            "threads": threading.active_count(),
        }
        if phase is not None:
            attrs["phase"] = phase
        training_phase = _progress_phase(self.recorder)
        if training_phase:
            attrs["progress_phase"] = training_phase
        where = f" in {phase}" if phase else ""
        message = f"no progress for {idle:.1f}s{where} (limit {limit / 1e9:g}s); last completed step {stats.last_step}"
        owners = {getattr(s, "tid", 0) for s in spans}
        stack = clip_text(thread_stacks(owners), 65536)
        self._put_error(HANG_SUSPECTED, attrs, message, stack)
        self.suspected_at = now
        self._suspected_ref = ref
        self.fired += 1
        if self.recorder.flush(5.0):
            log.error("traintrace: hang suspected: %s", message)
        else:
            # The writer itself is stuck (e.g. reading a tensor from a hung device):
            # the record may never reach a backend, so the log carries the stacks.
            log.error("traintrace: hang suspected: %s; the writer is stuck too\n%s", message, stack)

    def _resolved(self, now: int) -> None:
        assert self.suspected_at is not None
        ref = self._reference(open_spans(self.pipeline))
        attrs = {
            "hang_seconds": round((ref - self._suspected_ref) / 1e9, 3),
            "last_step": self.stats.last_step,
        }
        self.recorder.record_event(HANG_RESOLVED, attrs, int(Verbosity.ERROR), 0)
        log.warning("traintrace: progress resumed after %.1fs", attrs["hang_seconds"])
        self.suspected_at = None
        self.stats.quiet_flush = False

    def _exit(self, now: int) -> None:
        message = f"no progress for {(now - self._suspected_ref) / 1e9:.1f}s; exiting with {self.exit_code}"
        self._put_error(HANG_EXIT, {"exit_code": self.exit_code}, message, clip_text(thread_stacks(), 65536))
        log.critical("traintrace: %s", message)
        try:
            self.recorder.terminate("hang")
        finally:
            os._exit(self.exit_code)

    def _put_error(self, name: str, attrs: dict[str, Any], message: str, stack: str) -> None:
        recorder = self.recorder
        if recorder.closed:
            return
        item = (ERROR, name, attrs, 0, threading.get_ident(), perf_counter_ns(), (None, message, stack))
        recorder.put(item)
        recorder.wake()
