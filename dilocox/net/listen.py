"""Where the listening sockets of a `dilocox train` launcher and its ranks bind: the loopback on one machine,
`network.advertise_host` when the clusters of an elastic run are on several machines. Nothing listens on every
interface (docs/design.md §11).

    host = cfg.network.listen_host                   # "127.0.0.1", or the advertise host
    store = serve_store(host, timeout)               # a TCPStore server on `host` only
    bind_string("::1")                               # "[::1]:0", for torchft's servers
"""

from __future__ import annotations

import datetime
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

LOOPBACK = "127.0.0.1"
"""The address of every listener of a one-machine run."""


def bind_address(host: str) -> tuple[socket.AddressFamily, str]:
    """The address family and numeric address of `host` (an address, or a name of this machine) to bind to."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(
            f"network.advertise_host = {host!r} does not resolve ({exc}); give an address of this machine"
        ) from None
    return family, str(sockaddr[0])


def listening_socket(host: str) -> socket.socket:
    """A TCP socket listening on `host` at a port the system picks; a `host` that is not an address of this machine
    is a ValueError naming network.advertise_host."""
    family, address = bind_address(host)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((address, 0))
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        raise ValueError(
            f"network.advertise_host = {host!r} is not an address this machine can listen on ({exc.strerror}); give "
            "this machine's address on the network the other machines reach it by (across NAT: a tunnel's, e.g. "
            "WireGuard's)"
        ) from None
    return sock


def serve_store(host: str, timeout: datetime.timedelta) -> dist.TCPStore:
    """A TCPStore server that listens on `host` only. A TCPStore given a host name still listens on every interface,
    so the store is handed a socket bound here (`master_listen_fd`; the store owns it from then on)."""
    sock = listening_socket(host)
    address, port = sock.getsockname()[:2]
    import torch.distributed as dist  # here, not at the top: the config reads LOOPBACK without torch

    return dist.TCPStore(
        address, port, None, is_master=True, timeout=timeout, wait_for_workers=False, master_listen_fd=sock.detach()
    )


def bind_string(host: str, port: int = 0) -> str:
    """`address:port` of `host` for a server that takes its bind address as a string (torchft's Rust servers)."""
    return f"{url_host(bind_address(host)[1])}:{port}"


def url_host(host: str) -> str:
    """`host` as the host part of a URL or of a `host:port` bind string (an IPv6 address goes in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
