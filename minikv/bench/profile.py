"""Where a served token's time goes: `bench serve --profile`, the server's clocks joined with the client's.

The server (``/debug/profile``, `minikv.server.engine_loop.LoopProfile`) gives, per engine step, the
engine's own `StepStats` (the batch, the step's end and duration) with the engine thread's timings
around it, the event loop's lag, and on every streamed chunk the step that made it. The client knows
when each chunk arrived. Client and server run on one machine and read one monotonic clock
(``time.perf_counter``), so their times subtract directly.

A token's interval, client side, from chunk k-1 (step a) to chunk k (step b), is exactly

    end(b) - end(a)  +  delivery(k) - delivery(k-1),     delivery = client receive - end of its step

and ``end(b) - end(a)`` is the sum, over the steps a+1..b, of each step's duration and the gap before it.
So a request's TPOT splits into: the forward, the rest of the step (schedule, sampling), the gap before
each step (the engine's output processing after its record, posting the outputs to the event loop,
the server's bookkeeping, the inbox, idle time, and what no marker covers), and the drift of the
delivery delay. TTFT splits into: the request's way in (client send -> handler), the queue (the step
in flight when it came, then steps that ran without it), the prefill (first scheduled -> its first
token's step end) and the first token's delivery (the engine thread's output and posting, the event
loop's pick-up, then serialising, sending and the client's own parsing). Every term is measured; the
sum is compared with the client's own figure and the difference printed as unexplained (a token whose
steps are missing from the record, a clock that is not shared).
"""

from __future__ import annotations

import statistics

import numpy as np

TPOT_TERMS = (   # key, label
    ("forward", "forward (the model)"),
    ("step_rest", "rest of the step (schedule, sample, append)"),
    ("output", "gap: output processing after the step's record"),
    ("post", "gap: posting outputs to the event loop"),
    ("book", "gap: engine stats, metrics, landlord, admission"),
    ("inbox", "gap: applying new requests / aborts"),
    ("idle", "gap: idle (empty inbox)"),
    ("gap_other", "gap: not covered by a marker"),
    ("delivery_drift", "delivery delay, last minus first / (n-1)"),
)
TTFT_TERMS = (
    ("request_in", "client send -> handler start"),
    ("queue_inflight", "queue: until the next step began"),
    ("queue_held", "queue: later steps that did not admit it"),
    ("prefill", "first scheduled -> first token's step end"),
    ("first_output_post", "delivery: engine output + posting"),
    ("first_pickup", "delivery: event-loop pick-up"),
    ("first_send", "delivery: serialise, send, client parse"),
)


# -- the server side --------------------------------------------------------------------------------
def switch(url: str, on: bool) -> dict:
    """Start (empty) or stop the server's profile; returns what it had recorded."""
    import httpx

    r = httpx.post(f"{url}/debug/profile", json={"on": on}, timeout=60)
    if r.status_code == 404:
        raise RuntimeError(f"{url} has no /debug/profile: --profile needs a minikv server of this version")
    r.raise_for_status()
    return r.json()


def step_parts(rows: list[dict]) -> dict[int, dict]:
    """Per step: its duration split (forward, rest) and the gap before it split, when the step before it is
    recorded too (the gap needs its end). Keys: the engine's step numbers."""
    by = {r["step"]: r for r in rows}
    parts = {}
    for s, r in by.items():
        prev = by.get(s - 1)
        if prev is None:
            continue
        start = r["time"] - r["duration"]
        gap = start - prev["time"]
        p = {"forward": r["forward"], "step_rest": r["duration"] - r["forward"],
             "output": prev["ret"] - prev["time"], "post": prev["post_s"], "book": prev["book_s"],
             "inbox": r["before_inbox_s"], "idle": r["before_idle_s"]}
        p["gap_other"] = gap - sum(p[k] for k in ("output", "post", "book", "inbox", "idle"))
        p.update(gap=gap, duration=r["duration"], end=r["time"], start=start,
                 prefill_tokens=r["prefill_tokens"], decode_tokens=r["decode_tokens"])
        parts[s] = p
    return parts


