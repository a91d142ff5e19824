"""The Hugging Face Trainer callback on a real Trainer: a tiny random GPT-2, CPU, a few steps."""

from __future__ import annotations

import os
import pickle
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: nothing is downloaded
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import traintrace as tt
from traintrace.integrations.transformers import TraintraceTrainerCallback

SEQ = 8
VOCAB = 50


def tiny_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)


def dataset(rows: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        {"input_ids": ids, "labels": ids.clone()}
        for ids in (torch.randint(0, VOCAB, (SEQ,), generator=generator) for _ in range(rows))
    ]


def arguments(tmp_path: Path, **kwargs: Any) -> TrainingArguments:
    options: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "max_steps": 6,
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 8,
        "logging_steps": 2,
        "save_steps": 3,
        "eval_strategy": "steps",
        "eval_steps": 3,
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }
    options.update(kwargs)
    return TrainingArguments(**options)


@pytest.fixture
def memory() -> Iterator[tt.MemoryBackend]:
    backend = tt.MemoryBackend()
    tt.configure(backends=[], extra_backends=[backend])
    yield backend
    tt.close()


@pytest.mark.slow
def test_trainer_run_records_steps_logs_evaluation_and_saves(memory: tt.MemoryBackend, tmp_path: Path) -> None:
    """Steps, logged loss/lr/grad norm, eval metrics and saves equal what the Trainer did and logged."""
    model = tiny_model()
    training_forwards = time_training_forwards(model)
    trainer = Trainer(
        model=model,
        args=arguments(tmp_path),
        train_dataset=dataset(24),
        eval_dataset=dataset(8),
        callbacks=[TraintraceTrainerCallback()],
    )
    trainer.train()
    tt.flush()

    spans = memory.spans()
    ids = {s["id"]: s for s in spans}
    (app,) = memory.spans(tt.SpanName.APPLICATION)
    (loop,) = memory.spans(tt.SpanName.TRAINING_LOOP)
    assert loop["parent"] == app["id"] and app["attrs"]["framework"] == "transformers"
    assert loop["attrs"]["global_step"] == trainer.state.global_step == 6
    history = trainer.state.log_history
    assert loop["attrs"]["train_loss"] == pytest.approx(history[-1]["train_loss"])

    iterations = memory.spans(tt.SpanName.ITERATION)
    assert [s["attrs"]["step"] for s in iterations] == list(range(6))
    for span in iterations:
        assert span["parent"] == loop["id"] and span["status"] == "ok"
        assert span["attrs"]["batch_size"] == 4 and span["attrs"]["tokens"] == 4 * SEQ
    by_step = {s["attrs"]["step"]: s["attrs"] for s in iterations}
    step_logs = [h for h in history if "loss" in h]
    assert len(step_logs) == 3
    for logged in step_logs:
        attrs = by_step[logged["step"] - 1]  # the Trainer logs after the step, counting from 1
        for key in ("loss", "learning_rate", "grad_norm"):
            assert attrs[key] == pytest.approx(logged[key]), key
    optimizer_steps = memory.spans(tt.SpanName.OPTIMIZER_STEP)
    assert len(optimizer_steps) == 6
    assert all(ids[s["parent"]]["name"] == tt.SpanName.ITERATION for s in optimizer_steps)
    # Forward and backward of each step, in order; the evaluations' forwards are not training phases.
    forwards, backwards = memory.spans(tt.SpanName.FORWARD), memory.spans(tt.SpanName.BACKWARD)
    assert len(forwards) == len(backwards) == len(training_forwards) == 6
    for forward, backward, step, (began, ended) in zip(
        forwards, backwards, optimizer_steps, training_forwards, strict=True
    ):
        assert forward["parent"] == backward["parent"] == step["parent"]
        assert forward["ts"] + forward["dur"] <= backward["ts"] and backward["ts"] + backward["dur"] <= step["ts"]
        # The model's own forward (its clock, outside traintrace) lies within the span; the records' times
        # are the wall clock through the stream's anchor: 2 ms of slack.
        assert forward["ts"] <= began + 2_000_000 and forward["ts"] + forward["dur"] >= ended - 2_000_000

    # Data loading: each step's batch fetched (get_batch_samples) just before the step, under the loop.
    waits = memory.spans(tt.SpanName.DATA_LOADING)
    assert len(waits) == 6
    for wait, step in zip(waits, iterations, strict=True):
        assert wait["parent"] == loop["id"] and wait["status"] == "ok"
        assert wait["ts"] + wait["dur"] <= step["ts"]

    evaluations = memory.spans(tt.SpanName.VALIDATION)
    eval_logs = [h for h in history if "eval_loss" in h]
    assert len(evaluations) == len(eval_logs) == 2
    for span, logged in zip(evaluations, eval_logs, strict=True):
        assert span["parent"] == loop["id"]
        assert span["attrs"]["eval_loss"] == pytest.approx(logged["eval_loss"])
        assert span["attrs"]["global_step"] == logged["step"]

    saves = memory.spans(tt.SpanName.CHECKPOINT_SAVE_SYNC)
    assert [s["attrs"]["current_iteration"] for s in saves] == [3, 6]
    for save in saves:
        folder = Path(save["attrs"]["checkpoint_directory"])
        assert folder.is_dir() and folder.name == f"checkpoint-{save['attrs']['current_iteration']}"
        on_disk = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        assert save["attrs"]["checkpoint_size"] == on_disk > 0
        assert save["parent"] == loop["id"] and save["dur"] > 0
    assert memory.errors() == []

    after = trainer.evaluate()
    tt.flush()
    last = memory.spans(tt.SpanName.VALIDATION)[-1]
    assert last["parent"] == 0 and last["attrs"]["eval_loss"] == pytest.approx(after["eval_loss"])


