"""`bench steps`: the one timing procedure, its arithmetic on a fake engine, and the command on depth30; the vLLM
worker's protocol, and `bench engine --vllm` alternating its runs with a stand-in for it."""

import json
import math
import multiprocessing
import subprocess
import sys
import time

import pytest

from minikv.bench import vllm_peer
from minikv.bench.steps import cli, measure, summarize

SPEC = {"seed": 0, "low": 3, "high": 50, "prefill": 12, "context": 7, "batches": [1, 3], "steps": 5, "repeat": 3}


def fake_engine(calls: list):
    """An engine whose generate takes 0.1 s a call, 0.002 s a prompt token, and 0.01 s x batch a decode step."""

    def run(prompts, max_tokens):
        calls.append((prompts, max_tokens))
        tokens = sum(len(p) for p in prompts)
        return 0.1 + 0.002 * tokens + (max_tokens - 1) * 0.01 * len(prompts)

    return run


def test_measure_recovers_a_step_and_a_prefill():
    calls = []
    samples = measure({"fake": fake_engine(calls)}, SPEC, pause=0)
    out = {shape: figures[0] for shape, figures in summarize(samples)["fake"].items()}
    assert out["prefill"] == pytest.approx(0.1 + 0.002 * 12)
    assert out["decode_b1"] == pytest.approx(0.01)
    assert out["decode_b3"] == pytest.approx(0.03)
    # warm-up, 3 prefills, then per batch 3 pairs (1 token, 1 + steps tokens), alternating
    assert len(calls) == 1 + 3 + 2 * 3 * 2
    assert [len(p) for p, _ in calls[4:10]] == [1] * 6 and [k for _, k in calls[4:10]] == [1, 6] * 3
    assert all(len(p[0]) == 7 for p, _ in calls[4:]) and all(3 <= t < 50 for p, _ in calls for q in p for t in q)
    prompts = [tuple(q) for p, _ in calls[1:] for q in p]
    assert len(set(prompts)) == len(prompts), "every call gets fresh prompts"


def test_a_ratio_is_taken_call_by_call():
    """A machine twice as slow for the second repetition: the medians move, the paired ratio does not."""
    samples = {"mine": {"prefill": [1.2, 2.4, 1.25]}, "peer": {"prefill": [1.0, 2.0, 1.0]}}
    median, ratio = summarize(samples, "peer")["mine"]["prefill"]
    assert median == 1.25 and ratio == pytest.approx(1.2)
    # a pair with a sample <= 0 (a decode step lost in the noise) has no ratio: the others still do
    samples = {"mine": {"decode_b1": [1.2, -0.1, 2.4]}, "peer": {"decode_b1": [1.0, 0.5, 2.0]}}
    assert summarize(samples, "peer")["mine"]["decode_b1"][1] == pytest.approx(1.2)
    assert math.isnan(summarize({"mine": {"d": [0.0]}, "peer": {"d": [0.0]}}, "peer")["mine"]["d"][1])


def test_engines_take_turns_on_the_same_prompts():
    a, b = [], []
    out = measure({"a": fake_engine(a), "b": fake_engine(b)}, SPEC, pause=0)
    assert out["a"] == out["b"] and [p for p, _ in a] == [p for p, _ in b]
    assert all(ratio == pytest.approx(1) for _, ratio in summarize(out, "b")["a"].values())
    # one log of both engines' calls, in the order they were made: the first engine of each call rotates
    order = []
    measure({"a": lambda p, k: order.append("a") or 0.0, "b": lambda p, k: order.append("b") or 0.0}, SPEC, pause=0)
    assert order[:6] == ["a", "b", "b", "a", "a", "b"]


# A stand-in for vLLM's worker, in this interpreter: the same protocol, a generate that takes 0.01 s a prompt.
FAKE_WORKER = r"""
import json, sys, time
spec = json.load(open(sys.argv[1]))
if "child_pid_file" in spec:   # as vLLM's engine core: a child process that outlives the worker's os._exit
    import subprocess
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(spec["child_pid_file"], "w").write(str(child.pid))
print("some log line", flush=True)
print("MINIKV-READY", flush=True)
for line in sys.stdin:
    request = json.loads(line)
    counts = request["max_tokens"]
    counts = counts if isinstance(counts, list) else [counts] * len(request["prompts"])
    if 0 in counts:
        sys.exit("asked for no tokens")
    tokens = [[7] * k for k in counts] if request["tokens"] else None
    print("MINIKV-RESULT " + json.dumps({"seconds": 0.01 * len(request["prompts"]) * spec["scale"],
                                         "tokens": tokens}), flush=True)
import os
os._exit(0)
"""


