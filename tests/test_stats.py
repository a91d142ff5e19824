"""Iteration statistics, counters and checkpoint details, from real training loops."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import traintrace as tt
from tests._examples import examples
from tests._insight_helpers import configure, tiny_model, train_step
from traintrace._stats import LogHistogram, resolve_tensors

NS = 1e-9


@pytest.fixture
def memory() -> Iterator[tt.MemoryBackend]:
    """A recorder writing to memory only, with the monitor threads off."""
    backend = tt.MemoryBackend()
    yield backend
    tt.close()


def assert_valid(records: list[dict[str, Any]]) -> None:
    """Every record follows the v1 schema."""
    schema = json.loads((Path(tt.__file__).parent / "schema" / "record-v1.schema.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    for record in records:
        validator.validate(record)


def nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


def seconds(record: dict[str, Any]) -> float:
    return float(record["dur"]) * NS


# ---------------------------------------------------------------- histogram


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.floats(min_value=1e3, max_value=1e11), min_size=1, max_size=400))
def test_histogram_quantiles_within_half_a_percent(values: list[float]) -> None:
    """Every quantile is within 0.5% of the exact nearest-rank value."""
    histogram = LogHistogram()
    for value in values:
        histogram.add(value)
    qs = (0.5, 0.9, 0.99, 1.0)
    for q, estimate in zip(qs, histogram.quantiles(qs), strict=True):
        exact = nearest_rank(values, q)
        assert abs(estimate - exact) <= exact * 0.0051
    assert histogram.min == min(values)
    assert histogram.max == max(values)
    batched = LogHistogram()
    batched.add_many([int(v) for v in values])
    single = LogHistogram()
    for value in values:
        single.add(int(value))
    assert batched.quantiles(qs) == single.quantiles(qs)
    assert (batched.min, batched.max, batched.count) == (single.min, single.max, single.count)


def test_histogram_memory_is_bounded() -> None:
    """A million values spread over six decades occupy at most ~1,400 buckets."""
    histogram = LogHistogram()
    for i in range(1_000_000):
        histogram.add(1e3 * 10 ** (6 * (i % 1000) / 1000))
    assert len(histogram._buckets) <= 1400
    assert histogram.count == 1_000_000


# ---------------------------------------------------------------- statistics


def test_interval_statistics_match_the_step_records(memory: tt.MemoryBackend) -> None:
    """Times, quantiles, phases, throughput and counters agree with the per-step spans."""
    configure(memory, log_interval=10)
    model, optimizer, x, y = tiny_model()
    tt.set_step_info(batch_size=8, tokens=8 * 128)
    slow = {3, 17}
    with tt.training_loop():
        for step in range(25):
            with tt.training_iteration(step) as it:
                train_step(model, optimizer, x, y)
                if step in slow:
                    time.sleep(0.05)
                it.add_metrics(lr=0.01 * (step + 1), epoch=step // 10)
    tt.flush()

    iterations = sorted(memory.spans("iteration"), key=lambda r: r["attrs"]["step"])
    events = memory.events("training_iterations")
    assert [e["attrs"]["interval"] for e in events] == [10, 10, 5]
    assert events[-1]["attrs"]["final"] is True
    for index, event in enumerate(events):
        attrs = event["attrs"]
        chunk = iterations[index * 10 : index * 10 + 10]
        durations = [seconds(r) for r in chunk]
        assert attrs["current_iteration"] == chunk[-1]["attrs"]["step"]
        assert attrs["average_iteration_time"] == pytest.approx(sum(durations) / len(chunk), rel=1e-9)
        assert attrs["iteration_time_min"] == pytest.approx(min(durations), rel=1e-9)
        assert attrs["iteration_time_max"] == pytest.approx(max(durations), rel=1e-9)
        for q in (50, 90, 99):
            assert attrs[f"iteration_time_p{q}"] == pytest.approx(nearest_rank(durations, q / 100), rel=0.006)
        ids = {r["id"] for r in chunk}
        for name, field in (
            ("model_forward", "average_forward_time"),
            ("model_backward", "average_backward_time"),
        ):
            phase = [seconds(r) for r in memory.spans(name) if r["parent"] in ids]
            assert attrs[field] == pytest.approx(sum(phase) / len(phase), rel=1e-9)
        # Throughput over the interval's elapsed time: from the previous interval's
        # last step end (or this one's first start) to this one's last step end.
        end = chunk[-1]["ts"] + chunk[-1]["dur"]
        start = chunk[0]["ts"] if index == 0 else iterations[index * 10 - 1]["ts"] + iterations[index * 10 - 1]["dur"]
        elapsed = (end - start) * NS
        assert attrs["elapsed_time"] == pytest.approx(elapsed, rel=1e-3)
        assert attrs["samples_per_second"] == pytest.approx(8 * len(chunk) / elapsed, rel=1e-3)
        assert attrs["tokens_per_second"] == pytest.approx(8 * 128 * len(chunk) / elapsed, rel=1e-3)
        lrs = [r["attrs"]["lr"] for r in chunk]
        assert attrs["lr"] == pytest.approx(sum(lrs) / len(lrs))
        assert attrs["epoch"] == chunk[-1]["attrs"]["epoch"]
        assert attrs["completed_steps"] == index * 10 + len(chunk)
        assert attrs["consumed_samples"] == 8 * (index * 10 + len(chunk))
    # The injected sleeps show as each interval's maximum and p99 (a quantile is its histogram bucket's
    # middle, within 0.5%: a step of 50.1 ms is in the bucket from 49.7 to 50.2 ms, whose middle is 49.95).
    assert events[0]["attrs"]["iteration_time_max"] >= 0.05
    assert events[1]["attrs"]["iteration_time_p99"] >= 0.05 / 1.006
    assert events[2]["attrs"]["iteration_time_max"] < 0.05 or events[2]["attrs"]["interval"] == 5


def test_checkpoint_and_validation_time_are_excluded(memory: tt.MemoryBackend, tmp_path: Path) -> None:
    """Checkpoint and validation inside an interval are reported apart and not counted as training."""
    configure(memory, log_interval=6)
    model, optimizer, x, y = tiny_model()
    tt.set_step_info(batch_size=8)
    path = tmp_path / "ckpt.pt"
    with tt.training_loop():
        for step in range(6):
            with tt.training_iteration(step):
                train_step(model, optimizer, x, y)
            if step == 2:
                with tt.checkpoint_save(checkpoint_path=str(path), current_iteration=step):
                    torch.save(model.state_dict(), path)
                    time.sleep(0.02)
                with tt.validation(), torch.no_grad():
                    model(x)
                    time.sleep(0.02)
    tt.flush()
    (event,) = (e for e in memory.events("training_iterations") if e["attrs"]["interval"])
    attrs = event["attrs"]
    (save,) = memory.spans("checkpoint_save_sync")
    (validation,) = memory.spans("validation_loop")
    assert attrs["checkpoint_time"] == pytest.approx(seconds(save), rel=1e-9)
    assert attrs["validation_time"] == pytest.approx(seconds(validation), rel=1e-9)
    productive = attrs["elapsed_time"] - seconds(save) - seconds(validation)
    assert attrs["samples_per_second"] == pytest.approx(48 / productive, rel=1e-6)
    # The size was measured from the file, and the folder and name filled in.
    assert save["attrs"]["checkpoint_size"] == path.stat().st_size
    assert save["attrs"]["checkpoint_directory"] == str(tmp_path)
    assert save["attrs"]["checkpoint_filename"] == "ckpt.pt"
    assert_valid(memory.records)


def test_async_checkpoint_finalised_on_another_thread(memory: tt.MemoryBackend, tmp_path: Path) -> None:
    """The blocking part and the background finalisation are both recorded and linked."""
    configure(memory, log_interval=4)
    model, optimizer, x, y = tiny_model()
    folder = tmp_path / "step2"
    done = threading.Event()

    def finalise(blocking: tt.Span, state: dict[str, Any]) -> None:
        with tt.checkpoint_save_finalization(async_save=blocking):
            folder.mkdir()
            torch.save(state, folder / "model.pt")
            (folder / "meta.json").write_text("{}")
            time.sleep(0.03)
        done.set()

    with tt.training_loop():
        for step in range(4):
            with tt.training_iteration(step):
                train_step(model, optimizer, x, y)
            if step == 1:
                with tt.checkpoint_save_async(
                    checkpoint_path=str(folder),
                    checkpoint_type=tt.CheckPointType.GLOBAL,
                    current_iteration=step,
                ) as blocking:
                    state = {k: v.clone() for k, v in model.state_dict().items()}
                threading.Thread(target=finalise, args=(blocking, state)).start()
        assert done.wait(10)
    tt.flush()
    (blocking_record,) = memory.spans("checkpoint_save_async")
    (final,) = memory.spans("checkpoint_save_finalization")
    assert final["link"] == blocking_record["id"]
    assert final["tid"] != blocking_record["tid"]
    size = sum(p.stat().st_size for p in folder.iterdir())
    attrs = final["attrs"]
    assert attrs["checkpoint_size"] == size
    assert attrs["checkpoint_type"] == "global"
    assert attrs["current_iteration"] == 1
    assert attrs["blocking_time"] == pytest.approx(seconds(blocking_record), rel=1e-9)
    assert attrs["total_time"] > attrs["blocking_time"]
    (event,) = (e for e in memory.events("training_iterations") if e["attrs"]["interval"])
    # Only the part the loop waited for counts as checkpoint time.
    assert event["attrs"]["checkpoint_time"] == pytest.approx(seconds(blocking_record), rel=1e-9)


class CountingTensor(torch.Tensor):
    """Counts every read of its value to Python, and the threads that read."""

    reads: list[int] = []  # noqa: RUF012 - shared by design

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__):
            cls.reads.append(threading.get_ident())
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_cpu_float_tensor_is_read_on_the_writer_and_its_record_is_not_held(memory: tt.MemoryBackend) -> None:
    """A loss tensor on the CPU is never read on the training thread; the writer reads it at once
    (a read of memory: no device sync to save), so its record keeps its place in the stream."""
    CountingTensor.reads.clear()
    configure(memory, log_interval=10)
    model, optimizer, x, y = tiny_model()
    losses: list[float] = []
    with tt.training_loop():
        for step in range(40):
            with tt.training_iteration(step) as it:
                loss = train_step(model, optimizer, x, y)
                it.add_metrics(loss=loss.as_subclass(CountingTensor))
            losses.append(float(loss.detach()))  # the test's own reference values
    assert threading.get_ident() not in CountingTensor.reads
    tt.flush()
    assert len(CountingTensor.reads) == 40
    assert threading.get_ident() not in CountingTensor.reads
    # A step can outlast a write cycle: the writer then saw it open (a start and an end record, merged here).
    iterations = memory.spans("iteration")
    assert [r["attrs"]["step"] for r in iterations] == list(range(40))  # written in order, none held
    assert [r["attrs"]["loss"] for r in iterations] == pytest.approx(losses, rel=1e-6)
    events = [e for e in memory.events("training_iterations") if e["attrs"]["interval"]]
    for index, event in enumerate(events):
        chunk = losses[index * 10 : index * 10 + 10]
        assert event["attrs"]["loss"] == pytest.approx(sum(chunk) / 10, rel=1e-6)
        # Each interval's event follows its last iteration's record.
        last = next(r for r in iterations if r["attrs"]["step"] == index * 10 + 9)
        assert event["seq"] > last["seq"]
    assert_valid(memory.records)


def test_other_tensor_metrics_are_read_once_per_interval(memory: tt.MemoryBackend) -> None:
    """A tensor the writer cannot read for free (here an integer one; on a GPU, any) is never read
    per step: its iteration is held and the interval's tensors are read together, on the writer."""
    CountingTensor.reads.clear()
    configure(memory, log_interval=10)
    counts = [(step * 7) % 5 for step in range(40)]
    with tt.training_loop():
        for step in range(40):
            with tt.training_iteration(step) as it:
                it.add_metrics(correct=torch.tensor(counts[step]).as_subclass(CountingTensor))
    assert threading.get_ident() not in CountingTensor.reads
    tt.flush()
    assert len(CountingTensor.reads) == 4
    assert threading.get_ident() not in CountingTensor.reads
    records = sorted(memory.spans("iteration"), key=lambda r: r["attrs"]["step"])
    assert [r["attrs"]["correct"] for r in records] == counts
    events = [e for e in memory.events("training_iterations") if e["attrs"]["interval"]]
    for index, event in enumerate(events):
        chunk = counts[index * 10 : index * 10 + 10]
        assert event["attrs"]["correct"] == pytest.approx(sum(chunk) / 10)
    # Held records keep their sequence numbers in order.
    seqs = [r["seq"] for r in memory.records]
    assert seqs == sorted(seqs)
    assert_valid(memory.records)


