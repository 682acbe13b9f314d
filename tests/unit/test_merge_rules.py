"""The merge rules (`dilocox.sync.merge`): one class per `sync.merge`, each where docs/design.md §3 says it starts.

Checked on small vectors with plain averaging (where every rule has a closed form) and with the paper's Nesterov
SGD (where the predicting rules take the outer optimizer's own step: `OuterOptimizer.predict`)."""

import functools

import pytest
import torch

from dilocox.sync.config import MERGE_RULES
from dilocox.sync.merge import RULES, InFlight, build_merge_rule
from dilocox.sync.outer_optimizer import OuterOptimizer

C = 4
PHI = torch.tensor([1.0, -2.0, 0.5, 3.0])
G = torch.tensor([0.4, 0.2, -0.8, 1.2])  # this cluster's round-t pseudo-gradient
HELD_BEFORE = torch.tensor([0.1, 0.0, -0.1, 0.3])
HELD_AFTER = torch.tensor([0.05, 0.1, 0.0, -0.2])


def flight(factory=None, *, held: bool = False, reads: list | None = None, decay: float = 1.0) -> InFlight:
    phi = PHI.clone()
    outer = OuterOptimizer(phi, factory or (lambda p: torch.optim.SGD(p, lr=1.0)), lr_at=lambda base, k: base)

    def read_held_after():
        if reads is not None:
            reads.append(1)
        return HELD_AFTER.clone()

    return InFlight(
        phi,
        G.clone(),
        num_clusters=C,
        predict=functools.partial(outer.predict, update=0),
        held_before=HELD_BEFORE.clone() if held else None,
        read_held_after=read_held_after,
        feedback_decay=decay,
    )


def test_one_class_per_merge_setting_each_citing_its_source():
    assert tuple(RULES) == MERGE_RULES
    for name, rule in RULES.items():
        assert rule.name == name and "arXiv" in rule.__doc__, name
    with pytest.raises(ValueError, match="sync.merge = 'late' is not one of: reset, keep_local"):
        build_merge_rule("late")


def test_the_starts_under_plain_averaging():
    f = flight()
    assert build_merge_rule("reset").start(f) is f.outer_params  # phi itself: the round start is a copy of it
    assert torch.equal(build_merge_rule("keep_local").start(f), PHI - G)
    assert torch.equal(build_merge_rule("eager").start(f), PHI - G / C)
    assert torch.equal(build_merge_rule("lookahead").start(f), PHI - G)  # plain averaging: keep_local
    # own_payload before anything was held back: where eager starts; then on what its codec sent
    assert torch.equal(build_merge_rule("own_payload").start(f), PHI - G / C)
    sent = G + HELD_BEFORE - HELD_AFTER / 0.5
    assert torch.equal(build_merge_rule("own_payload").start(flight(held=True, decay=0.5)), PHI - sent)


def test_the_predicting_rules_take_the_outer_optimizers_step_with_its_momentum():
    nesterov = lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True)  # noqa: E731
    f = flight(nesterov)
    # the first outer step of torch's SGD: buf = g, phi - lr (g + m g)
    torch.testing.assert_close(build_merge_rule("lookahead").start(f), PHI - 0.7 * 1.9 * G, rtol=0, atol=1e-6)
    torch.testing.assert_close(build_merge_rule("eager").start(f), PHI - 0.7 * 1.9 * G / C, rtol=0, atol=1e-6)
    assert torch.equal(f.outer_params, PHI)  # phi is never moved by a prediction


def test_what_the_local_residual_keeps_out_of_each_start():
    reads: list = []
    f = flight(held=True, reads=reads)
    for name in ("reset", "keep_local", "eager", "lookahead"):
        assert torch.equal(build_merge_rule(name).held_share(f), HELD_BEFORE), name  # round t carries it
    assert reads == []  # none of them reads what the codec holds after the encoding (a collective over dp)
    own = build_merge_rule("own_payload")
    own.start(f)
    assert torch.equal(own.held_share(f), HELD_AFTER)  # it counted all of the rest as not sent
    assert len(reads) == 1  # read once for the start and the share
    assert own.held_share(flight()) is None  # nothing held before: as eager, nothing kept out
    assert [r.reads_held_back for r in RULES.values()] == [False, False, False, False, True]
