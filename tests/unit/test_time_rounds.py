"""`faults.slow_clusters`, `sync.round.mode = time` and the decisions of the round clock, from given step times."""

import tomllib

import pytest

from dilocox.checkpoint import check_resume, write_meta
from dilocox.config import load_config, to_dict, to_toml
from dilocox.sync.config import RoundConfig, SyncConfig
from dilocox.sync.rounds import RoundClock, RoundReport, token_weighted_factor


def test_slow_clusters_from_a_toml_table_and_from_the_flag_forms(tmp_path):
    path = tmp_path / "slow.toml"
    path.write_text("[topology]\nnum_clusters = 3\n[faults]\nslow_clusters = {2 = 2.0}\nslow_mode = 'virtual'\n")
    from_file = load_config(path)
    from_file.validate()
    assert from_file.faults.slow_factors(3) == {2: 2.0}
    assert from_file.faults.slow_factor(2) == 2.0 and from_file.faults.slow_factor(0) == 1.0
    for flag in ("--faults.slow_clusters=2:2.0", "--faults.slow_clusters={2 = 2.0}", "--faults.slow_clusters=2:2"):
        cfg = load_config(None, ["--topology.num_clusters=3", flag])
        cfg.validate()
        assert cfg.faults.slow_factors(3) == {2: 2.0}, flag
    two = load_config(None, ["--topology.num_clusters=3", "--faults.slow_clusters=1:1.5,2:3"])
    assert two.faults.slow_factors(3) == {1: 1.5, 2: 3.0}
    # the resolved config.toml reads back as the same table
    written = tomllib.loads(to_toml(two))["faults"]["slow_clusters"]
    assert load_config(None, ["--topology.num_clusters=3"]).faults.slow_clusters == {}
    assert {int(k): v for k, v in written.items()} == {1: 1.5, 2: 3.0}


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--faults.slow_clusters=3:2.0"], "faults.slow_clusters names cluster '3', which is not a cluster"),
        (["--faults.slow_clusters=1:0.5"], "a factor must be a number >= 1"),
        (["--faults.slow_clusters=1"], "is not a key:value pair"),
        (
            ["--sync.round.mode=time", "--sync.kind=allreduce"],
            "sync.round.mode = 'time' does not work with sync.kind = 'allreduce'",
        ),
        (
            ["--sync.round.mode=time", "--sync.sync_delay=1", "--sync.round.fit_link=true"],
            "does not work with sync.round.fit_link",
        ),
        (["--sync.round.seconds=2"], "set sync.round.mode = time"),
        # a budget below H steps of 1 ms cuts every round to one step (20 steps to 11 with H = 10)
        (["--sync.round.mode=time", "--sync.round.seconds=1e-9"], "use --sync.round.seconds=0.008 or more"),
        (["--sync.round.mode=time", "--sync.round.seconds=0.0079"], "sync.round.seconds = 0.0079 is less than H = 8 steps"),
    ],
)
def test_impossible_slow_or_time_settings_are_refused_naming_the_field(flags, words):
    with pytest.raises(ValueError) as error:
        cfg = load_config(None, ["--topology.num_clusters=3", "--sync.inner_steps=8", *flags])
        cfg.validate()
    assert words in str(error.value)


def clock(seconds: float = 0.0) -> RoundClock:
    return RoundClock(SyncConfig(inner_steps=8, round=RoundConfig(mode="time", seconds=seconds)), total_steps=20)


def test_virtual_rounds_count_each_step_as_its_factor():
    slow = RoundClock(SyncConfig(inner_steps=8, round=RoundConfig(mode="time")), total_steps=20, virtual_factor=2.0)
    odd = RoundClock(SyncConfig(inner_steps=8, round=RoundConfig(mode="time")), total_steps=20, virtual_factor=3.0)
    assert slow.num_rounds == 3  # ceil(20 / 8): the last round has the budget of 4 steps
    assert [slow.nominal_steps(r) for r in (1, 2, 3)] == [8, 8, 4]
    assert slow.first_steps() == 4 and odd.first_steps() == 2  # floor(8 / 3)
    assert slow.next_steps(3, last_step_s=0.0, reports=None, own_index=0) == 2
    assert odd.next_steps(3, last_step_s=0.0, reports=None, own_index=0) == 2  # 4 / 3 and the 2 / 3 left over
    assert slow.close_round() == 2.0  # what its reports say its step takes, in units


def test_the_fractions_of_steps_carry_over_so_the_steps_average_the_budget():
    odd = RoundClock(SyncConfig(inner_steps=8, round=RoundConfig(mode="time")), total_steps=80, virtual_factor=3.0)
    steps = [odd.first_steps()] + [odd.next_steps(r, last_step_s=0.0, reports=None, own_index=0) for r in range(2, 10)]
    assert steps == [2, 3, 3, 2, 3, 3, 2, 3, 3]  # 8 / 3 a round: 24 steps in 9 rounds
    resumed = RoundClock(SyncConfig(inner_steps=8, round=RoundConfig(mode="time")), total_steps=80, virtual_factor=3.0)
    resumed.load_state_dict(odd.state_dict())
    assert resumed.next_steps(10, last_step_s=0.0, reports=None, own_index=0) == odd.next_steps(
        10, last_step_s=0.0, reports=None, own_index=0
    )


