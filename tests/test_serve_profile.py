"""`bench serve --profile`: where a served token's time goes, on the tiny model (a real server, loopback).

The breakdown is an accounting of measured intervals, so what is checked is the accounting, never a
speed: every term is there and not negative, and the terms add up to the client's own figure within
the unexplained share the report prints. A synthetic record checks the arithmetic exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from minikv.bench.profile import TPOT_TERMS, TTFT_TERMS, breakdown
from minikv.bench.serve import Result, launch_server, stop_server, wait_healthy

SIGNED = {"delivery_drift"}   # a difference of two delays: either sign is a measurement


def test_bench_serve_profile_breaks_down_tpot_and_ttft():
    out = subprocess.run(
        [sys.executable, "-m", "minikv", "bench", "serve", "--model", "tiny-random-llama", "--threads", "1",
         "--num-requests", "10", "--rate", "20", "--workload", "fixed", "--max-prompt-len", "40",
         "--max-output-len", "24", "--profile", "--json", "-"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    run = json.loads(out.stdout.splitlines()[0])["runs"][0]
    assert run["completed"] == 10 and run["output_tokens"] == 10 * 24, "fixed: every request 24 tokens out"
    assert run["prompt_tokens"] == 10 * 40, "fixed: every prompt 40 tokens"
    prof = run["profile"]
    for name, terms in (("tpot", TPOT_TERMS), ("ttft", TTFT_TERMS)):
        t = prof[name]
        assert t is not None and t["requests"] == 10, f"{name}: every request had its steps recorded"
        assert set(t["terms_ms"]) == {k for k, _ in terms}
        for k, v in t["terms_ms"].items():
            assert k in SIGNED or v >= 0, (name, k, v)
        assert t["sum_ms"] == pytest.approx(sum(t["terms_ms"].values()))
        assert t["client_mean_ms"] - t["sum_ms"] == pytest.approx(t["unexplained_ms"])
        # every step of every token is in the record, so the terms account for the client's figure
        assert abs(t["unexplained_fraction"]) < 0.05, t
        assert t["terms_ms"]["forward" if name == "tpot" else "prefill"] > 0
    assert prof["tpot"]["steps_per_token"] >= 1
    assert prof["delivery"]["chunks"] == 10 * 24
    assert prof["event_loop"]["probes"] > 0 and prof["event_loop"]["lag_max_ms"] >= 0
    assert 0 < prof["engine_thread"]["busy_fraction"] <= 1.05
    assert prof["steps"]["decode_only"] and prof["steps"]["with_prefill"]["steps"] >= 1


def test_the_profile_endpoint_switches_and_refuses_bad_bodies():
    proc, url = launch_server(["--model", "tiny-random-llama", "--threads", "1"])
    try:
        wait_healthy(proc, url, wait=180)
        assert httpx.get(f"{url}/debug/profile").json() == {"on": False}
        assert httpx.post(f"{url}/debug/profile", content=b"[1").status_code == 400
        assert httpx.post(f"{url}/debug/profile", json={"on": "yes"}).status_code == 400
        assert httpx.post(f"{url}/debug/profile", json={"on": True}).json()["steps"] == []
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200
        got = httpx.post(f"{url}/debug/profile", json={"on": False}).json()
        assert got["on"] is False and len(got["steps"]) == 3, "one prefill step and two decode steps"
        row = got["steps"][0]
        assert row["prefill_tokens"] == 3 and row["duration"] > 0 and row["forward"] > 0
        assert httpx.get(f"{url}/debug/profile").json() == {"on": False}
    finally:
        log = stop_server(proc)
    assert proc.returncode == 0, log


def _row(step, end, duration, forward, prefill=0, decode=1):
    return {"step": step, "time": end, "duration": duration, "forward": forward, "prefill_tokens": prefill,
            "decode_tokens": decode, "ret": end + 0.001, "post_s": 0.002, "book_s": 0.001, "after_cpu_s": 0.003,
            "call": end - duration, "step_cpu_s": duration, "before_s": 0.0, "before_cpu_s": 0.0,
            "before_inbox_s": 0.0, "before_idle_s": 0.0}


def test_breakdown_arithmetic_on_a_synthetic_record():
    # Steps of 10 ms (8 ms forward) every 15 ms: a 5 ms gap, of which 1 output + 2 post + 1 book + 1 unmarked.
    rows = [_row(s, 1.0 + 0.015 * s, 0.010, 0.008, prefill=5 if s == 0 else 0) for s in range(5)]
    for r in rows[1:]:
        r["call"] = r["time"] - r["duration"]   # the call right at the step's start: the unmarked ms is before it
    res = Result(5, 4, start=0.98, status=200, finish_reason="length")
    res.chunk_times = [r["time"] + 0.003 for r in rows[1:]]     # each token 3 ms after its step ended
    res.chunk_tokens = [1] * 4
    res.stamps = [{"step": r["step"], "posted": r["time"] + 0.001, "picked": r["time"] + 0.002} for r in rows[1:]]
    res.server = {"arrival_s": 0.985, "queue_s": 0.0, "ttft_s": rows[1]["time"] - 0.985}
    # lag probes: (when, seconds late, the loop thread's CPU s so far): 4 ms of CPU in 40 ms of the run
    b = breakdown([res], {"steps": rows, "lag": [(1.02, 0.001, 0.500), (1.06, 0.0, 0.504)], "serialise_s": 0.0004,
                          "chunks": 4})
    assert b["event_loop"]["cpu_share"] == pytest.approx(0.1)
    t = b["tpot"]["terms_ms"]
    assert b["tpot"]["client_mean_ms"] == pytest.approx(15.0)
    assert t["forward"] == pytest.approx(8.0) and t["step_rest"] == pytest.approx(2.0)
    assert t["output"] == pytest.approx(1.0) and t["post"] == pytest.approx(2.0) and t["book"] == pytest.approx(1.0)
    assert t["gap_other"] == pytest.approx(1.0) and t["delivery_drift"] == pytest.approx(0.0, abs=1e-9)
    assert b["tpot"]["unexplained_ms"] == pytest.approx(0.0, abs=1e-9)
    tt = b["ttft"]["terms_ms"]
    assert tt["request_in"] == pytest.approx(5.0) and tt["first_output_post"] == pytest.approx(1.0)
    assert tt["first_pickup"] == pytest.approx(1.0) and tt["first_send"] == pytest.approx(1.0)
    assert b["ttft"]["unexplained_ms"] == pytest.approx(0.0, abs=1e-9)
    # a token whose step is missing from the record is left out, not guessed
    assert breakdown([res], {"steps": rows[:3] + rows[4:], "lag": []})["tpot"] is None
