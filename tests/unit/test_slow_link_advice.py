"""The warning that the slow link cannot keep up (`link_fit.slow_link_advice`), from given link and compute times:
it suggests a bandwidth only where a faster emulated uplink would hide the sync, and that bandwidth would."""

import pytest

from dilocox.net.channel import WanChannel
from dilocox.net.link import parse_bandwidth
from dilocox.sync import RoundStats
from dilocox.sync.link_fit import slow_link_advice


def advice(bandwidth: str, *, latency_s: float = 0.01, link_s: float, compute_s: float, nbytes: int) -> str:
    channel = WanChannel(None, bandwidth=parse_bandwidth(bandwidth), latency_s=latency_s)
    stats = RoundStats(link_s=link_s, exposed_s=link_s - compute_s, bytes_sent=nbytes, compute_s=compute_s)
    return slow_link_advice(stats, round_steps=10, overlap_steps=0, channel=channel)


def test_an_unlimited_link_gets_no_bandwidth_advice():
    # the link time is the real collective's: no network.bandwidth makes it shorter (it said ">= 0Mbps")
    text = advice("unlimited", link_s=0.5, compute_s=0.2, nbytes=5_000)
    assert "network.bandwidth >=" not in text and "0Mbps" not in text
    assert "network.bandwidth is unlimited: this is the real collective's time" in text
    assert "use sync.inner_steps >= 25" in text


def test_an_emulated_link_gets_the_bandwidth_that_would_hide_the_sync():
    # 1 MB in 0.5 s of compute minus 10 ms of latency: 16.33 Mbit/s, rounded up
    text = advice("1Mbps", link_s=8.01, compute_s=0.5, nbytes=1_000_000)
    needed = text.split("network.bandwidth >= ")[1].split()[0]
    assert needed == "16.4Mbps"
    assert parse_bandwidth(needed) * 0.49 >= 1_000_000 > parse_bandwidth("16.3Mbps") * 0.49


@pytest.mark.parametrize(
    "bandwidth, latency_s",
    [
        ("1Gbps", 0.01),  # the uplink already carries 1 kB in time: the real collective was slower than the model
        ("1Mbps", 0.5),  # the latency alone is as long as the compute
    ],
)
def test_no_bandwidth_is_suggested_where_none_would_help(bandwidth, latency_s):
    text = advice(bandwidth, latency_s=latency_s, link_s=0.6, compute_s=0.3, nbytes=1_000)
    assert "network.bandwidth" not in text and "use sync.inner_steps >= 20" in text
