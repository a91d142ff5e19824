"""The hang watchdog and the device/host sampler, on real loops and a real process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

import traintrace as tt
from traintrace._monitor import cgroup_memory, thread_stacks

LIMIT = 1.0
PERIOD = 0.2


@pytest.fixture
def memory() -> Iterator[tt.MemoryBackend]:
    """A memory-only recorder, closed after the test."""
    backend = tt.MemoryBackend()
    yield backend
    tt.close()


def configure(memory: tt.MemoryBackend, **settings: Any) -> tt.Recorder:
    base: dict[str, Any] = {
        "device_sample_interval": 0,
        "hang_timeout": LIMIT,
        "hang_check_interval": PERIOD,
        "flush_interval": 0.05,
        "job_id": "test",
    }
    base.update(settings)
    return tt.configure(backends={}, extra_backends=[memory], **base)


def wait_for(predicate: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def stuck_in_collective(release: threading.Event) -> None:
    """Stands for an all-reduce that never returns."""
    release.wait(30)


def test_watchdog_fires_with_stacks_and_resolves(memory: tt.MemoryBackend) -> None:
    """A loop that stops progressing is reported within the limit plus one period, then resolved."""
    configure(memory)
    release = threading.Event()

    def hung() -> bool:
        return bool([e for e in memory.errors() if e["name"] == "hang_suspected"])

    def watcher() -> None:
        wait_for(hung)
        release.set()

    threading.Thread(target=watcher, daemon=True).start()
    with tt.training_loop():
        for step in range(8):
            with tt.training_iteration(step):
                if step == 5:
                    stuck_in_collective(release)
        assert wait_for(lambda: memory.events("hang_resolved"), timeout=5)
    tt.flush()
    (error,) = (e for e in memory.errors() if e["name"] == "hang_suspected")
    attrs = error["attrs"]
    assert "stuck_in_collective" in error["stack"]
    assert "release.wait(30)" in error["stack"]
    assert attrs["last_step"] == 4
    assert LIMIT <= attrs["idle_seconds"] < LIMIT + PERIOD + 2.0  # 2 s of slack for a loaded machine
    names = [s["name"] for s in attrs["open_spans"]]
    assert names == ["training_loop", "iteration"]
    (resolved,) = memory.events("hang_resolved")
    assert resolved["attrs"]["last_step"] >= 5
    # The step that hung shows its own length.
    stuck = next(s for s in memory.spans("iteration") if s["attrs"]["step"] == 5)
    assert stuck["dur"] / 1e9 >= LIMIT


def test_a_hang_that_ends_in_an_exception_is_not_resolved(memory: tt.MemoryBackend) -> None:
    """A step that hangs, then fails (a collective's peer gave up), made no progress: the watchdog keeps
    the hang suspected while the process lives on, and only a step that completes resolves it."""
    configure(memory)

    def hung() -> bool:
        return any(e["name"] == "hang_suspected" for e in memory.errors())

    for attempt in range(2):
        try:
            with tt.training_loop():
                for step in range(4):
                    with tt.training_iteration(step):
                        if step == 3:
                            assert wait_for(hung, timeout=LIMIT + 10)
                            raise RuntimeError("Connection closed by peer")
        except RuntimeError:
            pass
        if attempt == 0:
            # The process lives on (its exception is being reported, the launcher is slow to stop it).
            time.sleep(PERIOD * 5)
            tt.flush()
            assert not memory.events("hang_resolved")
    # The second attempt's steps completed: that is progress.
    assert wait_for(lambda: memory.events("hang_resolved"), timeout=5)


def test_watchdog_waits_for_marked_long_phases(memory: tt.MemoryBackend) -> None:
    """A checkpoint longer than hang_timeout but within its own limit is not a hang."""
    configure(memory, phase_timeouts={"checkpoint_save_sync": 30})
    with tt.training_loop():
        for step in range(3):
            with tt.training_iteration(step):
                pass
            if step == 1:
                with tt.checkpoint_save(current_iteration=step):
                    time.sleep(LIMIT + 4 * PERIOD + 0.3)
        time.sleep(PERIOD * 2)
    tt.flush()
    assert [e for e in memory.errors() if e["name"] == "hang_suspected"] == []


def test_watchdog_counts_from_the_end_of_a_long_phase_that_failed(memory: tt.MemoryBackend) -> None:
    """An exception leaves a model initialisation longer than hang_timeout (its peers' collective timed out): the
    process lives on reporting it. The plain limit counts from the phase's end, not from the progress before it
    (the process group's initialisation): a report came at the first tick after the exception, `no progress for
    7.3s`, and `summary` counted the whole initialisation as a hang (`fault_sweep --seed 291 --abort`)."""
    configure(memory)
    with tt.distributed_init():
        pass
    try:
        with tt.model_init():
            # Half a period off the watchdog's ticks (which began with the configuration): its last tick that saw
            # the phase open came half a period before the end.
            time.sleep(LIMIT + 4.5 * PERIOD)
            raising_ns = time.time_ns()  # the phase ends after this
            raise RuntimeError("Timed out waiting 6000ms for recv operation to complete")
    except RuntimeError:
        ended = time.monotonic()
    time.sleep(LIMIT / 2)  # within the limit of the phase's end
    tt.flush()
    assert [e for e in memory.errors() if e["name"] == "hang_suspected"] == []
    # Past the limit of the phase's end it is a hang, and no older than that.
    assert wait_for(lambda: [e for e in memory.errors() if e["name"] == "hang_suspected"], timeout=LIMIT + 10)
    (error,) = (e for e in memory.errors() if e["name"] == "hang_suspected")
    idle = error["attrs"]["idle_seconds"]
    # Counted from the first tick that saw the phase ended: never more than the time since its end, and the report
    # no sooner than the limit after it, by the test's clock. (From the last tick that saw it open, CI's loaded run
    # read 1.006 s at 0.805 s past the end.)
    assert LIMIT <= idle <= time.monotonic() - ended + PERIOD, idle
    assert error["ts"] - raising_ns >= LIMIT * 1e9, (error["ts"] - raising_ns) / 1e9


def test_watchdog_is_paused_while_the_users_sigterm_handler_runs(memory: tt.MemoryBackend) -> None:
    """The user's own SIGTERM handler (traintrace records the signal, then calls it) works longer than hang_timeout
    (an emergency checkpoint save; the scheduler's time limit ended the job): no hang is reported while it runs,
    and if it returns and training goes on, the plain limit counts from its end. Every rank of a 2-node job the
    scheduler terminated read as hung before (`fault_sweep --seed 308 --nodes 2`)."""
    ran: list[float] = []

    def save_then_return(signum: int, frame: object) -> None:
        time.sleep(LIMIT + 4 * PERIOD)
        ran.append(time.monotonic())

    previous = signal.signal(signal.SIGTERM, save_then_return)
    try:
        configure(memory)
        with tt.training_loop():
            with tt.training_iteration(0):
                pass
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, on this (the main) thread
            assert ran, "the handler ran"
            time.sleep(LIMIT / 2)  # within the limit of the handler's end
            tt.flush()
            assert [e for e in memory.errors() if e["name"] == "hang_suspected"] == []
            assert [e["attrs"]["signal"] for e in memory.events("signal")] == ["SIGTERM"]
            # Past the limit of the handler's end it is a hang again, and no older than that.
            assert wait_for(lambda: [e for e in memory.errors() if e["name"] == "hang_suspected"], timeout=LIMIT + 10)
        (error,) = (e for e in memory.errors() if e["name"] == "hang_suspected")
        idle = error["attrs"]["idle_seconds"]
        assert LIMIT <= idle <= time.monotonic() - ran[0] + PERIOD, idle
    finally:
        tt.close()
        signal.signal(signal.SIGTERM, previous)


def test_watchdog_fires_when_a_phase_exceeds_its_own_limit(memory: tt.MemoryBackend) -> None:
    """A phase past its own limit is reported, naming the phase."""
    configure(memory, hang_timeout=60, phase_timeouts={"validation_loop": 0.5})
    with tt.training_loop():
        with tt.training_iteration(0):
            pass
        with tt.validation():
            assert wait_for(lambda: [e for e in memory.errors() if e["name"] == "hang_suspected"])
    tt.flush()
    (error,) = (e for e in memory.errors() if e["name"] == "hang_suspected")
    assert error["attrs"]["phase"] == "validation_loop"
    assert error["attrs"]["limit_seconds"] == 0.5


def test_watchdog_is_quiet_before_the_loop(memory: tt.MemoryBackend) -> None:
    """Without a loop, progress or an open phase, there is nothing to watch."""
    configure(memory, hang_timeout=0.3)
    time.sleep(0.3 + 3 * PERIOD)
    tt.flush()
    assert memory.errors() == []


def test_heartbeat_counts_as_progress(memory: tt.MemoryBackend) -> None:
    """heartbeat() keeps a loop doing long work outside iterations from being reported."""
    configure(memory, hang_timeout=0.6)
    with tt.training_loop():
        for _ in range(8):
            time.sleep(0.2)
            tt.heartbeat()
    tt.flush()
    assert memory.errors() == []


HARD_MODE = textwrap.dedent(
    """
    import sys, time
    import traintrace as tt
    tt.configure(log_dir=sys.argv[1], job_id="hard", backends={"log": False}, hang_timeout=0.5,
                 hang_check_interval=0.1, hang_exit_after=0.5, hang_exit_code=86, flush_interval=0.05,
                 device_sample_interval=0)
    with tt.training_loop():
        for step in range(3):
            with tt.training_iteration(step):
                pass
        def wait_forever():
            time.sleep(60)
        wait_forever()
    """
)


@pytest.mark.subprocess
def test_hard_mode_exits_with_its_code(tmp_path: Path) -> None:
    """In hard mode a hang that lasts ends the process with the configured code."""
    script = tmp_path / "hang.py"
    script.write_text(HARD_MODE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINTRACE_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1] / "src")
    command = [sys.executable, str(script), str(tmp_path / "logs")]
    done = subprocess.run(command, env=env, timeout=60, capture_output=True, check=False)
    assert done.returncode == 86, done.stderr.decode()
    records = [json.loads(line) for line in (tmp_path / "logs" / "hard" / "rank0.jsonl").read_text().splitlines()]
    names = [r.get("name") for r in records if r["kind"] == "error"]
    assert names == ["hang_suspected", "hang_exit"]
    schema = json.loads((Path(tt.__file__).parent / "schema" / "record-v1.schema.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    for record in records:
        validator.validate(record)
    suspected = next(r for r in records if r.get("name") == "hang_suspected")
    assert "wait_forever" in suspected["stack"]
    iteration = [r for r in records if r.get("name") == "iteration"]
    assert len(iteration) == 3


def test_sampler_records_host_figures_with_the_step(memory: tt.MemoryBackend) -> None:
    """device_properties events carry the step; without a GPU it says so once."""
    configure(memory, device_sample_interval=0.1, hang_timeout=0)
    with tt.training_loop():
        for step in range(3):
            with tt.training_iteration(step):
                pass
        assert wait_for(lambda: len(memory.events("device_properties")) >= 3)
    tt.flush()
    events = memory.events("device_properties")
    later = events[-1]["attrs"]
    assert later["step"] == 2
    assert later["process_rss"] > 0
    assert 0 < later["host_memory_used"] <= later["host_memory_total"]
    assert "process_cpu_percent" in later
    if "gpu_name" in later:  # a machine with a GPU and NVML
        assert 0 < later["memory_usage"] <= later["memory_total"]
        assert "gpu_utilization" in later
    else:
        notes = [e for e in events if "gpu" in e["attrs"]]
        assert len(notes) == 1
        assert notes[0]["attrs"]["gpu"].startswith("none: ")


def test_thread_stacks_show_every_thread() -> None:
    """The dump names each thread and shows where it is."""
    release = threading.Event()
    thread = threading.Thread(target=stuck_in_collective, args=(release,), name="worker-7")
    thread.start()
    try:
        text = thread_stacks({thread.ident or 0})
    finally:
        release.set()
        thread.join()
    assert text.startswith('Thread "worker-7"')
    assert "stuck_in_collective" in text
    assert 'Thread "MainThread"' in text


def test_watchdog_is_quiet_after_the_loop(memory: tt.MemoryBackend) -> None:
    """Once the training loop has ended, work after it is not a hang."""
    configure(memory, hang_timeout=0.3)
    with tt.training_loop():
        for step in range(3):
            with tt.training_iteration(step):
                pass
    time.sleep(0.3 + 4 * PERIOD)
    tt.flush()
    assert memory.errors() == []


class FakeNvml:
    """The parts of pynvml the sampler calls, with fixed readings (a unit test of our parsing)."""

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_NVLINK_MAX_LINKS = 4
    NVML_NVLINK_ERROR_DL_REPLAY = 0
    NVML_NVLINK_ERROR_DL_RECOVERY = 1
    NVML_NVLINK_ERROR_DL_CRC_FLIT = 2
    NVML_NVLINK_ERROR_DL_CRC_DATA = 3

    class _Util:
        gpu = 87
        memory = 40

    class _Memory:
        used = 60 << 30
        total = 80 << 30

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        return b"NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        return self._Util()

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return self._Memory()

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        return 650_500

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        return 71

    def nvmlDeviceGetClockInfo(self, handle: int, clock: int) -> int:
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    def nvmlDeviceGetNvLinkState(self, handle: int, link: int) -> int:
        return 1 if link < 2 else 0

    def nvmlDeviceGetNvLinkErrorCounter(self, handle: int, link: int, counter: int) -> int:
        return counter + 1


def test_gpu_readings_from_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML readings become the documented fields; an unsupported one is skipped and not asked again."""
    from traintrace import _monitor

    fake = FakeNvml()
    calls: list[int] = []
    original = fake.nvmlDeviceGetClockInfo

    def clock(handle: int, kind: int) -> int:
        calls.append(kind)
        return original(handle, kind)

    monkeypatch.setattr(fake, "nvmlDeviceGetClockInfo", clock)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    gpu = _monitor._Gpu(local_rank=0)
    assert gpu.present and gpu.index == 1
    first = gpu.sample()
    second = gpu.sample()
    assert first == second
    assert first == {
        "gpu_index": 1,
        "gpu_name": "NVIDIA H100 80GB HBM3",
        "gpu_utilization": 87,
        "memory_utilization": 40,
        "memory_usage": 60 << 30,
        "memory_total": 80 << 30,
        "power_draw": 650.5,
        "temperature": 71,
        "nvlink_errors": 2 * (1 + 2 + 3 + 4),
    }
    assert calls == [1]
    assert tt.peak_tflops(gpu.name or "") == 989.0


def _cgroup_tree(tmp_path: Path, proc_line: str, files: dict[str, str]) -> tuple[str, str]:
    """A /proc/self/cgroup with ``proc_line`` and a cgroup mount under ``tmp_path`` holding ``files``."""
    proc = tmp_path / "cgroup"
    proc.write_text(proc_line + "\n")
    root = tmp_path / "mnt"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    return str(proc), str(root)


@pytest.mark.parametrize(
    ("proc_line", "files", "expected"),
    [
        # v2: the process's own cgroup has the limit.
        (
            "0::/job/rank1",
            {"cgroup.controllers": "memory", "job/rank1/memory.max": "1073741824", "job/rank1/memory.current": "5"},
            (5, 1 << 30),
        ),
        # v2: no limit on the own cgroup ("max"), one on its parent (a Slurm job's step under the job).
        (
            "0::/job/step",
            {
                "cgroup.controllers": "memory",
                "job/step/memory.max": "max",
                "job/step/memory.current": "7",
                "job/memory.max": "2048",
                "job/memory.current": "9",
            },
            (9, 2048),
        ),
        # v1 in a namespace: the path is not under the mount, whose root is the container's cgroup.
        (
            "4:memory:/kubepods/pod1/c1",
            {"memory/memory.limit_in_bytes": "4096", "memory/memory.usage_in_bytes": "1000"},
            (1000, 4096),
        ),
        # v1 without a limit (the kernel's 2^63 - 4096), and a line for another controller.
        (
            "3:cpu:/x\n4:memory:/",
            {"memory/memory.limit_in_bytes": "9223372036854771712", "memory/memory.usage_in_bytes": "1000"},
            None,
        ),
    ],
)
def test_the_memory_cgroup_limit_is_found(
    tmp_path: Path, proc_line: str, files: dict[str, str], expected: tuple[int, int] | None
) -> None:
    proc, root = _cgroup_tree(tmp_path, proc_line, files)
    assert cgroup_memory(proc, root) == expected


def test_no_cgroup_file_means_no_reading(tmp_path: Path) -> None:
    assert cgroup_memory(str(tmp_path / "missing"), str(tmp_path)) is None
