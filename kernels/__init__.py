"""minikv's Triton kernels (stage 4): ``minikv_kernels.paged_attention`` is the paged-attention decode kernel.

This folder is installed as ``minikv_kernels``: import the kernel module itself, ``from
minikv_kernels.paged_attention import ...``. Under that name this file does nothing.

PyPI has an unrelated package whose import name is ``kernels`` (Hugging Face's hub kernels),
which ``transformers`` probes for and, from 5.25 on, requires. Wherever the repository root is on
``sys.path`` (the current folder of ``python -m pytest`` or ``python -m minikv`` run there, or
Colab's ``sys.path.insert(0, "/content/minikv")``), ``import kernels`` finds this folder first.
So, imported as ``kernels``, it puts the real package from the rest of ``sys.path`` in its place
(``transformers.integrations.hub_kernels`` then gets what it imports); where there is none, it
stays bare: no ``__version__``, so transformers' probe answers "not installed", the truth. Either
way nothing here imports torch or Triton.
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.realpath(os.path.join(os.path.dirname(__file__), os.pardir))
    _rest = [p for p in sys.path if os.path.realpath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _rest)
    if _spec is not None and _spec.origin != __spec__.origin:
        _real = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _real  # the import statement returns what sys.modules holds once this file ends
        _spec.loader.exec_module(_real)
