"""The engine: requests in, tokens out, one step at a time (vLLM's `LLM` and `LLMEngine` shapes).

One `LLMEngine.step()` is one iteration of continuous batching, three short methods:

    schedule     the scheduler decides who computes which tokens, into which slots, and which blocks
                 are copied or swapped (plain data: a `SchedulerOutput`)
    execute      the engine applies those block operations through the runner, in the order decided,
                 then one forward of the model over every scheduled token
    postprocess  sample, append, stop checks, retire finished

and returns the `RequestOutput`s that changed, each with this step's deltas (the output processor,
`minikv.outputs`, makes the text and finds stop strings). `LLM.generate` is that loop with a progress bar.
Data flows one way: input processor (`minikv.inputs`) -> scheduler -> block manager, and the scheduler's
output -> engine -> model runner -> attention -> kernel -> output processor. The scheduler never sees the
runner; nothing outside the engine reads its queues or pool except through `LLMEngine.stats()`, a frozen
snapshot.

The KV pool is sized once, at start (`kv_pool_blocks`), and printed: a serving engine
reserves its cache up front and then lives within it; admission and preemption are how.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import torch

from minikv.blocks import blocks_for
from minikv.config import EngineConfig, parse_bytes
from minikv.inputs import InputProcessor, blocks_at_most
from minikv.metrics import (
    SPAN_SAMPLE,
    SPAN_STEP,
    STEP_HISTORY,
    EngineStats,
    PoolView,
    Preemption,
    RequestMetrics,
    StepOutputs,
    StepStats,
    Tenant,
    span,
    summarize,
)
from minikv.outputs import OutputProcessor, RequestOutput
from minikv.prefix import BlockManager
from minikv.runner import ModelRunner, Runner
from minikv.sampling import SamplingParams, make_generator, sample
from minikv.scheduler import BlockOp, CopyBlocks, Scheduler, SchedulerOutput, SchedulerStalled, SwapOut, SwapSpace
from minikv.sequence import Request, Sequence
from minikv.sizing import fmt_bytes, kv_bytes_per_block
from minikv.step import SeqStep
from minikv.validation import (
    InvalidArgument,
    InvalidArgumentType,
    check_bool,
    check_int,
    check_model,
    check_num_blocks,
    check_tokenizer,
)

CPU_KV_CACHE_MEMORY = 1 << 30      # the CPU default pool: 1 GiB (a GPU gets a share of its free memory)
GPU_KV_CACHE_FRACTION = 0.5        # of the device memory free once the weights are loaded


# -- sizing ----------------------------------------------------------------------------------
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
    ``prepack_linears`` (None: on the CPU in fp32) is the runner's weight prepacking (for oneDNN and MKL), and
    ``linears`` the path each linear call takes (None: $MINIKV_LINEAR, else measured on this host at start);
    ``cpu_kernel`` (None: on the CPU in fp32, when it builds) its C++ attention (decode, and a prompt's
    first chunk), and ``compile`` (False) its torch.compile of every step (see ModelRunner).
    ``decode_graphs`` (False) runs decode steps through CUDA graphs captured at start, one per batch size
    (``minikv.speed.graphs``), with one extra pool block as their scratch; on the CPU the same plan runs
    eagerly (a test of it, not a speed-up).
    ``scheduler_cls`` (minikv's `Scheduler`) is built with ``(SchedulerConfig, BlockManager, SwapSpace)``:
    a subclass changes the policy through its public hooks (exercise 06 plugs a learner's policy in so).
    """

    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, *, runner=None,
                 scheduler_cls: type[Scheduler] = Scheduler, **engine_args):
        """`config` (a `minikv.config.EngineConfig`) or its fields as keywords (``block_size=8, ...``)."""
        check_model(model)
        check_tokenizer(tokenizer)
        if config is None:
            config = EngineConfig.from_kwargs(**engine_args)
        elif not isinstance(config, EngineConfig):
            raise InvalidArgumentType("config", config, "None or a minikv.config.EngineConfig")
        elif engine_args:
            raise InvalidArgument("config", config, message=f"give config= or its fields as keywords, not both "
                                  f"(got config and {', '.join(sorted(engine_args))})")
        if runner is not None and not isinstance(runner, Runner):
            raise InvalidArgumentType("runner", runner, "None or a model runner (execute, copy_blocks, swap_out, "
                                      "swap_in: see minikv.runner.Runner)")
        if config.decode_graphs and runner is not None:
            raise InvalidArgument("decode_graphs", config.decode_graphs, message=(
                "decode_graphs=True captures minikv's own ModelRunner; it cannot be combined with runner="))
        if not (isinstance(scheduler_cls, type) and issubclass(scheduler_cls, Scheduler)):
            raise InvalidArgumentType("scheduler_cls", scheduler_cls, "a subclass of minikv.scheduler.Scheduler "
                                      "(override can_admit / choose_victim to change the policy)")
        self.config = c = config
        self.model, self.tokenizer = model, tokenizer
        model_config = model.config
        self.max_model_len = model_config.max_position_embeddings
        eos = getattr(model_config, "eos_token_id", None)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos = tokenizer.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
        self.vocab_size = model_config.vocab_size

        self.num_blocks, self.bytes_per_block = kv_pool_blocks(
            model, c.block_size, c.num_blocks, c.kv_cache_memory, c.max_num_seqs, self.max_model_len)
        self.block_size = c.block_size
        if c.verbose:
            print(f"minikv: KV cache pool of {self.num_blocks} blocks x {c.block_size} tokens "
                  f"= {self.num_blocks * c.block_size} tokens, {fmt_bytes(self.num_blocks * self.bytes_per_block)}")

        self.bm = BlockManager(self.num_blocks, c.block_size, enable_prefix_caching=c.enable_prefix_caching)
        scheduler_config = c.scheduler_config(self.num_blocks, self.bytes_per_block, self.max_model_len)
        self.swap = SwapSpace(scheduler_config.swap_blocks)   # where swapped-out K/V waits, beside the pool
        self.runner = runner if runner is not None else ModelRunner(
            model, self.num_blocks, c.block_size, prepack_linears=c.prepack_linears, linears=c.linears,
            cpu_kernel=c.cpu_kernel,
            compile=c.compile, decode_graphs=c.decode_graphs, max_num_seqs=c.max_num_seqs)
        self.output_processor = OutputProcessor(tokenizer)
        self.input_processor = InputProcessor(tokenizer, c.limits(self.vocab_size, self.max_model_len,
                                                                  self.num_blocks))
        self.device = next(model.parameters()).device
        self.scheduler = scheduler_cls(scheduler_config, self.bm, self.swap)
        self.requests: dict[str, Request] = {}
        self.step_stats: list[StepStats] = []   # the bounded step history (see _record); read it through stats()
        self._num_steps = 0
        self._aborted: list[RequestOutput] = []
        self._preemptions: list[Preemption] = []   # the last step's preemptions, for the landlord's page

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue one request; it passes the input processor first, so a bad request never reaches the batch."""
        params = SamplingParams() if params is None else params
        if request_id in self.requests:
            raise InvalidArgument("request_id", request_id, message=f"request id {request_id!r} is already in use; "
                                  "give each request its own id")
        checked = self.input_processor.process(prompt, params)
        req = Request(request_id, checked.text, checked.token_ids, params,
                      RequestMetrics(arrival_time if arrival_time is not None else time.perf_counter()))
        seq = Sequence(req, 0, list(checked.token_ids), generator=make_generator(params.seed, self.device))
        req.seqs.append(seq)
        self.output_processor.add(req)
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
        self._aborted.append(self.output_processor.emit(req))
        return req.output

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def summary(self, outputs) -> dict:
        """The landlord's numbers for a run: tokens/s, TTFT, TPOT, preemptions, prefix hit rate, blocks."""
        out = summarize(outputs, self.step_stats, self.bm.stats)
        now = self.stats(history=0)
        out.update(num_blocks=self.num_blocks, block_size=self.block_size,
                   pool_bytes=self.num_blocks * self.bytes_per_block,
                   blocks_cached=now.blocks_cached, blocks_free=now.blocks_free)
        return out

    def stats(self, history: int | None = 64) -> EngineStats:
        """A read-only snapshot of the engine now, with its last `history` steps (None: every step kept).

        The one way to look at a live engine from outside it (server gauges, admission, demo, pictures)."""
        check_int("history", history, 0, "steps to include", optional=True)
        sched, bm = self.scheduler, self.bm
        kept = self.step_stats
        steps = kept if history is None else kept[max(0, len(kept) - history):]
        reserved = sum(blocks_at_most(len(r.prompt_token_ids), r.params.max_tokens, self.block_size,
                                      self.max_model_len, n=r.params.n) for r in self.requests.values())
        free = bm.num_free_blocks
        return EngineStats(
            running=len(sched.running), waiting=len(sched.waiting), swapped=len(sched.swapped),
            num_blocks=self.num_blocks, block_size=self.block_size, blocks_used=self.num_blocks - free,
            blocks_cached=bm.num_evictable_blocks, blocks_free=free, reserved_blocks=reserved,
            max_num_seqs=sched.config.max_num_seqs, preemptions=sched.num_preemptions,
            prefix_tokens_queried=bm.stats.tokens_queried, prefix_tokens_hit=bm.stats.tokens_hit,
            prefix_evictions=bm.stats.evictions, steps=tuple(steps))

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> StepOutputs:
        """One iteration: schedule -> execute -> postprocess. Returns the outputs that changed (a new token,
        a finish, an abort), as a list carrying what the step did: ``.stats`` (None if it ran nothing) and
        ``.preemptions``."""
        with span(SPAN_STEP):
            t0 = time.perf_counter()
            changed, self._aborted = self._aborted, []
            batch = self._schedule()
            self._preemptions = batch.preemptions
            if not batch.scheduled:
                return StepOutputs(changed)
            t1 = time.perf_counter()
            logits = self._execute(batch)
            changed += self._postprocess(batch, logits, t0, time.perf_counter() - t1)
            return StepOutputs(changed, self.step_stats[-1], batch.preemptions)

    def _schedule(self) -> SchedulerOutput:
        """Who computes which tokens this step, into which slots (blocks are allocated here)."""
        batch = self.scheduler.schedule()
        if not batch.scheduled and self.scheduler.has_unfinished():
            raise SchedulerStalled("the scheduler could not schedule anything although requests are pending "
                               f"(waiting {len(self.scheduler.waiting)}, swapped {len(self.scheduler.swapped)}, "
                               f"free blocks {self.bm.num_free_blocks}): this is a bug in minikv")
        return batch

    def _apply(self, ops: list[BlockOp]) -> None:
        """The step's block operations through the runner, in the order the scheduler decided them."""
        runner, swap = self.runner, self.swap
        for op in ops:
            if isinstance(op, CopyBlocks):
                runner.copy_blocks(op.pairs)
            elif isinstance(op, SwapOut):
                swap.put(op.seq_id, runner.swap_out(op.blocks))
            else:
                runner.swap_in(swap.take(op.seq_id), op.blocks)

    def _execute(self, batch: SchedulerOutput) -> torch.Tensor:
        """Block copies and swaps, then one forward over every scheduled token: logits of the samplers."""
        self._apply(batch.block_ops)
        steps = [SeqStep(s.seq.seq_id, s.seq.token_ids[s.start:s.start + s.num_tokens], s.start,
                         self.bm.block_table(s.seq.seq_id), s.slots, s.wants_logits) for s in batch.scheduled]
        return self.runner.execute(steps)

    def _postprocess(self, batch: SchedulerOutput, logits: torch.Tensor, t0: float,
                     forward: float) -> list[RequestOutput]:
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
        self._record(batch, t0, now, forward)
        return [self.output_processor.emit(req) for req in touched.values()]

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
        with span(SPAN_SAMPLE):
            return seqs, sample(logits, [s.request.params for s in seqs], [s.generator for s in seqs])

    def _record(self, batch: SchedulerOutput, t0: float, now: float, forward: float) -> None:
        """One row of the step history; the oldest rows go once it holds STEP_HISTORY (a server runs for days)."""
        sched, bm = self.scheduler, self.bm
        if len(self.step_stats) >= STEP_HISTORY:
            del self.step_stats[:STEP_HISTORY // 2]   # in halves: a delete per step would move the whole list
        self.step_stats.append(StepStats(
            step=self._num_steps, time=now, duration=now - t0, num_running=len(sched.running),
            num_waiting=len(sched.waiting), num_swapped=len(sched.swapped),
            blocks_used=self.num_blocks - bm.num_free_blocks, blocks_cached=bm.num_evictable_blocks,
            blocks_free=bm.num_free_blocks, prefill_tokens=batch.prefill_tokens, decode_tokens=batch.decode_tokens,
            preemptions=len(batch.preempted), forward=forward))
        self._num_steps += 1

    def long_run(self) -> None:
        """This engine will run long (a server, a benchmark): its runner does now what it would otherwise do once
        its steps had paid for it (``ModelRunner.long_run``: the packed weights' move onto huge pages)."""
        if hasattr(self.runner, "long_run"):
            self.runner.long_run()

    # -- the landlord's view (read-only; stage 7's live page) ----------------------------------------
    def speed_levers(self) -> str:
        """What the runner chose for this host, in words: each linear shape's path by row count and how it was
        chosen (measured, remembered, forced), and the attention backend. `serve` and the benchmarks print it."""
        return self.runner.describe() if hasattr(self.runner, "describe") else "a custom runner"

    def last_preemptions(self) -> list[Preemption]:
        """The preemptions the last step decided (empty in most steps)."""
        return list(self._preemptions)

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
                        [s.request.request_id for s in sched.waiting], counts, getattr(self.runner, "pool_bytes", None))

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """After its prompt: the request's other n-1 samples share every block of `seq` (copy-on-write)."""
        req = seq.request
        req.forked = True
        family = [seq]
        for i in range(1, req.params.n):
            child = Sequence(req, i, list(seq.token_ids),
                             generator=make_generator(None if req.params.seed is None else req.params.seed + i,
                                                      self.device))
            self.scheduler.fork(seq, child)
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
        reason, stop_string = None, self.output_processor.append(seq, tok)
        if stop_string or (tok in self.eos_token_ids and not p.ignore_eos) or (
                p.stop_token_ids and tok in p.stop_token_ids):
            reason = "stop"
        elif len(seq.token_ids) - seq.num_prompt_tokens >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)


class LLM:
    """Offline generation, vLLM's shape: ``LLM("smollm2-135m").generate(prompts, SamplingParams(...))``.

    `model` is a loaded ``transformers`` causal LM (give its `tokenizer` for text prompts) or a
    name for `minikv.models.load_model` ("smollm2-135m", "tiny-random-llama", or a Hub id). The
    other arguments are `LLMEngine`'s: `runner`, and the fields of `minikv.config.EngineConfig`
    (pool size, budgets, prefix caching, chunked prefill, preemption mode, swap space) as keywords
    or as one ``config=EngineConfig(...)``.
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
            for rid in ids:   # (their outputs come back from the next step, where no caller waits for them)
                eng.abort_request(rid)
        return [results[rid] for rid in ids]

    def chat(self, conversations, sampling_params=None, use_tqdm: bool = True, **template_kwargs):
        """Apply the tokenizer's chat template to each conversation (a list of {"role", "content"})."""
        inputs = self.engine.input_processor
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = []
        for c in conversations:
            chat = inputs.chat(c, **template_kwargs)
            prompts.append({"prompt": chat.text, "prompt_token_ids": chat.token_ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
