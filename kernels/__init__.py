"""minikv's Triton kernels (stage 4): ``minikv_kernels.paged_attention`` is the paged-attention decode kernel.

This file stays a bare docstring on purpose. ``transformers`` probes for an unrelated PyPI
package that is also called ``kernels``: it finds this folder, finds no distribution metadata,
imports it and looks for ``__version__``. With no version here the probe answers "not
installed", which is the truth, and the import costs nothing because nothing here imports
Triton or torch. Import the kernel module itself: ``from minikv_kernels.paged_attention import ...``.
"""
