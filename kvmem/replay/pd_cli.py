"""`kvmem-replay --prefill-replicas P --decode-replicas D` and `--pd-sweep N`: the disaggregated replay's options,
checks and runs (see cli.py and kvmem.replay.pd).

- `--prefill-replicas 2 --decode-replicas 2`: one P:D replay; the report adds `kv_transfer_bytes`, the latency
  percentiles and, with `--slo-ttft-s` and `--slo-tbt-s`, goodput.
- `--pd-sweep 4 --slo-ttft-s 10 --slo-tbt-s 0.1`: colocated 4 replicas (behind --router) against every split of the
  same replicas into P prefill + D decode ones, as a table on stderr, `pd_sweep` in the JSON, and with --plot
  goodput_vs_pd_ratio.png.
"""

from __future__ import annotations

import argparse
import sys

from kvmem._checks import non_negative_float_arg, positive_float_arg, positive_int_arg
from kvmem.replay.cluster_cli import DEFAULT_POLICY, _policies
from kvmem.replay.config import ReplayConfig
from kvmem.replay.kv_link import DEFAULT_KV_LINK_GBPS, DEFAULT_KV_LINK_LATENCY_US
from kvmem.router import POLICIES

PD_OPTIONS = ("--prefill-router", "--decode-router", "--kv-link-gbps", "--kv-link-latency-us",
              "--no-decode-prefix-cache", "--decode-preallocate")


def add_pd_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-replicas", type=positive_int_arg, metavar="P",
                   help="disaggregate: P prefill replicas and --decode-replicas D decode replicas (each with the "
                        "capacity and GPUs given above), the KV of each prompt sent from one to the other")
    p.add_argument("--decode-replicas", type=positive_int_arg, metavar="D",
                   help="decode replicas, with --prefill-replicas")
    p.add_argument("--prefill-router", type=_policy, metavar="POLICY",
                   help=f"routing policy of the prefill side: {', '.join(POLICIES)} (default {DEFAULT_POLICY})")
    p.add_argument("--decode-router", type=_policy, metavar="POLICY",
                   help=f"routing policy of the decode side (default {DEFAULT_POLICY}: to the decode replica that "
                        "caches most of the prompt, so that least is sent)")
    p.add_argument("--kv-link-gbps", type=positive_float_arg, metavar="G",
                   help=f"each prefill GPU's link to the decode side, gigabits per second as NICs are rated (default "
                        f"{DEFAULT_KV_LINK_GBPS:g}: one ConnectX-7 port)")
    p.add_argument("--kv-link-latency-us", type=non_negative_float_arg, metavar="US",
                   help=f"from a transfer's last byte sent to it landing, microseconds (default "
                        f"{DEFAULT_KV_LINK_LATENCY_US:g})")
    p.add_argument("--no-decode-prefix-cache", action="store_true",
                   help="the decode side matches no prompt in its cache: every prompt's KV is sent whole")
    p.add_argument("--decode-preallocate", choices=("arrival", "prefilled"),
                   help="when a decode replica gives a request its pages: on arrival, the prefill waiting for them "
                        "(SGLang; default), or once prefilled, the KV waiting on the prefill side (Mooncake)")
    p.add_argument("--slo-ttft-s", type=positive_float_arg, metavar="S",
                   help="time-to-first-token SLO, seconds: with --slo-tbt-s, the report's goodput counts the requests "
                        "per second that meet both (also for --replicas)")
    p.add_argument("--slo-tbt-s", type=positive_float_arg, metavar="S",
                   help="time-between-tokens SLO (a request's mean gap after its first token), seconds")
    p.add_argument("--pd-sweep", type=positive_int_arg, metavar="N",
                   help="compare N colocated replicas (behind --router) with every split into P prefill + D decode "
                        "replicas, P + D = N; needs the SLOs; with --plot, goodput_vs_pd_ratio.png")


def slo_of(args: argparse.Namespace):
    """The SLO of --slo-ttft-s and --slo-tbt-s, None without them; ValueError for one without the other."""
    given = (args.slo_ttft_s is not None, args.slo_tbt_s is not None)
    if given[0] != given[1]:
        raise ValueError("--slo-ttft-s and --slo-tbt-s go together (goodput counts the requests that meet both)")
    if not given[0]:
        return None
    from kvmem.replay.latency import SLO

    return SLO(args.slo_ttft_s, args.slo_tbt_s)


