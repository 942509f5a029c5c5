"""Which engine replays a configuration: the compiled one (`kvmem.replay.native_replay`) where it is built and
covers the configuration, else the Python reference (`kvmem.replay.simulator`), never silently: `fallback_note`
is the one line that says why.

`kvmem-replay --engine native|python` picks one (default: $KVMEM_ENGINE, else native); both give the same report,
timings aside, wherever the native engine runs. Torch-free until the Python engine is actually used.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from kvmem._extras import INSTALL_TORCH, torch_available

ENGINES = ("native", "python")
ENV = "KVMEM_ENGINE"


def requested_engine(flag: str | None = None) -> str:
    """--engine's value, else $KVMEM_ENGINE's, else "native"; ValueError for a name that is neither engine."""
    if flag is not None:
        name, source = flag, "--engine"
    else:
        name, source = os.environ.get(ENV, "native") or "native", ENV
    if name not in ENGINES:
        raise ValueError(f"{source} must be one of {', '.join(ENGINES)}, got {name!r}")
    return name


def fallback_reason(engine: str, config) -> str | None:
    """Why a replay of `config` asked of `engine` runs on the Python engine instead; None when it runs on `engine`."""
    if engine == "python":
        return None
    built, what = _native_gap(config)
    return what if not built else None if what is None else f"the native engine does not cover {what} yet"


def cluster_fallback_reason(engine: str, config) -> str | None:
    """fallback_reason for a cluster of `config`'s replicas, whose shared storage tier the native engine leaves to the
    Python engine (its differential test still finds cases where the two differ)."""
    reason = fallback_reason(engine, config)
    if reason is None and engine != "python" and config.storage is not None:
        reason = "the native engine does not cover a storage tier shared by a cluster's replicas yet"
    return reason


def _native_gap(config) -> tuple[bool, str | None]:
    """(whether the native engine is built, then what of `config` it does not cover, else why it is not built)."""
    from kvmem.replay import native_replay

    native = native_replay.load_native()
    if isinstance(native, ImportError):
        return False, f"the native engine is not built ({native})"
    return True, native_replay.unsupported(config)


def engine_for(engine: str, config) -> str:
    """The engine that replays `config` when `engine` is asked for."""
    return engine if fallback_reason(engine, config) is None else "python"


def fallback_note(engine: str, configs: Sequence) -> str | None:
    """One line for stderr when some of `configs` (the replays of one command) fall back to the Python engine."""
    if engine == "python":
        return None
    gaps = [_native_gap(c) for c in configs]
    if not gaps[0][0]:
        reason = gaps[0][1]
    else:
        whats = [what for _, what in gaps if what is not None]
        if not whats:
            return None
        reason = f"the native engine does not cover {', '.join(dict.fromkeys(whats))} yet"
        if len(whats) < len(configs):
            return f"{reason}: the Python engine replays those {len(whats)} of the {len(configs)} replays"
    return f"{reason}: the Python engine replays {'it' if len(configs) == 1 else 'them'}"


def require_python_engine(what: str) -> None:
    """Raises RuntimeError (one line) when `what` must run on the Python engine and torch is not installed."""
    if not torch_available():
        raise RuntimeError(f"{what} runs on the Python engine, which needs torch: {INSTALL_TORCH}")


def replay(requests, config, progress: bool = False, engine: str = "native"):
    """The ReplayReport of `config` over `requests` from `engine`, or from the Python engine where the native one
    cannot run it (say so with `fallback_note`)."""
    if engine_for(engine, config) == "native":
        from kvmem.replay import native_replay

        return native_replay.replay(requests, config, progress)
    from kvmem.replay.simulator import replay as python_replay  # imports torch

    return python_replay(requests, config, progress)


def replay_cluster(requests, config, replicas: int, policy: str, progress: bool = False, engine: str = "native",
                   slo=None):
    """The ClusterReport of `replicas` replicas of `config` behind a `policy` router, from `engine`, or from the
    Python engine where the native one cannot run it (say so with `fallback_reason`); with `slo` (a
    kvmem.replay.latency.SLO), from the Python engine, which times each request."""
    if slo is None and engine != "python" and cluster_fallback_reason(engine, config) is None:
        from kvmem.replay import native_cluster

        return native_cluster.replay_cluster(requests, config, replicas, policy, progress=progress)
    from kvmem.replay.cluster import replay_cluster as python_replay_cluster  # imports torch

    return python_replay_cluster(requests, config, replicas, policy, progress=progress, slo=slo)
