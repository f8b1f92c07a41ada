"""Incremental detokenization: token ids arrive one step at a time, text leaves as deltas.

Decoding each new token alone is wrong twice over: a byte-level BPE token can be half of a
UTF-8 character (the delta would be a replacement character), and a SentencePiece-style token
decodes differently without its left neighbour (the leading space). So, as vLLM does, decode a
short window: the text of ``ids[prefix:]`` minus the text of ``ids[prefix:read]``; emit nothing
while the window ends in an incomplete character; then slide the window forward.

The window arithmetic is the engine's own (`minikv.detokenizer.text_delta`, which cuts stop strings);
here it follows the token ids a handler receives. The streamed deltas and the non-streamed text come
from this one object, so they concatenate to the same string by construction.
"""

from __future__ import annotations

from minikv.detokenizer import PROMPT_CONTEXT_TOKENS, text_delta


class IncrementalText:
    """Text deltas for one sample: ``push(new_ids) -> str`` each step, ``flush() -> str`` at its end."""

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self.tok = tokenizer
        # a little left context: the first token's leading space
        self.ids = list(prompt_ids[max(len(prompt_ids) - PROMPT_CONTEXT_TOKENS, 0):])
        self.prefix = 0
        self.read = len(self.ids)
        self.text = ""

    def _delta(self, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        delta = text_delta(self.tok, self.ids, self.prefix, self.read, final)
        if delta is None:
            return ""                            # an incomplete character (or nothing new yet): wait
        self.prefix, self.read = self.read, len(self.ids)
        self.text += delta
        return delta

    def push(self, new_ids: list[int]) -> str:
        self.ids += new_ids
        return self._delta(final=False)

    def flush(self) -> str:
        """The sample finished: whatever is still held back, incomplete characters included."""
        return self._delta(final=True)