def time_training_forwards(model: torch.nn.Module) -> list[tuple[int, int]]:
    """The wall-clock interval of each forward of ``model`` in training mode, from its own hooks."""
    intervals: list[tuple[int, int]] = []
    began: list[int] = []
    model.register_forward_pre_hook(lambda module, args: began.append(time.time_ns()))

    def ended(module: torch.nn.Module, args: Any, output: Any) -> None:
        start = began.pop()
        if module.training:
            intervals.append((start, time.time_ns()))

    model.register_forward_hook(ended)
    return intervals


class Exploding(torch.nn.Module):
    """Wraps a model and raises in forward at a given call."""

    def __init__(self, inner: torch.nn.Module, fail_at: int) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0
        self.fail_at = fail_at

    def forward(self, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.fail_at:
            raise ValueError("bad batch")
        return self.inner(**kwargs)


def test_error_in_a_step_is_recorded_once_and_spans_end_as_errors(memory: tt.MemoryBackend, tmp_path: Path) -> None:
    """An exception in forward: one error record at the iteration; enclosing spans end with error."""
    callback = TraintraceTrainerCallback()
    trainer = Trainer(
        model=Exploding(tiny_model(), fail_at=3),
        args=arguments(tmp_path, eval_strategy="no", save_strategy="no", remove_unused_columns=False),
        train_dataset=dataset(24),
        callbacks=[callback],
    )
    with pytest.raises(ValueError, match="bad batch"), tt.span("user_main"):
        trainer.train()
    tt.flush()
    errors = memory.errors()
    assert len(errors) == 1 and errors[0]["error_type"] == "ValueError"
    ids = {s["id"]: s for s in memory.spans()}
    failed = ids[errors[0]["span"]]  # the phase it broke, in the iteration of its step
    assert failed["name"] == tt.SpanName.FORWARD and failed["status"] == "error"
    iteration = ids[failed["parent"]]
    assert iteration["name"] == tt.SpanName.ITERATION and iteration["attrs"]["step"] == 2
    assert iteration["status"] == "error"
    (loop,) = memory.spans(tt.SpanName.TRAINING_LOOP)
    assert loop["status"] == "error" and ids[loop["parent"]]["name"] == "user_main"
    assert memory.spans(tt.SpanName.APPLICATION) == []  # a user span was open
    assert pickle.loads(pickle.dumps(callback)).wrap_trainer is True


class Interrupted(Exploding):
    """Ctrl-C at a given forward call: a real SIGINT to this process (Python raises KeyboardInterrupt there)."""

    def forward(self, **kwargs: Any) -> Any:
        if self.calls + 1 == self.fail_at:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # (the interrupt comes first)
        return super().forward(**kwargs)


def test_ctrl_c_in_a_step_is_recorded_as_sigint(memory: tt.MemoryBackend, tmp_path: Path) -> None:
    """Ctrl-C in forward at step 2: the Trainer lets KeyboardInterrupt through; one ``signal`` record says SIGINT at
    the phase it broke, no error, the spans end ``terminated``. Nothing recorded the interrupt before."""
    trainer = Trainer(
        model=Interrupted(tiny_model(), fail_at=3),
        args=arguments(tmp_path, eval_strategy="no", save_strategy="no", remove_unused_columns=False),
        train_dataset=dataset(24),
        callbacks=[TraintraceTrainerCallback()],
    )
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    tt.flush()
    assert memory.errors() == []
    (interrupt,) = memory.events("signal")
    assert interrupt["attrs"] == {"signal": "SIGINT", "exception": "KeyboardInterrupt"}
    ids = {s["id"]: s for s in memory.spans()}
    at = ids[interrupt["span"]]
    assert at["name"] == tt.SpanName.FORWARD and at["status"] == "terminated", at
    assert ids[at["parent"]]["attrs"]["step"] == 2 and ids[at["parent"]]["status"] == "terminated"


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.once
@pytest.mark.parametrize(
    ("mode", "buffers", "write_delay_ms"), [("slow", "0", "0"), ("slow_data", "0", "60"), ("slow", "1", "0")]
)
def test_ddp_straggler_is_named_though_ddp_evens_the_step_times(
    tmp_path: Path, mode: str, buffers: str, write_delay_ms: str
) -> None:
    """Rank 1 of a 2-process DDP run under torchrun is 60 ms slower from step 4 on: computing its loss
    (``slow``) or fetching its batches (``slow_data``, where the Trainer's token-count gather makes rank 0 wait
    inside its own fetch). Both ranks' steps take as long (the script's own notes). `traintrace ranks` names
    rank 1, the part and the step it became slow at, as the script's notes say. With a buffer in the model, DDP
    broadcasts it from rank 0 before each forward, where rank 0 waits for rank 1's late forward: the callback
    records that broadcast as a collective (it named rank 0 too before, slow in compute). With each write of the
    model 60 ms longer (``slow_data``; a slow disk): rank 0, the only rank that writes it (the others save their RNG
    state alone), was named too, slow in its saves (CI's slow disk did it once, 31 ms against rank 1's 4.5); its saves
    say ``checkpoint_writer`` and are compared with no other rank's."""
    import sys

    from tests._fault_runs import check_straggler, run

    script = Path(__file__).parent / "_hf_ddp_run.py"
    command = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2", str(script)]
    logs = {"TRAINTRACE_LOG_DIR": str(tmp_path / "logs"), "TRAINTRACE_JOB_ID": "hf-ddp", "HF_HUB_OFFLINE": "1"}
    done = run(
        [*command, str(tmp_path), "4", mode],
        tmp_path,
        MAX_STEPS="14",
        BUFFERS=buffers,
        WRITE_DELAY_MS=write_delay_ms,
        **logs,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    check_straggler(tmp_path, tmp_path / "logs" / "hf-ddp", mode, ranks=2)


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.once
def test_ddp_the_others_wait_in_the_trainers_loss_gather_for_a_rank_that_failed_after_backward(
    tmp_path: Path,
) -> None:
    """Rank 1's optimizer step raises at step 2; the Trainer logs every step, so rank 0 goes on to gather the
    step's loss from every rank and waits there for rank 1 (its own traceback says so). `errors` says rank 0 was
    waiting in that collective at step 2 (it said "in a step (between phases)": the callback did not record the
    gather)."""
    import json
    import sys

    from tests._fault_runs import answers, run

    script = Path(__file__).parent / "_hf_ddp_run.py"
    command = [sys.executable, "-m", "traintrace.launch", "--standalone", "--nproc-per-node", "2", str(script)]
    logs = {"TRAINTRACE_LOG_DIR": str(tmp_path / "logs"), "TRAINTRACE_JOB_ID": "hf-ddp", "HF_HUB_OFFLINE": "1"}
    done = run([*command, str(tmp_path), "2", "optimizer"], tmp_path, DDP_TIMEOUT_S="10", **logs)
    assert done.returncode != 0, done.stdout[-3000:] + done.stderr[-3000:]
    truth = json.loads((tmp_path / "fault.json").read_text())
    rank0 = "\n".join(line for line in done.stderr.splitlines() if line.startswith("[rank0]"))
    assert "nested_gather" in rank0 and "all_gather" in rank0, rank0[-3000:]  # where rank 0 was, by itself
    errors, _ = answers(tmp_path / "logs" / "hf-ddp")
    assert (errors["culprit"]["rank"], errors["culprit"]["step"]) == (truth["rank"], truth["step"]) == (1, 2)
    assert errors["verdict"] == (
        "rank 1 raised RuntimeError in the optimizer step at step 2; rank 0 was waiting in a collective (all_gather) "
        "at step 2"
    ), errors["verdict"]


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.once
def test_ddp_fault_is_diagnosed_from_the_callbacks_records(tmp_path: Path) -> None:
    """Rank 1 of a 2-process DDP run (gloo, CPU) under traintrace-run raises while computing its loss at global
    step 3. `traintrace errors` on what the callback wrote names rank 1 and that step, as the script's own
    truth file says; the Trainer's checkpoint folders say which steps were kept (steps below the last one)."""
    import json
    import sys

    from tests._fault_runs import answers, run

    script = Path(__file__).parent / "_hf_ddp_run.py"
    command = [sys.executable, "-m", "traintrace.launch", "--standalone", "--nproc-per-node", "2", str(script)]
    logs = {"TRAINTRACE_LOG_DIR": str(tmp_path / "logs"), "TRAINTRACE_JOB_ID": "hf-ddp", "HF_HUB_OFFLINE": "1"}
    done = run([*command, str(tmp_path), "3"], tmp_path, **logs)
    assert done.returncode != 0, done.stdout[-3000:] + done.stderr[-3000:]
    truth = json.loads((tmp_path / "fault.json").read_text())
    saved = max(int(p.name.split("-")[1]) for p in (tmp_path / "out").glob("checkpoint-*"))
    errors, summary = answers(tmp_path / "logs" / "hf-ddp")
    culprit = errors["culprit"]
    assert culprit is not None, errors["verdict"]
    assert (culprit["rank"], culprit["step"]) == (truth["rank"], truth["step"]), errors["verdict"]
    assert "injected failure in compute_loss" in culprit["cause"]
    assert errors["verdict"].startswith(f"rank 1 raised RuntimeError in forward at step {truth['step']}")
    assert summary["status"] == "failed"
    assert (summary["steps_completed"], summary["steps_lost"]) == (saved, truth["step"] + 1 - saved)


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.once
def test_ddp_data_loading_fault_is_diagnosed_as_data_loading(tmp_path: Path) -> None:
    """Rank 1's dataset raises in its DataLoader worker process (a corrupt sample) in a 2-process DDP run under
    traintrace-run. The Trainer fetches a step's batches in ``get_batch_samples`` (accelerate reading one batch
    ahead), so the training process fails before the step after the last one it began. `traintrace errors`
    names rank 1, that step and data loading (it said "the training loop (between steps)" before the callback
    timed the fetch), against the script's own notes: the worker's note of the sample and each rank's last
    step begun."""
    import json
    import sys

    from tests._fault_runs import answers, run

    script = Path(__file__).parent / "_hf_ddp_run.py"
    command = [sys.executable, "-m", "traintrace.launch", "--standalone", "--nproc-per-node", "2", str(script)]
    logs = {"TRAINTRACE_LOG_DIR": str(tmp_path / "logs"), "TRAINTRACE_JOB_ID": "hf-ddp", "HF_HUB_OFFLINE": "1"}
    done = run([*command, str(tmp_path), "3", "data"], tmp_path, **logs)
    assert done.returncode != 0, done.stdout[-3000:] + done.stderr[-3000:]
    truth = json.loads((tmp_path / "fault.json").read_text())
    failed_before = int((tmp_path / "started1.txt").read_text()) + 1  # the step rank 1 never began
    errors, _ = answers(tmp_path / "logs" / "hf-ddp")
    culprit = errors["culprit"]
    assert culprit is not None, errors["verdict"]
    assert (culprit["rank"], culprit["step"], culprit["phase"]) == (1, failed_before, "data_loading")
    assert (
        culprit["cause"]
        == f"raised ValueError: injected corrupt sample {truth['index']} on rank 1 (in DataLoader worker process 0)"
    )
    assert errors["verdict"].startswith(f"rank 1 raised ValueError in data loading at step {failed_before}")
    assert errors["first_error"]["ts"] >= truth["ts"]


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.once
def test_ddp_data_loading_hang_killed_by_the_scheduler(tmp_path: Path) -> None:
    """Rank 1's DataLoader worker hangs reading a batch (no exception); rank 0 waits for it in the Trainer's
    gather of the step's token count, which is inside the fetch too, so both ranks are in data loading. The
    scheduler's SIGTERM to the launcher 4 s later ends the job. `traintrace errors` names rank 1 (not in a
    collective) and the step it never began, against the script's own notes; the callback records the gather
    as a collective."""
    import json
    import os
    import signal
    import sys
    import time

    from tests._fault_runs import answers, start

    script = Path(__file__).parent / "_hf_ddp_run.py"
    command = [sys.executable, "-m", "traintrace.launch", "--standalone", "--nproc-per-node", "2", str(script)]
    logs = {"TRAINTRACE_LOG_DIR": str(tmp_path / "logs"), "TRAINTRACE_JOB_ID": "hf-ddp", "HF_HUB_OFFLINE": "1"}
    launcher = start([*command, str(tmp_path), "3", "data_hang"], tmp_path, **logs)
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "fault.json").exists() and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(4)
        os.kill(launcher.pid, signal.SIGTERM)  # the scheduler's time limit
        launcher.wait(timeout=60)
    finally:
        (tmp_path / "release").write_text("")
        if launcher.poll() is None:
            launcher.kill()
    assert (tmp_path / "fault.json").exists(), (tmp_path / "output.txt").read_text()[-3000:]
    truth = json.loads((tmp_path / "fault.json").read_text())  # the worker's note: whose read hung
    began = {rank: int((tmp_path / f"started{rank}.txt").read_text()) for rank in (0, 1)}
    step = began[1] + 1  # the step rank 1 was fetching for and never began; rank 0 never began it either
    assert began[0] == began[1], began
    errors, _ = answers(tmp_path / "logs" / "hf-ddp")
    culprit = errors["culprit"]
    assert culprit is not None, errors["verdict"]
    assert (culprit["rank"], culprit["step"], culprit["phase"]) == (truth["rank"], step, "data_loading")
    assert errors["rule"] == "terminated while waiting for a rank"
    assert errors["verdict"].startswith(f"rank 1 hung in data loading at step {step}, not in a collective"), errors[
        "verdict"
    ]
    assert f"rank 0 was waiting in a collective (all_gather) in data loading at step {step}" in errors["verdict"]
