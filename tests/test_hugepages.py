"""minikv.speed.hugepages: packed weights move onto huge pages in place (same bytes, same results), only once 4 KiB
pages have cost the steps what the move will (ski rental), at once or never when told, and not at all where the
kernel cannot."""

from __future__ import annotations

import platform

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.speed import hugepages
from minikv.speed.choose import Choices
from minikv.speed.hugepages import HUGE, HugePages, Verdict, collapse, decide


class FakeKernel:
    """collapse() as a kernel that moves every byte it is given, in `seconds` per call; records what it moved."""

    def __init__(self, monkeypatch, moves: bool = True):
        self.calls: list[int] = []
        self.moves = moves

        def fake(tensors):
            moved = sum(t.nbytes for t in tensors) if self.moves else 0
            self.calls.append(moved)
            return moved

        monkeypatch.setattr(hugepages, "collapse", fake)
        monkeypatch.setattr(hugepages, "span", lambda t: (t.data_ptr(), t.nbytes))


def tensors(n: int = 4) -> list[torch.Tensor]:
    return [torch.zeros(1 << 20) for _ in range(n)]   # 4 MiB each


def test_nothing_moves_before_the_steps_have_paid_for_it(monkeypatch, tmp_path):
    kernel = FakeKernel(monkeypatch)
    remembered = Choices(tmp_path / "choices.json")   # not the host's file
    monkeypatch.setattr(hugepages, "choices", lambda: remembered)
    move = HugePages(tensors(), Verdict(0.25, 1 / 16, "test", question="q"))   # 16 MiB: 1 s to move
    assert move.cost == 1.0 and kernel.calls == [] and move.done is None
    for _ in range(3):
        move.after_step(1.0)              # 0.25 s lost each
    assert move.done is None and kernel.calls == []
    move.after_step(1.0)                  # 1.0 s lost: what the move costs
    assert move.done == 16 << 20 and kernel.calls == [16 << 20]
    move.after_step(1.0)
    assert len(kernel.calls) == 1         # once only
    assert str(move) == "16 of 16 MiB"


def test_now_moves_at_once_and_a_move_that_moved_nothing_is_not_tried_again(monkeypatch):
    kernel = FakeKernel(monkeypatch)
    assert HugePages(tensors(), Verdict(0.0, 0.0, "on"), now=True).done == 16 << 20
    kernel.moves = False
    move = HugePages(tensors(), Verdict(0.5, 0.0, "test"))
    for _ in range(100):
        move.after_step(10.0)
    assert move.done == 0 and kernel.calls == [16 << 20, 0]


def test_a_move_remembers_what_it_cost_for_the_next_start(monkeypatch, tmp_path):
    FakeKernel(monkeypatch)
    remembered = Choices(tmp_path / "choices.json")
    monkeypatch.setattr(hugepages, "choices", lambda: remembered)
    remembered.put({"q": {"path": "huge", "ms": {"huge": 1.0, "4k": 2.0}, "move_s_per_mib": 123.0}})
    HugePages(tensors(), Verdict(0.5, 123.0, "test", question="q"), now=True)
    entry = Choices(tmp_path / "choices.json").get("q")
    assert entry["path"] == "huge" and 0 <= entry["move_s_per_mib"] < 1.0   # the fake move took no time


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.floats(0.0, 2.0), max_size=60), saving=st.floats(0.01, 0.5), cost=st.floats(0.0, 5.0))
def test_the_rule_pays_at_most_twice_the_better_choice_in_hindsight(steps, saving, cost):
    """Ski rental: what the run pays for 4 KiB pages plus the move, against the cheaper of never moving and moving
    before the first step. It moves at the first step where the rent reaches the cost, never before."""
    move = HugePages([], Verdict(saving, 0.0, "test"))
    move.cost = cost
    moved_at, rent = None, 0.0
    for i, seconds in enumerate(steps):
        if move.done is None:
            rent += seconds * saving
        move.after_step(seconds)
        if move.done is not None and moved_at is None:
            moved_at = i
    paid = rent + (cost if moved_at is not None else 0.0)
    hindsight = min(sum(steps) * saving, cost)
    assert paid <= 2 * hindsight + max(steps, default=0.0) * saving + 1e-9
    if moved_at is not None:
        assert moved_at == 0 or sum(steps[:moved_at]) * saving < cost   # not a step before
        assert cost <= sum(steps[:moved_at + 1]) * saving + 1e-9
    else:
        assert sum(steps) * saving < cost + 1e-9


def test_env_forces_and_refuses_nonsense(monkeypatch):
    weight = torch.randn(3072, 576)
    pack = lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None)  # noqa: E731
    monkeypatch.setenv("MINIKV_HUGEPAGES", "off")
    assert decide(weight, pack).saving is None
    monkeypatch.setenv("MINIKV_HUGEPAGES", "on")
    assert decide(weight, pack).saving == 0.0
    monkeypatch.setenv("MINIKV_HUGEPAGES", "always")
    with pytest.raises(ValueError, match="on, off, measure"):
        decide(weight, pack)
    monkeypatch.delenv("MINIKV_HUGEPAGES")
    assert decide(torch.randn(64, 64), pack).how == "weights smaller than a huge page"


@pytest.mark.skipif(platform.system() != "Linux", reason="madvise(MADV_COLLAPSE) is Linux's")
def test_a_packed_weight_moved_onto_huge_pages_keeps_its_bytes_and_its_results():
    weight = torch.randn(3072, 576)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    x = torch.randn(8, 576)
    before = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    moved = collapse([packed])
    if moved == 0:
        pytest.skip("this kernel makes no huge pages on request (MADV_COLLAPSE needs Linux 6.1)")
    assert HUGE <= moved <= torch.ops.mkldnn._nbytes(packed)
    huge_kib = int(next(line.split()[1] for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHuge")))
    assert huge_kib * 1024 >= moved
    assert torch.equal(torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), before)


def test_bench_hugepages_prints_each_shape_and_row_count_beside_its_control(capsys):
    from minikv.bench import hugepages as bench

    assert bench.cli(["--copies", "2", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    if "makes no huge pages" in out:
        pytest.skip("this kernel makes no huge pages on request")
    lines = [line for line in out.splitlines() if "huge/4k" in line]
    assert len(lines) == len(bench.SHAPES) * 3, out
    for name in bench.SHAPES:
        for rows in (1, 8, 32):
            assert any(line.startswith(f"{name}, {rows:>2} rows") for line in lines), (name, rows, out)


def huge_kib_of(address: int) -> int:
    """AnonHugePages of the one mapping that holds `address` (/proc/self/smaps): this buffer's, no one else's."""
    inside = False
    for line in open("/proc/self/smaps"):
        first = line.split()[0]
        if "-" in first and ":" not in first:   # a mapping's header: start-end perms ...
            lo, hi = (int(x, 16) for x in first.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(platform.system() != "Linux", reason="transparent huge pages are Linux's")
def test_a_buffer_asked_for_huge_pages_before_its_first_touch_gets_them():
    buffer = hugepages.empty_on_huge_pages(8 * HUGE)
    assert buffer is not None and buffer.numel() == 8 * HUGE and buffer.data_ptr() % HUGE == 0
    buffer.view(torch.float32).fill_(1.0)
    if open("/sys/kernel/mm/transparent_hugepage/enabled").read().find("[never]") >= 0:
        pytest.skip("transparent huge pages are off on this machine")
    assert huge_kib_of(buffer.data_ptr()) >= 4 * HUGE // 1024   # most of it: the kernel may fall back page by page
    assert float(buffer.view(torch.float32).sum()) == 8 * HUGE // 4   # every float of it, written and read
