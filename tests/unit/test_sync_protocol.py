"""The trainer uses its sync only through the protocols (`SyncStrategy`, and `ElasticSync` for elastic runs), and every
strategy implements them: no attribute reached past the protocol, none probed with getattr."""

import ast
import inspect
from pathlib import Path

import pytest

import dilocox.trainer
from dilocox.sync import AllReduceSync, CocktailSync, ElasticSync, FollowerSync, OuterSync, SyncStrategy

TRAINER = Path(inspect.getsourcefile(dilocox.trainer))


def protocol_members(protocol: type) -> set[str]:
    """The names a Protocol class declares (attributes, properties, methods), with those of its protocol bases."""
    names: set[str] = set()
    for cls in protocol.__mro__:
        if cls in (object,) or not getattr(cls, "_is_protocol", False):
            continue
        names.update(getattr(cls, "__annotations__", {}))
        names.update(name for name, value in vars(cls).items() if callable(value) or isinstance(value, property))
    return {name for name in names if not name.startswith("_")}


def reached_through(source: str, owner: str) -> dict[str, int]:
    """Every attribute `X` of `self.<owner>.X` in `source`, with the line of its first use; and the getattr probes of
    `self.<owner>` (as `getattr:<name>`)."""
    reached: dict[str, int] = {}
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == owner
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "self"
        ):
            reached.setdefault(node.attr, node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            target = node.args[0] if node.args else None
            if isinstance(target, ast.Attribute) and target.attr == owner:
                name = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else "?"
                reached.setdefault(f"getattr:{name}", node.lineno)
    return reached


def test_the_trainer_reaches_nothing_of_its_sync_that_the_protocols_do_not_name():
    allowed = protocol_members(SyncStrategy) | protocol_members(ElasticSync)
    reached = reached_through(TRAINER.read_text(), "sync")
    assert {"after_inner_step", "flush", "rejoin", "status"} <= set(reached)  # the reader sees the trainer's use
    beyond = {name: line for name, line in reached.items() if name not in allowed}
    assert not beyond, f"trainer.py reaches past the sync protocols: {beyond} (name them in SyncStrategy/ElasticSync)"
    # a handful of verbs, and one typed status for everything it reads (docs/design.md §6c)
    assert len(reached) <= 8, sorted(reached)


def test_the_check_catches_a_reach_past_the_protocol_and_a_probe():
    source = "def f(self):\n    self.sync.diloco.elastic.rejoin()\n    getattr(self.sync, 'guard_counts', {})\n"
    assert reached_through(source, "sync") == {"diloco": 2, "getattr:guard_counts": 3}


def assigned_on_self(cls: type) -> set[str]:
    """The attributes a class's methods assign on `self` (`self.x = ...`, `self.x: T = ...`)."""
    names = set()
    for node in ast.walk(ast.parse(inspect.getsource(cls))):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                names.add(target.attr)
    return names


@pytest.mark.parametrize("strategy", [AllReduceSync, CocktailSync, OuterSync, FollowerSync])
def test_every_strategy_implements_the_protocol(strategy):
    missing = protocol_members(SyncStrategy) - {name for name in dir(strategy)} - assigned_on_self(strategy)
    assert not missing, f"{strategy.__name__} lacks {missing}"


def test_the_outer_loop_implements_the_elastic_protocol():
    extra = protocol_members(ElasticSync) - protocol_members(SyncStrategy)
    assert extra == {"rejoin"}  # heals are served by the membership, events and clusters come with the status
    assert all(hasattr(OuterSync, name) and hasattr(FollowerSync, name) for name in extra)
