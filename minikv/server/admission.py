"""Admission and back-pressure: whom the server starts now, whom it holds, whom it refuses (429).

The engine's scheduler decides who computes at each step; in front of it the server decides who
gets in at all. A `BackPressurePolicy` answers one question, ``decide(request, state)``, with

* ``"admit"``: hand the request to the engine now (its scheduler starts it when seats and blocks allow);
* ``"queue"``: hold it in the server's own FIFO queue, in front of the engine, and ask again later;
* ``"refuse"``: answer HTTP 429 with ``Retry-After`` now (a ``("refuse", "why")`` pair adds a reason).

It is asked when a request arrives, and again at every engine step for each held request, oldest
first, until one answer is ``"queue"`` (nobody overtakes the head of the queue). ``request`` and
``state`` are plain dicts (so a policy can run anywhere: in the server, in a simulation, in a
grader's sandbox):

request: ``prompt_tokens``, ``max_tokens``, ``n``, ``blocks_at_most`` (blocks it holds at its longest, all n
    samples: `minikv.inputs.blocks_at_most`, the unit of ``reserved_blocks`` too),
    ``waited_s`` (seconds since it arrived; 0 on arrival), ``held`` (False on arrival).
state: ``now_s``, ``running`` (sequences computing), ``waiting`` (in the engine, not computing:
    new or preempted), ``held`` (in this queue), ``queued`` (accepted, no first token yet: what
    ``--max-waiting`` bounds), ``free_blocks``, ``num_blocks``, ``block_size``,
    ``reserved_blocks`` (what every request in the engine would hold at its longest),
    ``max_num_seqs``, ``step_s`` (the last step's duration), ``preemptions`` (so far).

The lecture's policy is `BoundedFIFO`: admit while fewer than ``max_waiting`` requests wait for
their first token, refuse past it; it is what the server does without a policy (``--max-waiting``).
A policy plugs in as ``EngineLoop(engine, metrics, policy)``. Whatever it says, the server never
holds more than `HARD_LIMIT` requests (past it, a request is refused anyway), and a policy that
raises refuses that request with the error instead of stopping the server.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from minikv.inputs import blocks_at_most
from minikv.metrics import EngineStats

log = logging.getLogger("minikv.server")
DECISIONS = ("admit", "queue", "refuse")
HARD_LIMIT = 1024   # held requests, whatever the policy says: a queue is never unbounded


class BackPressurePolicy(Protocol):
    def decide(self, request: dict, state: dict) -> str | tuple[str, str]: ...


@dataclass
class BoundedFIFO:
    """The baseline: first come first served, at most `max_waiting` requests waiting to start."""
    max_waiting: int = 16

    def decide(self, request: dict, state: dict) -> str | tuple[str, str]:
        if request["held"] or state["queued"] < self.max_waiting:
            return "admit"
        return "refuse", f"{state['queued']} requests are already waiting to start (max {self.max_waiting})"


def normalize(answer, who: str = "decide") -> tuple[str, str]:
    """A policy's answer as (decision, reason); a wrong answer says what a right one looks like."""
    reason = ""
    if isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[1], str):
        answer, reason = answer
    if not isinstance(answer, str) or answer not in DECISIONS:
        raise ValueError(f"{who}() returned {answer!r}; it must return 'admit', 'queue' or 'refuse' "
                         "(or a pair like ('refuse', 'why'))")
    if answer == "refuse" and not reason:
        reason = "the admission policy refused it"
    return answer, reason


def request_info(prompt_tokens: int, max_tokens: int, block_size: int, waited_s: float = 0.0,
                 held: bool = False, *, n: int = 1, max_model_len: int | None = None) -> dict:
    return {"prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "n": n, "waited_s": waited_s, "held": held,
            "blocks_at_most": blocks_at_most(prompt_tokens, max_tokens, block_size, max_model_len, n=n)}


def engine_state(now: EngineStats, now_s: float, held: int, queued: int, step_s: float) -> dict:
    """The state dict of a live `LLMEngine`, from a snapshot of it (``engine.stats()``, taken in the thread
    that steps it)."""
    return {"now_s": now_s, "running": now.running, "waiting": now.waiting + now.swapped,
            "held": held, "queued": queued, "free_blocks": now.blocks_free, "num_blocks": now.num_blocks,
            "block_size": now.block_size, "reserved_blocks": now.reserved_blocks,
            "max_num_seqs": now.max_num_seqs, "step_s": step_s, "preemptions": now.preemptions}


class Gate:
    """The server's side of a policy. The handler thread asks `on_arrival` with the view of the engine's
    last snapshot (taken by the engine thread once per step and shared with the metrics and the landlord's
    feed, so a handler never reads the engine while it steps); the engine thread keeps the held requests and
    asks again in `release`."""

    def __init__(self, policy: BackPressurePolicy, block_size: int, max_model_len: int | None = None):
        self.policy, self.block_size, self.max_model_len = policy, block_size, max_model_len
        self.held: deque = deque()     # the engine loop's held `Add`s: request_id, arrival, prompt_tokens, params
        self.view: dict = {}
        self.t0 = time.perf_counter()
        self._lock = threading.Lock()  # a policy is asked from two threads: one question at a time

    def _ask(self, info: dict, state: dict) -> tuple[str, str]:
        with self._lock:
            try:
                return normalize(self.policy.decide(info, state))
            except Exception as err:  # noqa: BLE001 - a broken policy refuses; it never stops the server
                log.exception("the admission policy failed")
                return "refuse", f"the admission policy failed ({type(err).__name__}: {err})"

    def _info(self, prompt_tokens: int, params, waited_s: float = 0.0, held: bool = False) -> dict:
        return request_info(prompt_tokens, params.max_tokens, self.block_size, waited_s, held, n=params.n,
                            max_model_len=self.max_model_len)

    def snapshot(self, now: EngineStats, queued: int, step_s: float) -> None:
        self.view = engine_state(now, time.perf_counter() - self.t0, len(self.held), queued, step_s)

    def on_arrival(self, prompt_tokens: int, params, queued: int) -> tuple[str, str]:
        state = dict(self.view, queued=queued, held=len(self.held), now_s=time.perf_counter() - self.t0)
        if len(self.held) >= HARD_LIMIT:
            return "refuse", f"{len(self.held)} requests are held already"
        return self._ask(self._info(prompt_tokens, params), state)

    def release(self, now: EngineStats, queued: int, step_s: float, admit, refuse) -> None:
        """Ask about each held request, oldest first, until the policy says "queue". `now` is one snapshot
        of the engine, taken for this call; each admission adds to it what the engine then holds more."""
        self.snapshot(now, queued, step_s)
        while self.held:
            add = self.held[0]
            info = self._info(add.prompt_tokens, add.params, time.perf_counter() - add.arrival, held=True)
            state = dict(self.view, held=len(self.held), now_s=time.perf_counter() - self.t0)
            decision, reason = self._ask(info, state)
            if decision == "queue":
                return
            self.held.popleft()
            if decision == "admit":
                admit(add)
                # the engine now waits on one more request, which reserves its blocks (the one budget rule)
                self.view["waiting"] += 1
                self.view["reserved_blocks"] += info["blocks_at_most"]
            else:
                refuse(add, reason)

    def drop(self, request_id: str):
        """Take a held request out (its client went away); returns its `Add` or None."""
        for add in self.held:
            if add.request_id == request_id:
                self.held.remove(add)
                return add
        return None