def test_resolve_tensors_groups_by_dtype() -> None:
    """Mixed dtypes and shapes resolve to the right Python values."""
    values = [torch.tensor(1.5), torch.tensor(3), torch.tensor([2.0]), torch.tensor([1, 2])]
    assert resolve_tensors(values) == [1.5, 3, 2.0, [1, 2]]


def test_counters_continue_after_restart(memory: tt.MemoryBackend) -> None:
    """After a restart, counters go on from the step the checkpoint reports."""
    configure(memory, log_interval=100, restart_count=1)
    model, optimizer, x, y = tiny_model()
    tt.set_step_info(batch_size=8, tokens=1000)
    with tt.checkpoint_load(current_iteration=100, consumed_samples=800, consumed_tokens=100_000):
        pass
    with tt.training_loop():
        for step in range(100, 110):
            with tt.training_iteration(step) as it:
                train_step(model, optimizer, x, y)
                if step in (103, 107):
                    it.add_metrics(skipped=True)
    tt.flush()
    assert memory.header is not None and memory.header["restart"] == 1
    (event,) = memory.events("training_iterations")
    attrs = event["attrs"]
    assert attrs["final"] is True
    assert attrs["completed_steps"] == 110
    assert attrs["consumed_samples"] == 880
    assert attrs["consumed_tokens"] == 110_000
    assert attrs["skipped_steps"] == 2
    assert attrs["last_step"] == 109
    assert tt.counters()["completed_steps"] == 110