# -- the join -------------------------------------------------------------------------------------
def _interval(parts: dict, a: int, b: int) -> dict | None:
    """The terms of end(b) - end(a): every step a+1..b; None if one is missing."""
    out = {k: 0.0 for k, _ in TPOT_TERMS[:-1]} | {"prefill_step": 0.0, "steps": 0}
    for s in range(a + 1, b + 1):
        p = parts.get(s)
        if p is None:
            return None
        for k in out:
            if k in p:
                out[k] += p[k]
        out["steps"] += 1
        if p["prefill_tokens"]:
            out["prefill_step"] += p["duration"]
    return out


def tpot_terms(res, parts: dict, rows: dict) -> dict | None:
    """One request's TPOT split into TPOT_TERMS (seconds per token), or None without the stamps or steps."""
    steps = [st.get("step") for st in res.stamps]
    n = len(res.chunk_times)
    if n < 2 or len(steps) != n or None in steps or res.tpot is None:
        return None
    total = {k: 0.0 for k, _ in TPOT_TERMS} | {"prefill_step": 0.0, "steps": 0}
    for a, b in zip(steps, steps[1:]):
        iv = _interval(parts, a, b)
        if iv is None:
            return None
        for k, v in iv.items():
            total[k] += v
    if steps[0] not in rows:
        return None
    ends = [rows[s]["time"] for s in (steps[0], steps[-1])]
    total["delivery_drift"] = (res.chunk_times[-1] - ends[1]) - (res.chunk_times[0] - ends[0])
    per = {k: v / (res.tokens - 1) for k, v in total.items()}
    per["steps"] = total["steps"] / (n - 1)
    return per


def ttft_terms(res, rows: dict) -> dict | None:
    """One request's TTFT split into TTFT_TERMS (seconds), or None without the server's figures."""
    info, stamps = res.server or {}, res.stamps
    if res.ttft is None or not stamps or info.get("arrival_s") is None or info.get("queue_s") is None:
        return None
    arrival, queue, ttft = info["arrival_s"], info["queue_s"], info["ttft_s"]
    first = stamps[0]
    end = rows[first["step"]]["time"] if first.get("step") in rows else arrival + ttft
    scheduled = arrival + queue
    starts = [r["time"] - r["duration"] for r in rows.values() if r["time"] - r["duration"] >= arrival]
    next_start = min(starts, default=scheduled)
    inflight = min(next_start, scheduled) - arrival
    return {"request_in": arrival - res.start, "queue_inflight": inflight, "queue_held": queue - inflight,
            "prefill": end - scheduled, "first_output_post": first["posted"] - end,
            "first_pickup": first["picked"] - first["posted"], "first_send": res.chunk_times[0] - first["picked"]}


def _mean(xs):
    return statistics.fmean(xs) if xs else None


