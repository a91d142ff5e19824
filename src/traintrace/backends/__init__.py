"""Backends: where records go. Write your own by implementing :class:`Backend`."""

from .._console import ConsoleBackend, ConsoleBackendConfig
from ._base import Backend, BaseBackend, Record, SpanListener
from ._file import FileBackend
from ._log import LogBackend
from ._memory import MemoryBackend
from ._mlflow import MlflowBackend, MlflowConfig
from ._nvtx import NvtxBackend, NvtxBackendConfig
from ._scalars import TrackerBackend, TrackerConfig
from ._tensorboard import TensorBoardBackend, TensorBoardConfig
from ._wandb import WandbBackend, WandbConfig
from .otlp import OtlpLogsConfig, OtlpMetricsConfig, OtlpTracesConfig

__all__ = [
    "Backend",
    "BaseBackend",
    "ConsoleBackend",
    "ConsoleBackendConfig",
    "FileBackend",
    "LogBackend",
    "MemoryBackend",
    "MlflowBackend",
    "MlflowConfig",
    "NvtxBackend",
    "NvtxBackendConfig",
    "OtlpLogsConfig",
    "OtlpMetricsConfig",
    "OtlpTracesConfig",
    "Record",
    "SpanListener",
    "TensorBoardBackend",
    "TensorBoardConfig",
    "TrackerBackend",
    "TrackerConfig",
    "WandbBackend",
    "WandbConfig",
]
