"""The runner: an unmodified transformers model, one flattened row per step, KV through block tables.

Gold reference: the model's own plain forward (sdpa, no cache) on each sequence alone.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from minikv.blocks import blocks_for
from minikv.runner import ModelRunner
from minikv.sizing import kv_bytes_per_block
from minikv.speed.linears import mkl_packing
from minikv.step import SeqStep

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
    steps[1] = dataclasses.replace(steps[1], wants_logits=False)  # a chunk that is not a prompt's last: no logits
    # prompts with nothing cached (and more than one token) attend to themselves by SDPA; the rest by groups
    assert [n for _, n in runner.plan(steps)[0].fresh] == [9, 40]
    logits = runner.execute(steps)
    wanted = [i for i, s in enumerate(steps) if s.wants_logits]
    assert logits.shape == (len(wanted), VOCAB) and logits.dtype == torch.float32
    for row, i in enumerate(wanted):
        torch.testing.assert_close(logits[row], plain_last_logits(model, seqs[i]), atol=1e-5, rtol=1e-5)
    assert model.config._attn_implementation != "minikv_paged"  # the user's model is left as it was


def test_long_prefill_attends_in_tiles_with_the_same_logits(monkeypatch):
    """Past SCORE_BUDGET score elements a prefill group is attended a tile of queries at a time."""
    import minikv.runner as runner_module

    monkeypatch.setattr(runner_module, "SCORE_BUDGET", 700)  # tiles of a few query rows each
    model = tiny("llama")
    rng = random.Random(3)
    blocks = Blocks(num_blocks=64, block_size=7)
    runner = ModelRunner(model, 64, 7)
    seqs = [random_tokens(rng, n) for n in (45, 60, 30)]
    runner.execute([blocks.step(0, seqs[0][:20], wants_logits=False)])
    steps = [blocks.step(0, seqs[0][20:]), blocks.step(1, seqs[1]), blocks.step(2, seqs[2][:29], False)]
    groups = runner.plan(steps)[0].groups
    assert all(g.bias is None and g.q_tile < g.q_len for g in groups)
    logits = runner.execute(steps)
    for row, i in enumerate((0, 1)):
        torch.testing.assert_close(logits[row], plain_last_logits(model, seqs[i]), atol=1e-5, rtol=1e-5)


def test_prepacked_linears_are_swapped_in_only_while_executing():
    model = tiny("qwen2")  # with biases
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    runner = ModelRunner(model, 16, 16)
    assert runner.packed is not None and set(runner.packed.forwards) == set(linears)
    seen = []
    model.lm_head.register_forward_pre_hook(lambda m, args: seen.append("forward" in m.__dict__))
    runner.execute([SeqStep(0, [1, 5, 9], 0, [0], [0, 1, 2], True)])
    model(torch.tensor([[1, 5, 9]]))
    assert seen == [True, False]  # packed inside execute; the user's model computes as before outside it
    assert not any("forward" in m.__dict__ for m in linears)
    assert ModelRunner(model, 16, 16, prepack_linears=False).packed is None


PATHS = ["eager", "onednn"] + (["mkl"] if mkl_packing() else [])


@pytest.mark.parametrize("path", PATHS)
def test_every_forced_linear_path_gives_the_plain_forward_logits(monkeypatch, path):
    """linears="eager" runs every matmul on F.linear, "onednn" and "mkl" none (each on its packed copy); each
    gives the model's own logits (fp32, another summation order)."""
    model = tiny("qwen2")
    rng = random.Random(5)
    blocks = Blocks(num_blocks=16, block_size=16)
    runner = ModelRunner(model, 16, 16, linears=path)
    prompts = [random_tokens(rng, n) for n in (20, 9, 12, 5)]
    runner.execute([blocks.step(i, p[:-1], wants_logits=False) for i, p in enumerate(prompts)])
    eager = []
    real_linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a, **k: eager.append(a[1].shape) or real_linear(*a, **k))
    logits = runner.execute([blocks.step(i, p[-1:]) for i, p in enumerate(prompts)])
    monkeypatch.undo()
    layers = model.config.num_hidden_layers
    # q k v o gate up down per layer, and this tiny model's lm_head
    assert len(eager) == (7 * layers + 1 if path == "eager" else 0)
    assert {p.how for p in runner.packed.plans.values()} == {"forced"}
    for i in range(4):
        torch.testing.assert_close(logits[i], plain_last_logits(model, prompts[i]), atol=1e-5, rtol=1e-5)


