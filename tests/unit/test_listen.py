"""Where listeners bind (`dilocox.net.listen`, docs/design.md §11): a store on the given address only, an address of
another machine refused with the option to fix, host strings for torchft's servers and URLs."""

import datetime
import os

import pytest
import torch.distributed as dist

from dilocox.net.config import NetworkConfig
from dilocox.net.listen import bind_string, listening_socket, serve_store, url_host
from tests.e2e.helpers import listening_sockets


def test_the_store_listens_on_the_loopback_only_and_serves_its_clients():
    # a TCPStore told "127.0.0.1" still listens on every interface; this one is handed a socket bound there
    store = serve_store("127.0.0.1", datetime.timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", store.port, None, is_master=False, timeout=datetime.timedelta(seconds=10))
    client.set("key", "value")
    assert store.get("key") == b"value"
    assert [s for s in listening_sockets(os.getpid()) if s[1] == store.port] == [("127.0.0.1", store.port)]


def test_an_address_of_another_machine_is_refused_naming_advertise_host():
    with pytest.raises(ValueError, match=r"network.advertise_host = '203.0.113.77' is not an address this machine can"):
        listening_socket("203.0.113.77")  # TEST-NET-3: documentation only


def test_hosts_in_bind_strings_and_urls():
    assert bind_string("127.0.0.1") == "127.0.0.1:0"
    assert bind_string("::1", 29510) == "[::1]:29510"
    assert url_host("::1") == "[::1]" and url_host("[::1]") == "[::1]" and url_host("10.0.0.1") == "10.0.0.1"
    assert NetworkConfig().listen_host == "127.0.0.1"
    assert NetworkConfig(advertise_host="10.0.0.1").listen_host == "10.0.0.1"
