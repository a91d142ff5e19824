"""TensorBoard event files (extra ``tensorboard``), written on a thread of their own.

Scalars for every interval (step time, throughput, MFU, the user's metrics),
checkpoint and validation durations, errors in the Text tab, and the run's
totals at the end. See docs/integrations/tensorboard.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from .._config import ConfigError
from ._base import Record
from ._scalars import TrackerBackend, TrackerConfig, missing_extra

if TYPE_CHECKING:
    from .._config import Config
    from .._identity import Identity
    from ._base import Backend


@dataclass
class TensorBoardConfig(TrackerConfig):
    """Event files under ``log_dir`` (default ``<traintrace log_dir>/<job>/tensorboard``).

    ``log_dir`` is a template like the file backend's path (``{job}``,
    ``{rank}``, ...), relative to traintrace's ``log_dir``; point
    ``tensorboard --logdir`` at it (or at a parent holding several runs).
    """

    type: ClassVar[str] = "tensorboard"
    log_dir: str = "{job}/tensorboard"
    flush_secs: float = 10.0

    def validate(self, where: str) -> None:
        super().validate(where)
        if not isinstance(self.log_dir, str) or not self.log_dir.strip():
            raise ConfigError(f"{where}.log_dir: expected a folder (template)")

    def create(self, config: Config, identity: Identity, level: int) -> Backend:
        try:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter  # noqa: F401
        except ImportError:
            raise missing_extra("TensorBoard", "tensorboard") from None
        from .._config import resolve_path

        folder = resolve_path(self.log_dir.rstrip("/") + "/x", config.log_dir, identity).parent
        return TensorBoardBackend(
            folder, verbosity=level, metrics=self.metrics, queue_size=self.queue_size, flush_secs=self.flush_secs
        )


class TensorBoardBackend(TrackerBackend):
    """Writes a TensorBoard event file in ``folder``."""

    name = "tensorboard"

    def __init__(self, folder: str | Path, *, flush_secs: float = 10.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.folder = Path(folder)
        self.flush_secs = flush_secs
        self._writer: Any = None

    def _tool_open(self, header: Record) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.folder.mkdir(parents=True, exist_ok=True)
        rank = header.get("rank")
        suffix = f".rank{rank}" if isinstance(rank, int) else ""
        self._writer = EventFileWriter(str(self.folder), flush_secs=self.flush_secs, filename_suffix=suffix)

    def _event(self, step: int, values: list[Any]) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        self._writer.add_event(
            event_pb2.Event(wall_time=time.time(), step=step, summary=summary_pb2.Summary(value=values))
        )

    def _tool_scalars(self, step: int, values: dict[str, float]) -> None:
        from tensorboard.compat.proto import summary_pb2

        self._event(step, [summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in values.items()])

    def _tool_text(self, step: int, tag: str, text: str) -> None:
        from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
        from tensorboard.plugins.text import metadata

        tensor = tensor_pb2.TensorProto(
            dtype=types_pb2.DT_STRING,
            string_val=[("```\n" + text + "\n```").encode("utf-8", "replace")],
            tensor_shape=tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)]),
        )
        info = metadata.create_summary_metadata(display_name=tag, description="")
        info.data_class = summary_pb2.DATA_CLASS_TENSOR  # TensorBoard's fast loader reads only declared classes
        value = summary_pb2.Summary.Value(tag=tag, metadata=info, tensor=tensor)
        self._event(step, [value])

    def _tool_summary(self, values: dict[str, float]) -> None:
        self._tool_scalars(self._translate.step, values)

    def _tool_flush(self) -> None:
        self._writer.flush()

    def _tool_close(self) -> None:
        self._writer.close()
