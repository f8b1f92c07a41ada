"""Token ids to text, one token at a time, and the stop strings that text may contain.

A request with ``stop=["\\n\\n"]`` must finish the moment its text contains the stop string, and
its text must end just before it. The engine sees tokens, not text, so after every new token the
`Detokenizer` extends the sequence's text by what that token added, looks for a stop string in
the new part, and on a hit cuts the text there.

Decoding one token alone is wrong for most tokenizers: a token's leading space, or a character
split over several byte-level tokens, depends on its neighbours. So, as vLLM and Hugging Face's
``TextStreamer`` do, each sequence keeps two offsets into its token ids:

* ``prefix_offset``: where the decoded window starts (a few tokens back, for context);
* ``read_offset``: the first token whose text is not yet in ``seq.text``.

The new text is ``decode(ids[prefix_offset:]) - decode(ids[prefix_offset:read_offset])``. While
the window ends in an incomplete character (U+FFFD) nothing is emitted: the next token completes it.

Only requests with stop strings are detokenized step by step (the others decode their output
once, when asked for it: `output_text`). The state lives on the `Sequence` (``text``,
``prefix_offset``, ``read_offset``), so a sequence can be preempted and resumed without losing it.
"""

from __future__ import annotations

from minikv.sequence import Sequence

# How many prompt tokens back the first window starts, so the first output token's leading space is right.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT = "\ufffd"  # what decode gives for the bytes of a character that is not complete yet


def text_delta(tokenizer, ids: list[int], prefix: int, read: int, final: bool) -> str | None:
    """The text that ``ids[read:]`` add to the window ``ids[prefix:read]``; None while that text ends
    in an incomplete character (or adds nothing), unless `final`: wait for the next token."""
    before = tokenizer.decode(ids[prefix:read], skip_special_tokens=True)
    now = tokenizer.decode(ids[prefix:], skip_special_tokens=True)
    if not final and (len(now) <= len(before) or now.endswith(REPLACEMENT)):
        return None
    return now[len(before):]


class Detokenizer:
    """Incremental text and stop strings for the sequences of one tokenizer (None: no text at all)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def start(self, seq: Sequence) -> None:
        """Set up a new sequence: its text is empty, its first output token is the next to decode."""
        seq.prefix_offset = max(seq.num_prompt_tokens - PROMPT_CONTEXT_TOKENS, 0)
        seq.read_offset = seq.num_prompt_tokens

    def step(self, seq: Sequence) -> bool:
        """Add the newest token's text to ``seq.text``; True if that text completes a stop string
        (``seq.text`` is then cut just before the earliest stop string in it)."""
        stops = seq.request.params.stop
        old_len = len(seq.text)
        if not self._extend(seq, final=False):
            return False
        # A stop string can only end in the new text: search from where it could start.
        start = max(0, old_len - max(len(s) for s in stops) + 1)
        hits = [i for i in (seq.text.find(s, start) for s in stops) if i >= 0]
        if hits:
            seq.text = seq.text[:min(hits)]
            return True
        return False

    def flush(self, seq: Sequence) -> None:
        """The sequence finished without a stop string: emit whatever text is still pending."""
        if seq.read_offset < len(seq.token_ids):
            self._extend(seq, final=True)

    def output_text(self, seq: Sequence) -> str:
        """The sequence's output as text: the incremental text when it has stop strings (cut at the
        stop string), else its output tokens decoded at once."""
        if self.tokenizer is None:
            return ""
        if seq.request.params.stop:
            return seq.text
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)

    def _extend(self, seq: Sequence, final: bool) -> bool:
        """Append the text of tokens read_offset.. to seq.text; False (nothing done) while it ends
        in an incomplete character, unless `final`."""
        ids = seq.token_ids
        delta = text_delta(self.tokenizer, ids, seq.prefix_offset, seq.read_offset, final)
        if delta is None:   # wait for more tokens
            return False
        seq.text += delta
        if final:
            seq.read_offset = len(ids)
        else:
            seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        return True
