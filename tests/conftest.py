"""Runs the Triton kernels through Triton's interpreter on machines without CUDA.

Triton reads TRITON_INTERPRET when `@triton.jit` runs, i.e. when a kernel module is first imported, and
pytest loads this file before it imports any test module, so every kernel is decorated for the interpreter
however the test modules are ordered. With it set, kernels/ also runs Triton on CPU tensors by default.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def single_torch_thread():
    """One intra-op torch thread for a module of tiny-model runs: on the shared 2-core machine two threads made
    each small matmul several times slower (412 us against 82 us for a 40 x 64 x 128 linear)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
