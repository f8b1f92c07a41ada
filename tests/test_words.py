"""One meaning per word: *preemption* is a running request losing its blocks (recompute or swap); *eviction* is a
cached free block being reused for someone else (stage 5's LRU). A notebook, the glossary or the landlord's page
that says "evicted" for a preempted request teaches the two as one, so this test fails on it.

The rule, checked on every unit of text a learner reads: a Markdown sentence (list items, table rows, headings and
the glossary's index entries are units of their own), a code comment, a code string of three words or more (labels
and keys are not prose; an f-string's `{...}` fields are code), a line of the landlord's page. A unit that *uses* a
word of the evict* family must

1. have a cached free block in view: its paragraph (for Markdown; a heading is a paragraph of its own), or the unit
   itself, names one (cache, cached, prefix, LRU, least recently used, free block, hit, hash, evictable, the
   eviction curve, or the block manager that evicts), and
2. not speak of a preemption in the same unit (preempt*, victim*), which is where "evict" stands for "preempt".

A word *mentioned* rather than used is left out first: text in `code`, in *single asterisks* (italics), or in
quotation marks ("latency wobbles are often evictions" is a rule of thumb quoted, then said in the course's words).
"""

from __future__ import annotations

import io
import json
import re
import tokenize
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EVICT = re.compile(r"evict", re.I)
CACHE = re.compile(r"cach|prefix|\bLRU\b|least[- ]recently[- ]used|free blocks?|\bhits?\b|hit rate|hash|evictable|"
                   r"eviction[- _]curve|block ?manager|allocator", re.I)
PREEMPT = re.compile(r"preempt|victim", re.I)
MENTION = re.compile(r"`[^`\n]*`|(?<![*\w])\*(?!\*)[^*\n]+?(?<!\*)\*(?![*\w])|\"[^\"\n]*\"|“[^”\n]*”")
BLOCK_START = re.compile(r"\n(?=[ \t]*(?:[-*+] |\d+\. |\||#))")


def problem(unit: str, context: str = "") -> str | None:
    """What is wrong with one unit of text (in its paragraph, `context`), or None."""
    used = MENTION.sub(" ", unit)
    if not EVICT.search(used):
        return None
    if not CACHE.search(context or unit):
        return "evict* with no cached free block in view (a running request losing its blocks is 'preempted')"
    if PREEMPT.search(used):
        return "evict* beside a preemption: say 'preempt' for a running request losing its blocks"
    return None


def paragraphs(text: str) -> list[str]:
    """Blocks between blank lines, each heading line a block of its own."""
    out = []
    for block in re.split(r"\n[ \t]*\n", text):
        lines: list[str] = []
        for line in block.splitlines():
            if line.lstrip().startswith("#"):
                out += ["\n".join(lines), line] if lines else [line]
                lines = []
            else:
                lines.append(line)
        out.append("\n".join(lines))
    return [p for p in out if p.strip()]


def markdown_units(text: str) -> list[tuple[str, str]]:
    """(sentence, its paragraph) pairs."""
    units = []
    for para in paragraphs(text):
        for part in BLOCK_START.split(para):
            for piece in re.split(r" · |<br>", " ".join(part.split())):
                units += [(u, para) for u in re.split(r"(?<=[.!?])\s+(?=[A-Z(\[*\"`])", piece) if u.strip()]
    return units


