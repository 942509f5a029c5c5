"""The engine loop: kvmem's Scheduler decides what runs, the model runner runs it, greedy sampling closes the step."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvmem._checks import check_int
from kvmem._device import check_device
from kvmem._paging import round_up
from kvmem._torch import torch
from kvmem.allocator import PagedTokenAllocator, TokenAllocator
from kvmem.batch import ForwardMode, Req, ReqStatus
from kvmem.engine.attention import ATTENTION_BACKENDS, make_attention_backend
from kvmem.engine.hybrid import LINEAR, HybridAdapter
from kvmem.engine.models import adapter_for
from kvmem.engine.runner import HybridModelRunner, ModelRunner
from kvmem.hybrid import HybridRadixCache, HybridTokenAllocator
from kvmem.radix_cache import RadixCache
from kvmem.req_to_token import ReqToTokenPool
from kvmem.scheduler import Scheduler, SchedulerConfig
from kvmem.sizing import WINDOW_FREE_INTERVAL

DEFAULT_MAX_RUNNING_REQUESTS = 256
_UNORDERED = (Mapping, Set)  # iterable, but not in an order a caller chose


class RequestOutput(NamedTuple):
    """A finished request: `output_ids` (the stop token included when one ended it), `logits` [len(output_ids),
    vocab_size] float32 (each sampled token's distribution; None unless asked for) and `cached_tokens` (prompt
    tokens the prefix cache held when it was first admitted)."""

    rid: int
    output_ids: list[int]
    logits: torch.Tensor | None
    cached_tokens: int


@dataclass
class EngineStats:
    """Totals since the engine was built (tokens and batches)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    prefill_batches: int = 0
    decode_batches: int = 0
    retractions: int = 0
    evicted_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """cached_tokens / prompt_tokens, token-weighted, over requests admitted so far (0 before any)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Engine:
    """Greedy generation with a transformers causal LM whose KV cache is kvmem's.

    Args:
        model: a transformers causal LM of a supported architecture (kvmem.engine.SUPPORTED_ARCHITECTURES:
            Llama, Mistral, Qwen2 with MHA/GQA; DeepSeek-V2/V3 with MLA; the hybrid Gemma 3, gpt-oss and Qwen3-Next).
            Its own weights run; only attention (and linear attention's state) and the cache are replaced.
            ValueError naming the architecture otherwise.
        capacity_tokens: KV slots in the pool (a multiple of page_size), shared by running requests and the
            prefix cache; the radix cache evicts and the scheduler retracts when it runs short. For a hybrid model,
            the full-attention layers' pool: the tokens requests and the cache hold.
        page_size: tokens per KV page (1 = token-granular).
        kv_cache_dtype: "auto" (the model dtype), "fp8_e4m3", "fp8_e5m2", "int8" or "int4" (MHA only), as in
            kvmem.MHAKVPool / MLAKVPool.
        chunked_prefill_size: new tokens per prefill step (None: whole prompts).
        max_running_requests: requests decoding at once (default 256), also the req_to_token rows.
        device: where the pools live, and must be the model's (None: the model's device).
        attention_backend: "auto" (FlashInfer for a float16/bfloat16 model on CUDA when installed, else the torch
            reference), "torch", "flashinfer".
        schedule_policy: "lpm" (longest cached prefix first) or "fcfs".
        window_tokens: a model with sliding-window layers: their pool's slots (a multiple of page_size; None: as many
            as capacity_tokens). Tokens leave it as they leave every window (kvmem.hybrid.HybridRadixCache).
        state_slots: a model with linear-attention layers: recurrent states, a running request's own and the
            cached ones (at least 2; None: 2 x max_running_requests).
        Hybrid models run the torch attention ("auto" or "torch").

    Requests enter with `add_request` (checked there: a bad one raises ValueError naming it and nothing else
    changes, so the others keep running) and advance with `step()`; `generate` wraps both.

    >>> from kvmem.engine import Engine, build_model
    >>> engine = Engine(build_model("llama-tiny"), capacity_tokens=256)
    >>> outputs = engine.generate([[1, 2, 3, 4], [1, 2, 3, 5]], max_new_tokens=4)
    >>> [len(o) for o in outputs]
    [4, 4]
    """

    def __init__(self, model, *, capacity_tokens: int, page_size: int = 1, kv_cache_dtype: str = "auto",
                 chunked_prefill_size: int | None = None, max_running_requests: int | None = None,
                 device: str | torch.device | None = None, attention_backend: str = "auto",
                 schedule_policy: str = "lpm", window_tokens: int | None = None,
                 state_slots: int | None = None) -> None:
        self.adapter = adapter_for(model)
        capacity_tokens = check_int("capacity_tokens", capacity_tokens, minimum=1)
        page_size = check_int("page_size", page_size, minimum=1)
        if capacity_tokens % page_size:
            raise ValueError(f"capacity_tokens {capacity_tokens} must be a multiple of page_size {page_size}")
        rows = DEFAULT_MAX_RUNNING_REQUESTS if max_running_requests is None else \
            check_int("max_running_requests", max_running_requests, minimum=1)
        model_device = self.adapter.embed_tokens.weight.device
        device = model_device if device is None else torch.empty(0, device=check_device(device)).device
        if device != model_device:
            raise ValueError(f"device {device} differs from the model's {model_device}: move the model first")
        self.device = device
        self.model = model
        self.context_len = self.adapter.context_len()
        self.req_to_token_pool = ReqToTokenPool(rows, min(self.context_len, capacity_tokens), device=device)
        if isinstance(self.adapter, HybridAdapter):
            self._build_hybrid(capacity_tokens, page_size, kv_cache_dtype, window_tokens, state_slots, rows,
                               attention_backend, device)
        else:
            for name, value in (("window_tokens", window_tokens), ("state_slots", state_slots)):
                if value is not None:
                    raise ValueError(f"{name} is for hybrid models; {type(model).__name__} has neither sliding-window "
                                     "nor linear-attention layers")
            self.pool = self.adapter.make_pool(capacity_tokens, page_size, kv_cache_dtype, device)
            self.token_allocator = TokenAllocator(capacity_tokens, device=device) if page_size == 1 else \
                PagedTokenAllocator(capacity_tokens, page_size, device=device)
            self.tree_cache = RadixCache(self.req_to_token_pool, self.token_allocator, page_size=page_size)
            attention = make_attention_backend(attention_backend, self.pool, self.adapter.num_heads, device)
            self.runner = ModelRunner(self.adapter, self.pool, attention, device)
        config = SchedulerConfig(schedule_policy=schedule_policy, max_running_requests=rows,
                                 chunked_prefill_size=chunked_prefill_size)
        self.scheduler = Scheduler(self.req_to_token_pool, self.token_allocator, self.tree_cache, config)
        self.stats = EngineStats()
        self.default_stop_token_ids = _model_stop_tokens(model)
        self._next_rid = 0
        self._stop: dict[int, frozenset[int]] = {}
        self._logits: dict[int, list[torch.Tensor] | None] = {}
        self._cached: dict[int, int] = {}
        self._handed_off: set[Req] = set()  # taken out with their memory (hand_off), not released yet

    def _build_hybrid(self, capacity_tokens, page_size, kv_cache_dtype, window_tokens, state_slots, rows,
                      attention_backend, device) -> None:
        """kvmem.hybrid's allocator, pools and radix cache for a model with sliding-window or linear layers."""
        adapter = self.adapter
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}")
        if attention_backend == "flashinfer":
            raise ValueError(f"attention_backend 'flashinfer': hybrid models ({type(self.model).__name__}) run the "
                             "torch attention ('auto' or 'torch')")
        window = adapter.window
        if window is None and window_tokens is not None:
            raise ValueError(f"window_tokens is for a model with sliding-window layers; {type(self.model).__name__} "
                             "has none")
        if LINEAR not in adapter.kinds and state_slots is not None:
            raise ValueError(f"state_slots is for a model with linear-attention layers; {type(self.model).__name__} "
                             "has none")
        if window is not None:
            window_tokens = capacity_tokens if window_tokens is None else \
                check_int("window_tokens", window_tokens, minimum=1)
            if window_tokens % page_size:
                raise ValueError(f"window_tokens {window_tokens} must be a multiple of page_size {page_size}")
            self.token_allocator = HybridTokenAllocator(capacity_tokens, window_tokens, page_size, device=device)
        else:
            self.token_allocator = TokenAllocator(capacity_tokens, device=device) if page_size == 1 else \
                PagedTokenAllocator(capacity_tokens, page_size, device=device)
        if LINEAR in adapter.kinds:
            state_slots = 2 * rows if state_slots is None else check_int("state_slots", state_slots, minimum=2)
        self.pool = adapter.make_pools(capacity_tokens, window_tokens, state_slots, page_size, kv_cache_dtype, device)
        # A request frees the window slots it left in runs of one window at most: with a tiny window, the default
        # interval would keep more window slots per request than the window itself.
        interval = WINDOW_FREE_INTERVAL if window is None else min(WINDOW_FREE_INTERVAL, window)
        self.tree_cache = HybridRadixCache(self.req_to_token_pool, self.token_allocator, page_size, window=window,
                                           state_pool=self.pool.state_pool, window_free_interval=interval)
        self.runner = HybridModelRunner(adapter, self.pool, self.tree_cache, device)

    # ---- requests -----------------------------------------------------------------------------------
    def add_request(self, input_ids: Sequence[int], max_new_tokens: int, *,
                    stop_token_ids: Sequence[int] | None = None, return_logits: bool = False) -> int:
        """Queues a prompt and returns its request id.

        input_ids: token ids in [0, vocab_size). max_new_tokens: >= 1. stop_token_ids: tokens that end the
        request once sampled (kept in its output, as transformers' generate keeps EOS); None: the model's
        generation_config.eos_token_id. return_logits: keep each sampled token's logits in its RequestOutput.

        Raises ValueError (TypeError for non-integer ids) naming the request when the prompt is empty, holds
        a token outside the vocabulary, or when prompt + max_new_tokens exceed the model's context or the
        pool, and naming stop_token_ids when one is not a token of the vocabulary; nothing is queued then and
        running requests are unaffected.
        """
        req = self._new_req(self._next_rid, input_ids, max_new_tokens)
        stops = self._stop_ids(stop_token_ids)
        self.scheduler.add_request(req)
        self._next_rid += 1
        self._stop[req.rid] = stops
        self._logits[req.rid] = [] if return_logits else None
        return req.rid

    # ---- disaggregation (kvmem.disagg) ---------------------------------------------------------------
    def new_req(self, input_ids: Sequence[int], max_new_tokens: int) -> Req:
        """A request with this engine's next id, checked as add_request checks it but not queued: a disaggregated
        decode side gives it memory and the KV of its prompt, then admits it with add_prefilled_request."""
        req = self._new_req(self._next_rid, input_ids, max_new_tokens)
        self._next_rid += 1
        return req

    def add_prefilled_request(self, req: Req, *, stop_token_ids: Sequence[int] | None = None) -> RequestOutput | None:
        """Admits a request whose prompt's KV is in this engine's pool and whose first token another engine sampled
        (`Scheduler.add_prefilled_request`); stop_token_ids as add_request. Returns its output when that token
        finished it, else None (it decodes in the next steps). Raises as the scheduler does, changing nothing."""
        stops = self._stop_ids(stop_token_ids)
        cached = req.cache_protected_len  # the admission moves it to the prompt's whole pages
        finished = self.scheduler.add_prefilled_request(req, stopped=bool(req.output_ids) and
                                                        req.output_ids[-1] in stops)
        self._stop[req.rid] = stops
        self._logits[req.rid] = None  # the first token's logits stayed with the engine that sampled it
        self._cached[req.rid] = cached
        self.stats.requests += 1
        self.stats.prompt_tokens += len(req.input_ids)
        self.stats.cached_tokens += cached
        return self._output(req) if finished else None

    def hand_off(self, req: Req) -> RequestOutput:
        """Takes a request whose prompt this engine prefilled (it has sampled one token) out of the loop with its
        memory (`Scheduler.hand_off`), for a prefill side to send its KV, then `release_handed_off` it. Returns its
        output so far. While it holds memory, a step that can admit nothing is no error: it waits for that memory."""
        self.scheduler.hand_off(req)
        self._handed_off.add(req)
        return self._output(req)

    def release_handed_off(self, req: Req) -> None:
        """Frees a request taken out with hand_off (its whole pages stay cached); ValueError for any other."""
        if req not in self._handed_off:
            raise ValueError(f"request {req.rid!r} was not handed off by this engine (or is released already)")
        self._handed_off.remove(req)
        self.tree_cache.release_req(req, cache=True)
        req.status = ReqStatus.FINISHED

    def _stop_ids(self, stop_token_ids: Sequence[int] | None) -> frozenset[int]:
        """add_request's stop tokens, checked: ids of the vocabulary (the model's EOS ids for None)."""
        if stop_token_ids is None:
            return self.default_stop_token_ids
        if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, Iterable):
            raise TypeError(f"stop_token_ids must be a sequence of token ids, got {type(stop_token_ids).__name__}")
        vocab = self.adapter.vocab_size
        return frozenset(check_int("stop_token_ids: a token id", t, minimum=0, maximum=vocab - 1)
                         for t in stop_token_ids)

    def _new_req(self, rid, input_ids, max_new_tokens) -> Req:
        """The Req for a prompt, or raises naming `rid`; checks everything Scheduler.add_request would reject,
        in the words of the model and the pool."""
        if isinstance(input_ids, _UNORDERED):  # Req would take its keys, in no particular order
            raise TypeError(f"request {rid!r}: input_ids must be a sequence of token ids, got "
                            f"{type(input_ids).__name__}")
        req = Req(rid, input_ids, max_new_tokens)
        ids = np.frombuffer(req.input_ids, dtype=np.int64)
        bad = np.flatnonzero((ids < 0) | (ids >= self.adapter.vocab_size))
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"request {rid!r}: token id {int(ids[i])} at position {i} is outside the vocabulary "
                             f"[0, {self.adapter.vocab_size})")
        total = len(ids) + req.max_new_tokens
        if total > self.context_len:
            raise ValueError(f"request {rid!r}: {len(ids)} prompt + {req.max_new_tokens} new tokens exceed the "
                             f"model's context of {self.context_len} tokens")
        if round_up(total, self.token_allocator.page_size) > self.token_allocator.size:
            raise ValueError(f"request {rid!r}: {len(ids)} prompt + {req.max_new_tokens} new tokens exceed the KV "
                             f"pool's capacity of {self.token_allocator.size} tokens")
        return req

    def is_idle(self) -> bool:
        return self.scheduler.is_idle()

    # ---- the loop -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one batch (prefill if anything can be admitted, else decode) and returns the requests it
        finished; [] when idle."""
        sched = self.scheduler
        retractions, evicted = sched.stats.retractions, sched.stats.evicted_tokens
        batch = sched.step()
        if batch is None:
            if not sched.is_idle() and not self._handed_off:
                raise RuntimeError("the scheduler returned no batch while requests are pending")
            return []
        extend = batch.forward_mode is ForwardMode.EXTEND
        if extend:
            self._count_admissions(batch)
        logits = self.runner.forward(batch)
        tokens = logits.argmax(-1).tolist()
        stopped = []
        for i, (req, tok) in enumerate(zip(batch.reqs, tokens)):
            if extend and req.is_chunked():  # a middle chunk of a prompt samples nothing
                continue
            kept = self._logits[req.rid]
            if kept is not None:
                kept.append(logits[i].cpu())
            if tok in self._stop[req.rid]:
                stopped.append(i)
        finished = sched.process_batch_result(batch, tokens, stopped)
        stats = self.stats
        stats.prefill_batches += extend
        stats.decode_batches += not extend
        stats.retractions += sched.stats.retractions - retractions
        stats.evicted_tokens += sched.stats.evicted_tokens - evicted
        return [self._output(req) for req in finished]

    def _count_admissions(self, batch) -> None:
        """Prompt and cached tokens of requests admitted for the first time (a retracted one counts once)."""
        for req, prefix in zip(batch.reqs, batch.prefix_lens.tolist()):
            if req.rid not in self._cached:
                self._cached[req.rid] = prefix
                self.stats.requests += 1
                self.stats.prompt_tokens += len(req.input_ids)
                self.stats.cached_tokens += prefix

    def _output(self, req: Req) -> RequestOutput:
        self.stats.output_tokens += len(req.output_ids)
        logits = self._logits.pop(req.rid)
        del self._stop[req.rid]
        return RequestOutput(req.rid, list(req.output_ids), torch.stack(logits) if logits is not None else None,
                             self._cached.pop(req.rid))

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int], *,
                 stop_token_ids: Sequence[int] | None = None) -> list[list[int]]:
        """Greedy outputs of `prompts`, in order, batched and scheduled by kvmem (see add_request).

        prompts: a sequence (or iterable) of prompts, each a sequence of token ids. max_new_tokens: one count for
        all, or one per prompt. Every prompt is checked before any runs: a bad one raises ValueError naming its
        index (`prompts[i]`) and the engine is left as it was; `prompts` or `max_new_tokens` of the wrong kind
        raise TypeError naming it. Needs an idle engine (RuntimeError otherwise), since it runs until every
        request it added has finished.
        """
        if not self.is_idle():
            raise RuntimeError("generate() needs an idle engine; finish the requests added with add_request first")
        if not isinstance(prompts, Iterable) or isinstance(prompts, (str, bytes) + _UNORDERED):
            raise TypeError(f"prompts must be a sequence of prompts (token id sequences), got {type(prompts).__name__}")
        prompts = list(prompts)
        if isinstance(max_new_tokens, (int, np.integer)):
            counts = [max_new_tokens] * len(prompts)
        elif isinstance(max_new_tokens, Iterable) and not isinstance(max_new_tokens, (str, bytes) + _UNORDERED):
            counts = list(max_new_tokens)
        else:
            raise TypeError(f"max_new_tokens must be an int or one per prompt, got {type(max_new_tokens).__name__}")
        stops = self._stop_ids(stop_token_ids)
        if len(counts) != len(prompts):
            raise ValueError(f"max_new_tokens has {len(counts)} counts for {len(prompts)} prompts")
        for i, (prompt, n) in enumerate(zip(prompts, counts)):
            self._new_req(f"prompts[{i}]", prompt, n)
        rids = [self.add_request(p, n, stop_token_ids=stops) for p, n in zip(prompts, counts)]
        outputs: dict[int, list[int]] = {}
        while not self.is_idle():
            for out in self.step():
                outputs[out.rid] = out.output_ids
        return [outputs[rid] for rid in rids]


def _model_stop_tokens(model) -> frozenset[int]:
    """The model's EOS ids (generation_config first, as transformers' generate reads them)."""
    config = getattr(model, "generation_config", None) or model.config
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else map(int, eos))
