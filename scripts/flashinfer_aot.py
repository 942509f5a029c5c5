#!/usr/bin/env python3
"""Compiles the FlashInfer kernels that kvmem's GPU checks use, ahead of time, on a machine without a GPU.

FlashInfer JIT-compiles each kernel module on first use: minutes per Hopper prefill module, more than a lent
GPU's time allows for the CUDA tests (scripts/gpu_check.sh). This builds the modules of the tests and benchmarks
(batch decode and prefill for float16 / bfloat16 queries, head dims 128 and 64, and an fp8 KV cache; the cascade
merge) with nvcc for one architecture, and copies each .so to OUT/<module>/<module>.so, the layout of
FlashInfer's AOT folder: gpu_check.sh copies `.whl/aot/` there, and FlashInfer loads a module found there
instead of compiling it. Any module not built here is still JIT-compiled on the GPU machine.

    python scripts/flashinfer_aot.py [--arch 9.0a] [--out .whl/aot] [--jobs 2]

Needs the same flashinfer version as the GPU machine's (its kernel sources are in the package), nvcc with
CUDA_HOME set, and a libcuda.so to link against (CUDA's lib64/stubs). Prints one JSON line per module.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from kvmem._checks import positive_int_arg


def module_specs():
    """(kind, FlashInfer JitSpec) of every module kvmem's GPU tests and benchmarks plan."""
    import torch
    from flashinfer.jit.attention.modules import gen_batch_decode_module, gen_batch_prefill_module
    from flashinfer.jit.cascade import gen_cascade_module

    f16, bf16, e4m3 = torch.float16, torch.bfloat16, torch.float8_e4m3fn
    specs = [("cascade", gen_cascade_module())]
    # Queries and outputs of the model's dtype; KV of that dtype or fp8 (the engine's fp8 pools); int32 indptr;
    # no positional encoding in the kernel, no sliding window, no logits cap (what FlashInferAttention plans).
    for head_dim, q, kv in ((128, f16, f16), (128, bf16, bf16), (64, f16, f16), (64, bf16, bf16), (64, f16, e4m3)):
        args = (q, kv, q, torch.int32, head_dim, head_dim, 0, False, False)
        specs.append(("decode", gen_batch_decode_module(*args)))
        # On Hopper, backend "auto" picks FlashInfer's FA3 kernels for these prefills (and tensor-core decode);
        # FlashInferAttention takes FA2 for fp8 K/V under 16-bit queries, which FA3 does not read.
        specs.append(("prefill", gen_batch_prefill_module("fa3" if kv == q else "fa2", *args, False)))
    return specs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="9.0a", help="CUDA architecture to build for (H100 / H200: 9.0a)")
    ap.add_argument("--out", default=".whl/aot", help="folder for the modules (FlashInfer's AOT layout)")
    ap.add_argument("--jobs", type=positive_int_arg, default=os.cpu_count() or 1, help="parallel compiler jobs")
    args = ap.parse_args(argv)
    os.environ["FLASHINFER_CUDA_ARCH_LIST"] = args.arch  # read when flashinfer is imported
    os.environ["MAX_JOBS"] = str(args.jobs)
    try:
        specs = module_specs()
    except ImportError as e:
        ap.error(f"flashinfer does not import here: {e}")
    out, failed = Path(args.out), 0
    for kind, spec in specs:
        t0 = time.perf_counter()
        try:
            if not spec.is_compiled:
                spec.build(verbose=False)
        except Exception as e:  # a module this machine cannot build: the GPU machine JIT-compiles it
            failed += 1
            print(json.dumps({"module": spec.name, "kind": kind, "error": str(e)[-2000:]}), flush=True)
            continue
        target = out / spec.name / f"{spec.name}.so"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(spec.get_library_path(), target)
        print(json.dumps({"module": spec.name, "kind": kind, "seconds": round(time.perf_counter() - t0, 1),
                          "bytes": target.stat().st_size}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
