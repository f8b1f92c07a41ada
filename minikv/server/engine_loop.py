"""The engine loop: one thread steps the engine; HTTP handlers hand it requests and await tokens.

Two sides, and what crosses between them:

* **Handlers** run on uvicorn's asyncio event loop. `submit()` tokenizes nothing and computes
  nothing: it puts an `Add` on the *inbox* (a thread-safe `queue.Queue`) and returns an
  `asyncio.Queue`, the request's *outbox*, which the handler awaits. `abort()` puts an `Abort`
  on the inbox. Neither waits for the engine.
* **The engine thread** owns the `LLMEngine`; nothing else touches it (the handlers use only its input
  processor, `EngineLoop.inputs`, which is stateless and safe from any thread). The server builds the engine on
  that thread too (`EngineLoop.build`), so that it is the one thread of the process that runs torch (see
  "Why one thread runs torch" below). Each turn it drains the
  inbox (`add_request` / `abort_request`), runs one `engine.step()` if any request is live, and
  posts each changed request's deltas (`minikv.outputs`: new ids, new text) to its outbox with
  ``loop.call_soon_threadsafe`` (which only schedules a `put_nowait` on the event loop: it never
  waits). With nothing live it sleeps on the inbox, so an idle server burns no CPU.

Why nothing blocks a model forward: the forward runs in the engine thread, which never waits on
the event loop, and the handlers never wait on the engine (torch releases the GIL inside its
kernels, so the event loop keeps parsing requests and writing chunks while a forward runs).
A request that arrives mid-step waits in the inbox until that step ends and joins the batch at
the next `schedule()`: continuous batching, seen from outside. A client that disconnects is
aborted at the start of the next turn, i.e. within one step, and `abort_request` frees its blocks.

Why one thread runs torch: on the CPU, torch runs its parallel ops on an OpenMP (libgomp) thread pool, one
pool *per thread that calls them*, and libgomp keeps a pool's workers spinning between parallel regions
only while the process's OpenMP threads fit the machine's cores; past that they sleep after a hundred spins
and every region has to wake them. A model loaded on the main thread leaves a pool there; a second pool on
the engine thread then puts every op of every step behind a futex wake-up. On a 2-core machine that made a
batch-1 decode step ~1.6x slower served than offline (`bench steps --from-thread` shows it).

Profiling (`bench serve --profile`, through ``/debug/profile``): while `profile` holds a `LoopProfile`,
the thread records, per step, what it did around `engine.step()` (the forward's share of the step, the
output posting, the bookkeeping, the inbox and the idle wait before the next step, and its own CPU time
in each, so waiting for the GIL or a core shows as wall time without CPU time). The batch and the step's
duration are not recorded again: each row carries the engine's own `StepStats` of that step.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from minikv.outputs import SampleDelta
from minikv.sampling import SamplingParams
from minikv.server.admission import Gate

# Steps of history in the snapshot taken after each step: the landlord's feed copies the rows it has not seen
# (one per step; a few more cover a snapshot the feed skipped).
STATS_HISTORY = 8


@dataclass
class Update:
    """One post to a request's outbox: the step's deltas (`minikv.outputs.SampleDelta`: new ids, new
    text, a finish reason). `info` is set on its last update: usage and per-request metrics."""
    deltas: list[SampleDelta] = field(default_factory=list)
    finished: bool = False
    info: dict | None = None
    error: str | None = None
    # 400: the engine refused the request; 429: admission refused it; 500: the engine failed
    error_status: int = 400
    step: int | None = None                     # the engine step whose tokens these are (StepStats.step)
    posted: float | None = None                 # perf_counter when the engine thread posted it (profiles)


class ServerClosing(RuntimeError):
    """The server is shutting down: new requests are refused (503)."""


@dataclass
class _Live:
    """A request the engine thread knows of, from its `submit` to its last update."""
    outbox: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    queued: bool = True                         # accepted, no first token yet: it counts in num_queued
    itl_seen: int = 0                           # token_times already observed by the ITL histogram

    def post(self, update: Update) -> None:
        self.loop.call_soon_threadsafe(self.outbox.put_nowait, update)


class LoopProfile:
    """The engine thread's timings around each step, and the event loop's, while a profile is on.

    Rows (engine thread, one per recorded step): the engine's `StepStats` of the step (``step``, ``time``
    = its end, ``duration``, ``forward`` = its seconds in the runner, the batch: ``decode_tokens``,
    ``prefill_tokens``, ``num_running`` ...) plus ``call`` / ``ret`` (perf_counter just before
    `engine.step()` and when it returned: ``ret - time`` is the output processing after the engine's
    record), ``step_cpu_s`` (this thread's CPU time in `step()`), ``post_s`` (posting the outputs),
    ``book_s`` (reading the engine's stats, metrics, landlord, admission), ``after_cpu_s`` (this thread's
    CPU time from ``ret`` to the end of the bookkeeping), and for the stretch before the next step, from
    the bookkeeping's end to ``call``: ``before_s`` (wall), ``before_inbox_s`` (applying adds/aborts),
    ``before_idle_s`` (blocked on an empty inbox or sleeping), ``before_cpu_s`` (this thread's CPU time in it).
    The event loop adds its lag samples and the time it spends serialising stream chunks.
    """

    def __init__(self, size: int = 1 << 14, lag_size: int = 1 << 16):
        self._lock = threading.Lock()
        self._rows: deque[dict] = deque(maxlen=size)
        self.lag: deque[tuple] = deque(maxlen=lag_size)   # (when, seconds late, its CPU s): event loop only
        self.serialise_s = 0.0                                          # event loop only
        self.chunks = 0
        self.started = time.perf_counter()
        self.lag_task = None                                            # the event loop's watcher (app.py)

    def add(self, row: dict) -> None:
        with self._lock:
            self._rows.append(row)

    def rows(self) -> list[dict]:
        with self._lock:
            return list(self._rows)

    def as_dict(self) -> dict:
        return {"started": self.started, "steps": self.rows(), "lag": list(self.lag),
                "serialise_s": self.serialise_s, "chunks": self.chunks}


# -- what crosses the inbox, handler side -> engine thread ----------------------------------------------
@dataclass
class Add:
    """A validated request for the engine (`hold`: admission asked the server to keep it back for now)."""
    request_id: str
    prompt: dict                                # {"prompt": text or None, "prompt_token_ids": [...]}
    params: SamplingParams
    arrival: float                              # perf_counter when the handler got it
    live: _Live
    hold: bool = False

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt["prompt_token_ids"])


@dataclass
class Abort:
    """The client went away: abort the request wherever it is (held, queued or running)."""
    request_id: str


@dataclass
class Drain:
    """The server is stopping: refuse the held requests, abort the live ones, end the thread."""


class EngineLoop:
    """Owns the engine and its thread. `metrics` (a `minikv.server.metrics.ServerMetrics`) is updated per step."""

    def __init__(self, engine, metrics=None, policy=None, landlord=None):
        self.engine, self.metrics = engine, metrics
        self.inputs = engine.input_processor    # stateless: the handlers may call it from the event loop
        self.landlord = landlord                # the live page's feed (minikv.server.landlord.Feed), if any
        # admission (minikv.server.admission): a policy decides admit / queue / refuse; None: --max-waiting only
        self.gate = Gate(policy, engine.block_size, engine.max_model_len) if policy is not None else None
        self._step_s = 0.0
        if self.gate is not None:
            self.gate.snapshot(engine.stats(history=0), 0, 0.0)
        self.inbox: queue.Queue = queue.Queue()
        self._live: dict[str, _Live] = {}       # engine thread only
        self._lock = threading.Lock()           # guards num_queued and accepting (both sides touch them)
        self.num_queued = 0                     # accepted, no token yet: what --max-waiting bounds
        self.accepting = True
        self._thread = threading.Thread(target=self._run, name="minikv-engine", daemon=True)
        self.error: BaseException | None = None
        self.profile: LoopProfile | None = None  # set and cleared by the event loop (/debug/profile)
        self._idle_s = 0.0                      # blocked on an empty inbox or sleeping, since the last step
        self._inbox_s = 0.0                     # applying the inbox's adds and aborts, since the last step

    @classmethod
    def build(cls, make_engine: Callable[[], object], metrics=None, policy=None, landlord=None,
              timeout: float | None = None) -> EngineLoop:
        """Build the engine on the thread that will step it, start stepping, and return once it is built.

        `make_engine()` loads the model and returns the `LLMEngine`; an error it raises is raised here. The
        metrics and the landlord's feed get their first reading of the idle engine before this returns."""
        built, ready = {}, threading.Event()

        def body() -> None:
            try:
                loop = cls(make_engine(), metrics, policy, landlord)
                loop._thread = threading.current_thread()
                loop._read_idle()
                built["loop"] = loop
            except BaseException as err:   # re-raised in the caller
                built["error"] = err
                return
            finally:
                ready.set()
            loop._run()

        thread = threading.Thread(target=body, name="minikv-engine", daemon=True)
        thread.start()
        if not ready.wait(timeout):
            raise TimeoutError(f"the engine was not built within {timeout} s")
        if "error" in built:
            raise built["error"]
        return built["loop"]

    def start(self) -> None:
        """Step an engine built elsewhere (tests, the in-process checks): `build` is the server's way."""
        self._read_idle()
        self._thread.start()

    def _read_idle(self) -> None:
        now = self.engine.stats(history=STATS_HISTORY)
        if self.metrics is not None:
            self.metrics.after_step(now, live=False, stepped=False)
        if self.landlord is not None:
            self.landlord.after_step(self.engine, now, force=True)

    # -- the handler side (event loop thread) ----------------------------------------------------------
    def submit(self, request_id: str, prompt: dict, params: SamplingParams, max_queued: int | None = None,
               arrival_time: float | None = None) -> asyncio.Queue:
        """Hand a validated request to the engine; raises ServerClosing, or OverflowError past `max_queued`."""
        with self._lock:
            if not self.accepting:
                raise ServerClosing("the server is shutting down")
            kind = "add"
            if self.gate is not None:
                kind, reason = self.gate.on_arrival(len(prompt["prompt_token_ids"]), params, self.num_queued)
                if kind == "refuse":
                    raise OverflowError(reason)
            elif max_queued is not None and self.num_queued >= max_queued:
                raise OverflowError(self.num_queued)
            self.num_queued += 1
        outbox: asyncio.Queue = asyncio.Queue()
        live = _Live(outbox, asyncio.get_running_loop())
        self.inbox.put(Add(request_id, prompt, params, arrival_time or time.perf_counter(), live,
                           hold=kind == "queue"))
        return outbox

    def abort(self, request_id: str) -> None:
        self.inbox.put(Abort(request_id))

    def shutdown(self) -> None:
        """Stop accepting; the engine thread aborts what is in flight (each gets finish_reason "abort") and exits."""
        with self._lock:
            self.accepting = False
        self.inbox.put(Drain())

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- the engine side (its own thread) ------------------------------------------------------------------
    def _settle(self, live: _Live) -> None:
        """The one place a request stops counting as queued: its first token, its end, or its refusal."""
        if live.queued:
            live.queued = False
            with self._lock:
                self.num_queued -= 1

    def _run(self) -> None:
        try:
            end_prev = cpu_prev = None          # when the previous step's bookkeeping ended (wall, thread CPU)
            while True:
                gate = self.gate
                if not self._drain_inbox(block=not self._live and not (gate and gate.held)):
                    return
                if gate is not None and gate.held:   # the inbox changed the engine since the step's snapshot
                    gate.release(self.engine.stats(history=0), self.num_queued, self._step_s, self._add,
                                 self._refuse_held)
                    if not self._live:
                        t = time.perf_counter()
                        time.sleep(0.01)   # held requests and an idle engine: ask again in a moment
                        self._idle_s += time.perf_counter() - t
                if self._live:
                    prof = self.profile
                    call, cpu_call = time.perf_counter(), time.thread_time()
                    outputs = self.engine.step()
                    ret, cpu_ret = time.perf_counter(), time.thread_time()
                    last = outputs.stats   # None: nothing was scheduled (only aborts came out)
                    read = time.perf_counter()
                    self._post(outputs, None if last is None else last.step)
                    posted = time.perf_counter()
                    self._step_s = last.duration if last is not None else self._step_s
                    now = self.engine.stats(history=STATS_HISTORY)   # the step's one snapshot, for every reader
                    if gate is not None:
                        gate.snapshot(now, self.num_queued, self._step_s)
                    if self.metrics is not None:
                        self.metrics.after_step(now, bool(self._live))
                    if self.landlord is not None:   # throttled inside; the last step before idling always lands
                        self.landlord.after_step(self.engine, now, force=not self._live)
                    end, cpu_end = time.perf_counter(), time.thread_time()
                    if prof is not None and last is not None:   # a step ran: record it
                        prof.add(asdict(last) | {
                            "call": call, "ret": ret,
                            "step_cpu_s": cpu_ret - cpu_call, "post_s": posted - read,
                            "book_s": end - posted + read - ret, "after_cpu_s": cpu_end - cpu_ret,
                            "before_s": None if end_prev is None else call - end_prev,
                            "before_cpu_s": None if cpu_prev is None else cpu_call - cpu_prev,
                            "before_inbox_s": self._inbox_s, "before_idle_s": self._idle_s})
                    end_prev, cpu_prev = end, cpu_end
                    self._idle_s = self._inbox_s = 0.0
        except BaseException as err:   # a bug: tell every waiting client instead of leaving it hanging
            self.error = err
            with self._lock:
                self.accepting = False
            self._fail_all(f"the engine failed ({type(err).__name__}: {err}); the server log has the details")
            raise

    def _fail_all(self, why: str) -> None:
        """The engine thread is dying: every request it knows of, live, held or still in the inbox, hears `why`."""
        for rid, live in list(self._live.items()):
            try:
                self._end(rid, error=why)
            except Exception:   # too broken even to abort: the client still gets its answer
                live.post(Update(finished=True, error=why, error_status=500))
        while self.gate is not None and self.gate.held:
            self._refuse_held(self.gate.held.popleft(), why, 500)
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Add):
                self._refuse_held(item, why, 500)

    def _drain_inbox(self, block: bool) -> bool:
        """Apply every queued add/abort; False once a drain asked the thread to stop.

        The time blocked on an empty inbox counts as idle, the rest as inbox work (`LoopProfile`)."""
        t = time.perf_counter()
        while True:
            try:
                item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            except queue.Empty:
                if block:
                    continue
                self._inbox_s += time.perf_counter() - t
                return True
            if block:
                now = time.perf_counter()
                self._idle_s += now - t
                t = now
            block = False
            if isinstance(item, Add) and item.hold:
                self.gate.held.append(item)
            elif isinstance(item, Add):
                self._add(item)
            elif isinstance(item, Abort):
                held = self.gate.drop(item.request_id) if self.gate is not None else None
                if held is not None:
                    self._settle(held.live)
                    continue
                live = self._live.pop(item.request_id, None)
                if live is not None:
                    self._settle(live)
                self.engine.abort_request(item.request_id)
                if self.metrics is not None:
                    self.metrics.after_step(self.engine.stats(history=0), bool(self._live), stepped=False)
            elif isinstance(item, Drain):
                while self.gate is not None and self.gate.held:
                    self._refuse_held(self.gate.held.popleft(), "the server is shutting down", 503)
                for rid in list(self._live):
                    self._end(rid)
                return False

    def _add(self, add: Add) -> None:
        try:
            self.engine.add_request(add.request_id, add.prompt, add.params, arrival_time=add.arrival)
        except ValueError as err:   # the handler checked first; this is the engine's own word
            self._refuse_held(add, str(err), 400)
            return
        except Exception as err:   # a bug in the engine: this client hears it too, then the loop fails
            self._refuse_held(add, f"the engine failed ({type(err).__name__}: {err}); the server log has the "
                                   "details", 500)
            raise
        self._live[add.request_id] = add.live
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(add.prompt_tokens)

    def _post(self, outputs, step: int | None = None) -> None:
        now = time.perf_counter()
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:   # aborted by us already
                continue
            new_tokens = sum(len(d.token_ids) for d in out.deltas)
            if new_tokens or out.finished:
                self._settle(live)
            if self.metrics is not None:
                live.itl_seen = self.metrics.after_tokens(out.metrics, new_tokens, live.itl_seen)
            update = Update(list(out.deltas))
            if out.finished:
                update.finished = True
                update.info = self._info(out, now)
                del self._live[out.request_id]
                if self.metrics is not None:
                    self.metrics.after_finish(out.metrics, now)
            update.step, update.posted = step, time.perf_counter()
            live.post(update)

    def _refuse_held(self, add: Add, reason: str, status: int = 429) -> None:
        """A request that never ran is answered `status`: refused by the policy, at shutdown, or by the engine."""
        self._settle(add.live)
        add.live.post(Update(finished=True, error=reason, error_status=status))

    def _end(self, request_id: str, error: str | None = None) -> None:
        """Abort a live request and tell its client so: every unfinished sample ends with "abort"."""
        live = self._live.pop(request_id)
        out = self.engine.abort_request(request_id)
        self._settle(live)
        update = Update(finished=True, error=error, error_status=500)
        if out is not None:
            update.deltas = list(out.deltas)
            update.info = self._info(out, time.perf_counter())
        live.post(update)

    @staticmethod
    def _info(out, now: float) -> dict:
        m = out.metrics
        return {"prompt_tokens": len(out.prompt_token_ids),
                "completion_tokens": sum(len(c.token_ids) for c in out.outputs),
                "cached_tokens": m.cached_prompt_tokens, "preemptions": m.preemptions,
                "ttft_s": m.ttft, "queue_s": (m.first_scheduled_time - m.arrival_time)
                if m.first_scheduled_time is not None else None,
                "e2e_s": now - m.arrival_time, "max_itl_s": m.max_gap,
                "arrival_s": m.arrival_time, "finished_s": now}   # the server's clock (perf_counter)