def test_the_worker_protocol_and_a_worker_that_dies():
    with vllm_peer.Worker({"scale": 2}, script=FAKE_WORKER, exe=sys.executable, timeout=60) as worker:
        assert worker.run([[1, 2], [3]], 4) == pytest.approx(0.04)
        assert worker.run([[1]], 4) == pytest.approx(0.02)
        assert worker.generate([[1], [2, 3]], [2, 3]) == (pytest.approx(0.04), [[7, 7], [7, 7, 7]])
        assert worker.startup_s > 0
        with pytest.raises(RuntimeError, match="asked for no tokens"):
            worker.run([[1]], 0)


def test_closing_the_worker_ends_what_it_left_running(tmp_path):
    """vLLM's engine core runs in child processes that the worker's os._exit leaves behind: close() ends them."""
    import os
    import time

    pid_file = tmp_path / "child.pid"
    with vllm_peer.Worker({"scale": 1, "child_pid_file": str(pid_file)}, script=FAKE_WORKER, exe=sys.executable,
                          timeout=60) as worker:
        worker.run([[1]], 1)
        child = int(pid_file.read_text())
        os.kill(child, 0)   # alive while the worker is
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        state = open(f"/proc/{child}/stat").read().split()[2] if os.path.exists(f"/proc/{child}/stat") else "?"
        if state == "Z":   # killed, not yet reaped by its init
            return
        time.sleep(0.1)
    raise AssertionError(f"the worker's child {child} is still running")


def test_the_vllm_worker_script_parses():
    compile(vllm_peer.WORKER, "<vllm worker>", "exec")


