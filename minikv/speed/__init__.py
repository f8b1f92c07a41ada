"""The engine's speed levers, each switchable so a benchmark can show what it is worth.

* ``linears``: oneDNN-prepacked linear weights on the CPU (``prepack_linears``).
* ``graphs``: the decode step planned for CUDA graph replay (persistent buffers, padding).

The CPU attention kernel, the third lever (``cpu_kernel``), lives beside the Triton one in ``kernels/``.
"""
