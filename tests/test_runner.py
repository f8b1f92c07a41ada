"""The runner: an unmodified transformers model, one flattened row per step, KV through block tables.

Gold reference: the model's own plain forward (sdpa, no cache) on each sequence alone.
"""

from __future__ import annotations

import random

import pytest
import torch

from minikv.blocks import blocks_for
from minikv.runner import ModelRunner, SeqStep

VOCAB = 256


def tiny(kind: str):
    """A seeded 2-layer model of each Llama-family architecture (GQA: 4 query heads, 2 KV heads)."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = {
        "llama": lambda: transformers.LlamaConfig(head_dim=16, **common),
        "qwen2": lambda: transformers.Qwen2Config(**common),  # q/k/v projections carry biases
        "mistral": lambda: transformers.MistralConfig(sliding_window=None, head_dim=16, **common),
    }[kind]()
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "mistral": transformers.MistralForCausalLM}[kind]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(config)
        if kind == "qwen2":  # biases start at zero; make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    torch.nn.init.normal_(proj.bias, std=0.5)
    return model.eval()


class Blocks:
    """Just enough block bookkeeping for tests: random physical blocks, so tables are scattered."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0):
        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def step(self, seq_id: int, tokens: list[int], wants_logits: bool = True) -> SeqStep:
        table = self.tables.setdefault(seq_id, [])
        start = self.lengths.get(seq_id, 0)
        end = start + len(tokens)
        while len(table) < blocks_for(end, self.block_size):
            table.append(self.free.pop())
        self.lengths[seq_id] = end
        slots = [table[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, end)]
        return SeqStep(seq_id, list(tokens), start, list(table), slots, wants_logits)


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [1] + [rng.randrange(3, VOCAB) for _ in range(n - 1)]