def pd_runs(args: argparse.Namespace, config: ReplayConfig, trace) -> list[tuple[int, int]] | None:
    """The (P, D) splits to replay ((N, 0) for the colocated N of --pd-sweep), or None without a P:D option;
    ValueError for options that do not go together, or a decode pool that holds no request of `trace`."""
    split = args.prefill_replicas is not None or args.decode_replicas is not None
    if not split and args.pd_sweep is None:
        given = [o for o in PD_OPTIONS if getattr(args, o[2:].replace("-", "_")) not in (None, False)]
        if given:
            raise ValueError(f"{given[0]} needs --prefill-replicas and --decode-replicas (or --pd-sweep)")
        return None
    if split and (args.prefill_replicas is None or args.decode_replicas is None):
        missing = "--decode-replicas" if args.decode_replicas is None else "--prefill-replicas"
        raise ValueError(f"{missing} is needed too: a P:D fleet has both sides")
    if split and args.pd_sweep is not None:
        raise ValueError("--pd-sweep N replays its own splits of N replicas: drop --prefill-replicas and "
                         "--decode-replicas")
    for option, value in (("--replicas", args.replicas), ("--sweep", args.sweep), ("--sweep-gb", args.sweep_gb),
                          ("--sweep-host", args.sweep_host), ("--sweep-host-gb", args.sweep_host_gb),
                          ("--target-hit-fraction", args.target_hit_fraction),
                          ("--compare-policies", args.compare_policies)):
        if value is not None:
            raise ValueError(f"{option} does not go with a P:D replay (--prefill-replicas, --pd-sweep)")
    if args.router is not None and (split or len(args.router) > 1):
        raise ValueError("--router is the colocated fleet's policy in --pd-sweep (one); a P:D replay takes "
                         "--prefill-router and --decode-router")
    from kvmem.replay.pd import check_decode_pool, check_disaggregable

    check_disaggregable(config)
    check_decode_pool(trace, config)
    if args.pd_sweep is None:
        if args.plot:
            raise ValueError("--plot draws --pd-sweep's goodput against the P:D ratio; one P:D replay has no plot")
        return [(args.prefill_replicas, args.decode_replicas)]
    if args.pd_sweep < 2:
        raise ValueError(f"--pd-sweep {args.pd_sweep}: a split needs at least 2 replicas")
    if slo_of(args) is None:
        raise ValueError("--pd-sweep compares goodput: give --slo-ttft-s and --slo-tbt-s")
    n = args.pd_sweep
    return [(n, 0)] + [(p, n - p) for p in range(1, n)]


def run_pd(args: argparse.Namespace, trace, config: ReplayConfig, runs: list[tuple[int, int]], out: dict) -> dict:
    """Replays `runs` and adds their reports (a table on stderr and plots, with --plot, for a sweep) to `out`;
    ValueError for a decode pool too small for any request; RuntimeError (one line) when plots cannot be written."""
    from kvmem.replay.cluster import replay_cluster  # imports torch: only once the arguments are good
    from kvmem.replay.kv_link import KVLink
    from kvmem.replay.pd import PDReplay, link_for

    progress, slo = not args.no_progress, slo_of(args)
    link = link_for(config, KVLink(gbps=args.kv_link_gbps or DEFAULT_KV_LINK_GBPS,
                                   latency_us=DEFAULT_KV_LINK_LATENCY_US if args.kv_link_latency_us is None
                                   else args.kv_link_latency_us))
    replays = []
    for p, d in runs:  # all built first: a bad configuration fails before the first replay
        if d == 0:
            replays.append(None)
            continue
        replays.append(PDReplay(trace, config, p, d, prefill_router=args.prefill_router or DEFAULT_POLICY,
                                decode_router=args.decode_router or DEFAULT_POLICY, link=link,
                                decode_prefix_cache=not args.no_decode_prefix_cache,
                                preallocate=args.decode_preallocate or "arrival", slo=slo, progress=progress))
    rows = []
    for (p, d), replay in zip(runs, replays):
        if len(runs) > 1 and progress:
            print(f"kvmem-replay: {'colocated ' + str(p) if d == 0 else f'{p}P:{d}D'}", file=sys.stderr)
        if replay is None:
            policy = (args.router or [DEFAULT_POLICY])[0]
            rows.append({"layout": "colocated", "replicas": p, "router": policy,
                         **replay_cluster(trace, config, p, policy, progress=progress, slo=slo).to_json()})
        else:
            rows.append({"layout": f"{p}P:{d}D", **replay.run().to_json()})
    if len(runs) == 1:
        out.update(rows[0])
        return out
    out["pd_sweep"] = rows
    if not args.json_only:
        print(format_pd_table(rows, config), file=sys.stderr)
    if args.plot:
        try:
            out["plots"] = [str(write_pd_plot(rows, config, args.plot))]
        except OSError as e:
            raise RuntimeError(f"cannot write plots to {args.plot}: {e.strerror or e}") from None
    return out


