"""The public API: migration from the reference library, helpers, __all__."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import traintrace
import traintrace as tt
from tests.conftest import read_jsonl


def test_all_is_complete_and_importable() -> None:
    """__all__ lists every public name, and each one exists."""
    public = {
        name
        for name in dir(traintrace)
        if not name.startswith("_") and not isinstance(getattr(traintrace, name), types.ModuleType)
    }
    assert set(traintrace.__all__) - {"__version__"} == public
    for name in traintrace.__all__:
        assert getattr(traintrace, name) is not None


def test_reference_readme_usage_runs_with_only_the_import_changed(tmp_path: Path) -> None:
    """The reference library's README example, unchanged but for the import, records sensibly."""
    from traintrace import (
        ApplicationMetrics,
        CheckpointSaveMetrics,
        CheckPointType,
        IterationMetrics,
        application_running,
        checkpoint_save,
        training_iteration,
    )

    num_epochs, dataloader = 2, list(range(3))

    def get_application_metrics() -> dict:
        return ApplicationMetrics.create(
            rank=0,
            world_size=1,
            node_name="localhost",
            timezone="UTC",
            total_iterations=num_epochs * len(dataloader),
            checkpoint_enabled=True,
            checkpoint_strategy="sync",
        )

    @application_running(metrics=get_application_metrics())
    def main() -> None:
        current_iteration = 0
        for _ in range(num_epochs):
            for _batch in dataloader:
                with training_iteration() as training_iteration_span:
                    training_iteration_span.add_metrics(
                        IterationMetrics.create(
                            current_iteration=current_iteration,
                            num_iterations=len(dataloader),
                            loss=0.5,
                            accuracy=0.9,
                        )
                    )
                current_iteration += 1
            with checkpoint_save() as checkpoint_save_span:
                checkpoint_save_span.add_metrics(
                    CheckpointSaveMetrics.create(
                        checkpoint_type=CheckPointType.LOCAL,
                        current_iteration=current_iteration,
                        checkpoint_directory=str(tmp_path),
                        checkpoint_filename="ckpt.pt",
                    )
                )

    main()
    tt.close()
    files = list(Path("traintrace_logs").glob("*/rank0.jsonl"))
    assert len(files) == 1, "the application span configures defaults"
    records = read_jsonl(files[0])
    iterations = [r for r in records if r.get("name") == "iteration"]
    assert [r["attrs"]["current_iteration"] for r in iterations] == list(range(6))
    save = next(r for r in records if r.get("name") == "checkpoint_save_sync")
    assert save["attrs"]["checkpoint_type"] == "local"
    app = next(r for r in records if r.get("name") == "main_function")
    assert app["attrs"]["total_iterations"] == 6


def test_reference_aliases() -> None:
    """The reference's other names exist and mean the same."""
    assert tt.running is tt.application
    assert tt.training is tt.training_loop
    assert tt.CheckpointMetrics is tt.CheckpointSaveMetrics
    assert str(tt.CheckPointType.GLOBAL) == "global"
    assert tt.IterationMetrics.create(loss=None, accuracy=1) == {"accuracy": 1}


def test_application_reraises_unchanged(memory: tt.MemoryBackend) -> None:
    """The application helper records and re-raises the same exception object."""
    error = ValueError("x")
    with pytest.raises(ValueError) as info:
        with tt.application():
            raise error
    assert info.value is error
    tt.flush()
    assert len(memory.errors()) == 1


def test_helpers_accept_metrics_and_keywords(memory: tt.MemoryBackend) -> None:
    """Every standard helper opens its standard span name, with metrics."""
    helpers = {
        tt.distributed_init: "distributed_code_initialization",
        tt.model_init: "model_initialization",
        tt.optimizer_init: "optimizer_initialization",
        tt.data_loader_init: "data_loader_initialization",
        tt.training_loop: "training_loop",
        tt.data_loading: "data_loading",
        tt.forward: "model_forward",
        tt.backward: "model_backward",
        tt.zero_grad: "zero_grad",
        tt.optimizer_step: "optimizer_update",
        tt.validation: "validation_loop",
        tt.test: "test_loop",
        tt.checkpoint_save: "checkpoint_save_sync",
        tt.checkpoint_save_async: "checkpoint_save_async",
        tt.checkpoint_load: "checkpoint_load",
    }
    for helper, name in helpers.items():
        with helper({"a": 1}, b=2):
            pass
        tt.flush()
        span = memory.spans(name)
        assert span and span[0]["attrs"] == {"a": 1, "b": 2}, name


def test_nothing_is_written_when_disabled_for_this_rank(tmp_path: Path) -> None:
    """With every backend off on this rank, no file appears."""
    tt.configure(job_id="j", rank=1, world_size=2, log_dir=str(tmp_path), backends={"file": {"ranks": 0}, "log": False})
    with tt.training_loop():
        pass
    tt.close()
    assert not any(tmp_path.rglob("*.jsonl"))


@pytest.mark.subprocess
def test_import_is_light() -> None:
    """Importing traintrace imports no optional dependency."""
    import subprocess
    import sys

    code = (
        "import sys, traintrace; "
        "print(','.join(m for m in ('torch','numpy','yaml','orjson','opentelemetry','nvtx') if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(traintrace.__file__).parents[1])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() in ("", "orjson")


@pytest.mark.subprocess
def test_submodules_are_attributes_of_the_package_as_before_the_lazy_api() -> None:
    """``import traintrace`` loads its API on first use; ``traintrace.events`` still works."""
    script = (
        "import traintrace as tt, sys\n"
        "assert 'traintrace._api' not in sys.modules\n"
        "assert tt.events.record is not None and tt._setup.start_stream is not None\n"
        "assert tt.span is not None\n"
        "try:\n"
        "    tt.no_such_name\n"
        "except AttributeError:\n"
        "    print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert result.stdout.strip() == "ok", result.stderr