def bench(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "minikv", "bench", "steps", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_the_command_on_depth30():
    done = bench("--model", "depth30", "--batches", "1,2", "--steps", "3", "--repeat", "1", "--prefill", "16",
                 "--context", "16", "--beside", "0.3", "--from-thread", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert set(report["seconds"]["minikv"]) == {"prefill", "decode_b1", "decode_b2"}
    ratios = report["beside"]["ratio_to_alone"]   # the same engine beside a busy thread, and a busy process
    assert set(ratios) == {"beside a thread", "beside a process"} and report["beside"]["duty"] == 0.3
    # three depth30 steps are ~30 ms, a difference of two calls: on a busy CI host it can come out <= 0,
    # which the bench says on stderr rather than hides; the ratios must still be numbers
    noisy = [v for shapes in report["samples"].values() for shape, vs in shapes.items() if shape != "prefill"
             for v in vs if v <= 0]
    assert bool(noisy) == ("raise --steps" in done.stderr), done.stderr[-2000:]
    assert all(set(r) == {"prefill", "decode_b1", "decode_b2"} and math.isfinite(r["prefill"])
               and all(math.isfinite(v) or noisy for v in r.values()) for r in ratios.values())
    # --from-thread: an engine in a process of its own stepped from its main thread, and one from a 2nd thread
    assert {"own process", "2nd thread"} <= set(report["seconds"])
    assert set(report["from_thread"]["ratio_to_main_thread"]) == {"prefill", "decode_b1", "decode_b2"}
    assert report["samples"]["minikv"]["prefill"] == [report["seconds"]["minikv"]["prefill"]]   # --repeat 1
    assert 0 < report["seconds"]["minikv"]["prefill"] < 10, report
    assert all(abs(s) < 10 for s in report["seconds"]["minikv"].values()), report


def test_without_vllm_it_says_how_to_get_it(capsys):
    assert cli(["--vllm", "--vllm-venv", "/nonexistent/venv", "--model", "depth30"]) == 2
    assert "make vllm" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [["--batches", "0"], ["--batches", "one"], ["--steps", "0"]])
def test_bad_options_say_what_is_wrong(bad, capsys):
    with pytest.raises(SystemExit) as stop:
        cli(bad)
    assert stop.value.code == 2 and bad[0] in capsys.readouterr().err


def test_bench_engine_alternates_its_runs_with_vllms(monkeypatch, capsys):
    """`bench engine --vllm` (a stand-in worker): minikv's runs and vLLM's take turns, the ratio is the median
    of the ratios of runs made side by side, and vLLM's tokens are compared with transformers'."""
    from minikv.__main__ import main
    from minikv.bench import engine

    order = []
    real_interleaved = engine.interleaved

    def logged(runs, repeat, pause=0):
        return real_interleaved({name: lambda name=name, run=run: order.append(name) or run()
                                 for name, run in runs.items()}, repeat, pause=0)

    monkeypatch.setattr(engine, "interleaved", logged)
    monkeypatch.setattr(engine, "vllm_worker", lambda model, requests: vllm_peer.Worker(
        {"scale": 1}, script=FAKE_WORKER, exe=sys.executable, timeout=120))
    assert main(["bench", "engine", "--model", "tiny-random-llama", "--quick", "--n", "3", "--systems",
                 "static,minikv", "--repeat", "3", "--vllm", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert order == ["minikv", "vllm", "vllm", "minikv", "minikv", "vllm"]
    mine, theirs = report["systems"]["minikv"]["runs"], report["systems"]["vllm"]["runs"]
    assert theirs == [pytest.approx(0.03)] * 3
    assert report["minikv_vs_vllm_runs"] == [pytest.approx(t / m) for m, t in zip(mine, theirs)]
    assert report["minikv_vs_vllm"] == pytest.approx(sorted(report["minikv_vs_vllm_runs"])[1])
    assert report["identical_to_transformers"] == 3 and report["vllm_identical_to_transformers"] == 0
    assert report["minikv_identical_to_vllm"] == 0   # the stand-in answers 7s: minikv's tokens are compared to them
    assert report["startup_seconds"]["vllm"] > 0


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_a_busy_neighbour_runs_while_the_call_does_and_stops_after(kind):
    import threading

    from minikv.bench.contention import beside

    seen = []

    def run(prompts, max_tokens):
        seen.append((threading.active_count(), len(multiprocessing.active_children())))
        return 1.5

    assert beside(run, kind, 0.5)([[1]], 1) == 1.5
    threads, children = seen[0]
    assert (threads > threading.active_count()) if kind == "thread" else children == 1
    assert not multiprocessing.active_children()


def test_a_neighbour_is_a_thread_or_a_process():
    from minikv.bench.contention import neighbour

    with pytest.raises(ValueError, match="'thread' or a 'process'"):
        with neighbour("fiber", 0.5):
            pass


def test_settle_waits_for_a_busy_process_to_end():
    """vLLM keeps a core busy for ~1 s after its work: the next timed call waits until the machine is idle."""
    from minikv.bench.vllm_peer import cores_busy, settle

    if cores_busy() is None:
        pytest.skip("no /proc/stat on this system: settle sleeps its pause only")
    spin = "import time\nend = time.perf_counter() + 1.5\nwhile time.perf_counter() < end: pass"
    busy = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.3)   # it is spinning by now
        waited = settle(pause=0.0, timeout=60)
        assert busy.poll() is not None, f"settle returned after {waited:.2f} s while a process still spun"
    finally:
        busy.kill()
        busy.wait()
    spin_long = subprocess.Popen([sys.executable, "-c", spin.replace("1.5", "30")])
    try:
        time.sleep(0.3)
        assert settle(pause=0.0, timeout=0.5) < 5   # a machine that stays busy: it gives up after its timeout
    finally:
        spin_long.kill()
        spin_long.wait()


def test_a_decode_step_lost_in_the_noise_is_said(monkeypatch, capsys):
    """A decode step is the difference of two calls; when N steps take no longer than one call's noise the
    difference is <= 0, and the bench says so and what to do instead of printing it as a step."""
    from types import SimpleNamespace

    import minikv.bench.steps as steps

    monkeypatch.setattr(steps, "load", lambda name: (SimpleNamespace(config=SimpleNamespace(vocab_size=1024)), None))
    monkeypatch.setattr(steps, "minikv_run", lambda model, tokenizer, **levers: lambda prompts, n: 0.01)
    assert cli(["--model", "depth30", "--batches", "1", "--steps", "3", "--repeat", "1", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["samples"]["minikv"]["decode_b1"] == [0.0]
    assert "minikv, decode_b1" in out.err and "raise --steps" in out.err
