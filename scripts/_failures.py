"""Repeats the failures of scripts/test's passes at the end of its output, one paragraph each.

    python scripts/_failures.py RESULTS.xml...

Each argument is a pass's JUnit XML (pytest --junitxml), named after the pass. For every test that failed or
errored: the pass, the test's id, the exception's message (an assertion's values) and the line that raised it. A
log cut to its last lines, as CI's is, then still says what failed in every pass and why.
"""

from __future__ import annotations

import sys
from pathlib import Path
from xml.etree import ElementTree

MESSAGE_CHARS = 1500


def failures(path: Path) -> list[str]:
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError) as exc:
        return [f"{path.stem}: no results ({exc})"]
    out = []
    for case in root.iter("testcase"):
        for problem in (*case.findall("failure"), *case.findall("error")):
            test = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name', '')}"
            message = (problem.get("message") or "").strip()[:MESSAGE_CHARS]
            report = [line for line in (problem.text or "").splitlines() if line.strip()]
            where = report[-1:] if report else []  # the line that raised: path:line: exception type
            lines = ["  " + line for line in message.splitlines()]
            out.append("\n".join([f"{path.stem} pass: {problem.tag} {test}", *lines, *("  at " + w for w in where)]))
    return out


def main(paths: list[str]) -> int:
    found = [text for path in paths for text in failures(Path(path))]
    if found:
        print("\n== what failed, pass by pass", file=sys.stderr)
        for text in found:
            print(text + "\n", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
