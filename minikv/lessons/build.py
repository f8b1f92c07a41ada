"""Lessons generated from their answers: ``notebooks/answers/NN_*.ipynb`` -> ``notebooks/NN_*.ipynb``.

The answers source is the one place a lesson is written. Its `your-turn` cells hold the course's answer
between ``### BEGIN SOLUTION`` / ``### END SOLUTION``; the lesson a learner opens has each such region
replaced by the same ``NotImplementedError("not implemented yet: ...")`` stub the exercises get (the
``# hint:`` lines become its message), outputs cleared, and its relative links rebased from
``notebooks/answers/`` to ``notebooks/``. The checkpoint after each `your-turn` cell then falls back to the
course's version, so the shipped lesson runs top to bottom; the answers copy runs with every checkpoint
passing. nbval runs both.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

import nbformat

from minikv.grading.grader import strip_notebook

REPO = Path(__file__).resolve().parents[2]
ANSWERS = "answers"   # notebooks/answers/: the lessons' source, answers in
DEEP = "deep"         # notebooks/deep/: the deep dives beside the lessons (not generated)
LINK = re.compile(r"(\]\()([^)\s#]+)((?:#[^)\s]*)?\))")


def rebase_links(markdown: str) -> str:
    """Relative links written from notebooks/answers/ rewritten for notebooks/ (URLs and anchors untouched);
    the Colab badge opens the lesson, not its answers."""
    def rebase(m: re.Match) -> str:
        target = m.group(2)
        if "://" in target or target.startswith(("/", "mailto:")):
            return m.group(0)
        return m.group(1) + posixpath.normpath(posixpath.join(ANSWERS, target)) + m.group(3)

    return LINK.sub(rebase, markdown).replace(f"/notebooks/{ANSWERS}/", "/notebooks/")


def make_lesson(answers_nb):
    """The lesson a learner opens, generated from its answers source (the exercises' stripper, links rebased)."""
    return strip_notebook(answers_nb, rebase_links,
                          f"notebooks/{ANSWERS}/ (edit that copy, then run `make exercises` to regenerate this one)")


def lesson_sources(root: Path = REPO) -> list[Path]:
    return sorted((root / "notebooks" / ANSWERS).glob("*.ipynb"))


def lesson_path(source: Path) -> Path:
    return source.parent.parent / source.name


def generate_lessons(root: Path = REPO, check: bool = False) -> list[Path]:
    """Write each lesson from its answers source. With check=True write nothing; return the stale lessons."""
    stale = []
    for source in lesson_sources(root):
        target = lesson_path(source)
        text = nbformat.writes(make_lesson(nbformat.read(str(source), as_version=4))) + "\n"
        if not target.exists() or target.read_text() != text:
            stale.append(target)
            if not check:
                target.write_text(text)
    return stale


__all__ = ["generate_lessons", "make_lesson", "rebase_links", "lesson_sources", "lesson_path"]