def test_peak_table_lookup() -> None:
    """Device names as NVML and torch print them find their peak."""
    assert tt.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert tt.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert tt.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert tt.peak_tflops("NVIDIA H200") == 989.0
    assert tt.peak_tflops("a toaster") is None


def test_recorder_level_iterations_for_callbacks(memory: tt.MemoryBackend) -> None:
    """rec.start("iteration", {"step": n}) / rec.stop(...) feed the statistics too."""
    rec = configure(memory, log_interval=3)
    loop = rec.start("training_loop")
    for step in range(3):
        span = rec.start("iteration", {"step": step, "batch_size": 4})
        rec.stop(span, {"loss": 0.5})
    rec.stop(loop)
    tt.flush()
    (event,) = (e for e in memory.events("training_iterations") if e["attrs"]["interval"])
    assert event["attrs"]["consumed_samples"] == 12
    assert event["attrs"]["loss"] == 0.5
    assert event["span"] == loop.id


def test_per_step_records_stay_out_of_the_console_log(tmp_path: Path) -> None:
    """At the default levels the file gets every step; the log gets only the interval events."""
    console = tt.MemoryBackend(verbosity=tt.Verbosity.INFO)
    everything = tt.MemoryBackend()
    tt.configure(
        backends={},
        extra_backends=[console, everything],
        log_interval=2,
        device_sample_interval=0,
        hang_timeout=0,
    )
    try:
        with tt.training_loop():
            for step in range(4):
                with tt.training_iteration(step) as it:
                    it.add_metrics(loss=torch.tensor(1.0))
        tt.flush()
        assert console.spans("iteration") == []
        assert len(console.events("training_iterations")) == 3
        assert len(everything.spans("iteration")) == 4
    finally:
        tt.close()


