"""The lesson shape, enforced: every notebook in notebooks/ is a lesson a workshop can teach.

A lesson states its goals, has at most 1,800 words of Markdown, gives the learner 2-4 `your-turn` cells
each followed by a `checkpoint`, links the deep dives that carry what it left out, and ends with
questions answered in ANSWERS.md. Lessons are generated from notebooks/answers/ (answers in); this file
checks they are in sync, that a checkpoint's message is one line whatever the learner wrote, and that
no notebook, README or `python -m minikv claims` cites a document the learner does not have.
"""

from __future__ import annotations

import io
import json
import re
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from minikv.lessons import Case, checkpoint
from minikv.lessons.build import generate_lessons, lesson_path, lesson_sources, make_lesson, rebase_links

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
MAX_WORDS = 1800
# Every stage is a lesson now (issues 41 and 42); a stage that is still a report would be named here.
NOT_YET_LESSONS: set[str] = set()
LESSONS = [p for p in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")) if p.stem not in NOT_YET_LESSONS]
DEEP_DIVES = sorted((NOTEBOOKS / "deep").glob("*.ipynb"))


def cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def text(cell: dict) -> str:
    return "".join(cell["source"])


def tags(cell: dict) -> list[str]:
    return cell.get("metadata", {}).get("tags", [])


def markdown_words(path: Path) -> int:
    return sum(len(re.findall(r"\S+", text(c))) for c in cells(path) if c["cell_type"] == "markdown")


def test_every_lesson_has_an_answers_source_and_is_in_sync():
    sources = {p.name for p in lesson_sources()}
    assert {p.name for p in LESSONS} <= sources, "a lesson without notebooks/answers/ source"
    assert not generate_lessons(check=True), "a lesson is out of date: run `make exercises`"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_lesson_shape(path):
    nb = cells(path)
    words = markdown_words(path)
    assert words <= MAX_WORDS, f"{path.name}: {words} words of Markdown; a lesson has at most {MAX_WORDS}"
    assert "**Goals**" in text(nb[0]) or "## Goals" in text(nb[0]), f"{path.name}: no goals in the first cell"
    turns = [i for i, c in enumerate(nb) if "your-turn" in tags(c)]
    assert 2 <= len(turns) <= 4, f"{path.name}: {len(turns)} your-turn cells; a lesson has 2-4"
    for i in turns:
        assert nb[i]["cell_type"] == "code", f"{path.name} [{i}]: a your-turn cell is code"
        following = next((c for c in nb[i + 1:] if c["cell_type"] == "code"), None)
        assert following is not None and "checkpoint" in tags(following), (
            f"{path.name} [{i}]: a your-turn cell must be followed by a code cell tagged `checkpoint`")
        assert "raise NotImplementedError" in text(nb[i]), f"{path.name} [{i}]: the shipped cell is a stub"
    assert any(text(c).lstrip().startswith("## Questions") for c in nb if c["cell_type"] == "markdown"), (
        f"{path.name}: no `## Questions` at the end")
    stage = path.stem.split("_")[0]
    assert re.search(rf"^## {stage} ·", (ROOT / "ANSWERS.md").read_text(), re.M), f"ANSWERS.md has no {stage}"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_lesson_links_its_deep_dives(path):
    stage = path.stem.split("_")[0]
    mine = [d for d in DEEP_DIVES if d.name.startswith(stage + "_")]
    links = set(re.findall(r"\]\((deep/[^)#\s]+)", "".join(text(c) for c in cells(path))))
    for dive in mine:
        assert f"deep/{dive.name}" in links, f"{path.name} does not link its deep dive {dive.name}"
    for link in links:
        assert (NOTEBOOKS / link).exists(), f"{path.name} links {link}, which does not exist"


@pytest.mark.parametrize("path", DEEP_DIVES, ids=lambda p: p.stem)
def test_every_deep_dive_belongs_to_a_stage(path):
    assert re.match(r"\d\d_[a-z0-9_]+\.ipynb$", path.name), f"{path.name}: deep dives are named NN_topic.ipynb"
    assert list(NOTEBOOKS.glob(path.name[:3] + "*.ipynb")), f"{path.name}: no lesson {path.name[:2]}"


# ---- citations the learner cannot follow --------------------------------------------------------------
# The course's claims came from two essays that are not in the repository: a learner reads each claim in
# the course's own words, with a public source where there is one, never "the seed" or "seed essay 000".
CITATION = re.compile(r"seed essays?|seed 00\d|\bthe seed says|\bthe seed ends|\bthe seed's\b|\bseed's "
                      r"(?:claim|numbers|own)|shared/(?:seeds|COURSE)|COURSE\.md", re.I)


def course_texts() -> list[Path]:
    found = [p for folder in ("notebooks", "solutions", "exercises") for p in sorted((ROOT / folder).rglob("*"))
             if p.suffix in (".ipynb", ".md") and ".ipynb_checkpoints" not in p.parts]
    return found + [ROOT / name for name in ("README.md", "INSTRUCTORS.md", "ANSWERS.md", "GRADING.md")]


@pytest.mark.parametrize("path", course_texts(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_citation_of_a_document_the_learner_lacks(path):
    hits = sorted(set(m.group(0) for m in CITATION.finditer(path.read_text())))
    assert not hits, f"{path.relative_to(ROOT)} cites what is not in the repository: {hits}"


def test_claims_cite_no_document_the_learner_lacks():
    from minikv.bench.claims import cli

    out = io.StringIO()
    with redirect_stdout(out):
        cli(["--markdown"])
    hits = sorted(set(m.group(0) for m in CITATION.finditer(out.getvalue())))
    assert not hits, f"`python -m minikv claims` cites what is not in the repository: {hits}"


# ---- the machinery -------------------------------------------------------------------------------------
def square(x):
    return x * x


def not_yet(x):
    raise NotImplementedError("not implemented yet: multiply x by itself")


@pytest.mark.parametrize("yours, mark", [(square, "✅"), (not_yet, "⏳"), (None, "⏳"), (lambda x: x + x, "❌"),
                                         (lambda x: 1 / 0, "❌"), (lambda: 0, "❌")],
                         ids=["right", "stub", "undefined", "wrong", "raises", "wrong-signature"])
def test_a_checkpoint_says_one_line_and_falls_back(yours, mark):
    out = io.StringIO()
    with redirect_stdout(out):
        chosen = checkpoint("squares", yours, square, [Case((3,), 9, "square, don't double"), Case((-2,), 4)])
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith(mark), lines
    assert "Traceback" not in lines[0]
    assert chosen is (yours if mark == "✅" else square)


def test_a_checkpoint_names_the_case_that_failed():
    out = io.StringIO()
    with redirect_stdout(out):
        checkpoint("squares", lambda x: x + x, square, [Case((2,), 4), Case((3,), 9, "square, don't double")])
    assert "(3) returned 6, expected 9. square, don't double" in out.getvalue()


def test_rebase_links_from_answers_to_lessons():
    md = ("[g](../GLOSSARY.md#KV-cache) [d](../deep/01_x.ipynb) [w](https://example.org/a) [a](#here) "
          "[c](https://colab.research.google.com/github/o/r/blob/main/notebooks/answers/01_bytes.ipynb)")
    assert rebase_links(md) == ("[g](GLOSSARY.md#KV-cache) [d](deep/01_x.ipynb) [w](https://example.org/a) "
                                "[a](#here) [c](https://colab.research.google.com/github/o/r/blob/main/notebooks/"
                                "01_bytes.ipynb)")


def test_a_generated_lesson_keeps_no_answer():
    import nbformat

    for source in lesson_sources():
        lesson = make_lesson(nbformat.read(str(source), as_version=4))
        assert "### BEGIN SOLUTION" not in nbformat.writes(lesson), lesson_path(source)
