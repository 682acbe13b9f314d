"""A torchft Lighthouse as the clusters of an elastic run reach it (docs/design.md §10.1): its URL checked before
anything starts, a probe that it answers, and the age of each cluster's last heartbeat as it reports it.

    check_lighthouse_url("http://10.0.0.1:29510")   # ValueError naming network.lighthouse: scheme, host, port
    probe_lighthouse("http://10.0.0.1:29510")       # ValueError when nothing answers there, or not a Lighthouse
    ages = heartbeat_ages("http://10.0.0.1:29510")  # {"cluster0": 0.08, "cluster2": 7.3}: seconds since each beat
    proc, url = run_lighthouse("127.0.0.1:0", heartbeat="1s", stall_timeout="10s")   # one in a subprocess

torchft 0.2's Lighthouse serves its dashboard on its gRPC port: `GET /` names it ("Lighthouse Dashboard -
torchft"), `GET /status` lists every replica that ever beat with the time since its last heartbeat ("cluster2: seen
7.31s ago"); both are read here, with a short timeout, over plain HTTP.
"""

from __future__ import annotations

import http.client
import re
import socket
import subprocess
import sys
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dilocox.net.listen import LOOPBACK, url_host

if TYPE_CHECKING:
    from dilocox.net.config import NetworkConfig

PROBE_TIMEOUT_S = 3.0
"""How long a probe of the Lighthouse waits for its TCP connection and its answer."""

_DASHBOARD_TITLE = "Lighthouse Dashboard - torchft"
_HEARTBEAT = re.compile(r"(\S+): seen ([0-9.]+)(s|ms|µs|us|ns) ago")
_UNIT_S = {"s": 1.0, "ms": 1e-3, "µs": 1e-6, "us": 1e-6, "ns": 1e-9}