def test_statistics_work_with_an_info_only_backend() -> None:
    """With only an info-level backend, iterations and phases are still measured (not written)."""
    console = tt.MemoryBackend(verbosity=tt.Verbosity.INFO)
    tt.configure(backends={}, extra_backends=[console], log_interval=4, device_sample_interval=0, hang_timeout=0)
    try:
        model, optimizer, x, y = tiny_model()
        with tt.training_loop():
            for step in range(4):
                with tt.training_iteration(step) as it:
                    loss = train_step(model, optimizer, x, y)
                    it.add_metrics(loss=loss)
        tt.flush()
        assert console.spans("iteration") == []
        assert console.spans("model_forward") == []
        (event,) = (e for e in console.events("training_iterations") if e["attrs"]["interval"])
        assert event["attrs"]["interval"] == 4
        assert event["attrs"]["average_forward_time"] > 0
        assert isinstance(event["attrs"]["loss"], float)
    finally:
        tt.close()


def test_flush_writes_held_records_with_one_read(memory: tt.MemoryBackend) -> None:
    """flush() writes iterations held for their tensors (integer ones: a float on the CPU is read at once),
    reading them once, and the interval goes on."""
    CountingTensor.reads.clear()
    configure(memory, log_interval=10)
    with tt.training_loop():
        for step in range(5):
            with tt.training_iteration(step) as it:
                it.add_metrics(loss=torch.tensor(step).as_subclass(CountingTensor))
        tt.flush()
        assert len(CountingTensor.reads) == 1
        assert [r["attrs"]["loss"] for r in memory.spans("iteration")] == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert memory.events("training_iterations") == []
        for step in range(5, 10):
            with tt.training_iteration(step) as it:
                it.add_metrics(loss=torch.tensor(step).as_subclass(CountingTensor))
    tt.flush()
    assert len(CountingTensor.reads) == 2
    event, final = memory.events("training_iterations")
    assert event["attrs"]["loss"] == pytest.approx(4.5)
    assert event["attrs"]["interval"] == 10
    assert final["attrs"]["interval"] == 0
    assert final["attrs"]["final"] is True