def code_units(source: str) -> list[str]:
    """Comments and prose strings (three words or more, f-string fields taken out) of a code cell."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return [m.group(1) for m in re.finditer(r"#(.*)$", source, re.M)]
    lines, units = source.splitlines(keepends=True), []

    def string(literal: str) -> None:
        text = re.sub(r"^[rbufRBUF]*('\'\'|\"\"\"|'|\")|('\'\'|\"\"\"|'|\")$", "", literal)
        if re.match(r"^[rbuRBU]*[fF]", literal):
            text = re.sub(r"\{[^{}]*\}", " ", text)
        if len(text.split()) >= 3:
            units.append(text)

    def between(start, end) -> str:
        (r0, c0), (r1, c1) = start, end
        return lines[r0 - 1][c0:c1] if r0 == r1 else lines[r0 - 1][c0:] + "".join(lines[r0:r1 - 1]) + lines[r1 - 1][:c1]

    # Python 3.12 tokenizes an f-string in pieces (FSTRING_START ... FSTRING_END, PEP 701): take its whole text.
    f_start, f_end = getattr(tokenize, "FSTRING_START", -1), getattr(tokenize, "FSTRING_END", -1)
    depth, opened = 0, None
    for tok in tokens:
        if tok.type == f_start:
            opened = tok.start if depth == 0 else opened
            depth += 1
        elif tok.type == f_end:
            depth -= 1
            if depth == 0:
                string(between(opened, tok.end))
        elif depth:
            continue
        elif tok.type == tokenize.COMMENT:
            units.append(tok.string.lstrip("#"))
        elif tok.type == tokenize.STRING:
            string(tok.string)
    return units


def notebook_units(path: Path) -> list[tuple[str, str]]:
    out = []
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        source = "".join(cell["source"])
        units = markdown_units(source) if cell["cell_type"] == "markdown" else [(u, u) for u in code_units(source)]
        out += [(f"cell {i}", u, context) for u, context in units]
    return out


class _Text(HTMLParser):
    """The page's visible text and its script, line by line (styles left out)."""

    def __init__(self):
        super().__init__()
        self.lines, self._skip = [], False

    def handle_starttag(self, tag, attrs):
        self._skip = tag == "style"

    def handle_endtag(self, tag):
        self._skip = False

    def handle_data(self, data):
        if not self._skip:
            self.lines += [line.strip() for line in data.splitlines() if line.strip()]


def page_units(path: Path) -> list[tuple[str, str]]:
    parser = _Text()
    parser.feed(path.read_text())
    return [("page", line, line) for line in parser.lines]


def texts() -> list[Path]:
    found = [p for folder in ("notebooks", "solutions", "exercises") for p in sorted((ROOT / folder).rglob("*.ipynb"))
             if ".ipynb_checkpoints" not in p.parts]
    return found + [ROOT / "notebooks" / "GLOSSARY.md", ROOT / "minikv" / "server" / "landlord.html"]


def units_of(path: Path) -> list[tuple[str, str]]:
    if path.suffix == ".ipynb":
        return notebook_units(path)
    if path.suffix == ".html":
        return page_units(path)
    return [("text", u, context) for u, context in markdown_units(path.read_text())]


@pytest.mark.parametrize("path", texts(), ids=lambda p: str(p.relative_to(ROOT)))
def test_evict_means_a_cached_block_and_preempt_a_running_request(path):
    bad = [f"{where}: {why}: {unit[:160]!r}" for where, unit, context in units_of(path)
           if (why := problem(unit, context))]
    assert not bad, f"{path.relative_to(ROOT)} says evict* for something else:\n" + "\n".join(bad)


@pytest.mark.parametrize("unit, ok", [
    ("Reusing such a block for someone else is an **eviction** "
     "([least recently used first](GLOSSARY.md#LRU-eviction)).", True),
    ("LRU evicts the cached histories before they are asked for again.", True),
    ("A landlord would say *evicted*; in this course the request is preempted.", True),
    ('The rule of thumb "latency wobbles are often evictions" is about preemption.', True),
    ("Who is being evicted?", False),
    ("the victims' gap: each evicted request waits and is recomputed", False),
    ("a step that evicted", False),
    ("the newest tenant is evicted to free cached blocks for the others, then preempted again", False),
])
def test_the_rule_on_examples(unit, ok):
    assert (problem(unit) is None) == ok, problem(unit)


def test_code_units_are_comments_and_prose_strings():
    src = ('x = table["evicts", c]  # the preempting pool\n'
           'print(f"{n} evictions of cached blocks, {k} {\'evictions\':>8}")\n')
    assert code_units(src) == [" the preempting pool", "  evictions of cached blocks,    "]
