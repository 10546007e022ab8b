"""ggml's RPC backend as a user feature: a device of another machine (or process) that a model offloads layers to
as to a GPU, served there by `pydflash rpc-server` (or llama.cpp's `rpc-server`).

RPC is unauthenticated and unencrypted: whoever reaches the port can run graphs on the device and read or write
its memory. `pydflash rpc-server` listens on 127.0.0.1 unless told otherwise; expose it on a trusted network only.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import sys
from typing import Iterable

from . import _core

logger = logging.getLogger("pydflash")

# the endpoints this process has registered (ggml keeps a device per registration: each is added once)
_registered: list[str] = []
DEFAULT_PORT = 50052  # llama.cpp's rpc-server's


def parse_servers(servers: str | Iterable[str] | None) -> list[str]:
    """`rpc_servers` as llama-cpp-python takes it (one comma-separated string) or as a list of "host:port"."""
    if servers is None:
        return []
    if isinstance(servers, str):
        items = servers.split(",")
    elif isinstance(servers, Iterable) and all(isinstance(s, str) for s in servers):
        items = list(servers)
    else:
        raise TypeError(f"rpc_servers must be a str or a list of str ('host:port'), got {servers!r}")
    out = [s.strip() for s in items if s.strip()]
    if isinstance(servers, str) and not out:
        raise ValueError(f"rpc_servers = {servers!r}: expected 'host:port[,host:port...]'")
    for endpoint in out:  # (a port past 65535 or not a number was reported as an unreachable server)
        port = endpoint.rpartition(":")[2]
        if ":" in endpoint and not (port.isdigit() and 1 <= int(port) <= 65535):
            raise ValueError(f"rpc_servers: {endpoint!r} has port {port!r}, expected a TCP port in [1, 65535]")
    return out


def add_servers(servers: str | Iterable[str] | None) -> list[str]:
    """Registers each RPC server not yet registered in this process (ConnectionError when one cannot be reached,
    ValueError for an endpoint that is not host:port). Later models offload to the first as to a GPU. Returns the
    endpoints asked for."""
    endpoints = parse_servers(servers)
    for endpoint in endpoints:
        if endpoint not in _registered:
            _core.rpc_add_server(endpoint)
            _registered.append(endpoint)
            logger.info("RPC server %s registered as a device", endpoint)
    return endpoints


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(host: str = "127.0.0.1", port: int = DEFAULT_PORT, n_threads: int = 1, device: str = "auto") -> None:
    """Serves one device of this machine (auto: the first GPU, else the CPU) at host:port until the process ends
    (OSError, naming the address, when it cannot listen there)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"port = {port!r}, expected a TCP port in [1, 65535]")
    _check_can_listen(host, port)
    if not is_loopback(host):
        print(f"pydflash rpc-server: listening on {host}, beyond this machine. RPC is unauthenticated: anyone who "
              "reaches the port can run graphs on this device and read its memory. Use a trusted network only.",
              file=sys.stderr)
    _core.rpc_serve(f"{host}:{port}", n_threads, device)
    # ggml's server returns only when it could not listen (a race with another process taking the port)
    raise OSError(f"the RPC server could not listen on {host}:{port}")


def _check_can_listen(host: str, port: int) -> None:
    """OSError naming host:port and why, where this machine cannot listen there (ggml's server would only print
    that it failed)."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    family, kind, proto, _, address = found[0]
    with socket.socket(family, kind, proto) as probe:
        # as ggml's server sets it: a port left in TIME_WAIT by an earlier server is free, one listened on is not
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from None
