"""A request and its sequences: the state the scheduler moves between queues.

A *request* is what a user sends: one prompt, one `SamplingParams`. It owns ``n`` *sequences*
(one per sample asked for): each is the prompt followed by the tokens generated so far. The
scheduler works on sequences, never on requests: a sequence is what holds KV blocks, what is
preempted, what finishes.

The one number that drives scheduling is ``num_computed``: how many of the sequence's tokens
already have their K/V in the cache. Everything after it must still be run through the model:

* a waiting prompt:        ``num_computed = 0`` (or the prefix-cache hit), all prompt tokens to go;
* mid chunked prefill:     some prompt tokens computed, the rest to go;
* decoding:                every token but the newest sampled one computed (``num_to_compute == 1``);
* preempted by recompute:  back to ``0``: prompt *and* generated tokens are prefilled again.

So prefill, chunked prefill, decode and recompute are one thing: "compute the tokens after
``num_computed``". The scheduler only decides how many of them each sequence gets this step.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from minikv.metrics import RequestMetrics
from minikv.sampling import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"      # in the waiting queue: holds no blocks
    RUNNING = "running"      # admitted: holds blocks, gets tokens computed every step it fits
    SWAPPED = "swapped"      # preempted by swap: its K/V sits in the CPU pool, no GPU blocks
    FINISHED = "finished"    # done (stop, length or abort): blocks returned


_seq_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One sample of one request: its tokens, how many are cached, and its output so far."""

    request: "Request"
    index: int                               # which of the request's n samples
    token_ids: list[int]                     # prompt + generated
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0                    # tokens whose K/V are in the cache (= bm.num_tokens)
    finish_reason: str | None = None         # "stop" | "length" | "abort"
    generator: torch.Generator | None = None  # this sample's own RNG when the request has a seed

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_to_compute(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_prefill(self) -> bool:
        """More than the newest token to compute: a prompt, the rest of one, or a recompute."""
        return self.num_to_compute > 1

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass(eq=False)
class Request:
    """What the user sent, and its n sequences (only one until its prompt is prefilled: then forked)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False          # its n samples exist (the prompt is prefilled)
    admitted: bool = False
    output: object = None         # its RequestOutput, updated in place as it runs

    def on_admitted(self, cached_tokens: int) -> None:
        """First admission only: when it started, and how much of its prompt the prefix cache served."""
        if not self.admitted:
            self.admitted = True
            self.metrics.first_scheduled_time = time.perf_counter()
            self.metrics.cached_prompt_tokens = cached_tokens

    @property
    def finished(self) -> bool:
        # Before its prompt is prefilled a request has one sequence; it forks into n only then.
        # So "all finished" is right either way (an abort before the fork finishes the one there is).
        return all(s.finished for s in self.seqs)
