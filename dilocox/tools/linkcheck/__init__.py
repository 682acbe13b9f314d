"""Real link shaping: check the emulated slow link against a Linux link shaped with `tc tbf` (root only, optional).

`WanChannel` emulates the slow link between clusters: it runs each collective for real on a fast transport and
completes it when a `LinkModel` says `max(sent, recv) / bandwidth` seconds have passed. This package measures the
same collectives over a link the kernel actually shapes, so the model's times can be compared with real ones:

    dilocox linkcheck --bandwidth 100Mbps,1Gbps --out benchmarks/results/shaped_link

Topology (for any number of clusters C >= 2, one code path): every cluster is a network namespace with one
interface `wan0` (address 10.213.0.<i+1>/24), the end of a veth pair whose other end is a port of a bridge in a
separate *hub* namespace. The bridge lives in a namespace of its own, not in the host's root namespace, so the
check never touches the host's interfaces, routes or firewall (a host with `br_netfilter` and a FORWARD DROP
policy would otherwise drop the bridged traffic). A `tbf` qdisc on each `wan0` shapes the cluster's egress, which
is its *uplink* in `WanChannel`'s terms (`bandwidth` = bytes/s per cluster uplink); a cluster's downlink is not
shaped because it carries what the other clusters' shaped uplinks send. Latency is not shaped: `netem` is missing
on the kernels this was built for, so the comparison uses latency 0 and only checks bandwidth.

Names are `dlxshape-<pid>-hub` and `dlxshape-<pid>-c<i>`, so concurrent runs never collide, and namespaces are
deleted in `finally` (also on Ctrl+C and SIGTERM); namespaces left by a run that was killed with SIGKILL (its pid
no longer exists) are removed by the next run. Deleting a namespace also deletes its veth ends.

Each cluster runs one worker process (`ip netns exec NS python -m dilocox.tools.linkcheck.worker`), one gloo rank
bound to `wan0`. For every payload size it runs a ring all-reduce (fp32) and an all-gather (uint8 payload) through
a `WanChannel(group, bandwidth=None, latency_s=0)`, which runs the real collective and records its measured time
and its exact byte counts; the emulated time is what `LinkModel` would charge for those bytes at the same rate.
The same transfers are timed once on the unshaped veth (the overhead floor), then under each requested rate.

Modules: `units` (sizes and rates as typed), `namespaces` (netns/veth/bridge/tc set-up and teardown), `worker` (one
cluster's gloo rank), `results` (rows and their arithmetic), `runner` (`run_linkcheck`: the phases), `report`
(tables, results.md, results.json), `cli` (`dilocox linkcheck`).
"""
