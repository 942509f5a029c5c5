"""Synthetic workloads with known prefix structure, deterministic by seed.

- `shared_system_prompts`: a few long system prompts, each request one of them + a unique user message.
- `multi_turn_chat`: chat sessions; turn k's prompt is turn k-1's prompt + its output + a new user message.
- `agentic_tool_loops`: agents with a long system prompt + tool definitions; each step appends the model's
  tool call (its output) and a tool result to the previous step's prompt.

Outputs are `synthetic_output_ids(prompt, output_len)`, the same function a replay uses for the tokens it
"generates", so a follow-up turn can hit the cache on its predecessor's output. Sessions run interleaved,
`concurrent_sessions` at a time, so a follow-up lands some requests after its predecessor. Length ranges
are inclusive `(low, high)` pairs drawn uniformly. `arrival_rate` (requests/s) gives Poisson arrivals in
request order; None puts every arrival at 0.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvmem._checks import check_int
from kvmem.replay.traces import TOKEN_ID_BOUND, TokenTrace, _TokenTraceBuilder, synthetic_output_ids

Range = tuple[int, int]


def shared_system_prompts(num_requests: int = 1000, *, num_prompts: int = 8, prompt_len: int = 1024,
                          user_len: Range = (16, 256), output_len: Range = (16, 256),
                          arrival_rate: float | None = None, seed: int = 0) -> TokenTrace:
    """Each request: one of `num_prompts` shared prompts of `prompt_len` tokens + a unique user message."""
    _check_counts(num_requests=num_requests, num_prompts=num_prompts, prompt_len=prompt_len)
    _check_ranges(user_len=user_len, output_len=output_len)
    rng = np.random.default_rng(seed)
    prompts = [_tokens(rng, prompt_len) for _ in range(num_prompts)]
    arrivals = _arrivals(rng, num_requests, arrival_rate)
    builder = _TokenTraceBuilder()
    for i in range(num_requests):
        prompt = np.concatenate([prompts[rng.integers(num_prompts)], _tokens(rng, _draw(rng, user_len))])
        builder.add(prompt, _draw(rng, output_len), arrivals[i], None)
    return builder.build("synthetic-system")


def multi_turn_chat(num_requests: int = 1000, *, system_len: int = 256, turns: Range = (2, 8),
                    user_len: Range = (32, 512), output_len: Range = (32, 512), concurrent_sessions: int = 32,
                    arrival_rate: float | None = None, seed: int = 0) -> TokenTrace:
    """Chat sessions sharing one system prompt; turn k = turn k-1's prompt + output + a user message."""
    _check_counts(num_requests=num_requests, system_len=system_len, concurrent_sessions=concurrent_sessions)
    _check_ranges(turns=turns, user_len=user_len, output_len=output_len)
    rng = np.random.default_rng(seed)
    system = _tokens(rng, system_len)

    def opening() -> np.ndarray:
        return np.concatenate([system, _tokens(rng, _draw(rng, user_len))])

    return _sessions("synthetic-chat", rng, num_requests, opening, turns, user_len, output_len,
                     concurrent_sessions, arrival_rate)


def agentic_tool_loops(num_requests: int = 1000, *, num_agents: int = 2, system_len: int = 4096,
                       task_len: Range = (64, 512), steps: Range = (4, 16), result_len: Range = (16, 256),
                       output_len: Range = (16, 128), concurrent_sessions: int = 16,
                       arrival_rate: float | None = None, seed: int = 0) -> TokenTrace:
    """Agent loops: a long per-agent system prompt (tools included) + a task, then many steps that each
    append the model's tool call (the previous output) and a short tool result."""
    _check_counts(num_requests=num_requests, num_agents=num_agents, system_len=system_len,
                  concurrent_sessions=concurrent_sessions)
    _check_ranges(task_len=task_len, steps=steps, result_len=result_len, output_len=output_len)
    rng = np.random.default_rng(seed)
    systems = [_tokens(rng, system_len) for _ in range(num_agents)]

    def opening() -> np.ndarray:
        return np.concatenate([systems[rng.integers(num_agents)], _tokens(rng, _draw(rng, task_len))])

    return _sessions("synthetic-agent", rng, num_requests, opening, steps, result_len, output_len,
                     concurrent_sessions, arrival_rate)


GENERATORS: dict[str, Callable[..., TokenTrace]] = {
    "synthetic-system": shared_system_prompts,
    "synthetic-chat": multi_turn_chat,
    "synthetic-agent": agentic_tool_loops,
}


def _sessions(name: str, rng: np.random.Generator, num_requests: int, opening: Callable[[], np.ndarray],
              turns: Range, append_len: Range, output_len: Range, concurrent_sessions: int,
              arrival_rate: float | None) -> TokenTrace:
    """Interleaved session chains: each request continues a random live session (its history + output +
    `append_len` new tokens); a finished session is replaced by a new one from `opening()`."""
    arrivals = _arrivals(rng, num_requests, arrival_rate)
    builder = _TokenTraceBuilder()
    live: list[list] = []  # [history: int32 array (None before turn 1), turns left]
    while len(builder) < num_requests:
        while len(live) < concurrent_sessions:
            live.append([None, _draw(rng, turns)])
        j = int(rng.integers(len(live)))
        history, turns_left = live[j]
        prompt = opening() if history is None else np.concatenate([history, _tokens(rng, _draw(rng, append_len))])
        out_len = _draw(rng, output_len)
        builder.add(prompt, out_len, arrivals[len(builder)], None)
        if turns_left == 1:
            live[j] = live[-1]
            live.pop()
        else:
            live[j] = [np.concatenate([prompt, synthetic_output_ids(prompt, out_len)]), turns_left - 1]
    return builder.build(name)


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, TOKEN_ID_BOUND, size=n, dtype=np.int32)


def _draw(rng: np.random.Generator, bounds: Range) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))


def _arrivals(rng: np.random.Generator, n: int, arrival_rate: float | None) -> np.ndarray:
    """`[n] float64` seconds: Poisson arrivals at `arrival_rate` requests/s, or all 0 when None."""
    if arrival_rate is None:
        return np.zeros(n)
    if not (isinstance(arrival_rate, (int, float)) and 0 < arrival_rate < float("inf")):
        raise ValueError(f"arrival_rate must be a positive finite number or None, got {arrival_rate!r}")
    return np.cumsum(rng.exponential(1.0 / arrival_rate, size=n))


def _check_counts(**counts: int) -> None:
    for name, v in counts.items():
        check_int(name, v, minimum=1)


def _check_ranges(**ranges: Range) -> None:
    for name, r in ranges.items():
        ok = (isinstance(r, tuple) and len(r) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                          for x in r) and 1 <= r[0] <= r[1])
        if not ok:
            raise ValueError(f"{name} must be a (low, high) pair of ints with 1 <= low <= high, got {r!r}")
