"""A local Mooncake store for tests and demos: a `mooncake_master` and a storage process, on 127.0.0.1.

A Mooncake object lives in the memory segment of the client process that mounted it, and a client's segment
goes when the client exits. So that pages outlive the kvmem process that wrote them (a replica restarting, a
second replica reading the first's pages), the memory is held by a long-lived storage process
(`mooncake_client`, shipped with the package), and kvmem's `MooncakeStore` clients mount no segment of their
own. Nothing survives a restart of the master or of the storage process: Mooncake keeps object metadata in the
master's memory only.

    with MooncakeServer(segment_mb=1024) as server:          # free ports, stopped by process id on exit
        store = MooncakeStore(server.master_addr, server.metadata_server)

`python -m kvmem.storage.mooncake_server --segment-mb 4096` runs one until interrupted, printing its
addresses (what `kvmem-replay --storage mooncake:ADDR` needs).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvmem._checks import check_int, check_number, positive_int_arg

READY_TIMEOUT_S = 20.0


def find_binary(name: str) -> str | None:
    """The path of a Mooncake binary (`mooncake_master`, `mooncake_client`): beside this Python, or on PATH."""
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else shutil.which(name)


class MooncakeServer:
    """Starts a master and a storage process on free 127.0.0.1 ports; `stop()` (or leaving the `with` block)
    stops both by process id.

    segment_mb: memory the storage process contributes to the store (MiB, >= 16).
    metadata: "p2p" (the clients exchange their metadata directly) or "http" (the master also serves metadata
        over HTTP; Mooncake binds that port on every interface). The master's RPC port listens on 127.0.0.1
        only, but Mooncake's transfer engine binds the storage process's and every client's data ports on all
        interfaces: run it where those ports are not reachable from outside, or behind a firewall.
    lease_ms: how long a read protects an object from eviction (Mooncake's default is 10 s, which keeps a
        busy cache from evicting anything it recently looked up).
    """

    def __init__(self, segment_mb: int = 512, *, metadata: str = "p2p", lease_ms: int = 1000,
                 ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        self.segment_mb = check_int("segment_mb", segment_mb, minimum=16)
        if metadata not in ("p2p", "http"):
            raise ValueError(f"metadata must be 'p2p' or 'http', got {metadata!r}")
        self.metadata = metadata
        self.lease_ms = check_int("lease_ms", lease_ms, minimum=1)
        self.ready_timeout_s = check_number("ready_timeout_s", ready_timeout_s, 0, allow_minimum=False)
        self.master: subprocess.Popen | None = None
        self.storage: subprocess.Popen | None = None
        self.master_addr = ""
        self.metadata_server = ""

    def start(self) -> MooncakeServer:
        if self.master is not None or self.storage is not None:
            raise RuntimeError("start() on a server already started: stop() it first")
        master_bin, client_bin = find_binary("mooncake_master"), find_binary("mooncake_client")
        if master_bin is None or client_bin is None:
            raise RuntimeError("the Mooncake store is not installed: pip install 'kvmem[storage]' (on Debian, "
                               "apt-get install libibverbs1 librdmacm1 first)")
        rpc, metrics, http, client = (_free_port() for _ in range(4))
        cmd = [master_bin, f"--rpc_port={rpc}", "--rpc_address=127.0.0.1", f"--metrics_port={metrics}",
               "--metrics_host=127.0.0.1", f"--default_kv_lease_ttl={self.lease_ms}", "--minloglevel=1"]
        if self.metadata == "http":
            cmd += ["--enable_http_metadata_server=true", f"--http_metadata_server_port={http}",
                    "--http_metadata_server_host=127.0.0.1"]
            self.metadata_server = f"http://127.0.0.1:{http}/metadata"
        else:
            self.metadata_server = "P2PHANDSHAKE"
        self.master_addr = f"127.0.0.1:{rpc}"
        quiet = {**os.environ, "GLOG_minloglevel": "2", "MC_LOG_LEVEL": "ERROR"}
        try:
            self.master = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=quiet)
            _wait_for_port(rpc, self.ready_timeout_s, self.master)
            self.storage = subprocess.Popen(
                [client_bin, "--host=127.0.0.1", f"--metadata_server={self.metadata_server}",
                 f"--master_server_address={self.master_addr}", f"--global_segment_size={self.segment_mb}MB",
                 f"--port={client}", "--protocol=tcp"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=quiet)
            _wait_for_port(client, self.ready_timeout_s, self.storage)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stops the storage process, then the master, by process id (SIGTERM, then SIGKILL after 5 s)."""
        for proc in (self.storage, self.master):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.storage = self.master = None

    def kill_master(self) -> None:
        """Kills the master at once (for fault tests): clients then fail, and the store's contents are lost."""
        if self.master is not None and self.master.poll() is None:
            self.master.kill()
            self.master.wait()

    def __enter__(self) -> MooncakeServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with status {proc.returncode} before it listened")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"{proc.args[0]} did not listen on port {port} within {timeout_s} s")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run a local Mooncake master and storage process until "
                                                 "interrupted; prints the addresses for kvmem-replay --storage.")
    parser.add_argument("--segment-mb", type=positive_int_arg, default=4096)
    parser.add_argument("--metadata", choices=("p2p", "http"), default="p2p")
    args = parser.parse_args(argv)
    # SIGTERM (what `kill` and service managers send; a background job of a script ignores SIGINT) stops the
    # master and the storage process too, instead of leaving them behind.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        with MooncakeServer(args.segment_mb, metadata=args.metadata) as server:  # stops both on the way out
            print(f"--storage mooncake:{server.master_addr} --storage-metadata {server.metadata_server}", flush=True)
            while True:  # until interrupted, or until either process dies (the store is gone then)
                for name, proc in (("mooncake_master", server.master), ("mooncake_client", server.storage)):
                    if proc.poll() is not None:
                        print(f"{name} exited with status {proc.returncode}; stopping", file=sys.stderr)
                        return 1
                time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
