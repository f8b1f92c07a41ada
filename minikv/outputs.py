"""The one door out: what each step gave each sample, as token ids, text and a finish reason.

vLLM v1 draws an *output processor* after the engine core: the core only appends token ids;
the processor turns them into text and user-facing outputs. minikv's `OutputProcessor` keeps one
`IncrementalDetokenizer` per sample (`minikv.detokenizer`), tells the engine when a sample's text
completes a stop string, and after each step turns every changed request into

* ``RequestOutput.deltas``: what each sample gained *in this step* (new ids, new text, a finish
  reason once it has one). The server streams these as they are;
* ``RequestOutput.outputs``: the running total of those same deltas, one `CompletionOutput` per
  sample. ``LLM.generate`` returns these.

Because the total is the sum of the deltas, offline text and streamed text are equal by
construction, for stop strings that straddle tokens, characters split over tokens, and n > 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minikv.detokenizer import IncrementalDetokenizer
from minikv.metrics import RequestMetrics
from minikv.sequence import Request, Sequence


@dataclass
class SampleDelta:
    """What one sample gained in one step: new token ids, new text, and its finish reason once it has one."""
    index: int
    token_ids: list[int]
    text: str = ""
    finish_reason: str | None = None


@dataclass
class CompletionOutput:
    """One sample of a request: every delta so far, added up."""
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None

    def add(self, delta: SampleDelta) -> None:
        self.token_ids += delta.token_ids
        self.text += delta.text
        self.finish_reason = self.finish_reason or delta.finish_reason


@dataclass
class RequestOutput:
    """A request's prompt, its samples so far and this step's deltas; the same object is updated as it runs."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    outputs: list[CompletionOutput] = field(default_factory=list)
    deltas: list[SampleDelta] = field(default_factory=list)   # the last step's (or the abort's) only
    finished: bool = False


@dataclass
class _Sample:
    detok: IncrementalDetokenizer
    sent: int = 0          # output token ids already in a delta
    done: bool = False     # its finish reason went out


class OutputProcessor:
    """Text and deltas for the engine's requests; `tokenizer` None gives token ids and no text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._samples: dict[str, dict[int, _Sample]] = {}

    def add(self, req: Request) -> RequestOutput:
        """A new request: its (empty) output, updated by every later `emit`."""
        self._samples[req.request_id] = {}
        req.output = RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, req.metrics,
                                   outputs=[CompletionOutput(0)])
        return req.output

    def _sample(self, seq: Sequence) -> _Sample:
        samples = self._samples[seq.request.request_id]
        if seq.index not in samples:   # a new sample: index 0 at add, the others when the request forks
            samples[seq.index] = _Sample(IncrementalDetokenizer(self.tokenizer, seq.request.prompt_token_ids,
                                                                seq.request.params.stop))
        return samples[seq.index]

    def append(self, seq: Sequence, token_id: int) -> bool:
        """A sequence gained a token: True when its text now holds a stop string (it must stop)."""
        return self._sample(seq).detok.push([token_id])

    def emit(self, req: Request) -> RequestOutput:
        """Turn what the request's samples gained since the last call into deltas, and add them up.

        A finished request (an abort before its prompt forked into n samples included) gets a
        finish reason for every one of its n samples; its bookkeeping here ends."""
        out: RequestOutput = req.output
        out.deltas = []
        if req.request_id not in self._samples:   # emitted its end already
            return out
        for seq in req.seqs:
            s = self._sample(seq)
            if s.done:
                continue
            ids = seq.output_token_ids[s.sent:]
            reason = seq.finish_reason
            text = s.detok.take(finished=reason is not None)
            if ids or text or reason:
                out.deltas.append(SampleDelta(seq.index, list(ids), text, reason))
            s.sent += len(ids)
            s.done = reason is not None
        out.finished = req.finished
        if out.finished:
            present = {seq.index for seq in req.seqs}
            out.deltas += [SampleDelta(i, [], "", "abort") for i in range(req.params.n) if i not in present]
            self._samples.pop(req.request_id, None)
        for d in out.deltas:
            while len(out.outputs) <= d.index:
                out.outputs.append(CompletionOutput(len(out.outputs)))
            out.outputs[d.index].add(d)
        return out
