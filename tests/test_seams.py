"""The engine's seams: the duck types have protocols that the real classes meet, bytes per block has one
rule, and every SamplingParams / LLM argument is checked with a message that names it (and `.param`)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from minikv import LLM, SamplingParams
from minikv.grading.checks.ex05_prefix import Adapter, Reference
from minikv.models import tiny_random_llama
from minikv.paged import PagedKVCache, TableManager
from minikv.prefix import BlockManager, BlockManagerProtocol
from minikv.runner import ModelRunner, Runner
from minikv.sim.fake_runner import FakeRunner
from minikv.sizing import kv_bytes_per_block, kv_bytes_per_token
from minikv.validation import InvalidArgument, InvalidArgumentType

MODEL = tiny_random_llama()


def protocol_methods(protocol) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(member) for name, member in vars(protocol).items()
            if callable(member) and not name.startswith("_")}


def assert_meets(obj, protocol) -> None:
    """isinstance (names present) and, per method, the protocol's call binds to the object's signature."""
    assert isinstance(obj, protocol), f"{type(obj).__name__} lacks a member of {protocol.__name__}"
    for name, want in protocol_methods(protocol).items():
        got = inspect.signature(getattr(obj, name))
        params = [p for p in want.parameters.values() if p.name != "self"]
        args = [object() for p in params if p.default is inspect.Parameter.empty]
        got.bind(*args)   # the required arguments, positionally
        got.bind(*[object() for _ in params])   # and the optional ones too


@pytest.mark.parametrize("make", [
    lambda: BlockManager(8, 4),
    lambda: BlockManager(8, 4, enable_prefix_caching=False),
    lambda: TableManager(4, BlockManager(8, 4).allocator),
    lambda: PagedKVCache(MODEL.config, 8, 4).manager,
    lambda: Adapter(Reference(8, 4), 8, 4),   # exercise 05's managers run behind this adapter
], ids=["prefix", "prefix-no-caching", "paged-table-manager", "paged-default", "ex05-adapter"])
def test_block_managers_meet_the_protocol(make):
    assert_meets(make(), BlockManagerProtocol)


def test_a_manager_missing_a_method_does_not_meet_the_protocol():
    class NoFork:
        num_blocks = block_size = num_free_blocks = 1

        def open(self, seq_id, prompt_token_ids, extra_key=None): ...
        def blocks_needed(self, seq_id, n): ...
        def append(self, seq_id, token_ids): ...
        def block_table(self, seq_id): ...
        def num_tokens(self, seq_id): ...
        def free(self, seq_id): ...
        def take_copies(self): ...

    assert not isinstance(NoFork(), BlockManagerProtocol)


@pytest.mark.parametrize("make", [lambda: ModelRunner(MODEL, 8, 4), lambda: FakeRunner(8, 4, 256)],
                         ids=["model-runner", "fake-runner"])
def test_runners_meet_the_protocol(make):
    assert_meets(make(), Runner)


def test_the_engine_refuses_a_runner_that_is_not_one():
    with pytest.raises(TypeError, match=r"runner must be None or a model runner .*minikv.runner.Runner") as err:
        LLM(MODEL, verbose=False, num_blocks=8, runner=object())
    assert err.value.param == "runner"


# ---- bytes per block: one rule -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bytes_per_block_is_one_rule_everywhere(dtype):
    model = tiny_random_llama().to(dtype)
    cfg = model.config
    want = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize * 4
    assert kv_bytes_per_block(cfg, 4, dtype) == kv_bytes_per_token(cfg, dtype) * 4 == want
    assert ModelRunner(model, 8, 4).bytes_per_block == want
    assert PagedKVCache(cfg, 8, 4, dtype=dtype).bytes_per_block() == want
    assert LLM(model, verbose=False, num_blocks=8, block_size=4).engine.bytes_per_block == want


# ---- every argument is checked, by name --------------------------------------------------------

SAMPLING_BAD = [  # (field, bad value, words of the message, also a TypeError?)
    ("n", 0, "n must be an integer >= 1", False),
    ("n", 1.5, "n must be an integer", True),
    ("n", True, "n must be an integer", True),
    ("temperature", -0.1, "temperature must be a number >= 0", False),
    ("temperature", "hot", "temperature must be a number >= 0", True),
    ("temperature", math.nan, "temperature must be a number", False),
    ("top_p", 0.0, r"top_p must be a number in \(0.0, 1.0\]", False),
    ("top_p", 1.5, r"top_p must be a number in \(0.0, 1.0\]", False),
    ("top_p", None, "top_p must be a number", True),
    ("top_k", -1, "top_k must be an integer >= 0", False),
    ("top_k", "5", "top_k must be an integer", True),
    ("max_tokens", 0, "max_tokens must be an integer >= 1", False),
    ("max_tokens", 2.0, "max_tokens must be an integer", True),
    ("stop", 5, "stop must be a non-empty string or a list of non-empty strings", True),
    ("stop", [""], "stop must be a non-empty string", False),
    ("stop", ["ok", 3], "stop must be", True),
    ("stop_token_ids", 5, "stop_token_ids must be a list of integers", True),
    ("stop_token_ids", ["x"], "stop_token_ids must be a list of integers", True),
    ("stop_token_ids", [-1], "stop_token_ids must be a list of integers >= 0", False),
    ("ignore_eos", "no", "ignore_eos must be True or False", True),
    ("seed", "42", "seed must be an integer or None", True),
    ("seed", 1.0, "seed must be an integer or None", True),
    ("seed", 2**64, r"seed must be an integer in \[-2\*\*63, 2\*\*64\)", False),
]


@pytest.mark.parametrize("field, value, words, is_type", SAMPLING_BAD,
                         ids=[f"{f}={v!r}" for f, v, _, _ in SAMPLING_BAD])
def test_bad_sampling_params_name_the_field_and_what_it_must_be(field, value, words, is_type):
    with pytest.raises(InvalidArgument, match=words) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field and err.value.value is value
    assert isinstance(err.value, ValueError) and isinstance(err.value, TypeError) == is_type
    assert f"got {value!r}" in str(err.value)


def test_every_sampling_param_is_covered():
    fields = set(inspect.signature(SamplingParams).parameters)
    assert fields == {f for f, *_ in SAMPLING_BAD}


def test_good_sampling_params_still_pass():
    import numpy as np

    p = SamplingParams(n=np.int64(2), temperature=np.float32(0.5), top_p=0.9, top_k=5, max_tokens=3, stop=("a", "b"),
                       stop_token_ids=(1, 2), ignore_eos=True, seed=7)
    assert p.stop == ["a", "b"] and p.stop_token_ids == [1, 2]


LLM_BAD = [  # (argument, bad value, words)
    ("model", 42, "model must be a loaded transformers causal LM"),
    ("tokenizer", 42, "tokenizer must be None or a Hugging Face tokenizer"),
    ("block_size", 0, "block_size must be an integer >= 1"),
    ("block_size", "16", "block_size must be an integer >= 1"),
    ("num_blocks", 0, "num_blocks must be an integer >= 1"),
    ("num_blocks", 2.5, "num_blocks must be an integer >= 1"),
    ("kv_cache_memory", "lots", "kv_cache_memory must be a positive number of bytes or a string like '2GiB'"),
    ("kv_cache_memory", -5, "kv_cache_memory must be a positive number of bytes"),
    ("kv_cache_memory", 10, "kv_cache_memory must be at least one block"),
    ("max_num_seqs", 0, "max_num_seqs must be an integer >= 1"),
    ("max_num_batched_tokens", 0, "max_num_batched_tokens must be an integer >= 1 or None"),
    ("enable_prefix_caching", "yes", "enable_prefix_caching must be True or False"),
    ("enable_chunked_prefill", 1, "enable_chunked_prefill must be True or False"),
    ("long_prefill_token_threshold", -1, "long_prefill_token_threshold must be an integer >= 0 or None"),
    ("long_prefill_token_threshold", "64", "long_prefill_token_threshold must be an integer >= 0 or None"),
    ("preemption_mode", "drop", "preemption_mode must be one of 'recompute', 'swap'"),
    ("swap_space", "a lot", "swap_space must be a positive number of bytes"),
    ("watermark", 1.0, r"watermark must be a number in \[0, 1\)"),
    ("watermark", "low", "watermark must be a number"),
    ("runner", "fast", "runner must be None or a model runner"),
    ("verbose", "loud", "verbose must be True or False"),
    ("prepack_linears", "yes", "prepack_linears must be True or False"),
    ("linears", "fastest", "linears must be None, 'measure', 'eager', 'onednn' or 'mkl'; got 'fastest'"),
    ("cpu_kernel", 1, "cpu_kernel must be True or False"),
    ("compile", "yes", "compile must be True or False"),
    ("decode_graphs", 1, "decode_graphs must be True or False"),
    ("scheduler_cls", object, "scheduler_cls must be a subclass of minikv.scheduler.Scheduler"),
    ("config", "fast", "config must be None or a minikv.config.EngineConfig"),
]


@pytest.mark.parametrize("arg, value, words", LLM_BAD, ids=[f"{a}={v!r}" for a, v, _ in LLM_BAD])
def test_bad_llm_arguments_name_the_argument_and_what_it_must_be(arg, value, words):
    kwargs = dict(model=MODEL, verbose=False, num_blocks=8)
    kwargs[arg] = value
    if arg == "kv_cache_memory":
        kwargs.pop("num_blocks")
    with pytest.raises(InvalidArgument, match=words) as err:
        LLM(**kwargs)
    assert err.value.param == arg


def test_prefill_cap_without_chunked_prefill_is_refused_with_the_fix():
    with pytest.raises(InvalidArgument, match="needs chunked prefill; set enable_chunked_prefill=True or leave "
                       "long_prefill_token_threshold None") as err:
        LLM(MODEL, verbose=False, num_blocks=8, enable_chunked_prefill=False, long_prefill_token_threshold=64)
    assert err.value.param == "long_prefill_token_threshold"
    for off in (None, 0):   # no cap: fine either way
        LLM(MODEL, verbose=False, num_blocks=8, enable_chunked_prefill=False, long_prefill_token_threshold=off)


def test_every_llm_argument_is_covered():
    from dataclasses import fields

    from minikv.config import EngineConfig
    from minikv.engine import LLMEngine

    args = set(inspect.signature(LLMEngine).parameters) - {"engine_args"} | {f.name for f in fields(EngineConfig)}
    assert args == {a for a, *_ in LLM_BAD}


def test_an_unknown_engine_argument_is_named_with_the_known_ones():
    with pytest.raises(TypeError, match="unknown engine argument.*blocksize.*block_size"):
        LLM(MODEL, verbose=False, num_blocks=8, blocksize=8)


def test_config_or_keywords_build_the_same_engine():
    from minikv.config import EngineConfig

    a = LLM(MODEL, verbose=False, num_blocks=8, block_size=4, max_num_seqs=3)
    b = LLM(MODEL, config=EngineConfig(verbose=False, num_blocks=8, block_size=4, max_num_seqs=3))
    assert a.engine.config == b.engine.config and b.engine.num_blocks == 8 and b.engine.block_size == 4
    with pytest.raises(InvalidArgument, match="not both") as err:
        LLM(MODEL, config=EngineConfig(verbose=False), num_blocks=8)
    assert err.value.param == "config"


def test_the_command_line_flags_build_the_same_config():
    import argparse

    from minikv.config import EngineConfig, add_engine_args, engine_flags

    p = argparse.ArgumentParser()
    add_engine_args(p)
    argv = ["--block-size", "8", "--num-blocks", "48", "--no-enable-prefix-caching", "--preemption-mode", "swap",
            "--watermark", "0.05", "--kv-cache-memory", "1MiB"]
    args = p.parse_args(argv)
    config = EngineConfig.from_cli_args(args)
    assert config == EngineConfig(block_size=8, num_blocks=48, enable_prefix_caching=False, preemption_mode="swap",
                                  watermark=0.05, kv_cache_memory="1MiB")
    assert EngineConfig.from_cli_args(p.parse_args(engine_flags(args))) == config   # bench serve -> serve
    assert EngineConfig.from_cli_args(p.parse_args([])) == EngineConfig()
    with pytest.raises(InvalidArgument, match="block_size must be an integer >= 1"):
        EngineConfig.from_cli_args(p.parse_args(["--block-size", "0"]))


@pytest.mark.parametrize("call, param, words", [
    (lambda llm: llm.generate([5], SamplingParams(), use_tqdm="no"), "use_tqdm", "use_tqdm must be True or False"),
    (lambda llm: llm.generate([5], "greedy"), "sampling_params", "sampling_params must be None, a SamplingParams"),
    (lambda llm: llm.generate([5], [{"temperature": 0}]), "sampling_params", "sampling_params must be"),
    (lambda llm: llm.generate([[5], [6]], [SamplingParams()] * 3), "sampling_params", "one per prompt"),
    (lambda llm: llm.generate([]), "prompts", "prompts must be"),
    (lambda llm: llm.generate([3.5]), "prompt", "prompt must be a str, a list of token ids"),
    (lambda llm: llm.generate({"prompt_token_ids": ["a"]}), "prompt_token_ids", "list of integer token ids"),
    (lambda llm: llm.generate({"prompt": "hi"}), "prompt", "needs the key 'prompt_token_ids'"),
    (lambda llm: llm.generate("hi"), "prompt", "needs a tokenizer"),
    (lambda llm: llm.generate([5], SamplingParams(stop="x")), "stop", "stop strings need a tokenizer"),
    (lambda llm: llm.chat([{"role": "user", "content": "hi"}]), "tokenizer", "chat needs a tokenizer"),
])
def test_bad_generate_arguments_name_the_argument(call, param, words):
    llm = LLM(MODEL, verbose=False, num_blocks=8)
    with pytest.raises(InvalidArgument, match=words) as err:
        call(llm)
    assert err.value.param == param
    assert not llm.engine.has_unfinished_requests() and llm.engine.bm.num_free_blocks == 8


def test_prompt_token_ids_may_be_a_tensor():
    llm = LLM(MODEL, verbose=False, num_blocks=8)
    out = llm.generate({"prompt_token_ids": torch.tensor([5, 6, 7])}, SamplingParams(max_tokens=2), use_tqdm=False)
    assert out[0].prompt_token_ids == [5, 6, 7] and len(out[0].outputs[0].token_ids) == 2


def test_a_huge_value_is_shown_short():
    with pytest.raises(InvalidArgumentType, match=r"\.\.\. \(a list\)$"):
        SamplingParams(stop=list(range(100)))


def test_one_budget_rule_a_policys_request_and_the_reserved_total_agree_for_n_3():
    """A request of n = 3 samples: the figure an admission policy is shown for it (request_info) is what the
    engine then counts in its reserved total (stats), and the gate's view after admitting it says the same."""
    from minikv.engine import LLMEngine
    from minikv.inputs import blocks_at_most
    from minikv.server.admission import Gate

    eng = LLMEngine(MODEL, None, num_blocks=64, block_size=4, verbose=False, runner=FakeRunner(64, 4, 256))
    params = SamplingParams(n=3, max_tokens=9, temperature=1.0, seed=0)
    seen = []

    class Record:
        def decide(self, request, state):
            seen.append((request, dict(state)))
            return "queue" if not request["held"] else "admit"

    gate = Gate(Record(), eng.block_size, eng.max_model_len)
    gate.snapshot(eng.stats(history=0), 0, 0.0)
    assert gate.on_arrival(10, params, queued=0)[0] == "queue"
    held = type("Add", (), {"request_id": "r", "prompt_tokens": 10, "params": params, "arrival": 0.0})()
    gate.held.append(held)
    gate.release(eng.stats(history=0), 1, 0.0, lambda add: eng.add_request("r", list(range(1, 11)), params),
                 lambda add, why: None)
    request = seen[0][0]
    assert request["n"] == 3 and request["blocks_at_most"] == 3 * 5 == blocks_at_most(10, 9, 4, n=3)
    assert eng.stats().reserved_blocks == request["blocks_at_most"] == gate.view["reserved_blocks"]


def test_every_engine_setting_has_a_flag_or_says_why_not():
    """One settings object: each `EngineConfig` field carries its flag's help, or a stated reason for none."""
    from dataclasses import fields

    from minikv.config import EngineConfig

    for f in fields(EngineConfig):
        help_, why = f.metadata.get("help"), f.metadata.get("no_flag")
        assert help_ or why, f"EngineConfig.{f.name} has neither a flag's help nor a reason for having no flag"


def test_the_scheduler_and_input_views_repeat_no_default():
    """The scheduler's and the input processor's views are derived from EngineConfig: no defaults of their own,
    and read-only."""
    import dataclasses

    from minikv.inputs import EngineLimits
    from minikv.scheduler import SchedulerConfig

    for view in (SchedulerConfig, EngineLimits):
        assert view.__dataclass_params__.frozen, f"{view.__name__} can be changed after it is built"
        defaults = [f.name for f in dataclasses.fields(view)
                    if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING]
        assert not defaults, f"{view.__name__} repeats defaults of EngineConfig: {defaults}"