def breakdown(results: list, prof: dict) -> dict:
    """The served-latency breakdown of one run (`results`: bench serve's `Result`s; `prof`: /debug/profile)."""
    rows = {r["step"]: r for r in prof.get("steps", [])}
    parts = step_parts(list(rows.values()))
    ok = [r for r in results if r.ok]
    tp = [(r, t) for r in ok if (t := tpot_terms(r, parts, rows)) is not None]
    tt = [(r, t) for r in ok if (t := ttft_terms(r, rows)) is not None]

    def table(pairs, terms, client):
        if not pairs:
            return None
        measured = _mean([client(r) for r, _ in pairs])
        means = {k: _mean([t[k] for _, t in pairs]) for k, _ in terms}
        explained = sum(means.values())
        return {"requests": len(pairs), "client_mean_ms": measured * 1e3,
                "terms_ms": {k: v * 1e3 for k, v in means.items()},
                "fractions": {k: v / measured for k, v in means.items()},
                "sum_ms": explained * 1e3, "unexplained_ms": (measured - explained) * 1e3,
                "unexplained_fraction": (measured - explained) / measured}

    tpot = table(tp, TPOT_TERMS, lambda r: r.tpot)
    if tpot is not None:
        tpot["prefill_step_share"] = _mean([t["prefill_step"] for _, t in tp]) / _mean(
            [t["forward"] + t["step_rest"] for _, t in tp])
        tpot["steps_per_token"] = _mean([t["steps"] for _, t in tp])
    ttft = table(tt, TTFT_TERMS, lambda r: r.ttft)

    # Delivery of every chunk (its level; in TPOT only its drift counts)
    dl = [(c - rows[st["step"]]["time"], st["posted"] - rows[st["step"]]["time"], st["picked"] - st["posted"],
           c - st["picked"]) for r in ok for c, st in zip(r.chunk_times, r.stamps)
          if st.get("step") in rows and st.get("posted") is not None]
    delivery = None
    if dl:
        a = np.asarray(dl) * 1e3
        delivery = {"chunks": len(dl), **{f"{k}_ms": {"mean": float(a[:, i].mean()), "p50": float(np.median(a[:, i])),
                                                      "p99": float(np.percentile(a[:, i], 99))}
                                          for i, k in enumerate(("total", "output_post", "pickup", "send"))}}

    # The window of the run: the event loop's lag and busy time in it
    t0 = min((r.start for r in ok), default=0.0)
    t1 = max((r.chunk_times[-1] for r in ok if r.chunk_times), default=t0)
    probes = [p for p in prof.get("lag", []) if t0 <= p[0] <= t1]
    lag = [p[1] for p in probes]
    loop = None
    if lag:
        a = np.asarray(lag) * 1e3
        # the loop thread's CPU over the window, as a share of one core (what it leaves the engine's forward)
        cpu = [p for p in probes if len(p) > 2]
        busy = ((cpu[-1][2] - cpu[0][2]) / (cpu[-1][0] - cpu[0][0])
                if len(cpu) > 1 and cpu[-1][0] > cpu[0][0] else None)
        loop = {"probes": len(lag), "cpu_share": busy, "lag_mean_ms": float(a.mean()),
                "lag_p50_ms": float(np.median(a)),
                "lag_p99_ms": float(np.percentile(a, 99)), "lag_max_ms": float(a.max()),
                "serialise_ms_per_chunk": prof["serialise_s"] / prof["chunks"] * 1e3 if prof.get("chunks") else None,
                "serialise_share": prof.get("serialise_s", 0.0) / (t1 - t0) if t1 > t0 else None}

    # The engine thread: how busy, and how much of its between-step time it ran (vs waiting for the GIL or a core)
    inrun = [r for r in rows.values() if t0 <= r["time"] <= t1]
    # between steps: from engine.step()'s return through the bookkeeping, then to the next call (idle excluded)
    wall = sum(r["post_s"] + r["book_s"] for r in inrun) + sum(
        r["before_s"] - r["before_idle_s"] for r in inrun if r["before_s"] is not None)
    cpu = sum(r["after_cpu_s"] for r in inrun) + sum(r["before_cpu_s"] for r in inrun if r["before_s"] is not None)
    step_wall = sum(r["ret"] - r["call"] for r in inrun)
    thread = {"steps": len(inrun), "gap_wall_s": wall, "gap_cpu_s": cpu,
              "gap_not_running_fraction": (wall - cpu) / wall if wall > 0 else None,
              "step_wall_s": step_wall, "step_cpu_s": sum(r["step_cpu_s"] for r in inrun),
              "busy_fraction": (step_wall + wall) / (t1 - t0) if t1 > t0 else None}

    # Step time by batch: decode-only steps, by the number of sequences decoding
    by_batch: dict[int, list] = {}
    for r in inrun:
        if not r["prefill_tokens"]:
            by_batch.setdefault(r["decode_tokens"], []).append((r["duration"], r["forward"]))
    mixed = [r for r in inrun if r["prefill_tokens"]]
    batches = {b: {"steps": len(v), "duration_ms": _mean([d for d, _ in v]) * 1e3,
                   "forward_ms": _mean([f for _, f in v]) * 1e3} for b, v in sorted(by_batch.items())}
    steps = {"decode_only": batches, "with_prefill": {
        "steps": len(mixed), "duration_ms": _mean([r["duration"] for r in mixed]) * 1e3 if mixed else None,
        "prefill_tokens_mean": _mean([r["prefill_tokens"] for r in mixed]),
        "decode_tokens_mean": _mean([r["decode_tokens"] for r in mixed])},
        "mean_decode_batch": _mean([r["decode_tokens"] for r in inrun])}
    return {"tpot": tpot, "ttft": ttft, "delivery": delivery, "event_loop": loop, "engine_thread": thread,
            "steps": steps, "recorded_steps": len(rows)}


