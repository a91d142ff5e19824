"""Weights & Biases (extra ``wandb``), logged on a thread of their own.

Everything is logged with a ``traintrace/step`` value and charted against it
(``define_metric``), so W&B's own step counter, which the user's or a
framework's logging may drive, is never fought over. See
docs/integrations/wandb.md.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from .._config import ConfigError
from ._base import Record
from ._scalars import PREFIX, TrackerBackend, TrackerConfig, missing_extra

if TYPE_CHECKING:
    from .._config import Config
    from .._identity import Identity
    from ._base import Backend

STEP = PREFIX + "step"


@dataclass
class WandbConfig(TrackerConfig):
    """Log to a W&B run.

    The run already started in this process (``wandb.init()`` before
    ``configure()``, or a framework's W&B logger) is used and left for its
    owner to finish; otherwise traintrace starts one named after the job in
    ``project`` (default: the job name, or ``traintrace``) and finishes it at
    ``close()``. ``mode``: ``online``, ``offline`` or ``disabled`` (empty:
    W&B's own default, ``WANDB_MODE``). ``dir``: where W&B writes its files
    (empty: W&B's default).
    """

    type: ClassVar[str] = "wandb"
    project: str = ""
    entity: str = ""
    mode: str = ""
    dir: str = ""

    def validate(self, where: str) -> None:
        super().validate(where)
        for name in ("project", "entity", "mode", "dir"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{where}.{name}: expected a string")
        if self.mode not in ("", "online", "offline", "disabled"):
            raise ConfigError(f"{where}.mode: expected online, offline or disabled, got {self.mode!r}")

    def create(self, config: Config, identity: Identity, level: int) -> Backend:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise missing_extra("Weights & Biases", "wandb") from None
        init: dict[str, Any] = {"project": self.project or config.job_name or "traintrace", "name": identity.job_id}
        for name in ("entity", "mode", "dir"):
            if getattr(self, name):
                init[name] = getattr(self, name)
        return WandbBackend(init, verbosity=level, metrics=self.metrics, queue_size=self.queue_size)


class WandbBackend(TrackerBackend):
    """Logs through ``wandb``'s run object."""

    name = "wandb"

    def __init__(self, init: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.init = dict(init or {})
        self._run: Any = None
        self._own_run = False
        self._texts = 0

    def _tool_open(self, header: Record) -> None:
        import wandb

        run = wandb.run
        if run is None:
            config = {
                "traintrace": {
                    "job": header.get("job"),
                    "rank": header.get("rank"),
                    "world_size": header.get("world_size"),
                }
            }
            run = wandb.init(config=config, **self.init)
            self._own_run = True
        run.define_metric(STEP)
        # Our run: chart everything against traintrace's step. A borrowed run: only our own figures.
        run.define_metric("*" if self._own_run else PREFIX + "*", step_metric=STEP)
        self._run = run

    def _tool_scalars(self, step: int, values: dict[str, float]) -> None:
        self._run.log({**values, STEP: step})

    def _tool_text(self, step: int, tag: str, text: str) -> None:
        import wandb

        self._texts += 1
        page = wandb.Html(f"<pre>{html.escape(text)}</pre>", inject=False)
        self._run.log({tag: page, STEP: step})
        self._run.summary[PREFIX + "last_error"] = text.split("\n", 1)[0]

    def _tool_summary(self, values: dict[str, float]) -> None:
        for key, value in values.items():
            self._run.summary[key] = value

    def _tool_close(self) -> None:
        if self._own_run:
            self._run.finish()
