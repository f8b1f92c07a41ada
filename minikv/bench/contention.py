"""A busy neighbour for `bench steps --beside`: what a served engine's forward pays for sharing its process.

`minikv serve` runs the engine in a thread beside uvicorn's event loop, in one process, as the
notebooks' `LLM` does. Every Python-level op of the forward releases the GIL inside torch's kernel and
takes it back after; while another thread of the process runs Python, taking it back waits. vLLM V1
runs its engine core in a process of its own, so its event loop competes for a core but never for the
GIL. To tell those two costs apart, `bench steps --beside 0.3` times minikv's steps three ways, the
calls alternating: alone; beside a Python thread of the same process busy 30% of the time (it needs
the GIL and a core); and beside a separate process busy the same share (it needs only a core).

The neighbour's work is what an event loop does between waits: JSON in and out of small dicts, in
bursts of ``duty`` x 10 ms, each followed by a sleep of the rest of the 10 ms.

`own_process` times the other thing a process can do to its forward (`bench steps --from-thread`): step
it from a thread other than the one whose torch ops loaded the model, so two OpenMP pools share the cores.
"""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
from contextlib import contextmanager

PERIOD = 0.01   # seconds: one burst of work and one sleep


def busy(stop, ready, duty: float) -> None:
    """Work `duty` of every PERIOD, sleep the rest, until `stop` is set (a thread's or a process's body)."""
    chunk = {"id": "cmpl-1", "choices": [{"index": 0, "delta": {"content": "token"}, "finish_reason": None}]}
    ready.set()
    while not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < duty * PERIOD:
            json.loads(json.dumps(chunk))
        time.sleep((1 - duty) * PERIOD)


@contextmanager
def neighbour(kind: str, duty: float):
    """A busy neighbour ("thread" in this process, or "process") for the duration of the block."""
    if kind == "thread":
        stop, ready = threading.Event(), threading.Event()
        worker = threading.Thread(target=busy, args=(stop, ready, duty), daemon=True)
    elif kind == "process":
        context = multiprocessing.get_context("spawn")   # a fresh interpreter: no copy of torch's threads
        stop, ready = context.Event(), context.Event()
        worker = context.Process(target=busy, args=(stop, ready, duty), daemon=True)
    else:
        raise ValueError(f"a neighbour is a 'thread' or a 'process', not {kind!r}")
    worker.start()
    try:
        if not ready.wait(60):
            raise RuntimeError(f"the busy {kind} did not start within 60 s")
        yield
    finally:
        stop.set()
        worker.join(10)


def beside(run, kind: str, duty: float):
    """`run(prompts, max_tokens) -> seconds` timed with a busy neighbour of `kind` running."""

    def run_beside(prompts: list[list[int]], max_tokens: int) -> float:
        with neighbour(kind, duty):
            return run(prompts, max_tokens)

    return run_beside


def _answer_calls(conn, make_run, second_thread: bool) -> None:
    """A spawned process's body: `make_run()` loads the model on the main thread (its torch ops start an
    OpenMP pool there), then each `(prompts, max_tokens)` received on `conn` is timed, stepped from the
    main thread or from a second one, and the seconds sent back; None ends it."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    run = make_run()
    torch.ones(1 << 22).add_(1)   # a parallel op on the main thread: its pool exists whatever loading did
    second = ThreadPoolExecutor(1, thread_name_prefix="minikv-second") if second_thread else None
    conn.send("ready")
    while (call := conn.recv()) is not None:
        conn.send(second.submit(run, *call).result() if second is not None else run(*call))


@contextmanager
def own_process(make_run, second_thread: bool):
    """`run(prompts, max_tokens) -> seconds` by the engine `make_run()` builds (a picklable callable that
    loads a model and returns a timed run) in a spawned process of its own, on its main thread;
    `second_thread`: every call is stepped from one long-lived second thread.

    torch runs its CPU ops on an OpenMP pool per calling thread, and libgomp lets idle workers spin only
    while the process's OpenMP threads fit the cores; past that each parallel region wakes them from sleep.
    The two settings differ in the calling thread only, so their ratio is what a second pool costs. (They
    run in processes of their own because a second pool slows every thread of its process, the main one too.)"""
    context = multiprocessing.get_context("spawn")
    mine, theirs = context.Pipe()
    worker = context.Process(target=_answer_calls, args=(theirs, make_run, second_thread), daemon=True)
    worker.start()
    try:
        if not mine.poll(600) or mine.recv() != "ready":
            raise RuntimeError("the minikv process of --from-thread did not start within 600 s")

        def run(prompts: list[list[int]], max_tokens: int) -> float:
            mine.send((prompts, max_tokens))
            return mine.recv()

        yield run
    finally:
        try:
            mine.send(None)
        except OSError:
            pass
        worker.join(30)
        if worker.is_alive():
            worker.kill()