def test_failed_steps_and_run_totals(memory: tt.MemoryBackend) -> None:
    """A step an exception leaves is counted as failed; checkpoint and validation time add up over the run."""
    configure(memory, log_interval=100)
    tt.set_step_info(batch_size=2)
    with tt.training_loop():
        for step in range(4):
            try:
                with tt.training_iteration(step):
                    if step == 2:
                        raise RuntimeError("bad batch")
            except RuntimeError:
                pass
            with tt.checkpoint_save(current_iteration=step):
                pass
            with tt.validation():
                pass
    tt.flush()
    (event,) = memory.events("training_iterations")
    attrs = event["attrs"]
    assert (attrs["completed_steps"], attrs["failed_steps"], attrs["consumed_samples"]) == (3, 1, 6)
    assert attrs["interval"] == 4
    saves = sum(seconds(r) for r in memory.spans("checkpoint_save_sync"))
    validations = sum(seconds(r) for r in memory.spans("validation_loop"))
    assert attrs["total_checkpoint_time"] == pytest.approx(saves, rel=1e-9)
    assert attrs["total_validation_time"] == pytest.approx(validations, rel=1e-9)


def _read_stream(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for path in sorted(folder.rglob("*.jsonl")) for line in path.read_text().splitlines()]


def test_the_first_non_finite_value_of_each_metric_is_an_event(tmp_path: Path) -> None:
    """A loss that overflows at step 5 and is NaN after it, a gradient norm NaN from step 8: one
    ``non_finite_metric`` event each, at its first step, in the iteration's span (either core: the file is
    written by the native encoder where it is built)."""
    tt.configure(
        log_dir=str(tmp_path), job_id="nf", backends=[tt.FileBackendConfig()], log_interval=4, device_sample_interval=0
    )
    with tt.training_loop():
        for step in range(12):
            with tt.training_iteration(step) as it:
                loss = 0.5 if step < 5 else (math.inf if step == 5 else math.nan)
                norm = 1.0 if step < 8 else math.nan
                it.add_metrics(loss=torch.tensor(loss) if step % 2 else loss, grad_norm=norm, lr=0.1)
    tt.close()
    records = _read_stream(tmp_path)
    events = [r for r in records if r["kind"] == "event" and r["name"] == "non_finite_metric"]
    assert [e["attrs"] for e in events] == [
        {"metric": "loss", "value": "Infinity", "step": 5},
        {"metric": "grad_norm", "value": "NaN", "step": 8},
    ]
    iterations = {
        r["attrs"]["step"]: r for r in records if r.get("name") == "iteration" and r["kind"] in ("span", "start")
    }
    assert [e["span"] for e in events] == [iterations[5]["id"], iterations[8]["id"]]
    intervals = [e["attrs"] for e in records if e.get("name") == "training_iterations" and e["attrs"]["interval"]]
    assert [i["loss"] for i in intervals] == [0.5, "NaN", "NaN"]  # the mean of an interval with NaN in it
    assert_valid(records)


