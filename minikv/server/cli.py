"""`python -m minikv serve`: load a model, size the KV pool, start the engine thread and uvicorn.

Safe by default: it binds 127.0.0.1 (``--host 0.0.0.0`` opens it to the network, on purpose),
``--api-key`` (or ``MINIKV_API_KEY``) asks every ``/v1`` request for ``Authorization: Bearer KEY``,
a request body is at most ``--max-request-bytes``, at most ``--max-waiting`` requests wait to
start (then 429), and the model is chosen here, never by a request.

Stopping: on SIGINT or SIGTERM the server stops accepting, the engine aborts what is still in
flight (every streamed request gets a finish reason, ``abort``, and ``[DONE]``), the connections
close and the process exits 0, within a few seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import threading

from minikv.config import EngineConfig, add_engine_args

# Interactive defaults on the CPU (notebooks/deep/06_chunked_prefill.ipynb): a step costs roughly its token
# count, so the budget and the per-prompt chunk bound the longest pause a running stream sees when a long
# prompt arrives; on a GPU a step of a few hundred tokens costs about a decode step, and vLLM's defaults stand.
CPU_STEP_BUDGET = 512
CPU_PREFILL_CAP = 256
ENGINE_HELP = {
    "max_num_batched_tokens": f"tokens per step at most (default {CPU_STEP_BUDGET} on the CPU with chunked prefill, "
                              "2048 on a GPU: a CPU step's time grows with its tokens, and every running stream "
                              "waits for the whole step)",
    "long_prefill_token_threshold": f"one prompt's prefill tokens per step at most, 0 for no cap (default "
                                    f"{CPU_PREFILL_CAP} on the CPU, no cap on a GPU: a long prompt is prefilled in "
                                    "chunks beside the decodes, so it no longer stalls every stream for seconds; "
                                    "it waits longer for its own first token)",
}
SERVE_HELP = "serve the model over vLLM's OpenAI-compatible HTTP API (FastAPI + uvicorn)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default) or tiny-random-llama (tests)")
    p.add_argument("--served-model-name", default=None, help="the name clients send as 'model' (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    add_engine_args(p.add_argument_group("the engine (minikv.config.EngineConfig; LLM(...) takes the same names)"),
                    ENGINE_HELP)
    p.add_argument("--max-waiting", type=int, default=128,
                   help="requests accepted but not yet started at most; past it 429 + Retry-After (default 128)")
    p.add_argument("--api-key", default=os.environ.get("MINIKV_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $MINIKV_API_KEY, else none)")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch's CPU threads for the forward (default: torch's choice; 1 on a busy shared machine, "
                        "where threads that wait for each other stall every step)")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level (default warning)")


def _uvicorn_server(config, engine_loop):
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, but a signal first tells the engine to finish everyone, and exits 0 after."""

        def handle_exit(self, sig, frame):
            # From a signal handler: take no lock here (the interrupted code may hold it); a thread may.
            threading.Thread(target=engine_loop.shutdown, daemon=True).start()
            super().handle_exit(sig, frame)

        def capture_signals(self):   # uvicorn re-raises the signal after a graceful stop: we exit 0 instead
            import contextlib
            import signal

            @contextlib.contextmanager
            def captured():
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                before = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
                try:
                    yield
                finally:
                    for s, handler in before.items():
                        signal.signal(s, handler)
            return captured()

    return Server(config)


def run_server(args) -> int:
    import uvicorn

    from minikv.engine import LLMEngine
    from minikv.models import ALIASES, TINY, load_model
    from minikv.server.app import ServerState, create_app
    from minikv.server.engine_loop import EngineLoop
    from minikv.server.landlord import Feed
    from minikv.server.metrics import ServerMetrics
    from minikv.sizing import fmt_bytes

    for flag in ("port", "max_waiting", "max_request_bytes"):
        if getattr(args, flag) < (0 if flag == "port" else 1):
            raise ValueError(f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(args, flag)}")
    config = EngineConfig.from_cli_args(args, verbose=False)   # a bad engine flag fails before the model loads

    def make_engine() -> LLMEngine:
        """On the engine thread (EngineLoop.build): the model loads where it will run, so torch's CPU thread
        pool lives on that one thread only."""
        if args.threads is not None:
            import torch
            torch.set_num_threads(args.threads)
        model, tokenizer = load_model(args.model)
        if tokenizer is None and ALIASES.get(args.model, args.model) == TINY:
            from minikv.models import byte_tokenizer
            tokenizer = byte_tokenizer()   # so the tiny test model reads text and chat too
        chosen = config
        if next(model.parameters()).device.type == "cpu" and config.enable_chunked_prefill:   # interactive defaults
            budget = config.max_num_batched_tokens or CPU_STEP_BUDGET
            cap = config.long_prefill_token_threshold
            chosen = dataclasses.replace(config, max_num_batched_tokens=budget, long_prefill_token_threshold=min(
                CPU_PREFILL_CAP, budget) if cap is None else cap)
        engine = LLMEngine(model, tokenizer, chosen)
        engine.long_run()   # a server runs long: what would pay for itself later is done before it listens
        return engine

    name = args.served_model_name or args.model
    metrics = ServerMetrics(name)
    landlord = Feed()
    loop = EngineLoop.build(make_engine, metrics, landlord=landlord)
    engine = loop.engine
    tokenizer = engine.tokenizer
    config = engine.config   # with the interactive defaults make_engine chose
    cap = config.long_prefill_token_threshold
    state = ServerState(loop, tokenizer, name, max_waiting=args.max_waiting, api_key=args.api_key,
                        max_body_bytes=args.max_request_bytes, metrics=metrics, landlord=landlord)
    pool = engine.num_blocks * engine.block_size
    print(f"minikv serve: http://{args.host}:{args.port}/v1  model {name!r} ({engine.device}, context "
          f"{engine.max_model_len})\n  KV pool: {engine.num_blocks} blocks x {engine.block_size} tokens = {pool} "
          f"tokens, {fmt_bytes(engine.num_blocks * engine.bytes_per_block)}; prefix caching "
          f"{'on' if config.enable_prefix_caching else 'off'}, preemption {config.preemption_mode}, "
          f"max {config.max_num_seqs} seqs, max {args.max_waiting} waiting\n  step budget "
          f"{engine.input_processor.limits.max_num_batched_tokens} tokens, a prompt's prefill chunk "
          f"{'at most ' + str(cap) + ' tokens' if cap else 'uncapped'}"
          f"{'; API key required' if args.api_key else ''}\n"
          f"  {engine.speed_levers().replace(chr(10), chr(10) + '  ')}\n"
          f"  the landlord's window (the pool, live): http://{args.host}:{args.port}/landlord", flush=True)
    config = uvicorn.Config(create_app(state), host=args.host, port=args.port, log_level=args.log_level,
                            access_log=False, timeout_graceful_shutdown=5, lifespan="off")
    server = _uvicorn_server(config, loop)
    server.run()
    loop.shutdown()          # (already done if a signal stopped us)
    loop.join(timeout=10)
    print("minikv serve: stopped", flush=True)
    return 0 if server.started else 1


def exit_now(code: int) -> None:
    """End the process once the server has stopped. Everything is answered and flushed by then; the
    interpreter's own teardown (freeing torch and transformers module by module) would add seconds on
    a busy machine to a SIGTERM that should take a moment, so it is skipped."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minikv serve", description=SERVE_HELP)
    add_arguments(p)
    exit_now(run_server(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
