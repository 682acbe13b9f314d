"""The pieces of an elastic run that talk to torchft over the network (docs/design.md §10.1): the heal transport a
joining cluster loads a live peer's state with, a restart that finds nobody to heal from, and where torchft's servers
listen (§11). A real Lighthouse, a real torchft Manager and real HTTP; one process."""

from __future__ import annotations

import datetime
import http.server
import io
import os
import pickle
import re
import socket
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchft")
pytestmark = [pytest.mark.dist, pytest.mark.timeout(60)]

from dilocox.elastic.lighthouse import lighthouse_url, start_lighthouse  # noqa: E402
from dilocox.elastic.membership import ElasticMembership, NoLivePeer, _heal_transport, _reconfigurable_gloo  # noqa: E402
from dilocox.net.listen import bind_string, serve_store  # noqa: E402
from tests.e2e.helpers import listening_sockets  # noqa: E402

TIMEOUT = datetime.timedelta(seconds=10)


class _Touch:
    """Unpickling this creates `path`: what a malicious peer's heal state would do in a process that unpickles it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def _serve(body: bytes) -> tuple[http.server.HTTPServer, str]:
    """An HTTP server that answers every GET with `body`, as a (malicious) peer's checkpoint server would."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}/checkpoint/0/full"


def _streamed(obj: object) -> bytes:
    from torch.distributed._serialization import _streaming_save

    buffer = io.BytesIO()
    _streaming_save(obj, buffer)
    return buffer.getvalue()


def test_the_heal_state_travels_from_the_advertised_address_and_loads_writable_tensors():
    sender = _heal_transport(TIMEOUT, "127.0.0.1", max_bytes=1 << 20)
    receiver = _heal_transport(TIMEOUT, "127.0.0.1", max_bytes=1 << 20)
    try:
        # the address other machines fetch from is the advertised host, not this machine's hostname
        assert sender.metadata().startswith("http://127.0.0.1:")
        state = {
            "outer_params": torch.arange(1000, dtype=torch.float32),
            "outer_optimizer": {"state": {0: {"momentum_buffer": torch.ones(1000)}}, "param_groups": [{"lr": 0.7}]},
            "outer_step": 3,
            "phase": "round",
        }
        sender.send_checkpoint(dst_ranks=[1], step=5, state_dict=state, timeout=TIMEOUT)
        healed = receiver.recv_checkpoint(src_rank=0, metadata=sender.metadata(), step=5, timeout=TIMEOUT)
        assert torch.equal(healed["outer_params"], state["outer_params"])
        assert healed["outer_step"] == 3 and healed["phase"] == "round"
        momentum = healed["outer_optimizer"]["state"][0]["momentum_buffer"]
        momentum.mul_(0.9)  # the outer optimizer updates it in place: it must own writable memory
        assert torch.equal(momentum, torch.full((1000,), 0.9))
    finally:
        sender.shutdown(wait=False)
        receiver.shutdown(wait=False)


def test_a_heal_state_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    from torchft.checkpointing.http_transport import HTTPTransport

    marker = tmp_path / "ran"
    server, address = _serve(_streamed({"outer_params": torch.zeros(3), "payload": _Touch(marker)}))
    try:
        transport = _heal_transport(TIMEOUT, "127.0.0.1", max_bytes=1 << 20)
        with pytest.raises(pickle.UnpicklingError, match="Unsupported global"):
            transport._load_from_address(address, TIMEOUT)
        transport.shutdown(wait=False)
        assert not marker.exists()
        # torchft's own transport unpickles it whole: the peer's code runs (why dilocox does not use it as it is)
        HTTPTransport._load_from_address(address, TIMEOUT)
        assert marker.exists()
    finally:
        server.shutdown()


def test_a_heal_state_larger_than_its_bound_is_refused_before_it_is_loaded():
    server, address = _serve(_streamed({"outer_params": torch.zeros(4096)}))  # ~16 KiB
    try:
        transport = _heal_transport(TIMEOUT, "127.0.0.1", max_bytes=4096)
        with pytest.raises(ValueError, match="is larger than 4,096 bytes: refused"):
            transport._load_from_address(address, TIMEOUT)
        transport.shutdown(wait=False)
    finally:
        server.shutdown()


def _membership(
    lighthouse: str,
    cluster: int,
    store: dist.TCPStore,
    host: str = "127.0.0.1",
    *,
    timeout: datetime.timedelta = datetime.timedelta(seconds=30),
) -> ElasticMembership:
    return ElasticMembership(
        cluster=cluster,
        num_clusters=3,
        min_clusters=1,
        lighthouse=lighthouse,
        store_addr=host,
        store_port=store.port,
        rank_in_cluster=0,
        ranks_per_cluster=1,
        timeout=timeout,
        quorum_timeout=datetime.timedelta(seconds=30),
        control_timeout=datetime.timedelta(seconds=5),
        state_dict=lambda: {},
        load_state_dict=lambda state: None,
        heal_max_bytes=1 << 20,
        config_fingerprint=0,
    )


