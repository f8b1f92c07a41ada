"""The server's engine loop when the engine itself fails: no client is left waiting (in process, no HTTP)."""

import asyncio

import pytest

from minikv.engine import LLMEngine
from minikv.models import byte_tokenizer
from minikv.sampling import SamplingParams
from minikv.server.engine_loop import EngineLoop


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the failure, on purpose
def test_an_engine_failure_answers_every_request_it_knew_of(tiny_llama):
    engine = LLMEngine(tiny_llama, byte_tokenizer(), block_size=4, num_blocks=32, verbose=False)
    add = engine.add_request

    def add_request(request_id, *args, **kwargs):
        if request_id == "r1":
            raise RuntimeError("a bug while adding r1")
        return add(request_id, *args, **kwargs)

    engine.add_request = add_request
    loop = EngineLoop(engine)

    async def run():
        params = SamplingParams(temperature=0, max_tokens=4)
        # All three wait in the inbox before the thread starts: r0 is added and live when r1's add fails,
        # and r2 is still in the inbox then.
        outboxes = [loop.submit(f"r{i}", {"prompt": None, "prompt_token_ids": [5, 6, 7]}, params) for i in range(3)]
        loop.start()
        return [await asyncio.wait_for(box.get(), timeout=30) for box in outboxes]

    updates = asyncio.run(run())
    loop.join(10)
    assert not loop.alive and isinstance(loop.error, RuntimeError)
    for update in updates:
        assert update.finished and update.error_status == 500 and "the engine failed" in update.error, update


def test_build_makes_the_engine_on_the_thread_that_steps_it(tiny_llama):
    """The server's engine is built where it runs: torch's CPU thread pool is per calling thread, and a second
    pool on a 2-core machine makes every op of every step wait for a sleeping worker (engine_loop's docstring)."""
    import threading

    built_on, stepped_on = [], []

    def make_engine():
        built_on.append(threading.get_ident())
        engine = LLMEngine(tiny_llama, byte_tokenizer(), block_size=4, num_blocks=32, verbose=False)
        step = engine.step
        engine.step = lambda: (stepped_on.append(threading.get_ident()), step())[1]
        return engine

    loop = EngineLoop.build(make_engine, timeout=60)

    async def run():
        box = loop.submit("r0", {"prompt": None, "prompt_token_ids": [5, 6, 7]},
                          SamplingParams(temperature=0, max_tokens=3))
        while not (update := await asyncio.wait_for(box.get(), timeout=30)).finished:
            pass
        return update

    assert asyncio.run(run()).info["completion_tokens"] == 3
    loop.shutdown()
    loop.join(10)
    assert not loop.alive
    assert built_on and set(stepped_on) == set(built_on) and built_on[0] != threading.get_ident()


def test_build_raises_what_building_the_engine_raised():
    def make_engine():
        raise ValueError("unknown model 'nope'; try smollm2-135m")

    with pytest.raises(ValueError, match="unknown model"):
        EngineLoop.build(make_engine, timeout=60)