def test_measured_rounds_take_the_fastest_reported_step_time_as_the_budget():
    c = clock()
    assert c.first_steps() == 8  # nothing measured yet
    for seconds in (0.30, 0.30, 0.33):
        c.add_step_time(seconds)
    assert c.close_round() == pytest.approx(0.31)
    assert c.compute_steps == 0  # the next round is timed afresh
    reports = [RoundReport(8, 800, 0.1), RoundReport(8, 800, 0.3), RoundReport(8, 800, 0.2)]
    assert [clock().next_steps(2, last_step_s=9.9, reports=reports, own_index=i) for i in range(3)] == [8, 2, 4]
    # the fastest cluster does exactly the nominal steps whatever its step time's digits
    assert clock().next_steps(2, last_step_s=0, reports=[RoundReport(8, 8, 0.1 + 0.2), None], own_index=0) == 8
    assert clock().next_steps(2, last_step_s=0.3, reports=None, own_index=1) == 8  # no report landed yet
    assert clock().next_steps(3, last_step_s=0.3, reports=reports, own_index=1) == 1  # at least one step


def test_a_fixed_budget_divides_by_the_latest_step_time():
    def steps(round_index: int, step_s: float) -> int:
        return clock(seconds=1.2).next_steps(round_index, last_step_s=step_s, reports=None, own_index=0)

    assert steps(2, 0.1) == 12  # more than H when the budget allows
    assert steps(2, 0.4) == 3
    assert steps(3, 0.1) == 6  # the last round: budget of 4 of 8 steps


def test_progress_follows_the_round_so_a_slow_cluster_finishes_the_schedule():
    c = clock()
    assert [c.progress_step(1, k, 8) for k in range(8)] == [float(k) for k in range(8)]  # an unslowed cluster
    assert [c.progress_step(2, k, 4) for k in range(4)] == [8.0, 10.0, 12.0, 14.0]  # half the steps, same progress
    assert c.progress_step(3, 1, 2) == 18.0  # the last round: 4 nominal steps in 2


def test_the_weighted_factor_counts_the_clusters_kept():
    reports = [RoundReport(8, 800, 1.0), RoundReport(8, 800, 1.0), RoundReport(4, 400, 2.0)]
    # a mean over 3 of (n_c / n_ref) delta_c, times 3 / (1 + 1 + 0.5): sum n_c delta_c / sum n_c
    assert token_weighted_factor(reports, excluded={}, round_tokens=800) == (3 / 2.5, 2.5)
    # the gather reduction left cluster 1 out: its mean is over 2
    assert token_weighted_factor(reports, excluded={1: "outsized"}, round_tokens=800) == (2 / 1.5, 1.5)
    assert token_weighted_factor([RoundReport(8, 0, 1.0)] * 2, excluded={}, round_tokens=800) == (0.0, 0.0)
    assert token_weighted_factor([None, reports[2]], excluded={}, round_tokens=800) == (2 / 1.5, 1.5)


def test_a_robust_aggregate_scales_the_updates_by_the_median_clusters_tokens():
    reports = [RoundReport(8, 800, 1.0), RoundReport(8, 800, 1.0), RoundReport(4, 400, 2.0)]
    # the statistic of (n_c / n_ref) delta_c over 3, divided by the median weight 1: the slow cluster's update at half
    assert token_weighted_factor(reports, excluded={}, round_tokens=800, robust=True) == (1.0, 3.0)
    # equal tokens: the plain statistic of the updates, whatever the round's nominal tokens
    assert token_weighted_factor(reports[2:] * 3, excluded={}, round_tokens=800, robust=True) == (2.0, 1.5)
    # a cluster that claims 1000 rounds' tokens moves the divisor of no one (in a mean: every share / 335)
    liar = [*reports[:2], RoundReport(8, 800_000, 1.0)]
    assert token_weighted_factor(liar, excluded={}, round_tokens=800, robust=True) == (1.0, 3.0)
    assert token_weighted_factor(liar, excluded={}, round_tokens=800)[0] == 3 / 1002
    assert token_weighted_factor(liar, excluded={2: "outsized"}, round_tokens=800, robust=True) == (1.0, 2.0)


def test_a_checkpoint_resumes_only_into_the_round_mode_it_was_written_with(tmp_path):
    steps = load_config(None, ["--topology.num_clusters=3"])
    time_rounds = load_config(None, ["--topology.num_clusters=3", "--sync.round.mode=time"])
    for written, resumed, was, now in (
        (steps, time_rounds, "'steps'", "'time'"),
        (time_rounds, steps, "'time'", "'steps'"),
    ):
        path = tmp_path / f"from_{written.sync.round.mode}"
        path.mkdir()
        write_meta(path, {"step": 8, "config": to_dict(written), "files": {"rank0.pt": {}}})
        check_resume(written, path)  # the same settings resume
        with pytest.raises(ValueError, match=f"sync.round.mode was {was} in the checkpoint, {now} now"):
            check_resume(resumed, path)
    legacy = to_dict(steps)
    del legacy["sync"]["round"]  # written before sync.round.mode existed: step rounds
    path = tmp_path / "legacy"
    path.mkdir()
    write_meta(path, {"step": 8, "config": legacy, "files": {"rank0.pt": {}}})
    check_resume(steps, path)
    with pytest.raises(ValueError, match="sync.round.mode was 'steps'"):
        check_resume(time_rounds, path)
