"""Either side of disaggregated engine pairs as a process, KV moved by Mooncake's transfer engine on 127.0.0.1.

    python -m kvmem.disagg.serve prefill --preset llama-tiny --metadata-server http://127.0.0.1:PORT/metadata
        prints "listening PRESET 127.0.0.1:PORT" per preset once decode sides can connect, then serves until SIGTERM
        or SIGINT.
    python -m kvmem.disagg.serve decode --preset llama-tiny --prefill 127.0.0.1:PORT --metadata-server URL \\
        --prompts FILE
        FILE holds JSON: a list of waves, each a list of prompts (token id lists); each wave is generated after the
        one before has finished, so later waves find earlier prompts in the decode side's cache. Prints one JSON
        object: {PRESET: {"outputs": one list of output ids per prompt, in order, "stats": the decode side's counts}}.

`--preset` may repeat: one engine pair per preset, each with its own transfer engine and control port (`--port` and
`--prefill` then repeat in the same order), so that one pair of processes serves several models. Both sides build the
seeded model of a preset (kvmem.engine.PRESETS), so that their weights are the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import select
import signal
import sys
import time

from kvmem._checks import positive_int_arg


def _engine(args, preset: str):
    from kvmem.engine import Engine, build_model

    return Engine(build_model(preset, seed=args.seed), capacity_tokens=args.capacity_tokens, page_size=args.page_size,
                  chunked_prefill_size=args.chunked_prefill_size)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def serve_prefill(args) -> int:
    from kvmem.disagg import ChannelListener, KVSender, MooncakeTransport

    signal.signal(signal.SIGTERM, _interrupt)
    servers = []  # (listener, sender, transport) per preset
    try:
        for preset, port in zip(args.preset, args.port or [0] * len(args.preset)):
            transport = MooncakeTransport(args.metadata_server)
            servers.append((ChannelListener(port), KVSender(_engine(args, preset), transport), transport))
            print(f"listening {preset} {servers[-1][0].address}", flush=True)
        while True:
            ran, idle = False, True
            for listener, sender, _ in servers:
                while (channel := listener.accept()) is not None:
                    sender.accept(channel)
                ran |= sender.step()
                idle &= sender.is_idle()
            if not ran:  # nothing computed: sleep until a peer or a connection has news, or a write may have ended
                select.select([x for listener, sender, _ in servers for x in (listener, *sender.channels())], [], [],
                              0.05 if idle else 0.001)
    except KeyboardInterrupt:
        pass
    finally:
        for listener, sender, transport in servers:
            sender.close()
            listener.close()
            transport.close()
    return 0


def serve_decode(args) -> int:
    from kvmem.disagg import KVReceiver, MooncakeTransport

    with open(args.prompts) as f:
        waves = json.load(f)
    results = {}
    for preset, address in zip(args.preset, args.prefill):
        transport = MooncakeTransport(args.metadata_server)
        engine = _engine(args, preset)
        try:
            receiver = KVReceiver(engine, transport, _connect(address, args.connect_timeout_s),
                                  kv_timeout_s=args.kv_timeout_s)
            try:
                outputs = [out for wave in waves for out in receiver.generate(wave, args.max_new_tokens)]
                receiver.check_invariants()
                stats = {**dataclasses.asdict(receiver.stats), "engine_cached_tokens": engine.stats.cached_tokens}
            finally:
                receiver.close()
        finally:
            transport.close()
        results[preset] = {"outputs": outputs, "stats": stats}
    print(json.dumps(results), flush=True)
    return 0


def _connect(address: str, timeout_s: float):
    """A channel to the prefill side at `address`, retried for `timeout_s` seconds while it starts."""
    from kvmem.disagg import connect

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return connect(address)
        except RuntimeError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The prefill or the decode side of disaggregated kvmem engine pairs.")
    parser.add_argument("role", choices=("prefill", "decode"))
    parser.add_argument("--preset", action="append", help="a kvmem.engine preset (repeatable; default llama-tiny)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--metadata-server", required=True, help="the Mooncake master's HTTP metadata URL")
    parser.add_argument("--capacity-tokens", type=positive_int_arg, default=4096)
    parser.add_argument("--page-size", type=positive_int_arg, default=16)
    parser.add_argument("--chunked-prefill-size", type=positive_int_arg, default=None)
    parser.add_argument("--port", type=int, action="append", help="prefill: a control port per preset (default free)")
    parser.add_argument("--prefill", action="append", help="decode: the prefill side's address per preset (ignored "
                                                           "by prefill, so that both sides can share arguments)")
    parser.add_argument("--connect-timeout-s", type=float, default=0.0, help="decode: retry connecting this long")
    parser.add_argument("--prompts", help="decode: a JSON file of waves of prompts")
    parser.add_argument("--max-new-tokens", type=positive_int_arg, default=8)
    parser.add_argument("--kv-timeout-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    args.preset = args.preset or ["llama-tiny"]
    if args.role == "prefill" and args.port and len(args.port) != len(args.preset):
        parser.error(f"--port is given {len(args.port)} times for {len(args.preset)} presets")
    if args.role == "decode" and (not args.prompts or len(args.prefill or ()) != len(args.preset)):
        parser.error("decode needs --prompts and one --prefill address per preset")
    return serve_prefill(args) if args.role == "prefill" else serve_decode(args)


if __name__ == "__main__":
    sys.exit(main())
