"""The membership rule of the sync in flight when a quorum changes (docs/design.md §10.1)."""

from dilocox.sync.elastic import APPLY, NOTHING, REDO, delayed_update_verdict


def test_no_member_holding_a_sync_means_nothing_to_settle():
    assert delayed_update_verdict(num_holding=0, num_not_ok=3) == NOTHING


def test_an_unchanged_quorum_where_every_share_arrived_applies_it_as_a_static_run_would():
    assert delayed_update_verdict(num_holding=3, num_not_ok=0) == APPLY


def test_a_lost_share_or_a_new_member_makes_the_survivors_send_theirs_again():
    # a member whose transfer failed (a peer died during it)
    assert delayed_update_verdict(num_holding=2, num_not_ok=2) == REDO
    # a cluster that just healed holds no share and counts as not ok: the others redo without it
    assert delayed_update_verdict(num_holding=3, num_not_ok=1) == REDO


def test_the_launcher_names_a_restart_pending_until_it_asks_to_join(tmp_path):
    from dilocox.launch import _restarts_pending

    assert _restarts_pending(str(tmp_path), 3) == []  # first starts are not restarts: the first quorum waits for them
    (tmp_path / "restarting2").touch()
    assert _restarts_pending(str(tmp_path), 3) == [2]
    (tmp_path / "ready2").touch()  # just before it asks the Lighthouse for its first quorum
    assert _restarts_pending(str(tmp_path), 3) == []


def test_the_end_of_training_waits_for_a_restart_and_gives_up_after_network_timeout(capsys):
    import datetime
    import time

    from dilocox.sync.membership import ElasticMembership

    membership = ElasticMembership.__new__(ElasticMembership)  # the wait needs no torchft Manager
    membership.cluster, membership.timeout = 0, datetime.timedelta(seconds=0.3)
    asked = iter([[2], [2], [2], []])
    membership.restarts_pending = lambda: next(asked)
    membership.wait_for_restarts()
    assert "cluster 0 waits for restarted clusters [2] before the last sync" in capsys.readouterr().out

    membership.restarts_pending = lambda: [2]  # never comes
    start = time.monotonic()
    membership.wait_for_restarts()
    assert 0.3 <= time.monotonic() - start < 2
    assert "restarted clusters [2] did not come within network.timeout" in capsys.readouterr().out
