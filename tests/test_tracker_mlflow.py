"""MLflow backend: a real training loop logged to a local file store, read back with MLflow's client."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._trackers import STEPS, train

pytest.importorskip("mlflow")


def test_metrics_artifacts_and_run_in_mlflow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Metrics against the step, timings, the error as a text artifact, goodput; the run is ended."""
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    uri = (tmp_path / "mlruns").as_uri()
    truth = train(tmp_path / "logs", {"mlflow": {"tracking_uri": uri, "experiment": "exp"}})
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("exp")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "trk"
    assert run.data.tags["traintrace.job"] == "trk"
    loss = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    assert loss == pytest.approx(truth.losses, rel=1e-6)
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "traintrace/step_time_p90_ms"))
    assert steps == truth.interval_ends
    (save,) = client.get_metric_history(run.info.run_id, "traintrace/checkpoint/checkpoint_save_sync_s")
    assert 0.05 <= save.value <= truth.checkpoint_s and save.step == 9
    (val,) = client.get_metric_history(run.info.run_id, "traintrace/validation/validation_loop_s")
    assert 0.03 <= val.value <= truth.validation_s
    assert 0 < run.data.metrics["traintrace/goodput"] < 1
    assert run.data.metrics["traintrace/completed_steps"] == STEPS
    assert run.data.metrics["traintrace/errors"] == 1
    (folder,) = client.list_artifacts(run.info.run_id, "traintrace/errors")
    (artifact,) = client.list_artifacts(run.info.run_id, folder.path) if folder.is_dir else (folder,)
    assert artifact.path.endswith("-step7.txt")
    text = Path(client.download_artifacts(run.info.run_id, artifact.path, str(tmp_path))).read_text()
    assert "ValueError: bad batch 7" in text and "Traceback" in text


@pytest.mark.subprocess
def test_an_active_run_is_used_and_left_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With mlflow.start_run() before configure(), traintrace logs into that run and does not end it."""
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    mlflow.set_tracking_uri(uri)
    try:
        with mlflow.start_run(run_name="mine") as run:
            train(tmp_path / "logs", {"mlflow": {"tracking_uri": uri}})
            assert mlflow.get_run(run.info.run_id).info.status == "RUNNING"
            mlflow.log_metric("mine", 1.0)
        data = mlflow.get_run(run.info.run_id)
        assert data.info.status == "FINISHED"
        assert {"traintrace/step_time_ms", "loss", "mine"} <= set(data.data.metrics)
    finally:
        mlflow.set_tracking_uri("")


def test_missing_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without mlflow installed, configure() says which extra to install."""
    import sys

    import traintrace as tt

    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(tt.ConfigError, match=r"pip install 'traintrace\[mlflow\]'"):
        tt.configure(backends={"mlflow": {}})
