"""The engine: requests in, tokens out, one step at a time (vLLM's `LLM` and `LLMEngine` shapes).

One `LLMEngine.step()` is one iteration of continuous batching, three short methods:

    schedule     the scheduler decides who computes which tokens, into which slots
    execute      copy-on-write block copies, then one forward of the model over every scheduled token
    postprocess  sample, append, stop checks (stop strings through the `Detokenizer`), retire finished

and returns the `RequestOutput`s that changed. `LLM.generate` is that loop with a progress bar.
Data flows one way: request -> scheduler -> block manager -> model runner -> attention.

The KV pool is sized once, at start (`kv_pool_blocks`), and printed: a serving engine
reserves its cache up front and then lives within it; admission and preemption are how.
"""

from __future__ import annotations

import itertools
import math
import operator
import re
import time
from pathlib import Path

import torch

from minikv.blocks import blocks_for
from minikv.detokenizer import Detokenizer
from minikv.metrics import PoolView, Preemption, RequestMetrics, StepStats, Tenant, summarize
from minikv.prefix import BlockManager
from minikv.runner import ModelRunner, Runner, SeqStep
from minikv.sampling import SamplingParams, make_generator, sample
from minikv.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from minikv.sequence import Request, SeqStatus, Sequence
from minikv.sizing import fmt_bytes, kv_bytes_per_block
from minikv.validation import (
    InvalidArgument,
    InvalidArgumentType,
    check_block_size,
    check_bool,
    check_int,
    check_long_prefill_token_threshold,
    check_model,
    check_num_blocks,
    check_number,
    check_preemption_mode,
    check_tokenizer,
)

CPU_KV_CACHE_MEMORY = 1 << 30      # the CPU default pool: 1 GiB (a GPU gets a share of its free memory)
GPU_KV_CACHE_FRACTION = 0.5        # of the device memory free once the weights are loaded


# -- outputs ---------------------------------------------------------------------------------
class CompletionOutput:
    """One sample of a request, read live from its sequence (so streaming costs nothing per step)."""

    def __init__(self, seq: Sequence, detokenizer: Detokenizer):
        self._seq, self._detok = seq, detokenizer
        self.index = seq.index

    @property
    def token_ids(self) -> list[int]:
        return self._seq.output_token_ids

    @property
    def text(self) -> str:
        return self._detok.output_text(self._seq)

    @property
    def finish_reason(self) -> str | None:
        return self._seq.finish_reason

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
                f"finish_reason={self.finish_reason!r})")


class RequestOutput:
    """A request's prompt and its n samples so far; the same object is updated as it runs."""

    def __init__(self, request: Request, detokenizer: Detokenizer):
        self._request, self._detok = request, detokenizer
        self.request_id = request.request_id
        self.prompt = request.prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.metrics = request.metrics

    @property
    def outputs(self) -> list[CompletionOutput]:
        return [CompletionOutput(s, self._detok) for s in self._request.seqs]

    @property
    def finished(self) -> bool:
        return self._request.finished

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
                f"outputs={self.outputs}, finished={self.finished})")


