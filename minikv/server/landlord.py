"""The landlord's window: the KV pool drawn live in a browser, fed by the engine (stage 7).

Lesson 07 asks the landlord three questions: how big are the tenants, how full is the building,
who is being preempted? vLLM's gauges answer them in aggregate (KV usage %, running,
waiting, preemptions). This page answers them block by block: one cell per block, coloured by
the request that holds it, shared blocks marked with their reference count, free blocks that
still hold a cached prefix (evictable) shaded apart from truly free ones, the waiting line at the
door, and each preemption as it happens.

How it is fed, and why it cannot slow the engine:

* after every step the engine thread calls ``Feed.after_step(engine)``. It appends the step's
  preemptions to a bounded log (cheap: a few objects, only in steps that preempted), and builds
  a snapshot from the engine's read-only ``pool_view()`` only if ``min_interval`` has passed
  since the last one (at most ~10 a second, whatever the step rate);
* a snapshot is a JSON string held in one slot; a newer one replaces it. Each open page has its
  own server-sent-event stream that wakes every ``min_interval`` and sends the slot if it changed.
  A slow page therefore skips snapshots; nothing queues up and the engine never waits for it;
* the log travels inside every snapshot (the last ``log_size`` preemptions, numbered), so a page
  that skipped a snapshot still sees every recent preemption.

``/landlord`` serves the page (``landlord.html`` beside this file, one self-contained file: no
build step, no CDN), ``/landlord/events`` the stream, ``/landlord/snapshot`` one snapshot as JSON
(for a notebook's static picture), ``/landlord/steps?since=N`` the engine's per-step record after step
N as JSON rows (``StepStats``: occupancy, queues, preemptions, as the engine recorded them at the end of
each step, so a plot of them is exact, not a sampled gauge). With ``--api-key`` all four need the key,
as a bearer header or, because a browser's EventSource cannot set headers, as ``?key=`` in the URL.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path

from fastapi import Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse

from minikv.metrics import EngineStats
from minikv.server.protocol import APIError

PAGE = Path(__file__).with_name("landlord.html")


class Feed:
    """Per-step snapshots of the pool for the landlord's page: built on the engine thread, read by streams."""

    def __init__(self, min_interval: float = 0.1, log_size: int = 20, spark_size: int = 120,
                 step_size: int = 1 << 14):
        self.min_interval = min_interval
        self._steps: deque[dict] = deque(maxlen=step_size)  # the engine's step rows, copied on its thread
        self._lock = threading.Lock()
        self._log: deque[dict] = deque(maxlen=log_size)    # the last preemptions, numbered
        self._ttft: deque[float] = deque(maxlen=spark_size)  # first-token latencies, in arrival order
        self._gap: deque[float] = deque(maxlen=spark_size)   # the largest inter-token gap of each snapshot
        self._seen_first: set[str] = set()                  # requests whose TTFT is already in _ttft
        self._num_preempted = 0
        self._last_build = 0.0
        self._wanted_until = 0.0                            # a /landlord/snapshot asked: build until then
        self.snapshot: str | None = None                    # the latest snapshot, as JSON
        self.version = 0                                    # bumps with each new snapshot
        self.streams = 0                                    # open pages (event streams)

    # -- the engine thread -----------------------------------------------------------------------
    def after_step(self, engine, now: EngineStats | None = None, force: bool = False) -> None:
        """`now`: the engine's snapshot of this step (``engine.stats()`` with a few steps of history), shared
        with the server's other readers; taken here if not given."""
        # The step record: copied here, on the engine thread, from the frozen snapshot stats() builds;
        # the event loop only reads these plain dicts under the lock. A forced call repeats a step: skip it.
        now = engine.stats(history=8) if now is None else now
        last = self._steps[-1]["step"] if self._steps else -1
        rows = [asdict(s) for s in now.steps if s.step > last]
        if rows:
            with self._lock:
                self._steps.extend(rows)
        for p in engine.last_preemptions():
            self._num_preempted += 1
            self._log.append({"n": self._num_preempted, "t": round(p.time, 3), "request": p.request_id,
                              "seq": p.seq_id, "blocks": p.blocks, "mode": p.mode})
        now = time.perf_counter()
        watched = self.streams > 0 or now < self._wanted_until   # nobody looking: no snapshots to build
        if force or (watched and now - self._last_build >= self.min_interval):
            self._last_build = now
            self._publish(engine.pool_view(), now)

    def _publish(self, view, now: float) -> None:
        gaps = [t.last_gap for t in view.tenants if t.last_gap is not None]
        for t in view.tenants:
            if t.ttft is not None and t.request_id not in self._seen_first:
                self._seen_first.add(t.request_id)
                self._ttft.append(round(t.ttft, 4))
        live = {t.request_id for t in view.tenants}
        self._seen_first &= live          # bounded by the tenants alive now
        self._gap.append(round(max(gaps), 4) if gaps else 0.0)
        snap = {
            "t": round(now, 3), "step": view.step, "num_blocks": view.num_blocks, "block_size": view.block_size,
            "owner": view.owner, "refcount": view.refcount, "cached": view.cached,
            "tenants": [t.as_dict() for t in view.tenants], "waiting": view.waiting, "counts": view.counts,
            "preemptions": list(self._log), "ttft": list(self._ttft), "gap": list(self._gap),
        }
        text = json.dumps(snap, separators=(",", ":"))
        with self._lock:
            self.snapshot, self.version = text, self.version + 1

    # -- the event loop --------------------------------------------------------------------------
    def steps_since(self, since: int) -> list[dict]:
        """The recorded step rows whose step number is above `since` (the oldest kept first)."""
        with self._lock:
            return [r for r in self._steps if r["step"] > since]

    def with_viewers(self, text: str) -> str:
        """The snapshot with the number of pages watching now (counted here, not on the engine thread)."""
        return f'{{"viewers":{self.streams},{text[1:]}'

    async def fresh(self, wait: float = 0.5) -> str | None:
        """A snapshot at most ~one interval old: asks the engine for one and waits up to `wait` seconds
        (an idle engine published its last state when it went idle, so the current one is fresh)."""
        version = self.version
        self._wanted_until = time.perf_counter() + 2 * self.min_interval + wait
        for _ in range(max(1, int(wait / 0.02))):
            if self.version != version:
                break
            await asyncio.sleep(0.02)
        return None if self.snapshot is None else self.with_viewers(self.snapshot)

    async def stream(self, is_disconnected):
        """Server-sent events: the latest snapshot whenever it changed, at most every ``min_interval``."""
        self.streams += 1
        sent, quiet = -1, 0
        try:
            while not await is_disconnected():
                with self._lock:
                    version, text = self.version, self.snapshot
                if text is not None and version != sent:
                    sent, quiet = version, 0
                    yield f"event: snapshot\ndata: {self.with_viewers(text)}\n\n"
                elif (quiet := quiet + 1) * self.min_interval >= 5:
                    quiet = 0
                    yield ": idle\n\n"   # a comment now and then: a page that went away is noticed on write
                await asyncio.sleep(self.min_interval)
        finally:
            self.streams -= 1