def check_lighthouse_url(url: str) -> None:
    """Refuse a `network.lighthouse` that is not `http://HOST:PORT` (a scheme, a host, a port in 1-65535, nothing
    that fails to parse), with one message that names the value and an example."""
    example = "e.g. http://10.0.0.1:29510 (`dilocox lighthouse` prints its URL; it listens on port 29510)"
    try:
        parts = urllib.parse.urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError as exc:  # an unclosed IPv6 bracket, a port that is not a number or out of range
        raise ValueError(
            f"network.lighthouse = {url!r} is not a URL ({exc}); give a torchft Lighthouse's, {example}"
        ) from None
    if parts.scheme != "http":
        raise ValueError(
            f"network.lighthouse = {url!r} must start with http:// (torchft's Lighthouse speaks plain HTTP/2, "
            f"without TLS), {example}"
        )
    if not host:
        raise ValueError(f"network.lighthouse = {url!r} names no host; {example}")
    if port is None or port == 0:
        raise ValueError(f"network.lighthouse = {url!r} names no port; {example}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"network.lighthouse = {url!r} has a path; give the Lighthouse's address only, {example}")


def _get(url: str, path: str, timeout_s: float) -> str:
    """The body of `GET path` from the Lighthouse at `url` (OSError or http.client.HTTPException when it fails)."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        body = response.read(1 << 20).decode(errors="replace")
        if response.status != 200:
            raise http.client.HTTPException(f"HTTP {response.status}")
        return body
    finally:
        connection.close()


def probe_lighthouse(url: str, *, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Refuse a Lighthouse that does not answer: nothing listens at `url`, the host does not resolve or is not
    reached within `timeout_s`, or what answers is not a torchft Lighthouse. One message that names the URL and what
    to do; run before anything of the run is written."""
    start = "start `dilocox lighthouse --bind HOST:PORT` there first, or fix --network.lighthouse"
    try:
        body = _get(url, "/", timeout_s)
    except socket.gaierror as exc:
        raise ValueError(f"network.lighthouse = {url}: its host does not resolve ({exc.strerror}); {start}") from None
    except TimeoutError:
        raise ValueError(
            f"network.lighthouse = {url} did not answer within {timeout_s:g}s (a firewall, or a host that is down): "
            f"check that this machine reaches it, or {start}"
        ) from None
    except ConnectionRefusedError:
        raise ValueError(f"no Lighthouse answers at network.lighthouse = {url} (connection refused); {start}") from None
    except OSError as exc:
        raise ValueError(f"no Lighthouse answers at network.lighthouse = {url} ({exc}); {start}") from None
    except http.client.HTTPException as exc:
        body = f"{exc}"
    if _DASHBOARD_TITLE not in body:
        raise ValueError(
            f"what answers at network.lighthouse = {url} is not a torchft Lighthouse (it does not serve the Lighthouse "
            "dashboard); give the URL that `dilocox lighthouse` prints"
        )


def heartbeat_ages(url: str, *, timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, float]:
    """Seconds since the Lighthouse at `url` last heard each replica's heartbeat, by replica id ("cluster2"), from its
    status page; every replica that beat since the Lighthouse started is listed. OSError or HTTPException when the
    Lighthouse does not answer."""
    return parse_heartbeats(_get(url, "/status", timeout_s))


def parse_heartbeats(status: str) -> dict[str, float]:
    """The heartbeat ages of a Lighthouse status page (`heartbeat_ages`)."""
    return {name: float(value) * _UNIT_S[unit] for name, value, unit in _HEARTBEAT.findall(status)}


_PRINTED_URL = re.compile(r"--network\.lighthouse=(http://\S+);")


def run_lighthouse(
    bind: str,
    *,
    heartbeat: str,
    stall_timeout: str,
    prefix: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    log: Path | None = None,
) -> tuple[subprocess.Popen[str], str]:
    """`dilocox lighthouse --bind BIND` in a subprocess, with the `[network]` timeouts its clusters use, run under
    `prefix` (e.g. `ip netns exec NS`), for scripts and tests that run a Lighthouse of their own: the process (its
    stdout a pipe, which ends with "dilocox: lighthouse stopped"; its stderr, torchft's warnings, written to `log` or
    dropped) and the URL its first line gives for network.lighthouse. RuntimeError, with the process stopped, when
    it prints none."""
    command = [*prefix, sys.executable, "-m", "dilocox", "lighthouse", "--bind", bind,
               f"--network.heartbeat={heartbeat}", f"--network.stall_timeout={stall_timeout}"]  # fmt: skip
    environment = None if env is None else dict(env)
    with open(log or "/dev/null", "w") as stderr:  # the process keeps a descriptor of its own
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=cwd, env=environment)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    found = _PRINTED_URL.search(first)
    if found is None:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"`{' '.join(command)}` printed no address: {first!r}")
    return proc, found.group(1)


def lighthouse_timeouts(network: NetworkConfig) -> dict[str, float]:
    """The Lighthouse's timeouts from `[network]`: a cluster silent for 2 x network.heartbeat is left out of the next
    round; the live ones wait up to network.stall_timeout (or network.timeout) for one that beats but does not come."""
    return {
        "heartbeat_timeout_s": 2 * network.heartbeat_s,
        "join_timeout_s": network.stall_timeout_s or network.timeout_s,
    }


def start_lighthouse(*, bind: str = f"{LOOPBACK}:0", heartbeat_timeout_s: float, join_timeout_s: float):
    """A torchft LighthouseServer listening on `bind` (`host:port`; port 0: the system picks), in the launcher's
    process or `dilocox lighthouse`; `lighthouse_url` is what the clusters pass as network.lighthouse. A cluster whose
    heartbeat is silent for `heartbeat_timeout_s` is left out of the next quorum; the live ones wait at most
    `join_timeout_s` for a cluster that beats but does not come."""
    from torchft.coordination import LighthouseServer

    return LighthouseServer(
        bind=bind,
        min_replicas=1,
        join_timeout_ms=int(join_timeout_s * 1000),
        heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000),
    )


def lighthouse_url(lighthouse, host: str) -> str:
    """The URL of `lighthouse` at `host`, where it listens (torchft's `address()` names `socket.gethostname()`, which
    need not resolve to the address it listens on)."""
    return f"http://{url_host(host)}:{urllib.parse.urlsplit(lighthouse.address()).port}"
