"""traintrace report: one offline HTML file, opened in a real headless Chromium."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from tests.cli_jobs import Script, write_job

pytest.importorskip("duckdb")

from traintrace.cli import main

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="chromium is not installed (apt-get install -y chromium; scripts/_env.sh installs it when run as root)",
)
EVIL = "<script>document.title='pwned'</script><img src=x onerror=alert(1)>"


def _chromium(profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", *args],
        check=False, capture_output=True, text=True, timeout=120,
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
        handle.write('{"seq":500,"kind":"span","ts":1800000000500000000,"name":"' + EVIL.replace('"', '\\"')
                     + '","id":900,"parent":0,"tid":7,"dur":1000,"status":"ok"}\n')
    out = folder / "report.html"
    assert main(["report", str(folder / "job"), "-o", str(out), "--quiet"]) == 0
    return out


def test_report_is_self_contained_and_escapes_record_text(report: Path) -> None:
    """No external URL is referenced, and record text never appears as markup."""
    page = report.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "<script>document.title" not in page and "<img src=x" not in page
    assert page.count("<script") == 3  # the error hook, the data block, the drawing code
    assert "\\u003cscript\\u003e" in page


@needs_chromium
def test_report_renders_in_headless_chromium(report: Path, tmp_path: Path) -> None:
    """The page loads with no console output or script error, draws its six charts, and is not blank."""
    dom = _chromium(tmp_path / "profile1", "--dump-dom", report.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    console = [line for line in dom.stderr.splitlines() if ":CONSOLE" in line]
    assert console == []
    assert 'data-charts="6"' in dom.stdout
    assert 'data-errors="' not in dom.stdout.split(">", 2)[1]  # set on <html> by window.onerror
    assert "pwned" not in dom.stdout.split("<title>")[1].split("</title>")[0]
    assert "&lt;script&gt;document.title" in dom.stdout  # shown as text
    # The verdict comes first, above the cards: who failed, where, and that the restart finished.
    assert dom.stdout.index('id="verdict"') < dom.stdout.index('id="cards"')
    verdict = dom.stdout.split('id="verdict">', 1)[1].split("</p>", 1)[0]
    assert verdict.startswith("restart 0 failed: rank 3 raised RuntimeError") and "at step 25" in verdict
    assert "failed: rank 3" in dom.stdout.split('id="cards"', 1)[1]
    shot = tmp_path / "shot.png"
    result = _chromium(tmp_path / "profile2", "--window-size=1200,1600", f"--screenshot={shot}", report.as_uri())
    assert result.returncode == 0 and shot.exists(), result.stderr[-2000:]
    width, height, rows = _png_pixels(shot)
    assert (width, height) == (1200, 1600)
    colours = {row[i : i + 3] for row in rows[::4] for i in range(0, len(row), 12)}
    assert len(colours) > 50
    productive_green = bytes((0x2E, 0x9D, 0x5B))
    assert any(productive_green in row for row in rows), "the goodput bar is not drawn"
