"""minikv: a small, real LLM serving engine, built one stage at a time around its KV cache.

Stage by stage (each a module, each small enough to read in one sitting):

1. ``sizing``      bytes per token, cache vs weights, how many conversations fit
2. ``contiguous``  one worst-case slab per request (how early servers did it)
3. ``blocks``, ``paged``, ``attention``   fixed-size blocks, block tables, paged attention
4. ``kernels/``    a Triton paged-attention decode kernel
"""

__version__ = "0.1.0"
