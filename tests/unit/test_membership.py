"""The membership rule of the sync in flight when a quorum changes (docs/design.md §10.1)."""

import datetime
import http.server
import itertools
import json
import logging
import re
import socket
import threading

import pytest
import torch

from dilocox.elastic.events import MembershipLog
from dilocox.elastic.lighthouse import (
    check_lighthouse_url,
    heartbeat_ages,
    lighthouse_url,
    parse_heartbeats,
    probe_lighthouse,
    start_lighthouse,
)
from dilocox.elastic.membership import ElasticError, ElasticMembership, returning_by_heartbeat
from dilocox.elastic.stall import StallWatch, cluster_ages
from dilocox.elastic.vote import APPLY, NOTHING, REDO, delayed_update_verdict, diverged_members, outer_digest


def test_no_member_holding_a_sync_means_nothing_to_settle():
    assert delayed_update_verdict(num_holding=0, num_not_ok=3) == NOTHING


def test_an_unchanged_quorum_where_every_share_arrived_applies_it_as_a_static_run_would():
    assert delayed_update_verdict(num_holding=3, num_not_ok=0) == APPLY


def test_a_lost_share_or_a_new_member_makes_the_survivors_send_theirs_again():
    # a member whose transfer failed (a peer died during it)
    assert delayed_update_verdict(num_holding=2, num_not_ok=2) == REDO
    # a cluster that just healed holds no share and counts as not ok: the others redo without it
    assert delayed_update_verdict(num_holding=3, num_not_ok=1) == REDO


def test_the_agreed_outer_params_are_those_most_members_hold_ties_to_the_lowest_rank():
    assert diverged_members([7, 7, 7]) == []
    assert diverged_members([7, 9, 7]) == [1]
    assert diverged_members([9, 7, 7]) == [0]
    assert diverged_members([7, 9]) == [1]  # one against one: the lower rank's
    assert diverged_members([9, 7]) == [1]
    assert diverged_members([5, 7, 9, 7]) == [0, 2]


def test_the_outer_digest_sees_one_flipped_bit_and_ignores_the_order_of_the_sum():
    outer = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    flipped = outer.clone()
    flipped.view(torch.int32)[123] ^= 1  # the lowest mantissa bit of one value
    assert outer_digest(flipped) != outer_digest(outer)
    assert outer_digest(outer) == outer_digest(outer.clone())
    # the same values summed as two halves give the same digest: integer sums do not depend on the order
    halves = outer_digest(outer[:500]) + outer_digest(outer[500:])
    assert (halves - outer_digest(outer)) % 2**64 == 0


def test_the_launcher_reads_which_clusters_ended_the_run_from_the_first_record(tmp_path):
    from dilocox.launch.elastic import _last_round_clusters

    assert _last_round_clusters(tmp_path, 0) is None  # no record: the launcher stops no one on its account
    (tmp_path / "elastic").mkdir()
    (tmp_path / "elastic" / "cluster1.json").write_text(json.dumps({"cluster": 1, "last_round_clusters": [0, 1]}))
    assert _last_round_clusters(tmp_path, 1) == (0, 1)


def _ended_membership(restarts, beats, *, launched_here=(0,), timeout_s=0.3) -> ElasticMembership:
    """A membership at the end of training (the wait needs no torchft Manager): its launcher's `restarts` and the
    Lighthouse's heartbeat ages `beats()` (by replica id), network.heartbeat 0.5 s."""
    membership = ElasticMembership.__new__(ElasticMembership)
    membership.cluster, membership.timeout = 0, datetime.timedelta(seconds=timeout_s)
    membership.restarts, membership.launched_here, membership.heartbeat_s = restarts, launched_here, 0.5
    membership.stall_watch = StallWatch(ages=beats, stall_timeout_s=0.0, poll_s=0.5)
    return membership


def test_the_end_of_training_waits_for_a_restart_to_ask_and_gives_up_after_network_timeout(capsys):
    asked = iter([{2: False}, {2: False}, {2: False}, {2: True}])
    _ended_membership(lambda: next(asked), dict, launched_here=(0, 2)).wait_for_restarts()
    assert "cluster 0 waits for clusters [2], started again or silent" in capsys.readouterr().out

    _ended_membership(lambda: {2: False}, dict, launched_here=(0, 2)).wait_for_restarts()  # never asks
    assert "clusters [2] did not come back within network.timeout" in capsys.readouterr().out

    _ended_membership(None, dict).wait_for_restarts()  # nobody restarts clusters, and none is silent: no wait
    assert capsys.readouterr().out == ""


