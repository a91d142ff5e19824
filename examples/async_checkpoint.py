"""Asynchronous checkpoints with torch.distributed.checkpoint, recorded in two parts.

    python examples/async_checkpoint.py --log-dir traintrace_logs --job-id async-demo

``async_save`` blocks training only while it stages the state (copies it to
CPU memory); the write happens in the background. traintrace records:

* ``checkpoint_save_async``: the blocking part, on the training thread;
* ``checkpoint_save_finalization``: the background part, from when
  ``async_save`` returns until its future completes, linked to the blocking
  part (``link``) and ended from the future's callback, with the size written.

Falls back to ``torch.save`` in a thread where ``async_save`` is missing
(torch < 2.3). Runs on CPU in a single process (no process group needed).
"""

from __future__ import annotations

import argparse
import contextvars
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch import nn

import traintrace as tt


def folder_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def start_async_save(state: dict[str, Any], path: Path) -> Future[Any]:
    """Start a save that finishes in the background; return its future."""
    try:
        import torch.distributed.checkpoint as dcp

        if hasattr(dcp, "async_save"):
            result = dcp.async_save(state, checkpoint_id=str(path), no_dist=True)
            # Newer torch may answer with a response object that holds the future.
            return getattr(result, "upload_completion", result)  # type: ignore[no-any-return]
    except ImportError:
        pass
    future: Future[Any] = Future()
    staged = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}

    def write() -> None:
        try:
            torch.save(staged, path)
            future.set_result(None)
        except Exception as exc:  # noqa: BLE001 - handed to the future's callbacks
            future.set_exception(exc)

    threading.Thread(target=write, name="checkpoint-writer", daemon=True).start()
    return future


def save(model: nn.Module, step: int, root: Path) -> Future[Any]:
    path = root / f"step{step}"
    attrs = tt.CheckpointSaveMetrics.create(
        checkpoint_type=tt.CheckPointType.LOCAL,
        current_iteration=step,
        checkpoint_directory=str(root),
        checkpoint_filename=path.name,
        checkpoint_strategy="async",
    )
    with tt.checkpoint_save_async(attrs) as blocking:
        future = start_async_save(dict(model.state_dict()), path)
    # Opened in a copy of the context, so the training thread's current span stays
    # the training loop; ended from whichever thread completes the future.
    background = contextvars.copy_context().run(
        tt.start, tt.SpanName.CHECKPOINT_SAVE_FINALIZATION, attrs, link=blocking
    )

    # Resolved once the finalisation span has ended: a future's result() can
    # return before its done-callbacks have run.
    recorded: Future[Any] = Future()

    def finished(done: Future[Any]) -> None:
        error = done.exception()
        if error is not None:
            tt.error(error, {"checkpoint_directory": str(root)})
            tt.stop(background, status=tt.SpanStatus.ERROR)
        else:
            tt.stop(background, {"checkpoint_size": folder_size(path)})
        recorded.set_result(None)

    future.add_done_callback(finished)
    return recorded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-dir", default="traintrace_logs")
    parser.add_argument("--job-id", default="async-demo")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=20, help="checkpoint every N steps")
    parser.add_argument("--checkpoint-dir", help="where the checkpoints go (default: a new temporary folder)")
    args = parser.parse_args()

    tt.configure(log_dir=args.log_dir, job_id=args.job_id)
    root = Path(args.checkpoint_dir or tempfile.mkdtemp(prefix="traintrace-async-"))
    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    pending: list[Future[Any]] = []
    with tt.application(tt.ApplicationMetrics.create(checkpoint_enabled=True, checkpoint_strategy="async")):
        with tt.training_loop(total_iterations=args.steps):
            for step in range(args.steps):
                with tt.training_iteration(step, {"batch_size": 32}) as it:
                    x = torch.randn(32, 64)
                    loss = nn.functional.mse_loss(model(x), x)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    it.add_metrics(loss=loss.detach())
                if (step + 1) % args.every == 0:
                    pending.append(save(model, step + 1, root))
        for future in pending:
            future.result()  # training is over: wait for the last writes
    tt.close()
    print(f"{len(pending)} async checkpoints in {root}; records in {Path(args.log_dir) / args.job_id}")


if __name__ == "__main__":
    main()
