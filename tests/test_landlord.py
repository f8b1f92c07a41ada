"""The landlord's feed without a browser: what the engine's pool view says, step by step, is what the
block manager holds; every eviction is logged with its request; snapshots are throttled and built only
while someone watches. (The page itself, in Chromium under load: tests/test_landlord_page.py.)"""

from __future__ import annotations

import json

from test_runner import tiny

from minikv.engine import LLMEngine
from minikv.sampling import SamplingParams
from minikv.server.landlord import Feed
from minikv.viz.landlord import landlord_figure

SYSTEM = list(range(100, 135))   # 35 tokens: two full blocks of 16 shared by every request


def _engine(**kw) -> LLMEngine:
    return LLMEngine(tiny("llama"), num_blocks=16, block_size=16, max_num_seqs=6, verbose=False, **kw)


def _fill(eng: LLMEngine, n: int = 6) -> None:
    for i in range(n):
        eng.add_request(f"r{i}", {"prompt_token_ids": SYSTEM + [3 + i] * (4 + i)},
                        SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))


def test_every_snapshot_is_the_pool_the_engine_holds():
    eng, feed = _engine(), Feed(min_interval=0.0)
    feed.streams = 1                      # someone watches: build a snapshot after every step
    _fill(eng)
    seen_shared, logged, preempted = 0, [], set()
    while eng.has_unfinished_requests():
        preempted |= {out.request_id for out in eng.step() if out.metrics.preemptions}
        feed.after_step(eng)
        snap = json.loads(feed.snapshot)
        bm = eng.bm
        assert snap["counts"]["blocks_used"] == sum(r > 0 for r in snap["refcount"]) == \
            eng.num_blocks - bm.num_free_blocks
        assert snap["counts"]["blocks_cached"] == sum(snap["cached"])
        assert all(not (r and c) for r, c in zip(snap["refcount"], snap["cached"])), "a held block drawn as free"
        for t in snap["tenants"]:
            if t["state"] == "running":
                assert t["blocks"] == len(bm.block_table(t["seq_id"]))
        seen_shared = max(seen_shared, max(snap["refcount"]))
        logged = snap["preemptions"]
    assert seen_shared >= 2, "six prompts share two full blocks: the view never showed a shared one"
    assert logged and {p["request"] for p in logged} <= preempted
    assert len(logged) == min(eng.scheduler.num_preemptions, 20)
    assert all(p["blocks"] > 0 and p["mode"] == "recompute" for p in logged)
    fig = landlord_figure(json.loads(feed.snapshot))
    assert fig.axes and fig.axes[0].get_title().startswith("step")


def test_snapshots_are_throttled_and_only_built_while_watched():
    eng, feed = _engine(), Feed(min_interval=3600.0)
    _fill(eng, 2)
    eng.step()
    feed.after_step(eng)
    assert feed.snapshot is None, "nobody watches: no snapshot should be built"
    feed.after_step(eng, force=True)          # the engine going idle always publishes
    assert feed.version == 1
    feed.streams = 1
    for _ in range(5):
        eng.step()
        feed.after_step(eng)
    assert feed.version == 1, "one snapshot an hour at most: the steps since must not have built any"


def test_steps_route_returns_the_engines_step_record_exactly():
    """/landlord/steps is the engine's own per-step record (what a step plot draws), each step once, in order,
    even when the feed is called again without a new step (the loop forces a call when it goes idle)."""
    from dataclasses import asdict
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from minikv.server.app import ServerState, create_app

    eng, feed = _engine(), Feed()
    _fill(eng)
    while eng.has_unfinished_requests():
        eng.step()
        feed.after_step(eng)
        feed.after_step(eng, force=True)          # no new step: nothing may be recorded twice
    app = create_app(ServerState(SimpleNamespace(engine=eng), None, "m", api_key="k", landlord=feed))
    http, key = TestClient(app), {"Authorization": "Bearer k"}
    body = http.get("/landlord/steps", headers=key).json()
    want = [asdict(s) for s in eng.stats(history=None).steps]
    assert body["steps"] == want and body["last"] == want[-1]["step"]
    assert sum(r["preemptions"] for r in body["steps"]) == eng.scheduler.num_preemptions > 0
    half = want[len(want) // 2]["step"]
    tail = http.get(f"/landlord/steps?since={half}", headers=key).json()
    assert tail["steps"] == [r for r in want if r["step"] > half]
    empty = http.get(f"/landlord/steps?since={body['last']}", headers=key).json()
    assert empty == {"steps": [], "last": body["last"]}
    bad = http.get("/landlord/steps?since=soon", headers=key)
    assert bad.status_code == 400 and "not an integer" in bad.text
    assert http.get("/landlord/steps").status_code == 401
