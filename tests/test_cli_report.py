"""traintrace report: one offline HTML file, opened in a real headless Chromium."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from tests.cli_jobs import Script, write_job

pytest.importorskip("duckdb")

from traintrace.cli import main

# The analysis of files written by hand (tests/cli_jobs.py), not by either core: the same in both passes.
pytestmark = pytest.mark.once

ROOT = Path(__file__).resolve().parents[1]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="chromium is not installed (apt-get install -y chromium; scripts/_env.sh installs it when run as root)",
)
EVIL = "<script>document.title='pwned'</script><img src=x onerror=alert(1)>"


def _chromium(profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    return subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            "--enable-logging=stderr",
            "--v=0",
            *args,
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _png_pixels(path: Path) -> tuple[int, int, list[bytes]]:
    """Decode an 8-bit RGB/RGBA PNG (what Chromium writes) into rows of pixel bytes."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height, channels = 8, b"", 0, 0, 4
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and color in (2, 6)
            channels = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * channels
    rows: list[bytes] = []
    previous = bytearray(stride)
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up = previous[i]
            corner = previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 255
            elif kind == 2:
                line[i] = (line[i] + up) & 255
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 255
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 255
        rows.append(bytes(b for j in range(0, stride, channels) for b in line[j : j + 3]))
        previous = line
    return width, height, rows


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A report of a job with a failure, a straggler, and hostile text in a span name and an error message."""
    folder = tmp_path_factory.mktemp("report")
    write_job(folder / "job", Script(message=EVIL, steps=60))
    with (folder / "job" / "rank0.jsonl").open("a") as handle:
        handle.write(
            '{"seq":500,"kind":"span","ts":1800000000500000000,"name":"'
            + EVIL.replace('"', '\\"')
            + '","id":900,"parent":0,"tid":7,"dur":1000,"status":"ok"}\n'
        )
    out = folder / "report.html"
    assert main(["report", str(folder / "job"), "-o", str(out), "--quiet"]) == 0
    return out


def test_report_is_self_contained_and_escapes_record_text(report: Path) -> None:
    """No external URL is referenced, and record text never appears as markup."""
    page = report.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "<script>document.title" not in page and "<img src=x" not in page
    assert page.count("<script") == 4  # the error hook, the data block, the charting library, the drawing code
    assert "\\u003cscript\\u003e" in page
    # The one Content-Security-Policy: nothing loads from anywhere, scripts and styles only inline.
    csp = re.findall(r'http-equiv="Content-Security-Policy" content="([^"]*)"', page)
    assert csp == ["default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:"]
    # The charting library is inlined with its licence header, not loaded.
    assert "uPlot v1.6.32" in page and "The MIT License (MIT)" in page and "Copyright (c) 2022 Leon Sorokin" in page
    assert "__UPLOT_JS__" not in page and "__UPLOT_CSS__" not in page


@pytest.mark.subprocess
@needs_chromium
def test_report_renders_in_headless_chromium(report: Path, tmp_path: Path) -> None:
    """The page loads with no console output or script error, draws its six charts, and is not blank."""
    dom = _chromium(tmp_path / "profile1", "--dump-dom", report.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    console = [line for line in dom.stderr.splitlines() if ":CONSOLE" in line]
    assert console == []
    # breakdown, step time, loss, throughput, heat map, timeline
    assert 'data-charts="6"' in dom.stdout
    assert 'data-errors="' not in dom.stdout.split(">", 2)[1]  # set on <html> by window.onerror
    assert "pwned" not in dom.stdout.split("<title>")[1].split("</title>")[0]
    assert "&lt;script&gt;document.title" in dom.stdout  # shown as text
    # The verdict comes first, above the cards: who failed, where, and that the restart finished.
    assert dom.stdout.index('id="verdict"') < dom.stdout.index('id="cards"')
    verdict = dom.stdout.split('id="verdict">', 1)[1].split("</p>", 1)[0]
    assert verdict.startswith("restart 0 failed: rank 3 raised RuntimeError") and "at step 25" in verdict
    assert _cards(dom.stdout)["status"] == "recovered (restart 0 failed: rank 3)"  # the restart finished
    # Four ranks: one line per rank on the step axis, drawn by uPlot on a canvas with a live legend.
    steps = _chart(dom.stdout, "c-steps")
    assert steps["series"] == 4 and steps["canvas"]
    assert steps["legend"] == ["step", "rank 0", "rank 1", "rank 2 (straggler)", "rank 3"]
    # Step times are 0.1 s and 0.15 s (the straggler): the axis fits them, it does not start at 0.
    assert 0.05 < steps["ymin"] < 0.1 and 0.15 < steps["ymax"] < 0.2
    assert steps["mark"] == 25.0  # rank 3 failed at step 25: a line there
    loss = _chart(dom.stdout, "c-loss")
    assert loss["series"] == 1 and loss["legend"] == ["step", "training loss (rank 0)"]
    assert loss["ymin"] > 0  # losses 1/(1+step), from 1 down to 1/40: fitted, not pinned to 0
    assert 'id="c-lr"' not in dom.stdout  # no learning rate recorded, no chart
    assert _chart(dom.stdout, "c-throughput")["series"] == 1
    assert 'id="s-heat"' in dom.stdout
    # The cards say what they count: the straggler is rank 2, not "2 stragglers".
    assert _cards(dom.stdout)["straggler"] == "rank 2"
    shot = tmp_path / "shot.png"
    result = _chromium(tmp_path / "profile2", "--window-size=1200,1600", f"--screenshot={shot}", report.as_uri())
    assert result.returncode == 0 and shot.exists(), result.stderr[-2000:]
    width, height, rows = _png_pixels(shot)
    assert (width, height) == (1200, 1600)
    colours = {row[i : i + 3] for row in rows[::4] for i in range(0, len(row), 12)}
    assert len(colours) > 50
    productive_green = bytes((0x2E, 0x9D, 0x5B))
    assert any(productive_green in row for row in rows), "the goodput bar is not drawn"


def _chart(dom: str, chart_id: str) -> dict[str, object]:
    """One uPlot chart in the dumped DOM: its series count, canvas, legend labels, y range and failure mark."""
    start = dom.index(f'id="{chart_id}"')
    tag = dom[dom.rindex("<", 0, start) : dom.index(">", start)]
    body = dom[start : dom.index('class="hint"', start)]
    attrs = dict(re.findall(r'data-([a-z]+)="([^"]*)"', tag))
    return {
        "series": int(attrs["series"]),
        "canvas": "<canvas" in body,
        "legend": re.findall(r'<th>(?:<div class="u-marker"[^>]*></div>)?<div class="u-label">([^<]*)</div>', body),
        "ymin": float(attrs["ymin"]),
        "ymax": float(attrs["ymax"]),
        "mark": float(attrs["mark"]) if "mark" in attrs else None,
    }


def _cards(dom: str) -> dict[str, str]:
    """The status cards as {label: value}."""
    cards = dom.split('id="cards"', 1)[1].split("</section>", 1)[0]
    return {k: v for v, k in re.findall(r'<div class="v">([^<]*)</div><div class="k">([^<]*)</div>', cards)}


def _dump(page: Path, profile: Path) -> str:
    dom = _chromium(profile, "--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert [line for line in dom.stderr.splitlines() if ":CONSOLE" in line] == []
    assert 'data-errors="' not in dom.stdout.split(">", 2)[1]
    return dom.stdout


@pytest.mark.slow
@pytest.mark.subprocess
@needs_chromium
@pytest.mark.once  # the report of a finished run, whichever core wrote it
def test_single_rank_report_draws_that_rank(tmp_path: Path) -> None:
    """A real one-process run (examples/train_cpu.py): its rank's line, loss with validation loss and the
    learning rate on the step axis, no heat map or straggler card (there is nothing to compare it with)."""
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "train_cpu.py"),
            "--log-dir",
            str(tmp_path / "logs"),
            "--job-id",
            "one",
            "--epochs",
            "2",
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    out = tmp_path / "report.html"
    assert main(["report", str(tmp_path / "logs" / "one"), "-o", str(out), "--quiet"]) == 0
    dom = _dump(out, tmp_path / "profile")
    # breakdown, step time, loss, learning rate, throughput, timeline
    assert 'data-charts="6"' in dom
    assert 'id="s-heat"' not in dom
    steps = _chart(dom, "c-steps")
    assert steps["series"] == 1 and steps["canvas"] and steps["legend"] == ["step", "rank 0"]
    assert "<h2>Step time (rank 0)</h2>" in dom and "per rank" not in dom.split('id="s-steps"', 1)[1][:200]
    # 2 epochs of 64 steps, a validation after each: at steps 64 and 128 (the axis reaches the last one).
    loss = _chart(dom, "c-loss")
    assert loss["series"] == 2 and loss["legend"] == ["step", "training loss (rank 0)", "validation loss"]
    lr = _chart(dom, "c-lr")
    assert lr["series"] == 1 and lr["legend"] == ["step", "learning rate (rank 0)"]
    assert 0 <= lr["ymin"] < 0.001 and 0.01 <= lr["ymax"] < 0.0115  # cosine from 0.01 towards 0
    cards = _cards(dom)
    assert "straggler" not in cards and "stragglers" not in cards
    assert cards["status"] == "healthy" and cards["errors recorded"] == "none" and cards["steps completed"] == "128"
    assert "1 rank on 1 host" in dom


@pytest.mark.subprocess
@needs_chromium
def test_many_rank_report_draws_the_spread_and_the_stragglers(tmp_path: Path) -> None:
    """Above 16 ranks: the slowest, median and fastest rank per step as a band, and each straggler by name."""
    write_job(tmp_path / "job", Script(ranks=20, straggler=13, fail_rank=None, fail_step=None, steps=30))
    out = tmp_path / "report.html"
    assert main(["report", str(tmp_path / "job"), "-o", str(out), "--quiet"]) == 0
    dom = _dump(out, tmp_path / "profile")
    steps = _chart(dom, "c-steps")
    assert steps["legend"] == ["step", "slowest rank", "median over ranks", "fastest rank", "rank 13 (straggler)"]
    assert steps["series"] == 4 and steps["mark"] is None
    assert _cards(dom)["straggler"] == "rank 13"
