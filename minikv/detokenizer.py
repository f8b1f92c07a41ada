"""Token ids to text, one token at a time, and the stop strings that text may contain.

Every sample of every request has one `IncrementalDetokenizer` (the output processor,
`minikv.outputs`, keeps them). It turns the sample's new token ids into new text, finds a stop
string the moment the text contains one, and hands out only the text that is safe to show.

Decoding one token alone is wrong for most tokenizers: a token's leading space, or a character
split over several byte-level tokens, depends on its neighbours. So, as vLLM and Hugging Face's
``TextStreamer`` do, the detokenizer keeps two offsets into its token ids:

* ``prefix``: where the decoded window starts (a few tokens back, for context);
* ``read``: the first token whose text is not yet in ``text``.

The new text is ``decode(ids[prefix:]) - decode(ids[prefix:read])``. While the window ends in
an incomplete character (U+FFFD) nothing is added: the next token completes it.

A request with ``stop=["\\n\\n"]`` must finish the moment its text contains the stop string, and
its text must end just before it. So the last ``len(longest stop) - 1`` characters are *held
back* while the sample runs (they may be the start of a stop string), and released when it
finishes without one. Offline and streamed text are the same deltas, so they agree by construction.
"""

from __future__ import annotations

# How many prompt tokens back the first window starts, so the first output token's leading space is right.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT = "\ufffd"  # what decode gives for the bytes of a character that is not complete yet


class IncrementalDetokenizer:
    """One sample's text: ``push(ids)`` after each step, ``take(finished)`` for the text to show.

    With no tokenizer there is no text at all (token ids only), and no stop strings.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = list(stop or [])
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        # a little left context: the first output token's leading space
        self.ids = list(prompt_ids[max(len(prompt_ids) - PROMPT_CONTEXT_TOKENS, 0):])
        self.prefix = 0
        self.read = len(self.ids)
        self.text = ""          # the sample's text so far (cut just before a stop string once one is found)
        self.sent = 0           # characters of `text` already handed out by `take`
        self.stopped = False    # a stop string was found: `text` is final

    def push(self, token_ids: list[int]) -> bool:
        """Add new tokens; True when their text completes a stop string (`text` is then cut before it)."""
        if self.tokenizer is None or self.stopped:
            return False
        self.ids += token_ids
        old_len = len(self.text)
        if not self._extend(final=False) or not self.stop:
            return False
        # A stop string can only end in the new text: search from where it could start.
        start = max(0, old_len - self.hold)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
        return self.stopped

    def take(self, finished: bool) -> str:
        """The text not handed out yet. While the sample runs, the last characters that could begin a
        stop string stay back; once it finished, everything goes, incomplete characters included."""
        if finished and not self.stopped and self.tokenizer is not None and self.read < len(self.ids):
            self._extend(final=True)
        end = len(self.text) if finished or self.stopped else max(self.sent, len(self.text) - self.hold)
        delta, self.sent = self.text[self.sent:end], end
        return delta

    def _extend(self, final: bool) -> bool:
        """Append the text of tokens read.. to `text`; False (nothing done) while it ends in an incomplete
        character or adds nothing, unless `final`."""
        ids = self.ids
        before = self.tokenizer.decode(ids[self.prefix:self.read], skip_special_tokens=True)
        now = self.tokenizer.decode(ids[self.prefix:], skip_special_tokens=True)
        if not final and (len(now) <= len(before) or now.endswith(REPLACEMENT)):
            return False   # wait for the next token
        self.text += now[len(before):]
        self.prefix, self.read = (self.prefix, len(ids)) if final else (self.read, len(ids))
        return True
