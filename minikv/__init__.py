"""minikv: a small, real LLM serving engine, built one stage at a time around its KV cache.

Stage by stage (each a module, each small enough to read in one sitting):

1. ``sizing``      bytes per token, cache vs weights, how many conversations fit
2. ``contiguous``  one worst-case slab per request (how early servers did it)
3. ``blocks``, ``paged``, ``attention``   fixed-size blocks, block tables, paged attention
4. ``kernels/``    a Triton paged-attention decode kernel
5. ``prefix``      shared prefixes: a hash-chained prefix cache, fork, copy-on-write
6. ``sequence``, ``scheduler``, ``runner``, ``sampling``, ``engine``   continuous batching:
   ``from minikv import LLM, SamplingParams``
7. ``server/``     the landlord: the engine behind an OpenAI-compatible HTTP server
   (``python -m minikv serve``) and a load generator (``python -m minikv bench serve``)

Instruments and machinery live in subpackages: ``sim/`` (simulators), ``viz/`` (pictures),
``bench/`` (benchmarks and the claims table), ``grading/`` (the exercises' grader), ``speed/``
(the engine's CPU and GPU speed levers).
"""

__version__ = "0.1.0"

# Importing minikv sets no environment variable: Triton's interpreter (the only way its kernels run without a
# CUDA GPU) is chosen where the kernels are defined, in minikv_kernels/paged_attention.py.
from minikv.engine import LLM, LLMEngine  # noqa: E402
from minikv.sampling import SamplingParams  # noqa: E402

__all__ = ["LLM", "LLMEngine", "SamplingParams"]