# -- sizing ----------------------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str, param: str = "a memory size") -> int:
    """``2 * 2**30``, ``"2GiB"``, ``"512 MB"``, ``"1.5gib"`` -> bytes. `param` names the argument in errors."""
    must = "a positive number of bytes or a string like '2GiB' or '512MB'"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value > 0 and math.isfinite(value):
            return int(value)
        raise InvalidArgument(param, value, must)
    if not isinstance(value, str):
        raise InvalidArgumentType(param, value, must)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b|b)?\s*", value.lower())
    if not m or float(m.group(1)) <= 0:
        raise InvalidArgument(param, value, must)
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def kv_pool_blocks(model, block_size: int, num_blocks: int | None, kv_cache_memory, max_num_seqs: int,
                   max_model_len: int) -> tuple[int, int]:
    """How many blocks the KV pool gets, and the bytes one block takes (K and V, every layer).

    ``num_blocks`` wins; else ``kv_cache_memory`` (bytes or "2GiB"); else on a GPU half the
    device memory still free after the weights, on the CPU 1 GiB. Either default is capped at
    what ``max_num_seqs`` sequences of full context could ever use.
    """
    param = next(model.parameters())
    per_block = kv_bytes_per_block(model.config, block_size, param.dtype)
    if num_blocks is not None:
        return check_num_blocks(num_blocks), per_block
    if kv_cache_memory is not None:
        blocks = parse_bytes(kv_cache_memory, "kv_cache_memory") // per_block
        if blocks < 1:
            raise InvalidArgument("kv_cache_memory", kv_cache_memory,
                                  f"at least one block: one block of {block_size} tokens takes {fmt_bytes(per_block)}")
        return blocks, per_block
    if param.device.type == "cuda":
        budget = int(torch.cuda.mem_get_info(param.device)[0] * GPU_KV_CACHE_FRACTION)
    else:
        budget = CPU_KV_CACHE_MEMORY
    cap = max_num_seqs * blocks_for(max_model_len, block_size)
    return max(1, min(budget // per_block, cap)), per_block


# -- the engine ------------------------------------------------------------------------------
class LLMEngine:
    """Step-level API: `add_request`, `step`, `abort_request`, `has_unfinished_requests`.

    `runner` replaces the model runner (tests pass a fake one that needs no model forward).
    ``watermark`` is the share of the pool kept free when admitting (at least one block when > 0).
    ``long_prefill_token_threshold`` (vLLM V1's name and meaning) caps one request's prefill chunk per
    step, within an unchanged ``max_num_batched_tokens``; None or 0 is no cap. It needs chunked prefill
    (refused without it, as vLLM needs chunked prefill for partial prefills).
    ``prepack_linears`` (None: on the CPU in fp32) is the runner's oneDNN weight prepacking;
    ``cpu_kernel`` (None: on the CPU in fp32, when it builds) its C++ decode attention, and ``compile``
    (False) its torch.compile of decode steps (see ModelRunner). ``decode_graphs`` (False) runs decode
    steps through CUDA graphs captured at start, one per batch size (``minikv.speed.graphs``), with one
    extra pool block as their scratch; on the CPU the same plan runs eagerly (a test of it, not a speed-up).
    """

    def __init__(self, model, tokenizer=None, *, block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_memory=None, max_num_seqs: int = 64, max_num_batched_tokens: int | None = None,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 long_prefill_token_threshold: int | None = None,
                 preemption_mode: str = "recompute", swap_space=None, watermark: float = 0.01,
                 runner=None, verbose: bool = True, prepack_linears: bool | None = None,
                 cpu_kernel: bool | None = None, compile: bool = False, decode_graphs: bool = False):
        check_model(model)
        check_tokenizer(tokenizer)
        check_block_size(block_size)
        check_int("num_blocks", num_blocks, 1, "KV blocks in the pool", optional=True)
        check_int("max_num_seqs", max_num_seqs, 1, "sequences running at once")
        check_int("max_num_batched_tokens", max_num_batched_tokens, 1, "tokens computed per step", optional=True)
        check_bool("enable_prefix_caching", enable_prefix_caching)
        check_bool("enable_chunked_prefill", enable_chunked_prefill)
        check_long_prefill_token_threshold(long_prefill_token_threshold, enable_chunked_prefill)
        check_preemption_mode(preemption_mode)
        for name, size in (("kv_cache_memory", kv_cache_memory), ("swap_space", swap_space)):
            if size is not None:
                parse_bytes(size, name)
        check_number("watermark", watermark, 0, 1, high_open=True, what="share of the pool kept free when admitting")
        if runner is not None and not isinstance(runner, Runner):
            raise InvalidArgumentType("runner", runner, "None or a model runner (execute, copy_blocks, swap_out, "
                                      "swap_in: see minikv.runner.Runner)")
        check_bool("verbose", verbose)
        check_bool("compile", compile)
        check_bool("decode_graphs", decode_graphs)
        if decode_graphs and runner is not None:
            raise InvalidArgument("decode_graphs", decode_graphs, message=(
                "decode_graphs=True captures minikv's own ModelRunner; it cannot be combined with runner="))
        for name, lever in (("prepack_linears", prepack_linears), ("cpu_kernel", cpu_kernel)):
            if lever is not None:
                check_bool(name, lever)
        self.model, self.tokenizer = model, tokenizer
        config = model.config
        self.max_model_len = config.max_position_embeddings
        eos = getattr(config, "eos_token_id", None)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos = tokenizer.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
        self.vocab_size = config.vocab_size

        if max_num_batched_tokens is None:
            max_num_batched_tokens = 2048 if enable_chunked_prefill else max(2048, self.max_model_len)

        self.num_blocks, self.bytes_per_block = kv_pool_blocks(
            model, block_size, num_blocks, kv_cache_memory, max_num_seqs, self.max_model_len)
        self.block_size = block_size
        swap_blocks = 0
        if preemption_mode == "swap":
            swap_blocks = (self.num_blocks if swap_space is None
                           else parse_bytes(swap_space, "swap_space") // self.bytes_per_block)
        if verbose:
            print(f"minikv: KV cache pool of {self.num_blocks} blocks x {block_size} tokens "
                  f"= {self.num_blocks * block_size} tokens, {fmt_bytes(self.num_blocks * self.bytes_per_block)}")

        self.bm = BlockManager(self.num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        # With decode graphs the runner's pool has one block more than the block manager's: the scratch
        # block that padding rows write to and read from, which no sequence is ever given.
        self.runner = runner if runner is not None else ModelRunner(
            model, self.num_blocks + (1 if decode_graphs else 0), block_size, prepack_linears=prepack_linears,
            cpu_kernel=cpu_kernel, compile=compile)
        if decode_graphs:
            from minikv.speed.graphs import DecodeGraphs

            self.runner.graphs = DecodeGraphs(self.runner, max_num_seqs, blocks_for(self.max_model_len, block_size),
                                              scratch_block=self.num_blocks)
        self.detokenizer = Detokenizer(tokenizer)
        self.device = next(model.parameters()).device
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill, preemption_mode=preemption_mode,
            watermark_blocks=max(1, int(watermark * self.num_blocks)) if watermark > 0 else 0,
            swap_blocks=swap_blocks, long_prefill_token_threshold=long_prefill_token_threshold),
            self.bm, self.runner)
        self.requests: dict[str, Request] = {}
        self.step_stats: list[StepStats] = []
        self._aborted: list[RequestOutput] = []

    # -- requests ------------------------------------------------------------------------------
    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise InvalidArgument("prompt", prompt, message="a dict prompt needs the key 'prompt_token_ids'; "
                                      f"got keys {sorted(prompt)}")
            try:   # a list, a tuple, an array or a tensor of integers
                ids = [operator.index(t) for t in prompt["prompt_token_ids"]]
            except TypeError:
                raise InvalidArgumentType("prompt_token_ids", prompt["prompt_token_ids"],
                                          "a list of integer token ids") from None
            return prompt.get("prompt"), ids
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidArgument("prompt", prompt, message="a text prompt needs a tokenizer: pass tokenizer=... "
                                      "or give token ids ({'prompt_token_ids': [...]})")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidArgumentType("prompt", prompt, "a str, a list of token ids or {'prompt_token_ids': [...]}")

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue one request; every check happens here, so a bad request never reaches the batch."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidArgumentType("params", params, "a SamplingParams")
        if request_id in self.requests:
            raise InvalidArgument("request_id", request_id, message=f"request id {request_id!r} is already in use; "
                                  "give each request its own id")
        text, ids = self._tokenize(prompt)
        if not ids:
            raise InvalidArgument("prompt", prompt, message="empty prompt: give at least one token (a text prompt "
                                  "must tokenize to something)")
        if not all(0 <= t < self.vocab_size for t in ids):
            raise InvalidArgument("prompt", prompt, message=f"prompt token ids must lie in [0, {self.vocab_size}) "
                                  "(the model's vocabulary)")
        if len(ids) > self.max_model_len:
            raise InvalidArgument("prompt", prompt, message=f"prompt of {len(ids)} tokens is longer than the model's "
                                  f"context of {self.max_model_len} tokens (max_position_embeddings); shorten it")
        if params.stop and self.tokenizer is None:
            raise InvalidArgument("stop", params.stop, message="stop strings need a tokenizer to detokenize; use "
                                  "stop_token_ids instead")
        cfg = self.scheduler.config
        if params.n > cfg.max_num_seqs:
            raise InvalidArgument("n", params.n, message=f"n={params.n} samples cannot run together with "
                                  f"max_num_seqs={cfg.max_num_seqs}; lower n or raise max_num_seqs")
        # The most K/V one sequence ever holds: every token but the last one sampled.
        longest = min(len(ids) + params.max_tokens - 1, self.max_model_len)
        need = blocks_for(longest, self.block_size)
        if need > self.num_blocks:
            raise InvalidArgument("max_tokens", params.max_tokens, message=(
                f"request {request_id!r} cannot fit even alone: {len(ids)} prompt + {params.max_tokens} max_tokens "
                f"need up to {need} blocks of {self.block_size} tokens, but the pool has {self.num_blocks}; give "
                "the cache more memory or lower max_tokens"))
        if not cfg.enable_chunked_prefill and longest > cfg.max_num_batched_tokens:
            raise InvalidArgument("max_tokens", params.max_tokens, message=(
                f"without chunked prefill a sequence of up to {longest} tokens must fit in one step, but "
                f"max_num_batched_tokens={cfg.max_num_batched_tokens}; raise it or enable chunked prefill"))
        req = Request(request_id, text, ids, params,
                      RequestMetrics(arrival_time if arrival_time is not None else time.perf_counter()))
        seq = Sequence(req, 0, list(ids), generator=make_generator(params.seed, self.device))
        self.detokenizer.start(seq)
        req.seqs.append(seq)
        req.output = RequestOutput(req, self.detokenizer)
        self.requests[request_id] = req
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is; every block it held is freed. Unknown ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.finish(seq, "abort")
        self.scheduler.remove_finished()
        req.metrics.finished_time = time.perf_counter()
        self._aborted.append(req.output)
        return req.output

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def summary(self, outputs) -> dict:
        """The landlord's numbers for a run: tokens/s, TTFT, TPOT, preemptions, prefix hit rate, blocks."""
        out = summarize(outputs, self.step_stats, self.bm.stats)
        out.update(num_blocks=self.num_blocks, block_size=self.block_size,
                   pool_bytes=self.num_blocks * self.bytes_per_block,
                   blocks_cached=len(self.bm.cache.evictable), blocks_free=self.bm.num_free_blocks)
        return out

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule -> execute -> postprocess. Returns the outputs that changed
        (a new token, a finish, an abort)."""
        t0 = time.perf_counter()
        changed, self._aborted = self._aborted, []
        batch = self._schedule()
        self._preemptions = batch.preemptions
        if batch.scheduled:
            logits = self._execute(batch)
            changed += self._postprocess(batch, logits, t0)
        return changed

    def _schedule(self) -> SchedulerOutput:
        """Who computes which tokens this step, into which slots (blocks are allocated here)."""
        batch = self.scheduler.schedule()
        if not batch.scheduled and self.scheduler.has_unfinished():
            raise RuntimeError("the scheduler could not schedule anything although requests are pending "
                               f"(waiting {len(self.scheduler.waiting)}, swapped {len(self.scheduler.swapped)}, "
                               f"free blocks {self.bm.num_free_blocks}): this is a bug in minikv")
        return batch

    def _execute(self, batch: SchedulerOutput) -> torch.Tensor:
        """Copy-on-write copies, then one forward over every scheduled token: logits of the samplers."""
        if batch.copies:
            self.runner.copy_blocks(batch.copies)
        steps = [SeqStep(s.seq.seq_id, s.seq.token_ids[s.start:s.start + s.num_tokens], s.start,
                         self.bm.block_table(s.seq.seq_id), s.slots, s.wants_logits) for s in batch.scheduled]
        return self.runner.execute(steps)

    def _postprocess(self, batch: SchedulerOutput, logits: torch.Tensor, t0: float) -> list[RequestOutput]:
        """Sample, append each token, retire what finished, record the step's numbers."""
        seqs, tokens = self._sample(batch, logits)
        now = time.perf_counter()
        touched = {}
        for seq, tok in zip(seqs, tokens):
            self._append_token(seq, tok, now)
            touched[seq.request.request_id] = seq.request
        self.scheduler.remove_finished()
        for req in touched.values():
            if req.finished:
                req.metrics.finished_time = now
                del self.requests[req.request_id]
        self._record(batch, t0, now)
        return [req.output for req in touched.values()]

    def _sample(self, batch: SchedulerOutput, logits: torch.Tensor) -> tuple[list[Sequence], list[int]]:
        """One token for each sequence whose chunk reached its newest token.

        A request's first sample forks it into its n sequences (they share the prompt's blocks),
        and each draws from the same logits row."""
        rows, seqs = [], []
        for i, s in enumerate(s for s in batch.scheduled if s.wants_logits):
            family = [s.seq] if s.seq.request.forked else self._fork(s.seq)
            rows += [i] * len(family)
            seqs += family
        if not seqs:
            return [], []
        if len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(rows, device=logits.device)]
        return seqs, sample(logits, [s.request.params for s in seqs], [s.generator for s in seqs])

    def _record(self, batch: SchedulerOutput, t0: float, now: float) -> None:
        sched, bm = self.scheduler, self.bm
        self.step_stats.append(StepStats(
            step=len(self.step_stats), time=now, duration=now - t0, num_running=len(sched.running),
            num_waiting=len(sched.waiting), num_swapped=len(sched.swapped),
            blocks_used=self.num_blocks - bm.num_free_blocks, blocks_cached=len(bm.cache.evictable),
            blocks_free=bm.num_free_blocks, prefill_tokens=batch.prefill_tokens, decode_tokens=batch.decode_tokens,
            preemptions=len(batch.preempted)))

    # -- the landlord's view (read-only; stage 7's live page) ----------------------------------------
    def last_preemptions(self) -> list[Preemption]:
        """The evictions the last step decided (empty in most steps)."""
        return list(getattr(self, "_preemptions", ()))

    def pool_view(self) -> PoolView:
        """Who holds which block right now, the tenants and the line at the door: for pictures, not the hot path."""
        sched = self.scheduler
        owner, refcount, cached = self.bm.pool_map()

        def tenant(seq: Sequence, state: str) -> Tenant:
            m, table = seq.request.metrics, self.bm.tables.get(seq.seq_id)
            times = m.token_times
            return Tenant(seq.request.request_id, seq.seq_id, state, len(table.blocks) if table else 0,
                          table.num_tokens if table else 0, seq.num_prompt_tokens, len(seq.output_token_ids),
                          m.preemptions, m.ttft, times[-1] - times[-2] if len(times) > 1 else None)

        tenants = ([tenant(s, "running") for s in sched.running] + [tenant(s, "swapped") for s in sched.swapped]
                   + [tenant(s, "waiting") for s in sched.waiting])
        used = sum(r > 0 for r in refcount)
        counts = {"running": len(sched.running), "waiting": len(sched.waiting), "swapped": len(sched.swapped),
                  "blocks_used": used, "blocks_cached": sum(cached), "blocks_free": self.num_blocks - used,
                  "preemptions": sched.num_preemptions}
        return PoolView(len(self.step_stats), self.num_blocks, self.block_size, owner, refcount, cached, tenants,
                        [s.request.request_id for s in sched.waiting], counts)

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """After its prompt: the request's other n-1 samples share every block of `seq` (copy-on-write)."""
        req = seq.request
        req.forked = True
        family = [seq]
        for i in range(1, req.params.n):
            child = Sequence(req, i, list(seq.token_ids), status=SeqStatus.RUNNING, num_computed=seq.num_computed,
                             generator=make_generator(None if req.params.seed is None else req.params.seed + i,
                                                      self.device))
            self.detokenizer.start(child)
            self.bm.fork(seq.seq_id, child.seq_id)
            self.scheduler.running.append(child)
            req.seqs.append(child)
            family.append(child)
        return family

    # -- stopping ------------------------------------------------------------------------------
    def _append_token(self, seq: Sequence, tok: int, now: float) -> None:
        """Append a sampled token; finish the sequence on a stop string or token, EOS, or its length."""
        seq.token_ids.append(tok)
        m = seq.request.metrics
        if seq.index == 0:
            m.token_times.append(now)
        if m.first_token_time is None:
            m.first_token_time = now
        p = seq.request.params
        reason, stop_string = None, bool(p.stop) and self.detokenizer.step(seq)
        if stop_string or (tok in self.eos_token_ids and not p.ignore_eos) or (
                p.stop_token_ids and tok in p.stop_token_ids):
            reason = "stop"
        elif len(seq.token_ids) - seq.num_prompt_tokens >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            reason = "length"
        if reason is not None:
            if p.stop and not stop_string:
                self.detokenizer.flush(seq)   # the text's last characters may still be pending
            self.scheduler.finish(seq, reason)


class LLM:
    """Offline generation, vLLM's shape: ``LLM("smollm2-135m").generate(prompts, SamplingParams(...))``.

    `model` is a loaded ``transformers`` causal LM (give its `tokenizer` for text prompts) or a
    name for `minikv.models.load_model` ("smollm2-135m", "tiny-random-llama", or a Hub id). The
    other arguments are `LLMEngine`'s (pool size, budgets, prefix caching, chunked prefill,
    preemption mode, swap space).
    """

    def __init__(self, model, tokenizer=None, **engine_args):
        """Every argument is checked here (minikv.validation): a bad one raises `InvalidArgument`
        (a ValueError) whose ``.param`` names it and whose message says what it must be."""
        if isinstance(model, (str, Path)):
            from minikv.models import load_model
            model, loaded_tok = load_model(str(model))
            tokenizer = tokenizer if tokenizer is not None else loaded_tok
        self.engine = LLMEngine(model, tokenizer, **engine_args)
        self.tokenizer = tokenizer
        self._ids = itertools.count()

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order."""
        check_bool("use_tqdm", use_tqdm)
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                 and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise InvalidArgument("prompts", prompts, "a str, a list of them, or token-id lists (none given)")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            must = "None, a SamplingParams, or a list of them (one per prompt)"
            if not isinstance(sampling_params, (list, tuple)):
                raise InvalidArgumentType("sampling_params", sampling_params, must)
            params = list(sampling_params)
            if not all(isinstance(p, SamplingParams) for p in params):
                raise InvalidArgumentType("sampling_params", sampling_params, must)
            if len(params) != len(prompts):
                raise InvalidArgument("sampling_params", sampling_params, message=(
                    f"{len(prompts)} prompts but {len(params)} SamplingParams: give one, or one per prompt"))
        ids = [str(next(self._ids)) for _ in prompts]
        eng = self.engine
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                eng.add_request(rid, prompt, p)
            results: dict[str, RequestOutput] = {}
            bar = None
            if use_tqdm:
                from tqdm.auto import tqdm
                bar = tqdm(total=len(prompts), desc="Processed prompts", unit="req")
            mine = set(ids)
            while len(results) < len(ids):
                for o in eng.step():
                    if o.finished and o.request_id in mine and o.request_id not in results:
                        results[o.request_id] = o
                        if bar is not None:
                            bar.update(1)
            if bar is not None:
                bar.close()
        finally:   # an error or ^C mid-run: nothing stays queued, every block goes back
            for rid in ids:
                eng.abort_request(rid)
            eng._aborted.clear()
        return [results[rid] for rid in ids]

    def chat(self, conversations, sampling_params=None, use_tqdm: bool = True, **template_kwargs):
        """Apply the tokenizer's chat template to each conversation (a list of {"role", "content"})."""
        if self.tokenizer is None:
            raise InvalidArgument("tokenizer", None, message="chat needs a tokenizer with a chat template: "
                                  "pass tokenizer=...")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = []
        for c in conversations:
            text = self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False, **template_kwargs)
            # the template already wrote any special tokens it wants: do not add them again
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
