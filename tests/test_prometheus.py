"""traintrace-run --metrics-port: scrape /metrics during a real torchrun job (gloo, CPU)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _scrape(port: int) -> dict[tuple[str, str], float]:
    """{(sample name, rank): value}, parsed by prometheus-client's own parser."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, sample.labels.get("rank", ""))] = sample.value
    return out


@pytest.mark.subprocess
@pytest.mark.slow
def test_metrics_endpoint_during_a_torchrun_job(tmp_path: Path) -> None:
    """While both ranks wait after ten steps: step 9, step time, throughput, last progress between the
    worker's own clock readings, rank 1's caught error counted, no hang, streams not closed."""
    port = _free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TRAINTRACE_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_", "MASTER_"))
    }
    env.update(
        {
            "PYTHONPATH": str(ROOT / "src"),
            "TRAINTRACE_LOG_DIR": str(tmp_path / "logs"),
            "TRAINTRACE_BACKENDS_LOG_ENABLED": "0",
            "OMP_NUM_THREADS": "1",
            "TRAINTRACE_JOB_ID": "prom",
        }
    )
    command = [
        sys.executable,
        "-m",
        "traintrace.launch",
        "--metrics-port",
        str(port),
        "--standalone",
        "--nproc-per-node",
        "2",
        "--monitor-interval",
        "0.2",
        str(ROOT / "tests" / "_prom_worker.py"),
        str(tmp_path),
    ]
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"truth{r}.json").exists() for r in (0, 1)):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the workers did not reach step 9"
            time.sleep(0.1)
        truths = {r: json.loads((tmp_path / f"truth{r}.json").read_text()) for r in (0, 1)}
        metrics = _scrape(port)
        assert metrics[("traintrace_ranks", "")] == 2
        for rank in ("0", "1"):
            truth = truths[int(rank)]
            assert metrics[("traintrace_step", rank)] == truth["last_step"]
            assert metrics[("traintrace_errors_total", rank)] == truth["errors"]
            assert metrics[("traintrace_hangs_total", rank)] == 0
            assert metrics[("traintrace_step_time_seconds", rank)] >= 0.01  # each step sleeps 10 ms
            assert metrics[("traintrace_samples_per_second", rank)] > 0
            assert truth["last_start"] <= metrics[("traintrace_last_progress_timestamp_seconds", rank)]
            assert metrics[("traintrace_last_progress_timestamp_seconds", rank)] <= truth["t_end"]
            assert metrics[("traintrace_stream_closed", rank)] == 0
            assert metrics[("traintrace_restart", rank)] == 0
        (tmp_path / "go").touch()
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        assert f":{port}/metrics" in err
    finally:
        (tmp_path / "go").touch()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.subprocess
def test_missing_extra_is_named(tmp_path: Path) -> None:
    """Without prometheus-client, --metrics-port stops before launching and names the extra."""
    code = (
        "import sys; sys.modules['prometheus_client'] = None\nfrom traintrace.launch import main\n"
        "main(['--metrics-port', '9', '--standalone', 'x.py'])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert result.returncode == 2 and "traintrace[prometheus]" in result.stderr
