"""Runs the Triton kernels through Triton's interpreter on machines without CUDA.

Triton reads TRITON_INTERPRET when `@triton.jit` runs, i.e. when a kernel module is first imported, and
pytest loads this file before it imports any test module, so every kernel is decorated for the interpreter
however the test modules are ordered. With it set, kernels/ also runs Triton on CPU tensors by default.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