def add_routes(app, state) -> None:
    """/landlord (the page), /landlord/events (its stream), /landlord/snapshot (one snapshot as JSON),
    /landlord/steps (the engine's per-step record as JSON rows)."""
    def check_key(request: Request) -> None:
        if not state.api_key:
            return
        if request.headers.get("authorization") == f"Bearer {state.api_key}" or \
                request.query_params.get("key") == state.api_key:
            return
        raise APIError(401, "missing or wrong API key: open /landlord?key=<key> with the key the server was "
                            "started with (--api-key / MINIKV_API_KEY)")

    @app.get("/landlord")
    async def page(request: Request):
        check_key(request)
        return HTMLResponse(PAGE.read_text())

    @app.get("/landlord/snapshot")
    async def snapshot(request: Request):
        check_key(request)
        text = await state.landlord.fresh()
        if text is None:
            raise APIError(503, "no snapshot yet: the engine has not started; try again in a moment")
        return Response(text, media_type="application/json")

    @app.get("/landlord/steps")
    async def steps(request: Request):
        check_key(request)
        raw = request.query_params.get("since", "-1")
        try:
            since = int(raw)
        except ValueError:
            raise APIError(400, f"since={raw!r} is not an integer: pass the last step number you have "
                                "(e.g. /landlord/steps?since=120), or leave it out for every kept step") from None
        rows = state.landlord.steps_since(since)
        return {"steps": rows, "last": rows[-1]["step"] if rows else since}

    @app.get("/landlord/events")
    async def events(request: Request):
        check_key(request)
        return StreamingResponse(state.landlord.stream(request.is_disconnected), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
