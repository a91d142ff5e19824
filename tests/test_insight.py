"""The public insight API and its wiring: settings, step info, FLOPs, an end-to-end run."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import traintrace as tt
from tests._insight_helpers import configure, tiny_model, train_step
from traintrace.reader import read_file


@pytest.fixture
def memory() -> Iterator[tt.MemoryBackend]:
    """A recorder writing to memory only, with the monitor threads off."""
    backend = tt.MemoryBackend()
    yield backend
    tt.close()


def test_flops_counted_once_give_tflops_and_mfu(memory: tt.MemoryBackend) -> None:
    """count_flops() measures the first step; TFLOPS and MFU follow from it."""
    configure(memory, log_interval=5, peak_tflops=0.001)
    model, optimizer, x, y = tiny_model()
    with tt.training_loop():
        for step in range(5):
            with tt.training_iteration(step), tt.count_flops():
                train_step(model, optimizer, x, y)
    tt.flush()
    # Matmul FLOPs (2*m*n*k): forward of both layers, backward of the weights of
    # both and of the input of the second (the data needs no gradient).
    forward = 2 * 8 * 16 * 32 + 2 * 8 * 32 * 1
    backward = 2 * 8 * 16 * 32 + 2 * 8 * 32 * 1 + 2 * 8 * 32 * 1
    (event,) = (e for e in memory.events("training_iterations") if e["attrs"]["interval"])
    attrs = event["attrs"]
    expected = (forward + backward) * 5 / attrs["elapsed_time"] / 1e12
    assert attrs["tflops"] == pytest.approx(expected, rel=1e-6)
    assert attrs["mfu"] == pytest.approx(expected / 0.001, rel=1e-6)


def test_statistics_off(memory: tt.MemoryBackend) -> None:
    """statistics=False leaves the stream as the core writes it."""
    configure(memory, statistics=False, log_interval=1)
    with tt.training_loop():
        for step in range(3):
            with tt.training_iteration(step):
                pass
    tt.flush()
    assert memory.events("training_iterations") == []
    assert tt.counters() == {}


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("hang_timeout", -1),
        ("hang_check_interval", 0),
        ("hang_exit_code", 0),
        ("peak_tflops", "fast"),
        ("phase_timeouts", {"checkpoint_save_sync": -5}),
        ("device_sample_interval", True),
    ],
)
def test_bad_settings_name_the_field(setting: str, value: Any) -> None:
    """A bad insight setting raises ConfigError naming it."""
    with pytest.raises(tt.ConfigError, match=setting):
        _build(**{setting: value})


def _build(**settings: Any) -> tt.Config:
    from traintrace._config import build_config

    return build_config(env={}, **settings)


def test_phase_timeouts_from_the_environment() -> None:
    """TRAINTRACE_PHASE_TIMEOUTS takes name=seconds pairs."""
    from traintrace._config import build_config

    config = build_config(env={"TRAINTRACE_PHASE_TIMEOUTS": "validation_loop=7200, checkpoint_load=60"})
    assert config.phase_timeouts == {"validation_loop": 7200.0, "checkpoint_load": 60.0}


def test_calls_before_configure_do_nothing() -> None:
    """set_step_info, heartbeat, counters and count_flops are harmless without a recorder."""
    tt.close()
    tt.set_step_info(batch_size=3)
    tt.heartbeat()
    assert tt.counters() == {}
    with tt.count_flops():
        torch.ones(2) @ torch.ones(2)


def test_step_info_applies_from_the_next_iteration(memory: tt.MemoryBackend) -> None:
    """A batch size set between steps counts for the steps that start after it."""
    configure(memory, log_interval=4)
    with tt.training_loop():
        for step in range(4):
            if step == 2:
                tt.set_step_info(batch_size=10)
            elif step == 0:
                tt.set_step_info(batch_size=1)
            with tt.training_iteration(step):
                pass
    tt.flush()
    (event,) = (e for e in memory.events("training_iterations") if e["attrs"]["interval"])
    assert event["attrs"]["consumed_samples"] == 1 + 1 + 10 + 10


@pytest.mark.slow
@pytest.mark.subprocess
def test_demo_run_writes_interval_events(tmp_path: Path) -> None:
    """The CPU example, run as a process, writes interval events a reader agrees with."""
    example = Path(__file__).resolve().parents[1] / "examples" / "train_cpu.py"
    command = [sys.executable, str(example), "--log-dir", str(tmp_path), "--job-id", "demo", "--epochs", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    stream = read_file(tmp_path / "demo" / "rank0.jsonl").streams[0]
    events = [r for r in stream.of_kind("event") if r.get("name") == "training_iterations"]
    iterations = stream.spans("iteration")
    assert sum(e["attrs"]["interval"] for e in events) == len(iterations)
    assert events[-1]["attrs"]["final"] is True
    assert events[-1]["attrs"]["completed_steps"] == len(iterations)
    assert events[-1]["attrs"]["consumed_samples"] == sum(r["attrs"]["batch_size"] for r in iterations)
    losses = [r["attrs"]["loss"] for r in iterations[:20]]
    assert all(isinstance(v, float) for v in losses)
    assert events[0]["attrs"]["loss"] == pytest.approx(sum(losses) / 20)
    (save,) = stream.spans("checkpoint_save_sync")
    assert save["attrs"]["checkpoint_size"] > 0
