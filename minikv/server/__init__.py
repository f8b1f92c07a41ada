"""`python -m minikv serve`: minikv's engine behind vLLM's OpenAI-compatible HTTP API.

The pieces, one idea each, in the order a request meets them:

* `cli`: the flags, loading the model, sizing the pool, starting uvicorn and stopping on SIGTERM;
* `app`: the FastAPI routes (`/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`,
  `/metrics`), API-key check, body-size limit, back-pressure (429) and disconnects;
* `protocol`: parsing the request bodies (pydantic) and OpenAI's error body (the values are
  checked by the engine's own door, `minikv.inputs`, and by `SamplingParams`);
* `responses`: the JSON a client gets back, whole or as server-sent-event chunks;
* `tokens`: vLLM's small endpoints beside the API (`/tokenize`, `/detokenize`, `/version`);
* `engine_loop`: the one thread that steps the engine, and how handlers hand it work;
* `metrics`: Prometheus metrics under vLLM's names with the `minikv:` prefix;
* `admission` and `landlord`: who gets in (429 and `Retry-After`), and the pool drawn live.

(The tiny test model's byte tokenizer is `minikv.models.byte_tokenizer`.)
"""