@pytest.mark.parametrize(
    ("restarts", "message"),
    [
        ({}, "cluster 2 was started again, but no other cluster is alive to heal from"),
        # the launcher starts every cluster again (every one died), and cluster 2's restart asks first
        ({0: False, 1: True, 2: True}, "cluster 2 was started again, and so were clusters [0, 1]: no live cluster "
         "holds the run's state to heal from (every cluster died)"),
    ],
    ids=["the-others-gone", "every-cluster-died"],
)  # fmt: skip
def test_a_restart_alone_at_the_lighthouse_stops_at_once_with_no_live_peer(restarts, message):
    # the run ended (or every other cluster died) before cluster 2's restart came: it would otherwise wait for its
    # peers up to network.timeout and then fail as if the user had started too few clusters; that timeout is longer
    # than the test's own, so a wait for it fails the test. Which of the two it says depends on whether the other
    # clusters are being started again, never on which restart reaches the Lighthouse first.
    lighthouse = start_lighthouse(heartbeat_timeout_s=1.0, join_timeout_s=2.0)
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    membership = _membership(lighthouse_url(lighthouse, "127.0.0.1"), 2, store, timeout=datetime.timedelta(hours=1))
    try:
        membership.restarted = True
        membership.restarts = lambda: restarts
        with pytest.raises(NoLivePeer, match=re.escape(message)):
            membership.join()
    finally:
        membership.close()
        lighthouse.shutdown()


def _can_listen(host: str) -> bool:
    try:
        with socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET):
            return True
    except OSError:
        return False


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_torchfts_servers_and_the_slow_link_group_listen_on_the_clusters_address_only(host):
    # torchft 0.2 binds its manager server (whose Kill call ends the process) and its checkpoint server (the heal
    # state: the outer params) to every interface, and its gloo group to GLOO_SOCKET_IFNAME's interface
    if not _can_listen(host):
        pytest.skip(f"this machine cannot listen on {host}")
    before = set(listening_sockets(os.getpid()))
    lighthouse = start_lighthouse(bind=bind_string(host), heartbeat_timeout_s=1.0, join_timeout_s=1.0)
    store = serve_store(host, TIMEOUT)
    membership = _membership(lighthouse_url(lighthouse, host), 0, store, host)
    try:
        quorum = membership.start_round(check=False)  # alone at the Lighthouse: the round's gloo group of one
        assert quorum.clusters == (0,)
        grown = set(listening_sockets(os.getpid())) - before
        manager_port = int(membership.manager._manager.address().rsplit(":", 1)[1])
        heal_port = membership.manager._checkpoint_transport._server.server_address[1]
        # the Lighthouse, the store, the manager server, the heal server and the round's two gloo groups (payloads,
        # control)
        assert {manager_port, heal_port} <= {port for _, port in grown} and len(grown) == 6, grown
        assert {address for address, _ in grown} == {host}, grown
        assert membership.manager._checkpoint_transport.metadata().startswith(f"http://{bind_string(host, heal_port)}/")
    finally:
        membership.close()
        lighthouse.shutdown()


def test_a_quorum_group_forms_within_the_connect_timeout_and_its_collectives_wait_network_timeout():
    # A member killed between a quorum and its group would hold the others in the group's rendezvous for
    # network.timeout: it is bounded by network.stall_timeout instead, and the collectives keep network.timeout
    # (a legitimate slow-link transfer may take long).
    connect, long = datetime.timedelta(seconds=3), datetime.timedelta(seconds=120)  # 3 s: two threads connect
    store = serve_store("127.0.0.1", TIMEOUT)
    address = f"127.0.0.1:{store.port}"
    alone = _reconfigurable_gloo(long, "127.0.0.1", connect_timeout=connect)
    with pytest.raises(Exception):  # noqa: B017 (torch raises its own timeout classes): within the test's 60 s
        alone.configure(f"{address}/q1", "cluster0", 0, 2, quorum_id=1, group_rank=0, group_world_size=1)

    groups = [_reconfigurable_gloo(long, "127.0.0.1", connect_timeout=connect) for _ in range(2)]
    errors: list[BaseException] = []
    sums = [torch.ones(1), torch.ones(1)]

    def member(rank: int) -> None:
        try:
            groups[rank].configure(f"{address}/q2", f"cluster{rank}", rank, 2, quorum_id=2, group_rank=0,
                                   group_world_size=1)  # fmt: skip
            if rank == 1:
                threading.Event().wait(2 * connect.total_seconds())  # later than the rendezvous bound
            groups[rank].parent.allreduce([sums[rank]], dist.AllreduceOptions()).wait()
        except BaseException as error:  # the test asserts on it
            errors.append(error)

    threads = [threading.Thread(target=member, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=40)
    assert errors == [] and [float(t) for t in sums] == [2.0, 2.0]