SWEEP_COLUMNS = ("goodput_rps", "slo_met_fraction", "ttft_p50_s", "ttft_p90_s", "tbt_p50_s", "tbt_p90_s", "hit_rate",
                 "kv_transfer_bytes")


def format_pd_table(rows: list[dict], config: ReplayConfig) -> str:
    """The sweep as a table: one row per layout."""
    gpus = f"{config.tp} x {config.gpu} each" if config.gpu else "the fixed step cost"
    head = f"{'layout':>10} " + " ".join(f"{c:>17}" for c in SWEEP_COLUMNS)
    lines = [f"colocated vs P:D, {rows[0]['replicas']} replicas ({gpus}), SLO: TTFT <= {rows[0]['slo_ttft_s']:g} s, "
             f"TBT <= {rows[0]['slo_tbt_s']:g} s", head]
    for row in rows:
        hit = row.get("hit_rate", row.get("prefill_hit_rate"))
        values = {**row, "hit_rate": hit, "kv_transfer_bytes": row.get("kv_transfer_bytes", 0)}
        lines.append(f"{row['layout']:>10} " + " ".join(f"{_cell(values.get(c)):>17}" for c in SWEEP_COLUMNS))
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.4g}"


def write_pd_plot(rows: list[dict], config: ReplayConfig, directory: str):
    """goodput_vs_pd_ratio.png: goodput of each P:D split against P / D, the colocated fleet a horizontal line."""
    from pathlib import Path

    from kvmem.replay.report import require_matplotlib

    figure_cls = require_matplotlib()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    splits = [r for r in rows if r["layout"] != "colocated"]
    colocated = [r for r in rows if r["layout"] == "colocated"]
    fig = figure_cls(figsize=(8, 4.5))
    ax = fig.subplots()
    ratios = [r["prefill_replicas"] / r["decode_replicas"] for r in splits]
    ax.plot(ratios, [r.get("goodput_rps", 0.0) for r in splits], marker="o", label="P:D")
    for ratio, r in zip(ratios, splits):
        ax.annotate(r["layout"], (ratio, r.get("goodput_rps", 0.0)), textcoords="offset points", xytext=(4, 4))
    for r in colocated:
        ax.axhline(r.get("goodput_rps", 0.0), color="tab:orange", linestyle="--",
                   label=f"colocated ({r['replicas']} replicas, {r['router']})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ratios, [f"{ratio:.3g}" for ratio in ratios])
    ax.minorticks_off()
    gpus = f"{config.model} on {config.tp} x {config.gpu} per replica" if config.gpu else "fixed step cost"
    ax.set(xlabel="prefill / decode replicas", ylabel="goodput (requests/s meeting both SLOs)",
           title=f"Goodput vs P:D ratio ({gpus}; TTFT <= {rows[0]['slo_ttft_s']:g} s, "
                 f"TBT <= {rows[0]['slo_tbt_s']:g} s)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best")
    path = out / "goodput_vs_pd_ratio.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def _policy(text: str) -> str:
    names = _policies(text)
    if len(names) != 1 or text == "all":
        raise argparse.ArgumentTypeError(f"expected one routing policy of {', '.join(POLICIES)}, got {text!r}")
    return names[0]
