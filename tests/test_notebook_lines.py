"""Notebook code stays on screen: no code line in notebooks/, solutions/ or exercises/ is cut off in JupyterLab.

At a 1,400 px window with the file browser open, JupyterLab 4.6 shows about 120 characters of a
code line (issue 19's browser run); longer lines run off the cell's right edge. A long hint is written
over several `# hint:` lines, and the exercise generator wraps the stub it makes of them (at 100
characters), so the generated exercises are checked too: they are what a learner opens first.
"""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_CODE_LINE = 120
NOTEBOOKS = [path for folder in ("notebooks", "solutions", "exercises")  # lessons, answers and deep dives too
             for path in sorted((ROOT / folder).rglob("*.ipynb")) if ".ipynb_checkpoints" not in path.parts]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_lines_fit_the_notebook_width(path):
    long = []
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        if cell["cell_type"] != "code":
            continue
        for line in "".join(cell["source"]).splitlines():
            if len(line) > MAX_CODE_LINE:
                long.append(f"cell {i}: {len(line)} chars: {line.strip()[:60]}...")
    assert not long, f"{path.name}: code lines over {MAX_CODE_LINE} characters:\n" + "\n".join(long)