def test_a_held_tensor_that_is_not_finite_is_an_event_once_read(
    memory: tt.MemoryBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loss tensor the writer holds for the interval's one read (on a GPU; here every tensor, as if it
    were) is checked when it is read: the event has the step of its own iteration."""
    monkeypatch.setattr("traintrace._stats.read_if_cpu_float", lambda value: None)
    configure(memory, log_interval=4)
    with tt.training_loop():
        for step in range(8):
            with tt.training_iteration(step) as it:
                it.add_metrics(loss=torch.tensor(math.nan if step >= 6 else 1.0))
    tt.flush()
    events = memory.events("non_finite_metric")
    assert [e["attrs"] for e in events] == [{"metric": "loss", "value": "NaN", "step": 6}]


def test_a_wait_for_a_batch_cut_short_is_no_part_of_the_data_loading_mean(tmp_path: Path) -> None:
    """A wait for a batch that something else cut short (the Lightning callback ends it ``interrupted`` when a
    checkpoint save begins) is left out of ``average_dataloader_time``, as the commands leave it out of data
    loading: the mean is that of the waits that ended with a batch (either core: the native encoder counts the
    sub-phases of a file's statistics itself)."""
    tt.configure(
        log_dir=str(tmp_path), job_id="cut", backends=[tt.FileBackendConfig()], log_interval=4, device_sample_interval=0
    )
    with tt.training_loop():
        for step in range(4):
            wait = tt.start(tt.SpanName.DATA_LOADING)
            time.sleep(0.002)
            tt.stop(wait)
            with tt.training_iteration(step):
                pass
            if step == 1:
                cut = tt.start(tt.SpanName.DATA_LOADING)
                time.sleep(0.03)
                tt.stop(cut, status=tt.SpanStatus.INTERRUPTED)
    tt.close()
    records = _read_stream(tmp_path)
    waits = [r for r in records if r.get("name") == tt.SpanName.DATA_LOADING and r["kind"] in ("span", "end")]
    assert [w["status"] for w in waits].count(tt.SpanStatus.INTERRUPTED) == 1 and len(waits) == 5, waits
    whole = [w["dur"] * NS for w in waits if w["status"] == tt.SpanStatus.OK]
    intervals = [e["attrs"] for e in records if e.get("name") == "training_iterations" and e["attrs"]["interval"]]
    assert len(intervals) == 1, intervals
    assert intervals[0]["average_dataloader_time"] == pytest.approx(sum(whole) / len(whole), rel=1e-9)
    assert intervals[0]["average_dataloader_time"] < 0.03
    assert_valid(records)