# -- the control: the same engine without a server ----------------------------------------------------
def control_batches(b: dict, most: int = 3) -> list[int]:
    """The decode batch sizes the served run stepped most often (the control measures those)."""
    table = b["steps"]["decode_only"]
    return sorted(sorted(table, key=lambda k: -table[k]["steps"])[:most])


def offline_steps(args, batches: list[int], prompt_len: int, steps: int = 6, seed: int = 0) -> dict[int, dict]:
    """Decode-only steps of the same model and engine flags in this process, no server (no event loop, no
    HTTP): per batch size, the mean and spread of `steps` step durations (after one warm-up).

    As in the server (`EngineLoop.build`), the model loads on the thread that steps it, and no other thread of
    this process runs torch: torch's CPU thread pool is per calling thread, and a second pool on a 2-core
    machine makes every op wait for a sleeping worker (`minikv.server.engine_loop`)."""
    import threading

    import torch

    from minikv.config import EngineConfig
    from minikv.engine import LLMEngine
    from minikv.models import load_model

    out: dict[int, dict] = {}
    failed: list[BaseException] = []

    def run():
        try:
            if getattr(args, "threads", None):
                torch.set_num_threads(args.threads)
            model, tokenizer = load_model(args.model)
            engine = LLMEngine(model, tokenizer, EngineConfig.from_cli_args(args, verbose=False))
            engine.long_run()   # as `minikv serve` does
            out.update(_decode_steps(engine, batches, prompt_len, steps, seed))
        except BaseException as err:   # re-raised in the caller
            failed.append(err)

    worker = threading.Thread(target=run, name="minikv-control")
    worker.start()
    worker.join()
    if failed:
        raise failed[0]
    return out


def _decode_steps(engine, batches: list[int], prompt_len: int, steps: int, seed: int) -> dict[int, dict]:
    from minikv.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    # Prefill the largest batch once, then abort requests down to each smaller size: one prefill in all.
    batches = sorted(batches, reverse=True)
    # long enough that no request finishes while the others still prefill (then the batch would never be whole)
    params = SamplingParams(max_tokens=engine.max_model_len - prompt_len - 1, temperature=0.0, ignore_eos=True)
    ids = [f"control-{i}" for i in range(batches[0])]
    for rid in ids:
        engine.add_request(rid, {"prompt": None, "prompt_token_ids": rng.integers(100, engine.vocab_size,
                                                                               prompt_len).tolist()}, params)
    out = {}
    for b in batches:
        while len(ids) > b:
            engine.abort_request(ids.pop())
        durations = []
        for _ in range(100 * (steps + 1)):   # prefill steps first; then decode-only steps of all b (1 warm-up)
            if len(durations) > steps:
                break
            engine.step()
            last = engine.stats(history=1).last_step
            if last is not None and last.prefill_tokens == 0 and last.decode_tokens == b:
                durations.append(last.duration)
        if len(durations) <= steps:
            raise RuntimeError(f"the control never ran {steps} decode-only steps of batch {b}")
        d = np.asarray(durations[1:]) * 1e3
        out[b] = {"steps": steps, "duration_ms": float(d.mean()), "min_ms": float(d.min()), "max_ms": float(d.max())}
    for rid in ids:
        engine.abort_request(rid)
    return dict(sorted(out.items()))


def compare_control(b: dict, control: dict[int, dict]) -> dict:
    """Served decode step vs the same batch offline: what serving adds to the step itself."""
    served = b["steps"]["decode_only"]
    return {k: {"served_ms": served[k]["duration_ms"], "served_steps": served[k]["steps"],
                "offline_ms": v["duration_ms"], "offline_min_ms": v["min_ms"], "offline_max_ms": v["max_ms"],
                "ratio": served[k]["duration_ms"] / v["duration_ms"]} for k, v in control.items() if k in served}