@torch.no_grad()
def plain_last_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0, -1].float()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("block_size", [1, 7, 16])
def test_mixed_step_matches_plain_forward(kind, block_size):
    """Prefill chunks at different start positions and decodes in ONE flattened forward."""
    model = tiny(kind)
    rng = random.Random(block_size)
    blocks = Blocks(num_blocks=600 // block_size + 40, block_size=block_size, seed=block_size)
    runner = ModelRunner(model, 600 // block_size + 40, block_size)
    # (cached prefix, tokens this step): fresh prompts, later chunks, decodes at various lengths.
    shapes = [(0, 9), (13, 20), (0, 1), (30, 1), (5, 1), (40, 33), (17, 1), (0, 40)]
    seqs = [random_tokens(rng, cached + new) for cached, new in shapes]
    warmup = [blocks.step(i, seq[:cached], wants_logits=False)
              for i, (seq, (cached, _)) in enumerate(zip(seqs, shapes)) if cached]
    runner.execute(warmup)
    steps = [blocks.step(i, seq[cached:]) for i, (seq, (cached, _)) in enumerate(zip(seqs, shapes))]
    steps[1].wants_logits = False  # a chunk that is not a prompt's last: no logits row for it
    logits = runner.execute(steps)
    wanted = [i for i, s in enumerate(steps) if s.wants_logits]
    assert logits.shape == (len(wanted), VOCAB) and logits.dtype == torch.float32
    for row, i in enumerate(wanted):
        torch.testing.assert_close(logits[row], plain_last_logits(model, seqs[i]), atol=1e-5, rtol=1e-5)
    assert model.config._attn_implementation != "minikv_paged"  # the user's model is left as it was


def greedy_loop(runner: ModelRunner, prompts: list[list[int]], max_new: list[int], chunk: int = 10**9,
                block_size: int = 16) -> list[list[int]]:
    """The engine's shape in miniature: chunked prefill, then one decode token per sequence per step."""
    blocks = Blocks(runner.num_blocks, block_size)
    done_prefill = [0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    while any(len(o) < m for o, m in zip(outputs, max_new)):
        steps, who = [], []
        for i, prompt in enumerate(prompts):
            if len(outputs[i]) >= max_new[i]:
                continue
            if done_prefill[i] < len(prompt):
                piece = prompt[done_prefill[i]: done_prefill[i] + chunk]
                done_prefill[i] += len(piece)
                steps.append(blocks.step(i, piece, wants_logits=done_prefill[i] == len(prompt)))
            else:
                steps.append(blocks.step(i, outputs[i][-1:]))
            who.append(i)
        logits = runner.execute(steps)
        for row, i in enumerate(i for i, s in zip(who, steps) if s.wants_logits):
            outputs[i].append(int(logits[row].argmax()))
    return outputs


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_greedy_tokens_equal_generate(kind):
    model = tiny(kind)
    rng = random.Random(1)
    prompts = [random_tokens(rng, n) for n in (3, 17, 40, 9)]
    max_new = [12, 5, 9, 15]
    runner = ModelRunner(model, 64, 16)
    got = greedy_loop(runner, prompts, max_new, chunk=8)
    assert got == [hf_greedy(model, p, n) for p, n in zip(prompts, max_new)]


def test_kernel_path_under_the_interpreter_gives_the_same_tokens():
    """The CUDA code path (Triton kernel for decodes), run by Triton's CPU interpreter in fp32."""
    pytest.importorskip("triton")
    model = tiny("llama")
    rng = random.Random(2)
    prompts = [random_tokens(rng, n) for n in (5, 19, 11)]
    max_new = [4, 3, 4]
    torch_path = greedy_loop(ModelRunner(model, 32, 16, use_kernel=False), prompts, max_new)
    kernel_runner = ModelRunner(model, 32, 16, use_kernel=True)
    assert kernel_runner.use_kernel
    assert greedy_loop(kernel_runner, prompts, max_new) == torch_path


def test_copy_swap_and_bytes_per_block():
    model = tiny("llama")
    runner = ModelRunner(model, 8, 4)
    config = model.config
    assert runner.bytes_per_block == 2 * config.num_hidden_layers * 4 * 2 * 16 * 4
    assert ModelRunner.bytes_per_block_for(config, 4, torch.float16) == runner.bytes_per_block // 2
    for pool in runner.k_pools + runner.v_pools:
        pool.normal_()
    before = [p.clone() for p in runner.k_pools + runner.v_pools]
    runner.copy_blocks([(1, 5), (2, 6)])
    for old, pool in zip(before, runner.k_pools + runner.v_pools):
        assert torch.equal(pool[5], old[1]) and torch.equal(pool[6], old[2]) and torch.equal(pool[0], old[0])
    data = runner.swap_out([1, 3])
    assert data.device.type == "cpu" and data.shape == (2, 2, 2, 4, 2, 16)
    runner.swap_in(data, [7, 0])
    for old, pool in zip(before, runner.k_pools + runner.v_pools):
        assert torch.equal(pool[7], old[1]) and torch.equal(pool[0], old[3])
    with pytest.raises(ValueError, match="swap_out"):
        runner.swap_in(data, [7])


def test_swap_round_trip_keeps_generation_exact():
    """Swap a sequence's blocks out, into other blocks, and keep decoding: same tokens."""
    model = tiny("llama")
    runner = ModelRunner(model, 16, 4)
    prompt = random_tokens(random.Random(3), 10)
    blocks = Blocks(16, 4)
    logits = runner.execute([blocks.step(0, prompt)])
    token = int(logits[0].argmax())
    table = blocks.tables[0]
    data = runner.swap_out(table)
    new_table = [blocks.free.pop() for _ in table]  # other blocks, taken from the free list
    runner.swap_in(data, new_table)
    blocks.tables[0] = new_table
    tokens = [token]
    for _ in range(5):
        tokens.append(int(runner.execute([blocks.step(0, [tokens[-1]])])[0].argmax()))
    assert tokens == hf_greedy(model, prompt, 6)


@pytest.mark.parametrize(
    "step, words",
    [
        (SeqStep(0, [5, 6], 0, [0], [0], True), "one slot per token"),
        (SeqStep(0, [5] * 5, 0, [0], list(range(5)), True), "append before executing"),
        (SeqStep(0, [5], 0, [99], [99 * 4], True), "outside the pool"),
    ],
)
def test_bad_steps_are_refused_with_the_reason(step, words):
    runner = ModelRunner(tiny("llama"), 8, 4)
    with pytest.raises(ValueError, match=words):
        runner.execute([step])


def test_step_with_no_logits_still_fills_the_cache():
    model = tiny("llama")
    runner = ModelRunner(model, 16, 4)
    blocks = Blocks(16, 4)
    prompt = random_tokens(random.Random(4), 12)
    assert runner.execute([blocks.step(0, prompt[:7], wants_logits=False)]).shape == (0, VOCAB)
    logits = runner.execute([blocks.step(0, prompt[7:])])
    torch.testing.assert_close(logits[0], plain_last_logits(model, prompt), atol=1e-5, rtol=1e-5)


def test_split_by_length_groups_similar_lengths():
    from minikv.runner import split_by_length

    lens = [300, 20, 18, 310, 25, 150, 160, 22]
    groups = split_by_length(lens, 16)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    assert [sorted(lens[i] for i in g) for g in groups] == [[18, 20, 22, 25], [150, 160], [300, 310]]
    assert split_by_length([30] * 10, 16) == [list(range(10))]  # equal lengths: one group


def test_bench_engine_quick_smoke(capsys):
    """`python -m minikv bench engine` end to end on the tiny Llama, a few requests (no timing asserted)."""
    import json

    from minikv.__main__ import main

    assert main(["bench", "engine", "--model", "tiny-random-llama", "--quick", "--n", "3", "--json", "--profile"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["systems"]) == {"static", "continuous", "minikv"}
    assert report["identical_to_transformers"] == 3 and report["continuous_identical_to_static"] == 3
    assert report["profile"]["steps"] > 0
