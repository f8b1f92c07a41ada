"""Every link into notebooks/GLOSSARY.md lands at its term in JupyterLab and on GitHub.

The two renderers name a Markdown heading differently, and each finds a link's fragment its own way:

* JupyterLab 4.6 (``@jupyterlab/rendermime``, ``Private.createHeaderId``) gives a heading the id
  ``heading.textContent.replace(/ /g, '-')``: case and punctuation kept (its sanitizer stores it as
  ``data-jupyter-id``). A link ``GLOSSARY.md#X`` opens the file in Markdown Preview and scrolls to the
  heading ``h3[data-jupyter-id="X"]``: an exact, case-sensitive match. A link to an ``<a id=...>``
  does not scroll (seen in the browser), so only headings can be targets.
* GitHub (github-slugger) lowercases the text, drops every character that is not a letter, digit,
  mark, ``_``, ``-`` or space, and turns spaces into ``-``; a repeated slug gets ``-1``, ``-2``.
  Its page script lowercases a link's fragment before looking for the ``user-content-`` anchor, so
  ``#KV-cache`` finds ``kv-cache`` (anchors are case-insensitive on GitHub).

So a fragment works in both when it is a heading's JupyterLab id and, lowercased, that heading's
GitHub slug: headings hold letters, digits, spaces, ``-`` and ``_`` only. Colab renders a notebook's
Markdown itself and opens a relative link against its own address; that is not checked here (README).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GLOSSARY = ROOT / "notebooks" / "GLOSSARY.md"
NOTEBOOK_DIRS = ("notebooks", "solutions", "exercises")
LINK = re.compile(r"\]\(([^)#\s]*GLOSSARY\.md)(?:#([^)\s]*))?\)")  # [text](../GLOSSARY.md#Term) -> path, fragment


def rendered_text(heading: str) -> str:
    """A heading's Markdown as the browser's textContent: code spans, emphasis and links unwrapped."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"(\*\*|__|\*)(.+?)\1", r"\2", text)
    return text.strip()


def jupyterlab_id(heading: str) -> str:
    """JupyterLab 4.6's id for a heading: its text content with every space replaced by '-'."""
    return rendered_text(heading).replace(" ", "-")


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading (github-slugger, without the -1, -2 of repeats): lowercase,
    punctuation other than '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", rendered_text(heading).lower()).replace(" ", "-")


def headings(markdown: str) -> list[str]:
    """The Markdown headings' texts, outside fenced code."""
    out, fenced = [], False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.+?)\s*#*\s*$", line)):
            out.append(m.group(1))
    return out


def glossary_links() -> list[tuple[str, str]]:
    """(where, fragment) for every link to the glossary: from the notebooks' Markdown cells (lectures,
    solutions, exercises) and from the glossary's own index and cross-references."""
    links = []
    for folder in NOTEBOOK_DIRS:
        for path in sorted((ROOT / folder).rglob("*.ipynb")):  # lessons, their answers, deep dives
            if ".ipynb_checkpoints" in path.parts:
                continue
            cells = json.loads(path.read_text())["cells"]
            for i, cell in enumerate(cells):
                if cell["cell_type"] != "markdown":
                    continue
                for target, fragment in LINK.findall("".join(cell["source"])):
                    where = f"{path.relative_to(ROOT)} cell {i}"
                    assert (path.parent / target).resolve() == GLOSSARY, f"{where}: {target} is not the glossary"
                    links.append((where, fragment))
    for fragment in re.findall(r"\]\(#([^)\s]+)\)", GLOSSARY.read_text()):
        links.append(("GLOSSARY.md", fragment))
    return links


def test_the_two_slug_functions_agree_with_what_each_renderer_was_seen_to_do():
    # JupyterLab 4.6 in Chromium gave the old heading "GQA, MQA, MHA" the id "GQA,-MQA,-MHA" (the
    # browser run of this issue); GitHub's anchor for it was "gqa-mqa-mha".
    assert jupyterlab_id("GQA, MQA, MHA") == "GQA,-MQA,-MHA"
    assert github_slug("GQA, MQA, MHA") == "gqa-mqa-mha"
    assert jupyterlab_id("`head_dim`") == github_slug("head_dim") == "head_dim"
    assert jupyterlab_id("Reserved-but-unused") == "Reserved-but-unused"
    assert github_slug("Reserved-but-unused") == "reserved-but-unused"


def test_every_glossary_heading_has_one_id_both_renderers_find():
    terms = headings(GLOSSARY.read_text())
    assert len(terms) > 30
    for h in terms:
        assert jupyterlab_id(h).lower() == github_slug(h), (
            f"heading {h!r}: JupyterLab's id {jupyterlab_id(h)!r} and GitHub's {github_slug(h)!r} differ by more "
            "than case; use letters, digits, spaces, '-' and '_' only")
    ids = [jupyterlab_id(h).lower() for h in terms]
    assert len(ids) == len(set(ids)), "two headings share an anchor: GitHub would number the second"
    assert "<a id" not in GLOSSARY.read_text(), "JupyterLab strips <a id=...>: link to a heading instead"


def test_every_link_into_the_glossary_lands_at_a_term_in_both_renderers():
    terms = headings(GLOSSARY.read_text())
    lab_ids = {jupyterlab_id(h) for h in terms}
    github = {github_slug(h) for h in terms}
    links = glossary_links()
    from_notebooks = [link for link in links if link[0] != "GLOSSARY.md"]
    assert len(from_notebooks) >= 16 and len(links) - len(from_notebooks) >= 30, (len(from_notebooks), len(links))
    for where, fragment in links:
        if not fragment:
            continue  # the glossary's top: fine anywhere
        assert fragment in lab_ids, f"{where}: #{fragment} is no heading id in JupyterLab (ids: {sorted(lab_ids)})"
        assert fragment.lower() in github, f"{where}: #{fragment} is no heading anchor on GitHub"


def test_the_glossary_index_links_every_term():
    text = GLOSSARY.read_text()
    linked = set(re.findall(r"\]\(#([^)\s]+)\)", text.split("\n## ", 1)[0]))
    terms = {jupyterlab_id(h) for h in headings(text) if not h.startswith("Glossary")}
    sections = {jupyterlab_id(h) for h in re.findall(r"^## (.+)$", text, re.M)}
    assert terms - sections - linked == set(), "terms missing from the index at the glossary's top"


def test_markdown_files_open_rendered_in_make_lab():
    """`make lab` points JUPYTER_CONFIG_PATH at .jupyter/, whose overrides make a double-click on a
    .md file (the glossary) open Markdown Preview instead of the text editor."""
    makefile = (ROOT / "Makefile").read_text()
    assert 'JUPYTER_CONFIG_PATH="$(CURDIR)/.jupyter' in makefile
    overrides = json.loads((ROOT / ".jupyter" / "labconfig" / "default_setting_overrides.json").read_text())
    assert overrides["@jupyterlab/docmanager-extension:plugin"]["defaultViewers"]["markdown"] == "Markdown Preview"
