"""What a client gets back: OpenAI's response and chunk objects, built from a request's choices.

A choice is the handler's view of one sample: a `minikv.outputs.CompletionOutput`, the sum of the
deltas the engine's output processor made for it (token ids, text with any stop string already
cut, finish reason), exactly what `LLM.generate` returns. `minikv` is our extra field, on a
response and on the last chunk of a stream: how the request fared inside the engine (preemptions,
prefix-cache hits, queueing, TTFT), which a client cannot see otherwise; the load generator reads
it to find the preempted tenants.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from minikv.outputs import CompletionOutput as Choice


def usage(info: dict | None, choices: list[Choice], prompt_len: int) -> dict:
    completion = sum(len(c.token_ids) for c in choices)
    cached = (info or {}).get("cached_tokens", 0)
    return {"prompt_tokens": prompt_len, "completion_tokens": completion, "total_tokens": prompt_len + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def extra(info: dict | None) -> dict:
    """The `minikv` field: per-request engine facts (preemptions, cached tokens, queue and first-token times)."""
    return dict(info or {})


@dataclass
class Envelope:
    """The fields every object of one request shares."""
    id: str
    model: str
    chat: bool
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_token_ids: list[int] | None = None   # echoed when return_token_ids (vLLM's extra)

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, choice: Choice, delta: str, finish_reason: str | None, token_ids: list[int] | None = None,
              role: bool = False) -> dict:
        if self.chat:
            d = {"role": "assistant", "content": ""} if role else {"content": delta}
            c = {"index": choice.index, "delta": d, "logprobs": None, "finish_reason": finish_reason}
            out = self._head("chat.completion.chunk")
        else:
            c = {"index": choice.index, "text": delta, "logprobs": None, "finish_reason": finish_reason,
                 "stop_reason": None}
            out = self._head("text_completion")
        if token_ids is not None:
            c["token_ids"] = token_ids
        out["choices"] = [c]
        return out

    def usage_chunk(self, usage_: dict) -> dict:
        return self._head("chat.completion.chunk" if self.chat else "text_completion") | {"choices": [],
                                                                                          "usage": usage_}

    def response(self, choices: list[Choice], usage_: dict, info: dict | None, token_ids: bool) -> dict:
        out = self._head("chat.completion" if self.chat else "text_completion")
        rows = []
        for c in choices:
            if self.chat:
                row = {"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                       "finish_reason": c.finish_reason}
            else:
                row = {"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason,
                       "stop_reason": None}
            if token_ids:
                row["token_ids"] = c.token_ids
            rows.append(row)
        out |= {"choices": rows, "usage": usage_, "minikv": extra(info)}
        if token_ids:
            out["prompt_token_ids"] = self.prompt_token_ids
        return out


def sse(obj: dict | str) -> str:
    """One server-sent event: ``data: {json}`` and a blank line."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"