# -- printing -----------------------------------------------------------------------------------
def _table(title: str, t: dict | None, terms) -> None:
    if t is None:
        print(f"{title}: nothing to break down (no request had every step recorded)")
        return
    print(f"{title}: client mean {t['client_mean_ms']:.1f} ms over {t['requests']} requests")
    for k, label in terms:
        print(f"  {label:<46}{t['terms_ms'][k]:9.2f} ms {t['fractions'][k]:7.1%}")
    print(f"  {'sum of the terms':<46}{t['sum_ms']:9.2f} ms   unexplained {t['unexplained_ms']:+.2f} ms "
          f"({t['unexplained_fraction']:+.1%})")


def print_breakdown(b: dict) -> None:
    print(f"{'=' * 14} Served-latency breakdown (--profile) {'=' * 14}")
    _table("TPOT", b["tpot"], TPOT_TERMS)
    if b["tpot"] is not None:
        print(f"  steps per token {b['tpot']['steps_per_token']:.2f}; of the step time, "
              f"{b['tpot']['prefill_step_share']:.0%} in steps that carried a prefill chunk")
    _table("TTFT", b["ttft"], TTFT_TERMS)
    d = b["delivery"]
    if d is not None:
        print("delivery of every chunk (step end -> client), ms mean/p50/p99: "
              + "  ".join(f"{k} {d[k + '_ms']['mean']:.2f}/{d[k + '_ms']['p50']:.2f}/{d[k + '_ms']['p99']:.2f}"
                          for k in ("total", "output_post", "pickup", "send")))
    e = b["event_loop"]
    if e is not None:
        ser = "-" if e["serialise_ms_per_chunk"] is None else f"{e['serialise_ms_per_chunk']:.3f}"
        print(f"event loop lag (probe every 10 ms, {e['probes']} probes): mean {e['lag_mean_ms']:.2f} ms, p50 "
              f"{e['lag_p50_ms']:.2f}, p99 {e['lag_p99_ms']:.2f}, max {e['lag_max_ms']:.1f}; chunk building + "
              f"JSON {ser} ms a chunk ({e['serialise_share']:.1%} of the run)"
              + ("" if e.get("cpu_share") is None else f"; its thread used {e['cpu_share']:.1%} of a core"))
    t = b["engine_thread"]
    if t["gap_not_running_fraction"] is not None:
        print(f"engine thread: {t['steps']} steps, busy {t['busy_fraction']:.0%} of the run; between steps "
              f"(idle excluded) {t['gap_wall_s'] * 1e3:.0f} ms wall, of which not running (GIL or core) "
              f"{t['gap_not_running_fraction']:.0%}; in steps {t['step_cpu_s']:.1f} s CPU of {t['step_wall_s']:.1f} s")
    s = b["steps"]
    print("decode-only steps by batch (seqs: steps, mean ms, forward ms): " + ", ".join(
        f"{k}: {v['steps']}, {v['duration_ms']:.1f}, {v['forward_ms']:.1f}" for k, v in s["decode_only"].items()))
    w = s["with_prefill"]
    if w["steps"]:
        print(f"steps with a prefill chunk: {w['steps']}, mean {w['duration_ms']:.1f} ms "
              f"({w['prefill_tokens_mean']:.0f} prefill + {w['decode_tokens_mean']:.1f} decode tokens)")

def print_control(b: dict) -> None:
    if b.get("control"):
        print("control, decode-only step by batch: served (steps) vs the same engine offline in the client after "
              "the run (min-max), ratio")
        for k, v in b["control"].items():
            print(f"  batch {k:>3}: served {v['served_ms']:7.1f} ms ({v['served_steps']})   offline "
                  f"{v['offline_ms']:7.1f} ms ({v['offline_min_ms']:.1f}-{v['offline_max_ms']:.1f})   "
                  f"{v['ratio']:.2f}x")
