"""MLflow metrics, artifacts and tags (extra ``mlflow``), logged on a thread of their own.

See docs/integrations/mlflow.md for what appears where in the MLflow UI.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from .._config import ConfigError
from ._base import Record
from ._scalars import PREFIX, TrackerBackend, TrackerConfig, missing_extra

if TYPE_CHECKING:
    from .._config import Config
    from .._identity import Identity
    from ._base import Backend


@dataclass
class MlflowConfig(TrackerConfig):
    """Log to an MLflow run.

    ``tracking_uri``: MLflow's own default (``MLFLOW_TRACKING_URI``) when
    empty. The run: ``run_id`` when given; else the run active in this
    process (``mlflow.start_run()`` before ``configure()``), left open for
    you to end; else a new run named after the job in ``experiment``
    (default: the job name, or ``traintrace``), ended at ``close()``.
    """

    type: ClassVar[str] = "mlflow"
    tracking_uri: str = ""
    experiment: str = ""
    run_id: str = ""
    run_name: str = ""

    def validate(self, where: str) -> None:
        super().validate(where)
        for name in ("tracking_uri", "experiment", "run_id", "run_name"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{where}.{name}: expected a string")

    def create(self, config: Config, identity: Identity, level: int) -> Backend:
        try:
            import mlflow  # noqa: F401
        except ImportError:
            raise missing_extra("MLflow", "mlflow") from None
        return MlflowBackend(
            tracking_uri=self.tracking_uri or None,
            experiment=self.experiment or config.job_name or "traintrace",
            run_id=self.run_id or None,
            run_name=self.run_name or identity.job_id,
            verbosity=level,
            metrics=self.metrics,
            queue_size=self.queue_size,
        )


class MlflowBackend(TrackerBackend):
    """Logs through ``mlflow.MlflowClient`` (no global state of MLflow's is changed)."""

    name = "mlflow"

    def __init__(
        self,
        *,
        tracking_uri: str | None = None,
        experiment: str = "traintrace",
        run_id: str | None = None,
        run_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_id = run_id
        self.run_name = run_name
        self._own_run = False
        self._client: Any = None
        self._texts = 0

    def _tool_open(self, header: Record) -> None:
        import mlflow
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=self.tracking_uri)
        tags = {"traintrace.job": str(header.get("job")), "traintrace.rank": str(header.get("rank"))}
        if self.run_id is None:
            active = mlflow.active_run()
            if active is not None:
                self.run_id = active.info.run_id
        if self.run_id is None:
            found = client.get_experiment_by_name(self.experiment)
            experiment_id = found.experiment_id if found is not None else client.create_experiment(self.experiment)
            run = client.create_run(experiment_id, run_name=self.run_name, tags=tags)
            self.run_id = run.info.run_id
            self._own_run = True
        else:
            for key, value in tags.items():
                client.set_tag(self.run_id, key, value)
        self._client = client

    def _tool_scalars(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in values.items()]
        self._client.log_batch(self.run_id, metrics=metrics)

    def _tool_text(self, step: int, tag: str, text: str) -> None:
        self._texts += 1
        self._client.log_text(self.run_id, text, f"{PREFIX}errors/{self._texts:04d}-step{step}.txt")

    def _tool_summary(self, values: dict[str, float]) -> None:
        self._tool_scalars(self._translate.step, values)

    def _tool_close(self) -> None:
        if self._own_run:
            self._client.set_terminated(self.run_id, status="FINISHED")