def test_runners_of_one_model_share_its_packed_weights_until_a_weight_changes():
    from minikv.speed.linears import _packed

    model = tiny("llama")
    ModelRunner(model, 16, 16)
    before = _packed(model.lm_head)
    ModelRunner(model, 16, 16)
    assert _packed(model.lm_head) is before   # the second runner packed nothing again
    with torch.no_grad():
        model.lm_head.weight.mul_(2)   # an in-place change: the next runner must pack the new values
    step = SeqStep(0, [1, 5, 9], 0, [0], [0, 1, 2], True)
    logits = ModelRunner(model, 16, 16).execute([step])[0]
    assert _packed(model.lm_head) is not before
    torch.testing.assert_close(logits, plain_last_logits(model, [1, 5, 9]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 31, 32, 33, 200])
def test_merged_siblings_are_bitwise_their_separate_matmuls(rows, path):
    """q/k/v (with biases) and gate/up run as one matmul each: every slice is exactly the separate call's on the
    same path (on the eager path each sibling runs its own F.linear)."""
    from minikv.speed.linears import _packed

    model = tiny("qwen2")
    runner = ModelRunner(model, 16, 16, linears=path)
    layer = model.model.layers[1]
    x = torch.randn(rows, model.config.hidden_size)
    for group in ((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                  (layer.mlp.gate_proj, layer.mlp.up_proj)):
        merged = [runner.packed.forwards[m](x) for m in group]   # the first computes all, the others slice
        for m, out in zip(group, merged):
            alone = (torch.nn.functional.linear(x, m.weight, m.bias) if path == "eager"
                     else _packed(m).run(path, x, m.bias))
            assert torch.equal(out, alone)


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8, 13, 16, 31, 32, 48, 200])
@pytest.mark.parametrize("shape", [(576, 576), (960, 576), (576, 1536), (100, 64)])
def test_every_path_is_f_linear_at_every_row_count(rows, shape):
    """Each path of Packed is F.linear's result to within rounding (with a bias, on a [1, T, K] input, as the
    model calls it), MKL's for row counts other than the one its copy was packed for."""
    from minikv.speed.linears import Packed

    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(*shape, generator=gen), torch.randn(shape[0], generator=gen)
    x = torch.randn(1, rows, shape[1], generator=gen)
    packed = Packed(weight)
    with torch.inference_mode():
        want = torch.nn.functional.linear(x, weight, bias)
        for path in packed.paths:
            got = packed.run(path, x, bias)
            assert got.shape == (1, rows, shape[0])
            # outputs of order sqrt(K) (up to ~40 here): a few ulp of them
            torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-5)


