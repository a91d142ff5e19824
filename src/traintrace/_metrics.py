"""Standard metric sets: typed helpers that return plain dicts.

The ``create`` helpers keep the reference library's names so that migrated
code runs unchanged; they drop arguments left as ``None`` and turn enums into
their values, so a record reads ``checkpoint_type=local``, not
``CheckPointType.LOCAL``.
"""

from __future__ import annotations

import enum
from typing import Any


class CheckPointType(str, enum.Enum):
    """Where a checkpoint goes: node-local storage or the global file system."""

    LOCAL = "local"
    GLOBAL = "global"

    def __str__(self) -> str:
        return self.value


def _plain(values: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in (*values.items(), *extra.items()):
        if value is None:
            continue
        out[key] = value.value if isinstance(value, enum.Enum) else value
    return out


class ApplicationMetrics:
    """Metrics of the whole run, attached to the application span."""

    @staticmethod
    def create(
        *,
        rank: int | None = None,
        world_size: int | None = None,
        node_name: str | None = None,
        timezone: str | None = None,
        total_iterations: int | None = None,
        checkpoint_enabled: bool | None = None,
        checkpoint_strategy: str | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        return _plain(
            {
                "rank": rank,
                "world_size": world_size,
                "node_name": node_name,
                "timezone": timezone,
                "total_iterations": total_iterations,
                "checkpoint_enabled": checkpoint_enabled,
                "checkpoint_strategy": checkpoint_strategy,
            },
            extra,
        )


class IterationMetrics:
    """Metrics of one iteration or of an interval of iterations."""

    @staticmethod
    def create(
        *,
        current_iteration: int | None = None,
        num_iterations: int | None = None,
        interval: int | None = None,
        loss: Any = None,
        accuracy: Any = None,
        batch_size: int | None = None,
        consumed_samples: int | None = None,
        tflops: float | None = None,
        tokens_per_second: float | None = None,
        average_iteration_time: float | None = None,
        average_forward_time: float | None = None,
        average_backward_time: float | None = None,
        average_dataloader_time: float | None = None,
        average_optimizer_update_time: float | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        return _plain(
            {
                "current_iteration": current_iteration,
                "num_iterations": num_iterations,
                "interval": interval,
                "loss": loss,
                "accuracy": accuracy,
                "batch_size": batch_size,
                "consumed_samples": consumed_samples,
                "tflops": tflops,
                "tokens_per_second": tokens_per_second,
                "average_iteration_time": average_iteration_time,
                "average_forward_time": average_forward_time,
                "average_backward_time": average_backward_time,
                "average_dataloader_time": average_dataloader_time,
                "average_optimizer_update_time": average_optimizer_update_time,
            },
            extra,
        )


class CheckpointSaveMetrics:
    """Metrics of a checkpoint save or load."""

    @staticmethod
    def create(
        *,
        checkpoint_type: CheckPointType | str | None = None,
        current_iteration: int | None = None,
        num_iterations: int | None = None,
        interval: int | None = None,
        checkpoint_size: int | None = None,
        checkpoint_directory: str | None = None,
        checkpoint_filename: str | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        return _plain(
            {
                "checkpoint_type": checkpoint_type,
                "current_iteration": current_iteration,
                "num_iterations": num_iterations,
                "interval": interval,
                "checkpoint_size": checkpoint_size,
                "checkpoint_directory": checkpoint_directory,
                "checkpoint_filename": checkpoint_filename,
            },
            extra,
        )


class EvaluationMetrics:
    """Metrics of a validation or test pass."""

    @staticmethod
    def create(
        *,
        current_iteration: int | None = None,
        num_iterations: int | None = None,
        loss: Any = None,
        accuracy: Any = None,
        **extra: Any,
    ) -> dict[str, Any]:
        return _plain(
            {
                "current_iteration": current_iteration,
                "num_iterations": num_iterations,
                "loss": loss,
                "accuracy": accuracy,
            },
            extra,
        )


class CustomMetrics:
    """Any metrics: ``CustomMetrics.create(lr=1e-4, grad_norm=0.3)``."""

    @staticmethod
    def create(**metrics: Any) -> dict[str, Any]:
        return _plain({}, metrics)


#: The reference library's name for checkpoint metrics.
CheckpointMetrics = CheckpointSaveMetrics
ValidationMetrics = EvaluationMetrics
TestMetrics = EvaluationMetrics
