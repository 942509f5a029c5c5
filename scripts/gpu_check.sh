#!/usr/bin/env bash
# GPU checks for kernels/ and kvmem/attention/, run from anywhere on a CUDA machine:
#   0. installs kvmem itself without dependencies (kernels/ installs as kvmem.kernels, so the source tree alone
#      does not import),
#   1. installs the carried FlashInfer wheels from .whl/ (if any) into /tmp/site, with the modules that
#      scripts/flashinfer_aot.py compiled ahead of time into .whl/aot/ (the JIT compiles the rest, minutes each),
#   2. runs the CUDA tests (Triton == torch fallback on CUDA tensors, FlashInfer == reference attention)
#      and the kernel / attention tests without TRITON_INTERPRET, i.e. on CUDA tensors,
#   3. runs the kv_indices benchmark (JSON; also saved to $OUT/bench_kv_indices.json when OUT is set), the
#      cascade benchmark (FlashInfer's cascade wrapper against BatchDecode; $OUT/bench_cascade.json), and the
#      engine's decode benchmark (0.5B random-weight Qwen2, FlashInfer vs transformers' generate) when
#      transformers imports (carry its wheels in .whl/ too; $OUT/bench_engine.json),
#      beside SGLang's own create_flashinfer_kv_indices_triton when a copy of its source is carried in
#      .peer/sglang/ (ignored by git: SGLang's code is never committed here).
# The first FlashInfer test JIT-compiles its kernels (minutes); later runs on the same machine reuse them.
# Exit status: 0 when the tests pass.
set -uo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . || { echo "cannot install kvmem"; exit 1; }
[ -d .peer ] && export PYTHONPATH="$PWD/.peer${PYTHONPATH:+:$PYTHONPATH}"

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site"
    # FlashInfer modules compiled ahead of time on a machine without a GPU (scripts/flashinfer_aot.py) load as
    # its AOT modules; any other module is JIT-compiled here as usual.
    [ -d .whl/aot ] && [ -d /tmp/site/flashinfer ] && mkdir -p /tmp/site/flashinfer/data/aot \
        && cp -r .whl/aot/. /tmp/site/flashinfer/data/aot/
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO CUDA')"
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" \
    || echo "flashinfer is not importable: its tests will be skipped"

status=0
python3 -m pytest -q -rs tests/test_flashinfer_cuda.py tests/test_cascade_cuda.py tests/test_engine_cuda.py \
    tests/test_kernels_kv_indices.py tests/test_kernels_req_to_token.py tests/test_attention.py tests/test_cascade.py \
    || status=1

if [ -n "${OUT:-}" ]; then
    python3 scripts/bench_kv_indices.py --device cuda | tee "$OUT/bench_kv_indices.json" || status=1
    python3 scripts/bench_cascade.py --device cuda --snapshots 4 --out "$OUT/bench_cascade.json" || status=1
else
    python3 scripts/bench_kv_indices.py --device cuda || status=1
    python3 scripts/bench_cascade.py --device cuda --snapshots 4 || status=1
fi
if python3 -c "import transformers" 2>/dev/null; then
    python3 scripts/bench_engine.py --device cuda | tee "${OUT:-/tmp}/bench_engine.json" || status=1
else
    echo "transformers is not importable: the engine benchmark is skipped"
fi
exit $status