def test_a_merged_sibling_given_another_input_computes_its_own():
    model = tiny("llama")
    runner = ModelRunner(model, 16, 16)
    attn = model.model.layers[0].self_attn
    x, y = torch.randn(3, 64), torch.randn(3, 64)
    q = runner.packed.forwards[attn.q_proj](x)
    k = runner.packed.forwards[attn.k_proj](y)   # not the input q_proj saw: no stale slice
    torch.testing.assert_close(q, torch.nn.functional.linear(x, attn.q_proj.weight), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, torch.nn.functional.linear(y, attn.k_proj.weight), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        attn.v_proj.weight.mul_(2)   # in place: the next runner packs the merged weight again
    v = ModelRunner(model, 16, 16).packed.forwards[attn.v_proj](x)
    torch.testing.assert_close(v, torch.nn.functional.linear(x, attn.v_proj.weight), atol=1e-5, rtol=1e-5)


def test_packed_linear_operator_is_the_linear_on_the_current_packed_weight():
    """The compiled graph's matmul operator: F.linear's result and fake shape, never a stale packed copy."""
    from minikv.speed.linears import packed_linear

    model = tiny("qwen2")
    ModelRunner(model, 16, 16)   # packs every linear
    proj = model.model.layers[0].self_attn.q_proj   # with a bias
    x = torch.randn(2, 3, proj.in_features)
    with torch.inference_mode():
        torch.testing.assert_close(packed_linear(x, proj.weight, proj.bias), torch.nn.functional.linear(
            x, proj.weight, proj.bias), atol=1e-5, rtol=1e-5)
    torch.library.opcheck(packed_linear, (x, proj.weight, proj.bias), test_utils=("test_schema", "test_faketensor"))
    with torch.no_grad():
        proj.weight.mul_(2)   # in place: the operator must not use the old packed copy
    with torch.inference_mode():
        torch.testing.assert_close(packed_linear(x, proj.weight, None), x @ proj.weight.T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows", [2, 5])
def test_merged_linear_operator_is_the_siblings_side_by_side(rows, path):
    """The compiled graph's operator for sibling linears: their outputs side by side, bitwise the eager merged
    path's on the active plan's path, never on a stale packed copy."""
    from minikv.speed.linears import merged_linear

    model = tiny("qwen2")
    runner = ModelRunner(model, 16, 16, linears=path)   # packs the merged siblings
    attn = model.model.layers[0].self_attn
    group = (attn.q_proj, attn.k_proj, attn.v_proj)
    x = torch.randn(rows, attn.q_proj.in_features)
    args = (x, [m.weight for m in group], [m.bias for m in group])
    with torch.inference_mode(), runner.packed.active():
        assert torch.equal(merged_linear(*args), torch.cat([runner.packed.forwards[m](x) for m in group], -1))
    torch.library.opcheck(merged_linear, args, test_utils=("test_schema", "test_faketensor"))
    with torch.no_grad():
        attn.k_proj.weight.mul_(2)   # in place: the operator must not use the old merged copy
    with torch.inference_mode(), runner.packed.active():
        torch.testing.assert_close(merged_linear(*args), torch.cat(
            [torch.nn.functional.linear(x, m.weight, m.bias) for m in group], -1), atol=1e-5, rtol=1e-5)


def test_compiled_decode_step_runs_its_matmuls_on_the_packed_weights():
    """compile=True with packed linears: every matmul of a compiled decode step of five sequences runs on the
    copies packed at start (no sgemm on raw weights, no packing per step): one merged_linear per sibling group
    (q/k/v with their biases, gate/up), packed_linear for the others."""
    from torch.profiler import profile

    from minikv_kernels import paged_attention_cpu

    if paged_attention_cpu.load() is None:
        pytest.skip(f"compile=True needs the CPU kernel: {paged_attention_cpu.why_not}")
    model = tiny("qwen2")
    path = "mkl" if mkl_packing() else "onednn"
    runner = ModelRunner(model, 64, 16, compile=True, linears=path)
    blocks = Blocks(64, 16)
    for i in range(5):
        runner.execute([blocks.step(i, [1] + [5 + i] * 20)])
    steps = [blocks.step(i, [7]) for i in range(5)]
    before = runner.compiled.steps
    with profile() as prof:
        runner.execute(steps)
    assert runner.compiled.steps == before + 1
    calls = {e.key: e.count for e in prof.key_averages()}
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    layers = model.config.num_hidden_layers
    assert "minikv_speed::merged_linear" in calls
    # 7 linears a layer: 2 merged + 2, each on the forced path's packed copy
    packed_op = "mkl::_mkl_linear" if path == "mkl" else "mkldnn::_linear_pointwise"
    assert calls.get(packed_op) == linears - 3 * layers
    logits = runner.execute([blocks.step(i, [9]) for i in range(5)])
    for i in range(5):
        torch.testing.assert_close(logits[i], plain_last_logits(model, [1] + [5 + i] * 20 + [7, 9]), atol=1e-5,
                                   rtol=1e-5)
    assert not {"aten::mm", "aten::addmm", "aten::linear", "mkldnn::_reorder_linear_weight",
                "mkl::_mkl_reorder_linear_weight"} & set(calls)


def greedy_loop(runner: ModelRunner, prompts: list[list[int]], max_new: list[int], chunk: int = 10**9,
                block_size: int = 16, execute=None, blocks: Blocks | None = None) -> list[list[int]]:
    """The engine's shape in miniature: chunked prefill, then one decode token per sequence per step."""
    blocks = blocks or Blocks(runner.num_blocks, block_size)
    execute = execute or runner.execute
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
        logits = execute(steps)
        for row, i in enumerate(i for i, s in zip(who, steps) if s.wants_logits):
            outputs[i].append(int(logits[row].argmax()))
    return outputs


def test_decode_graph_plan_pads_into_a_scratch_block_and_keeps_the_tokens():
    """The CUDA-graph decode plan (persistent buffers, padding to captured sizes, scratch block), run eagerly."""
    from minikv.speed.graphs import DecodeGraphPlan, graph_batch_sizes

    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(5) == [1, 2, 4, 8] and graph_batch_sizes(20) == [1, 2, 4, 8, 16, 32]
    model = tiny("llama")
    rng = random.Random(2)
    prompts = [random_tokens(rng, n) for n in (3, 17, 40, 9, 22)]
    max_new = [12, 5, 9, 15, 7]
    expected = greedy_loop(ModelRunner(model, 64, 16), prompts, max_new)
    runner = ModelRunner(model, 65, 16)  # block 64 is the scratch block: the test's Blocks hand out 0..63
    plan = DecodeGraphPlan(max_num_seqs=8, max_blocks_per_seq=4, block_size=16, scratch_block=64)
    sizes = []

    def execute(steps):
        if any(len(s.token_ids) > 1 for s in steps):
            return runner.execute(steps)  # prefill stays eager
        sizes.append((len(steps), plan.load(steps)))
        return runner.execute(plan.steps())[: plan.real]

    assert greedy_loop(runner, prompts, max_new, execute=execute, blocks=Blocks(64, 16)) == expected
    assert (5, 8) in sizes and (3, 4) in sizes and (1, 1) in sizes
    with pytest.raises(ValueError, match="decodes only"):
        plan.load([SeqStep(0, [1, 2], 0, [0], [0, 1], True)])


def test_decode_graphs_run_their_buffers_step_plans_eagerly_on_the_cpu():
    """DecodeGraphs without capture: every decode step goes through the persistent buffers and the step plan
    a graph would be captured on (padding rows in the scratch block), and the tokens stay transformers'."""
    from minikv.speed.graphs import DecodeGraphs
    from minikv_kernels import paged_attention_cpu

    if paged_attention_cpu.load() is None:
        pytest.skip(f"decode graphs need a decode kernel: {paged_attention_cpu.why_not}")
    model = tiny("llama")
    rng = random.Random(5)
    prompts = [random_tokens(rng, n) for n in (3, 17, 40, 9, 22)]
    max_new = [12, 5, 9, 15, 7]
    runner = ModelRunner(model, 65, 16)
    runner.graphs = graphs = DecodeGraphs(runner, max_num_seqs=8, max_blocks_per_seq=8, scratch_block=64)
    assert not graphs.capture and set(graphs.step_plans) == {1, 2, 4, 8}
    blocks, sizes, load = Blocks(64, 16), [], graphs.plan.load
    graphs.plan.load = lambda steps: sizes.append((len(steps), load(steps))) or sizes[-1][1]
    got = greedy_loop(runner, prompts, max_new, chunk=8, blocks=blocks)
    assert got == [hf_greedy(model, p, n) for p, n in zip(prompts, max_new)]
    assert graphs.replays > 10 and (5, 8) in sizes and (3, 4) in sizes  # padded steps among them
    # Padding rows wrote into the scratch block only: every block no sequence was given is still zero.
    assert all(store[:, b].abs().sum() == 0 for store in runner.k_stores + runner.v_stores for b in blocks.free)
    with pytest.raises(ValueError, match="capturing CUDA graphs needs a CUDA model"):
        DecodeGraphs(runner, 8, 8, 64, capture=True)
    with pytest.raises(ValueError, match="need a decode kernel"):
        DecodeGraphs(ModelRunner(model, 65, 16, cpu_kernel=False), 8, 8, 64)


def test_engine_decode_graphs_option_keeps_the_tokens():
    from minikv.engine import LLM
    from minikv.sampling import SamplingParams
    from minikv_kernels import paged_attention_cpu

    if paged_attention_cpu.load() is None:
        pytest.skip(f"decode graphs need a decode kernel: {paged_attention_cpu.why_not}")
    model = tiny("llama")
    rng = random.Random(6)
    prompts = [random_tokens(rng, n) for n in (5, 30, 12)]
    llm = LLM(model, num_blocks=32, max_num_seqs=4, decode_graphs=True, verbose=False)
    assert llm.engine.runner.num_blocks == 33 and llm.engine.bm.num_blocks == 32  # one scratch block more
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 10) for p in prompts]
    assert llm.engine.runner.graphs.replays > 0
    with pytest.raises(ValueError, match="cannot be combined with runner="):
        LLM(model, num_blocks=32, decode_graphs=True, runner=ModelRunner(model, 33, 16), verbose=False)


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("cpu_kernel", [None, False], ids=["default", "gather"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_greedy_tokens_equal_generate(kind, cpu_kernel):
    """Both CPU decode paths: the C++ kernel (the default where it builds) and the gather + matmul one."""
    from minikv_kernels import paged_attention_cpu

    model = tiny(kind)
    rng = random.Random(1)
    prompts = [random_tokens(rng, n) for n in (3, 17, 40, 9)]
    max_new = [12, 5, 9, 15]
    runner = ModelRunner(model, 64, 16, cpu_kernel=cpu_kernel)
    built = cpu_kernel is None and paged_attention_cpu.load() is not None
    assert runner.attn_backend == ("cpu" if built else "gather")
    got = greedy_loop(runner, prompts, max_new, chunk=8)
    assert got == [hf_greedy(model, p, n) for p, n in zip(prompts, max_new)]


def test_compiled_decode_steps_give_the_same_tokens():
    """compile=True: one graph, compiled at start on a warm-up step (five decodes and a six-token prompt), serves
    every later step without recompiling: prefill chunks, decodes of other batch sizes and table widths, both
    mixed, steps that sample nothing or one row; attention runs outside it, reading each step's plan. That is
    checked with Dynamo's guards kept, and it is why the engine may skip them after the warm-up
    (minikv.speed.compile): the same prompts then give the same tokens."""
    from minikv_kernels import paged_attention_cpu

    if paged_attention_cpu.load() is None:
        pytest.skip(f"compile=True needs the CPU kernel: {paged_attention_cpu.why_not}")
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()   # reset() keeps them: an earlier test's graph would count here
    model = tiny("llama")
    rng = random.Random(4)
    prompts = [random_tokens(rng, n) for n in (3, 17, 40, 9, 33)]
    max_new = [12, 5, 30, 15, 20]
    runner = ModelRunner(model, 64, 16, compile=True)
    assert runner.compiled.startup_s > 0 and runner.compiled.steps == 1  # the warm-up step
    skippable = runner.compiled.skip_guards   # the default where this torch can (MINIKV_COMPILE_GUARDS unset)
    runner.compiled.skip_guards = False
    expected = [hf_greedy(model, p, n) for p, n in zip(prompts, max_new)]
    assert greedy_loop(runner, prompts, max_new, chunk=8) == expected
    assert runner.compiled.steps > 10
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames == 1, f"{frames} graphs compiled: a step of another shape or structure recompiled"
    if not skippable:
        return
    runner.compiled.skip_guards = True
    steps = runner.compiled.steps
    assert greedy_loop(runner, prompts, max_new, chunk=8) == expected
    assert runner.compiled.steps > steps + 10


def test_cpu_kernel_falls_back_to_the_gather_path_when_it_cannot_be_built(monkeypatch):
    """No compiler (say): the default quietly keeps the gather path; asking for the kernel says why not."""
    from minikv_kernels import paged_attention_cpu

    monkeypatch.setattr(paged_attention_cpu, "load", lambda verbose=False: None)
    monkeypatch.setattr(paged_attention_cpu, "why_not", "RuntimeError: no C++ compiler")
    model = tiny("llama")
    assert ModelRunner(model, 16, 16).attn_backend == "gather"
    with pytest.raises(RuntimeError, match="no C.. compiler"):
        ModelRunner(model, 16, 16, cpu_kernel=True)
    with pytest.raises(ValueError, match="float32 model on the CPU"):
        ModelRunner(tiny("llama").half(), 16, 16, cpu_kernel=True)


def test_kernel_path_under_the_interpreter_gives_the_same_tokens():
    """The CUDA code path (Triton kernel for decodes), run by Triton's CPU interpreter in fp32."""
    pytest.importorskip("triton")
    model = tiny("llama")
    rng = random.Random(2)
    prompts = [random_tokens(rng, n) for n in (5, 19, 11)]
    max_new = [4, 3, 4]
    torch_path = greedy_loop(ModelRunner(model, 32, 16, use_kernel=False), prompts, max_new)
    kernel_runner = ModelRunner(model, 32, 16, use_kernel=True)
    assert kernel_runner.attn_backend == "triton"
    assert greedy_loop(kernel_runner, prompts, max_new) == torch_path


def test_copy_swap_and_bytes_per_block():
    model = tiny("llama")
    runner = ModelRunner(model, 8, 4)
    config = model.config
    assert runner.bytes_per_block == 2 * config.num_hidden_layers * 4 * 2 * 16 * 4
    assert kv_bytes_per_block(config, 4, torch.float16) == runner.bytes_per_block // 2
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


def test_bench_engine_repeats_and_ablates(capsys):
    """--repeat times each system (and each lever switched off) that many times and keeps the median; the
    levers are the runner's switches and keep the tokens; --vllm on another model says why it skips."""
    import json

    from minikv.__main__ import main

    argv = ["bench", "engine", "--model", "tiny-random-llama", "--quick", "--n", "3", "--systems", "static,minikv",
            "--repeat", "2", "--ablate", "--vllm", "--json"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{"):])
    assert all(len(r["runs"]) == 2 and r["seconds"] == min(r["runs"]) for r in report["systems"].values())
    assert set(report["ablation"]) == {"prepacked linears", "CPU attention kernel", "any lever"}
    assert all(a["identical"] == 3 and len(a["runs"]) == 2 for a in report["ablation"].values())
    assert "vllm: skipped" in out and "vllm" not in report["systems"]
