"""Shared pytest set-up.

Triton kernels: without a CUDA device they run under the Triton interpreter, which must be chosen before triton is
first imported, so it is set here (before any test module imports triton). On a GPU host the variable is left alone
and the kernel tests run compiled on CUDA tensors.
"""
import os

try:
    import torch as _torch

    _has_cuda = _torch.cuda.is_available()
except Exception:  # pragma: no cover
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
