"""The model runner's speed levers, each a switch of ``ModelRunner`` (and so of ``LLM``/``LLMEngine``),
so a benchmark can show what it is worth (``python -m minikv bench engine --repeat``):

* ``linears``: linear weights prepacked once, for oneDNN and for MKL's packed sgemm, on the CPU in fp32; each
  call takes the copy that measured faster at its row count (``prepack_linears``);
* ``compile``: every step of two tokens or more through ``torch.compile`` (``compile``);
* ``graphs``: decode steps replayed from CUDA graphs, over persistent buffers padded to captured batch
  sizes (``decode_graphs``; on the CPU the same plan runs eagerly).

On the CPU the runner also keeps what a step frees mapped for the next (``malloc``: glibc's thresholds,
process-wide, not a switch; ``MINIKV_MALLOC=default`` is its control). The runner builds them; they read
its step layout from ``minikv.step`` and never import the runner.
The C++ decode attention kernel (``cpu_kernel``) is an attention backend, chosen in ``minikv.dispatch``
beside the Triton one; both live in ``kernels/``.
"""