def test_a_cluster_no_launcher_here_restarts_is_waited_for_from_its_silence_until_it_beats_again(capsys):
    # cluster 1 is a torchrun job's (or another machine's): its heartbeat stopped 3 s ago; its restart beats under a
    # new replica id from the third look on. Cluster 2 beats (it is in the run), cluster 3 went silent long ago.
    silent = {"cluster0:a": 0.1, "cluster1:a": 3.0, "cluster2:a": 0.2, "cluster3:a": 90.0}
    looks = itertools.chain([silent, silent], itertools.repeat({**silent, "cluster1:b": 0.1}))
    membership = _ended_membership(None, lambda: next(looks), timeout_s=60)
    membership.wait_for_restarts()
    assert "cluster 0 waits for clusters [1], started again or silent" in capsys.readouterr().out
    assert membership.returning() == {1: True, 2: True}  # back; cluster 3 is not waited for, nor this cluster

    # past network.timeout of silence the restart is not waited for; a cluster of this machine's launcher is judged
    # by the launcher alone (it knows whether it starts it again)
    assert returning_by_heartbeat({1: 61.0, 2: 3.0}, skip=(0,), beating_s=1.0, window_s=60.0) == {2: False}
    assert returning_by_heartbeat({1: 3.0, 2: 3.0}, skip=(0, 2), beating_s=1.0, window_s=60.0) == {1: False}
    membership = _ended_membership(lambda: {}, lambda: silent, launched_here=(0, 1), timeout_s=60)
    assert membership.returning() == {2: True}

    # a Lighthouse that does not answer holds nothing up
    def unreachable():
        raise OSError("connection refused")

    _ended_membership(None, unreachable).wait_for_restarts()
    assert capsys.readouterr().out == ""


def test_below_min_clusters_the_round_is_refused_with_one_line_naming_the_setting():
    membership = ElasticMembership.__new__(ElasticMembership)
    membership.num_clusters, membership.min_clusters = 3, 2
    membership._check((0, 2))  # two are enough
    with pytest.raises(ElasticError) as refused:
        membership._check((1,))
    assert str(refused.value) == (
        "only 1 of 3 clusters (clusters [1]) are left in the round, fewer than sync.min_clusters = 2: the run stops"
    )


def test_torchft_flight_recorder_warning_is_dropped_and_its_other_warnings_and_errors_are_not(caplog):
    """torchft's Manager warns after every reconfiguration, on a CPU build of torch, that it cannot reset NCCL's
    flight recorder; the slow-link group is gloo, so that line is dropped, through torchft's own logger, and only it."""
    from torchft.manager import _ManagerLogger

    from dilocox.elastic.membership import quiet_torchft_logs

    class Step:
        def current_step(self) -> int:
            return 3

    quiet_torchft_logs()
    quiet_torchft_logs()  # idempotent: one filter
    manager_log = _ManagerLogger(Step(), "cluster0", 0)  # what torchft's Manager logs through
    with caplog.at_level(logging.WARNING):
        manager_log.warn("Unable to reset NCCL flight recorder recording so traces will be incorrect.")
        manager_log.warn("a warning that does apply")
        try:
            raise RuntimeError("gloo connection reset")
        except RuntimeError:
            manager_log.exception("got exception in pg configure: gloo connection reset")
    messages = [record.getMessage() for record in caplog.records]
    assert messages == [
        "[cluster0/0 - step 3] a warning that does apply",
        "[cluster0/0 - step 3] got exception in pg configure: gloo connection reset",
    ]
    assert len(logging.getLogger("torchft.manager").filters) == 1


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("http://[::1", "is not a URL (Invalid IPv6 URL)"),
        ("http://127.0.0.1:99999", "is not a URL (Port out of range"),
        ("https://10.0.0.1:29510", "must start with http://"),
        ("10.0.0.1:29510", "must start with http://"),
        ("http://:29510", "names no host"),
        ("http://10.0.0.1", "names no port"),
        ("http://10.0.0.1:29510/status", "has a path"),
    ],
)
def test_a_malformed_lighthouse_url_is_refused_with_what_is_wrong(url, said):
    with pytest.raises(ValueError, match=re.escape(said)) as refused:
        check_lighthouse_url(url)
    assert str(refused.value).startswith(f"network.lighthouse = {url!r}")
    assert "e.g. http://10.0.0.1:29510" in str(refused.value)
    check_lighthouse_url("http://[::1]:29510")  # IPv6 in brackets, a name, an address: all fine
    check_lighthouse_url("http://lighthouse.internal:29510/")


def test_a_probe_names_a_url_where_nothing_listens_and_one_that_is_not_a_lighthouse():
    with socket.socket() as unused:  # bound, never listening: a connection is refused
        unused.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{unused.getsockname()[1]}"
        with pytest.raises(ValueError, match=re.escape(f"no Lighthouse answers at network.lighthouse = {url}")):
            probe_lighthouse(url)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(ValueError, match="is not a torchft Lighthouse"):
            probe_lighthouse(url)
    finally:
        server.shutdown()
        server.server_close()


