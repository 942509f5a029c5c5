"""A small engine that runs transformers causal LMs over kvmem's pools, allocators, radix cache and scheduler.

Optional extra `model` (transformers). `Engine(model, capacity_tokens=...)` and `generate(prompts,
max_new_tokens)`; `build_model(preset)` makes seeded random models from `PRESETS` (nothing is downloaded).
Hybrid models (Gemma 3, gpt-oss, Qwen3-Next: sliding-window and linear-attention layers) run on kvmem's window
and state pools (`kvmem.engine.hybrid`).
"""

from kvmem.engine.engine import Engine, EngineStats, RequestOutput
from kvmem.engine.models import SUPPORTED_ARCHITECTURES
from kvmem.engine.presets import PRESETS, build_model

__all__ = ["PRESETS", "SUPPORTED_ARCHITECTURES", "Engine", "EngineStats", "RequestOutput", "build_model"]
