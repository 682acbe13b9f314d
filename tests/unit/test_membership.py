"""The membership rule of the sync in flight when a quorum changes (docs/design.md §10.1)."""

from dilocox.sync.membership import APPLY, NOTHING, REDO, delayed_update_verdict


def test_no_member_holding_a_sync_means_nothing_to_settle():
    assert delayed_update_verdict(num_holding=0, num_not_ok=3) == NOTHING


def test_an_unchanged_quorum_where_every_share_arrived_applies_it_as_a_static_run_would():
    assert delayed_update_verdict(num_holding=3, num_not_ok=0) == APPLY


def test_a_lost_share_or_a_new_member_makes_the_survivors_send_theirs_again():
    # a member whose transfer failed (a peer died during it)
    assert delayed_update_verdict(num_holding=2, num_not_ok=2) == REDO
    # a cluster that just healed holds no share and counts as not ok: the others redo without it
    assert delayed_update_verdict(num_holding=3, num_not_ok=1) == REDO