def test_a_real_lighthouse_answers_the_probe_and_reports_heartbeat_ages():
    pytest.importorskip("torchft")
    from torchft.coordination import LighthouseClient

    lighthouse = start_lighthouse(heartbeat_timeout_s=1.0, join_timeout_s=2.0)
    try:
        url = lighthouse_url(lighthouse, "127.0.0.1")
        probe_lighthouse(url)
        LighthouseClient(url, datetime.timedelta(seconds=5)).heartbeat("cluster2")
        ages = heartbeat_ages(url)
        assert list(ages) == ["cluster2"] and 0 <= ages["cluster2"] < 60
    finally:
        lighthouse.shutdown()


def test_heartbeat_ages_are_read_in_every_unit_the_status_page_uses():
    page = "cluster0: seen 0.25s ago <li> cluster12: seen 3.5ms ago cluster3: seen 40µs ago cluster4: seen 7ns ago"
    assert parse_heartbeats(page) == pytest.approx({"cluster0": 0.25, "cluster12": 3.5e-3, "cluster3": 4e-5,
                                                    "cluster4": 7e-9})  # fmt: skip


def test_a_clusters_heartbeat_age_is_that_of_its_newest_process():
    # torchft's replica ids are cluster{c}:{uuid}, one per process; the Lighthouse keeps those of ended processes
    ages = {"cluster0:1f2e": 0.1, "cluster2:aaaa": 30.0, "cluster2:bbbb": 0.3, "cluster12:cccc": 9.0, "other": 1.0}
    assert cluster_ages(ages) == {0: 0.1, 2: 0.3, 12: 9.0}


def test_a_restart_back_before_any_quorum_went_without_it_is_recorded_once_as_a_rejoin():
    # killed and restarted within a round: every quorum held cluster 2, so only its heal at a boundary says it
    log = MembershipLog(cluster=0, heartbeat_timeout_s=1.0)
    assert log.quorum((0, 1, 2), step=0, ages={}) == []
    assert log.quorum((0, 1, 2), step=10, ages={}) == []  # the same clusters: no change seen
    [back] = log.healed([2], step=20)
    assert (back.kind, back.cluster, back.step) == ("rejoined", 2, 20) and "restarted and healed" in back.reason
    assert log.healed([2], step=20) == []  # the settling tried again in another quorum: said once
    assert log.healed([0], step=30) == []  # this cluster's own heal is its own line
    log.quorum((0, 1), step=40, ages={2: 3.0})
    [rejoined] = log.quorum((0, 1, 2), step=50, ages={})
    assert rejoined.kind == "rejoined" and log.healed([2], step=50) == []  # the quorum's change said it already


def test_the_membership_log_names_each_leave_stall_and_rejoin_once():
    log = MembershipLog(cluster=0, heartbeat_timeout_s=1.0)
    assert log.quorum((0, 1, 2, 3), step=0, ages={}) == []  # the first quorum: nothing changed
    [left] = log.quorum((0, 1, 3), step=10, ages={2: 4.5})
    assert (left.kind, left.cluster, left.step, left.seconds) == ("left", 2, 10, 4.5)
    assert left.line().startswith("dilocox: elastic: cluster 2 left at step 10: no heartbeat for 4.5s")
    assert left.record() == {"step": 10, "event": "elastic", "kind": "left", "cluster": 2, "reason": left.reason,
                             "seconds": 4.5}  # fmt: skip
    [stalled] = log.stalled({3: 6.0}, (0, 1, 3), step=20, stall_timeout_s=5)
    assert stalled.kind == "stalled" and "network.stall_timeout = 5s" in stalled.reason
    assert log.stalled({3: 6.5}, (0, 1, 3), step=20, stall_timeout_s=5) == []  # named once
    assert log.quorum((0, 1), step=20, ages={3: 7.0}) == []  # its leave is the stall already named
    rejoined = log.quorum((0, 1, 2), step=30, ages={})
    assert [(e.kind, e.cluster) for e in rejoined] == [("rejoined", 2)] and rejoined[0].seconds >= 0
    [late] = log.quorum((0, 2), step=40, ages={1: 0.2})  # it beats: it came late or failed a collective
    assert late.kind == "left" and "did not join this round's quorum in time" in late.reason
    # the lowest of the clusters that see a change prints it
    assert log.printer((0, 1, 2), gone={2}) and not MembershipLog(cluster=1, heartbeat_timeout_s=1).printer(
        (0, 1, 2), gone={2}
    )
