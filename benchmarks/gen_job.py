"""Write a synthetic traintrace job: many ranks, many iterations, checkpoints, a straggler, a failure.

    python benchmarks/gen_job.py OUT_DIR --ranks 64 --iterations 100000

The job, on every rank: a header, initialisation spans, then iteration spans
(one ``span`` record each, with ``step``, ``loss`` and ``batch_size``), a
``training_iterations`` event every 100 steps, a synchronous checkpoint every
``--checkpoint-every`` steps. Rank ``--straggler`` runs 30% slower from the
middle of the run. At ``--fail-at`` steps rank ``--failing-rank`` raises (an
``error`` record, its iteration ``end`` with status ``error``) and every rank's
stream stops without a ``close``; after 30 s every rank restarts (a new header
appended to the same file), loads the last checkpoint and redoes the steps
after it. The files are written by string templates, not by the library, so
that writing 6.4 million records takes about a minute.

``--gap-us N``: each rank idles N µs between its steps, outside any span (a
framework's work between steps). ``--one-saver``: rank 0 alone writes the
checkpoints; the others spend the save's time between their steps, outside any
span (a barrier after rank 0's save, as Lightning's ``Trainer.save_checkpoint``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

STEP_NS = 100_000_000
INIT_NS = 2_000_000_000
SAVE_NS = 1_500_000_000
LOAD_NS = 3_000_000_000
RESTART_GAP_NS = 30_000_000_000


def _header(rank: int, world: int, ts: int, restart: int, job: str) -> str:
    return json.dumps(
        {
            "seq": 0,
            "kind": "header",
            "ts": ts,
            "schema": "traintrace",
            "schema_version": 1,
            "time": "",
            "mono": 0,
            "job": job,
            "rank": rank,
            "world_size": world,
            "local_rank": rank % 8,
            "local_world_size": 8,
            "node_rank": rank // 8,
            "restart": restart,
            "host": f"node{rank // 8}",
            "pid": 1000 + rank,
            "library_version": "0.1.0",
            "python": "3.11.7",
        },
        separators=(",", ":"),
    )


def write_rank(  # noqa: PLR0917 - one call site, all arguments named there
    path: Path,
    rank: int,
    world: int,
    iterations: int,
    checkpoint_every: int,
    straggler: int,
    failing_rank: int,
    fail_at: int,
    t0: int,
    job: str,
    gap_ns: int = 0,
    one_saver: bool = False,
) -> int:
    """Write one rank's file; returns its number of records."""
    count = 0
    tid = 2000 + rank
    slow_from = iterations // 2

    def step_ns(step: int) -> int:
        jitter = ((step * 2654435761 + rank * 40503) % 1000) * 10_000  # 0..10 ms, deterministic
        base = STEP_NS + jitter
        if rank == straggler and step >= slow_from:
            base = base * 13 // 10
        return base

    def run(start_step: int, end_step: int, ts: int, restart: int) -> tuple[int, bool]:
        nonlocal count
        seq = 0
        lines = [_header(rank, world, ts, restart, job)]
        seq += 1
        lines.append(f'{{"seq":{seq},"kind":"thread","ts":{ts},"tid":{tid},"thread_name":"MainThread"}}')
        seq += 1
        lines.append(
            f'{{"seq":{seq},"kind":"start","ts":{ts + 1000},"name":"main_function","id":1,"parent":0,"tid":{tid}}}'
        )
        seq += 1
        lines.append(
            f'{{"seq":{seq},"kind":"span","ts":{ts + 2000},"name":"model_initialization","id":2,"parent":1,'
            f'"tid":{tid},"dur":{INIT_NS},"status":"ok"}}'
        )
        seq += 1
        now = ts + 2000 + INIT_NS
        span_id = 3
        if restart:
            lines.append(
                f'{{"seq":{seq},"kind":"span","ts":{now},"name":"checkpoint_load","id":{span_id},"parent":1,'
                f'"tid":{tid},"dur":{LOAD_NS},"status":"ok","attrs":{{"current_iteration":{start_step}}}}}'
            )
            seq += 1
            span_id += 1
            now += LOAD_NS
        loop_id = span_id
        span_id += 1
        lines.append(
            f'{{"seq":{seq},"kind":"start","ts":{now},"name":"training_loop","id":{loop_id},"parent":1,"tid":{tid}}}'
        )
        seq += 1
        failed = False
        for step in range(start_step, end_step):
            dur = step_ns(step)
            loss = 10.0 / (1.0 + step / 1000.0)
            if restart == 0 and rank == failing_rank and step == fail_at:
                lines.append(
                    f'{{"seq":{seq},"kind":"start","ts":{now},"name":"iteration","id":{span_id},"parent":{loop_id},'
                    f'"tid":{tid},"attrs":{{"step":{step}}}}}'
                )
                seq += 1
                lines.append(
                    f'{{"seq":{seq},"kind":"error","ts":{now + dur // 2},"name":"exception","span":{span_id},'
                    f'"tid":{tid},"error_type":"RuntimeError","message":"CUDA error: an illegal memory access",'
                    f'"stack":"Traceback (most recent call last):\\n  File \\"train.py\\", line 42, in step\\n'
                    f'RuntimeError: CUDA error: an illegal memory access"}}'
                )
                seq += 1
                lines.append(
                    f'{{"seq":{seq},"kind":"end","ts":{now + dur // 2},"name":"iteration","id":{span_id},'
                    f'"dur":{dur // 2},"status":"error"}}'
                )
                seq += 1
                failed = True
                break
            if restart == 0 and step == fail_at + 1:
                failed = True  # the other ranks are killed while in this step
                lines.append(
                    f'{{"seq":{seq},"kind":"start","ts":{now},"name":"iteration","id":{span_id},"parent":{loop_id},'
                    f'"tid":{tid},"attrs":{{"step":{step}}}}}'
                )
                seq += 1
                break
            lines.append(
                f'{{"seq":{seq},"kind":"span","ts":{now},"name":"iteration","id":{span_id},"parent":{loop_id},'
                f'"tid":{tid},"dur":{dur},"status":"ok","attrs":{{"step":{step},"loss":{loss:.6f},"batch_size":32}}}}'
            )
            seq += 1
            span_id += 1
            now += dur + gap_ns
            if (step + 1) % 100 == 0:
                lines.append(
                    f'{{"seq":{seq},"kind":"event","ts":{now},"name":"training_iterations","span":{loop_id},'
                    f'"tid":{tid},"attrs":{{"last_step":{step},"consumed_samples":{(step + 1) * 32 * world},'
                    f'"samples_per_second":{32 * world / (dur / 1e9):.1f}}}}}'
                )
                seq += 1
            if (step + 1) % checkpoint_every == 0 and one_saver and rank:
                now += SAVE_NS  # waiting at the barrier for rank 0's save: no span
            elif (step + 1) % checkpoint_every == 0:
                lines.append(
                    f'{{"seq":{seq},"kind":"span","ts":{now},"name":"checkpoint_save_sync","id":{span_id},'
                    f'"parent":{loop_id},"tid":{tid},"dur":{SAVE_NS},"status":"ok",'
                    f'"attrs":{{"checkpoint_type":"global","current_iteration":{step + 1}}}}}'
                )
                seq += 1
                span_id += 1
                now += SAVE_NS
            if len(lines) >= 65536:
                handle.write("\n".join(lines) + "\n")
                count += len(lines)
                lines.clear()
        if not failed:
            lines.append(
                f'{{"seq":{seq},"kind":"end","ts":{now},"name":"training_loop","id":{loop_id},"dur":1,"status":"ok"}}'
            )
            seq += 1
            lines.append(f'{{"seq":{seq},"kind":"end","ts":{now},"name":"main_function","id":1,"dur":1,"status":"ok"}}')
            seq += 1
            lines.append(f'{{"seq":{seq},"kind":"close","ts":{now},"records":{seq + 1},"dropped":0}}')
        handle.write("\n".join(lines) + "\n")
        count += len(lines)
        return now, failed

    with path.open("w") as handle:
        # Every rank reaches the failure at the same time: the straggler's extra time is waited out by the others.
        _, failed = run(0, iterations, t0, 0)
        if failed:
            resume = (fail_at // checkpoint_every) * checkpoint_every
            run(resume, iterations, t0 + _time_to(fail_at + 1, checkpoint_every, gap_ns) + RESTART_GAP_NS, 1)
    return count


def _time_to(step: int, checkpoint_every: int, gap_ns: int = 0) -> int:
    """Upper bound of the wall time of the first ``step`` steps (so restarts start after every rank stopped)."""
    return INIT_NS + step * (STEP_NS * 14 // 10 + 10_000_000 + gap_ns) + (step // checkpoint_every + 1) * SAVE_NS


def generate(  # noqa: PLR0917 - mirrors the command-line options
    folder: str | os.PathLike[str],
    ranks: int = 64,
    iterations: int = 100_000,
    checkpoint_every: int = 5000,
    straggler: int = 13,
    failing_rank: int = 37,
    fail_at: int | None = None,
    job: str = "synthetic",
    gap_us: int = 0,
    one_saver: bool = False,
) -> int:
    """Write the job into ``folder``; returns the total number of records."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    fail = int(iterations * 0.7) + checkpoint_every // 3 if fail_at is None else fail_at
    t0 = 1_790_000_000_000_000_000
    return sum(
        write_rank(
            out / f"rank{rank}.jsonl",
            rank,
            ranks,
            iterations,
            checkpoint_every,
            straggler,
            failing_rank,
            fail,
            t0,
            job,
            gap_us * 1000,
            one_saver,
        )
        for rank in range(ranks)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=100_000)
    parser.add_argument("--checkpoint-every", type=int, default=5000)
    parser.add_argument("--gap-us", type=int, default=0, help="idle time between steps, outside any span")
    parser.add_argument("--one-saver", action="store_true", help="rank 0 alone saves; the others wait between steps")
    args = parser.parse_args()
    started = time.perf_counter()
    records = generate(
        args.out,
        args.ranks,
        args.iterations,
        args.checkpoint_every,
        gap_us=args.gap_us,
        one_saver=args.one_saver,
    )
    print(f"wrote {records:,} records for {args.ranks} ranks in {time.perf_counter() - started:.1f} s to {args.out}")


if __name__ == "__main__":
    main()
