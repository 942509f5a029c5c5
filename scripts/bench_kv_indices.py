"""Times create_kv_indices (page_size 1) for batches of 1/64/256 requests x 1k/8k/32k tokens each.

    python scripts/bench_kv_indices.py --device cpu [--quick]    # the torch fallback, us per call
    python scripts/bench_kv_indices.py --device cuda [--quick]   # Triton on the GPU against baselines

On CUDA every row reports the median time (triton.testing.do_bench, L2 flushed between calls) and GB/s,
counting 4 bytes read and 4 written per token plus the kv_indptr read, for:
  kvmem_api         create_kv_indices(..., kv_indices=buf): checks + launch, as a server calls it
  kvmem_kernel      the same Triton kernel launched directly
  sglang_style      the classic shape of SGLang's create_flashinfer_kv_indices_triton, rewritten here:
                    one program per request looping over fixed 512-token blocks
  sglang            SGLang's own kernel, when sglang is importable, launched as its FlashInfer backend does
                    (one program per request)
  sglang_block_parallel  the same kernel with its TOKEN_BLOCK_PARALLEL 2-D grid (SGLang 0.5.23+), sized by
                    its own kv_indices_num_token_blocks
  torch_fallback    the vectorized torch path on the GPU
  copy              a device-to-device copy_ of the same number of int32s (the bandwidth ceiling)
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from kvmem.kernels.kv_indices import _launch, create_kv_indices, create_kv_indptr

BATCH_SIZES = (1, 64, 256)
TOKENS_PER_REQUEST = (1024, 8192, 32768)


def make_batch(bs: int, tokens: int, device: str):
    g = torch.Generator().manual_seed(bs * 7 + tokens)
    req_to_token = torch.randint(1, 1 << 24, (bs + 8, tokens), generator=g, dtype=torch.int32).to(device)
    rows = (torch.randperm(bs + 8, generator=g)[:bs]).to(device)
    kv_lens = torch.full((bs,), tokens, dtype=torch.int32, device=device)
    kv_indptr = create_kv_indptr(kv_lens)
    kv_indices = torch.empty(bs * tokens, dtype=torch.int32, device=device)
    return req_to_token, rows, kv_lens, kv_indptr, kv_indices


def time_cpu_us(fn, min_seconds: float = 0.3, min_calls: int = 3, max_calls: int = 200) -> float:
    fn()
    samples, start = [], time.perf_counter()
    while len(samples) < max_calls and (len(samples) < min_calls or time.perf_counter() - start < min_seconds):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def bench_cpu(batch_sizes, tokens_list) -> list[dict]:
    rows = []
    for bs in batch_sizes:
        for tokens in tokens_list:
            req_to_token, req_rows, kv_lens, kv_indptr, kv_indices = make_batch(bs, tokens, "cpu")
            us = time_cpu_us(lambda: create_kv_indices(req_to_token, req_rows, kv_lens, kv_indptr,
                                                       kv_indices=kv_indices, backend="torch"))
            rows.append({"bs": bs, "tokens_per_request": tokens, "torch_fallback_us": round(us, 1),
                         "torch_fallback_gbps": round(_bytes(bs, tokens) / us / 1e3, 2)})
    return rows


def _bytes(bs: int, tokens: int) -> int:
    return 8 * bs * tokens + 4 * (bs + 1)


def _sglang_style_kernel():
    """One program per request, 512-token blocks: the classic FlashInfer kv_indices gather, written here."""
    import triton
    import triton.language as tl

    @triton.jit
    def gather_one_program_per_request(req_to_token_ptr, req_pool_indices_ptr, kv_lens_ptr, kv_indptr_ptr,
                                       kv_indices_ptr, row_stride):
        BLOCK: tl.constexpr = 512
        req = tl.program_id(0)
        src = req_to_token_ptr + tl.load(req_pool_indices_ptr + req).to(tl.int64) * row_stride
        dst = kv_indices_ptr + tl.load(kv_indptr_ptr + req)
        n = tl.load(kv_lens_ptr + req)
        for block in range(tl.cdiv(n, BLOCK)):
            offs = block * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    return gather_one_program_per_request


def _sglang_kernel():
    """SGLang's kernel and its block-count helper (None where this SGLang has no block-parallel grid)."""
    name = "create_flashinfer_kv_indices_triton"
    for module in ("sglang.kernels.ops.attention.kv_indices", "sglang.srt.layers.attention.utils"):
        try:
            mod = __import__(module, fromlist=[name])
        except Exception:  # absent, or present but needing a server config: either way no comparison
            continue
        return getattr(mod, name), getattr(mod, "kv_indices_num_token_blocks", None)
    return None, None


