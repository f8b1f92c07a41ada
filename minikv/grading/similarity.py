"""Is a submission minikv's own module, pasted in? A MOSS-style comparison of token streams.

Delegation (`minikv.grading.delegation`) catches code that *calls* minikv's answer; it cannot see
code that *is* minikv's answer, copied into a cell (``inspect.getsource(minikv.prefix)`` printed and
pasted, names changed). This module compares what the two say, not how they are spelled, the way
MOSS does (Schleimer, Wilkerson and Aiken, "Winnowing", SIGMOD 2003):

* each source becomes a stream of tokens with every name, string and number replaced by its kind
  (``N``, ``S``, ``0``) and comments, docstrings and layout dropped, so renaming, reformatting and
  re-commenting change nothing;
* the stream is cut into overlapping runs of `K` tokens, each hashed: a source's *fingerprints*;
* `overlap(submission, original)` is the share of the original's fingerprints found in the submission.

Two independent answers to the same exercise share short idioms (``for N in N(N):``) but few runs of
`K` tokens; a paste shares most of them, whatever it renamed.
"""

from __future__ import annotations

import io
import keyword
import tokenize

K = 25  # tokens per run: long enough that idioms two authors write alike rarely fill a whole run

_SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER,
         tokenize.ENCODING}


def normalized_tokens(source: str) -> list[str]:
    """The tokens of `source` with names, strings and numbers replaced by their kind; a string that
    stands alone as a statement (a docstring) dropped. Lines that do not tokenize are skipped."""
    out: list[str] = []
    for line_block in _blocks(source):
        try:
            tokens = list(tokenize.generate_tokens(io.StringIO(line_block).readline))
        except (tokenize.TokenError, IndentationError, SyntaxError):
            continue
        previous = tokenize.NEWLINE
        for tok in tokens:
            if tok.type in _SKIP:
                if tok.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
                    previous = tokenize.NEWLINE
                continue
            if tok.type == tokenize.STRING and previous == tokenize.NEWLINE:
                continue  # a docstring or a bare string statement: prose, not code
            previous = tok.type
            if tok.type == tokenize.NAME:
                out.append(tok.string if keyword.iskeyword(tok.string) else "N")
            elif tok.type == tokenize.STRING or tok.type == getattr(tokenize, "FSTRING_START", -1):
                out.append("S")
            elif tok.type == tokenize.NUMBER:
                out.append("0")
            else:
                out.append(tok.string)
    return out


def _blocks(source: str) -> list[str]:
    """`source` whole, or (if it does not tokenize, as a notebook's magic lines do not) line by line."""
    try:
        list(tokenize.generate_tokens(io.StringIO(source).readline))
        return [source]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return [ln + "\n" for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!"))]


def fingerprints(source: str, k: int = K) -> set[int]:
    tokens = normalized_tokens(source)
    return {hash(tuple(tokens[i:i + k])) for i in range(len(tokens) - k + 1)}


def overlap(submission: str, original: str, k: int = K) -> float:
    """The share (0-1) of `original`'s fingerprints that `submission` also has."""
    theirs = fingerprints(original, k)
    return len(theirs & fingerprints(submission, k)) / len(theirs) if theirs else 0.0
