"""traintrace in a real Jupyter kernel (nbclient): the command's main() and, later, the analysis API."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli_jobs import Script, write_job

pytest.importorskip("duckdb")
nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

SRC = Path(__file__).resolve().parents[1] / "src"


def run_notebook(cells: list[str], cwd: Path) -> list[dict]:
    """Execute ``cells`` in a fresh python3 kernel; returns each code cell's outputs."""
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(f"import sys; sys.path.insert(0, {str(SRC)!r})")]
    notebook.cells += [nbformat.v4.new_code_cell(source) for source in cells]
    client = nbclient.NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
    )
    client.execute()
    return [cell.outputs for cell in notebook.cells[1:]]


@pytest.mark.subprocess
def test_cli_main_runs_in_a_kernel(tmp_path: Path) -> None:
    """`traintrace.cli.main([...])` in Jupyter returns 0 and prints the summary (no ipywidgets needed)."""
    write_job(tmp_path / "job", Script(ranks=2, steps=12, fail_rank=None, fail_step=None, straggler=None))
    outputs = run_notebook(
        [f"from traintrace.cli import main\nrc = main(['summary', {str(tmp_path / 'job')!r}])\nprint('rc', rc)"],
        tmp_path,
    )
    text = "".join(o.get("text", "") for o in outputs[0] if o.get("output_type") == "stream")
    errors = [o for o in outputs[0] if o.get("output_type") == "error"]
    assert not errors, errors
    assert "rc 0" in text, text
    assert "goodput" in text.lower(), text


@pytest.mark.subprocess
def test_analysis_api_in_a_kernel(tmp_path: Path) -> None:
    """analysis.open in Jupyter: the job renders as an HTML summary, ranks() as a DataFrame table."""
    pytest.importorskip("pandas")
    script = write_job(tmp_path / "job", Script())
    outputs = run_notebook(
        [
            f"from traintrace import analysis\njob = analysis.open({str(tmp_path / 'job')!r})\njob",
            "job.ranks()",
            "print(job.summary().steps_completed, job.errors().first_error['rank'])",
        ],
        tmp_path,
    )
    for cell in outputs:
        assert not [o for o in cell if o.get("output_type") == "error"], cell
    summary_html = outputs[0][0]["data"]["text/html"]
    assert "goodput" in summary_html and "<table>" in summary_html
    ranks_html = outputs[1][0]["data"]["text/html"]
    assert "straggler" in ranks_html and "<table" in ranks_html
    printed = "".join(o.get("text", "") for o in outputs[2])
    assert printed.split()[1] == str(script.fail_rank)