def bench_cuda(batch_sizes, tokens_list) -> list[dict]:
    from triton.testing import do_bench

    baseline, (sglang, sglang_blocks) = _sglang_style_kernel(), _sglang_kernel()
    rows = []
    for bs in batch_sizes:
        for tokens in tokens_list:
            req_to_token, req_rows, kv_lens, kv_indptr, kv_indices = make_batch(bs, tokens, "cuda")
            copy_src = torch.empty_like(kv_indices)
            stride = req_to_token.stride(0)
            fns = {
                "kvmem_api": lambda: create_kv_indices(req_to_token, req_rows, kv_lens, kv_indptr,
                                                       kv_indices=kv_indices, backend="triton"),
                "kvmem_kernel": lambda: _launch(req_to_token, req_rows, kv_lens, kv_indptr, None, 1, kv_indices),
                "sglang_style": lambda: baseline[(bs,)](req_to_token, req_rows, kv_lens, kv_indptr, kv_indices,
                                                        stride),
                "torch_fallback": lambda: create_kv_indices(req_to_token, req_rows, kv_lens, kv_indptr,
                                                            kv_indices=kv_indices, backend="torch"),
                "copy": lambda: kv_indices.copy_(copy_src),
            }
            if sglang is not None:
                fns["sglang"] = lambda: sglang[(bs,)](req_to_token, req_rows, kv_lens, kv_indptr, None, kv_indices,
                                                      stride)
            if sglang_blocks is not None:
                grid = (bs, sglang_blocks(stride, bs))
                fns["sglang_block_parallel"] = lambda: sglang[grid](
                    req_to_token, req_rows, kv_lens, kv_indptr, None, kv_indices, stride, TOKEN_BLOCK_PARALLEL=True)
            want = create_kv_indices(req_to_token, req_rows, kv_lens, kv_indptr, backend="torch")
            row = {"bs": bs, "tokens_per_request": tokens}
            for name, fn in fns.items():
                kv_indices.fill_(-1)  # so that the check below sees what this fn wrote
                us = do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
                if name != "copy":
                    assert torch.equal(kv_indices, want), f"{name} gathered wrong indices"
                row[f"{name}_us"] = round(us, 2)
                row[f"{name}_gbps"] = round(_bytes(bs, tokens) / us / 1e3, 1)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="batches of 1 and 64 x 1k and 8k tokens only")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("argument --device: cuda needs a CUDA device")
    batch_sizes = BATCH_SIZES[:2] if args.quick else BATCH_SIZES
    tokens_list = TOKENS_PER_REQUEST[:2] if args.quick else TOKENS_PER_REQUEST
    report = {"device": args.device, "page_size": 1, "torch": torch.__version__, "python": platform.python_version()}
    if args.device == "cuda":
        import triton

        report |= {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__,
                   "timer": "triton.testing.do_bench median, L2 flushed",
                   "results": bench_cuda(batch_sizes, tokens_list)}
    else:
        report |= {"threads": torch.get_num_threads(), "timer": "time.perf_counter median",
                   "results": bench_cpu(batch_sizes, tokens_list)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
