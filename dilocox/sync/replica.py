"""The replicas of a stage that follow replica 0's outer sync: clusters of different data-parallel degree
(docs/design.md §2.1, §10.1).

Clusters of different dp have no replicas to pair up past replica 0 (neither the static cluster groups nor torchft's
quorums can pair them), so replica 0 of each stage (the leader) is the stage's only rank on the slow link: its sync
(`OuterSync`) averages the whole stage with the other clusters' leaders, each cluster's pseudo-gradient weighted by
its tokens, and after every call the trainer makes of it, it tells the stage's other replicas over the fast dp_group
what the call returned and, when the call wrote the parameters, sends them. Those replicas run `FollowerSync`:
inside a round DDP keeps them equal to the leader, and at the leader's events they take its parameters; an error of
the leader's call is raised on them too.

    mirror = StageMirror(model.parameters(), dp_group)       # on every replica of the stage
    leader:   OuterSync.from_configs(..., mirror=mirror)     # tells the followers after each call
    follower: FollowerSync(mirror, name="dilocox", inner_optimizer=opt)
"""

from __future__ import annotations

import dataclasses
import pickle
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dilocox.sync.base import FlatParams, RoundStats, SyncStatus, clear_non_finite_state


@dataclass
class Told:
    """What one call of the leader's sync did, as its followers take it."""

    value: Any
    """What the call returned (`RoundStats`, a rejoin's (step, phase), or None)."""
    status: SyncStatus | None
    """The leader's status after the call."""
    wrote: bool
    """The call wrote the parameters: they follow the header on the dp_group."""
    healed: bool = False
    """The guard reset the cluster's parameters to the agreed ones (the inner optimizer's non-finite state goes)."""
    error: BaseException | None = None
    """The call failed on the leader with this error: the followers raise it too."""


class StageMirror:
    """The replicas of one stage of a cluster, over its fast `dp_group`: group rank 0 leads, the others follow."""

    def __init__(self, params, dp_group: dist.ProcessGroup) -> None:
        self.flat = FlatParams(params)
        self.group = dp_group
        self.leads = dist.get_rank(dp_group) == 0

    def tell(self, told: Told) -> None:
        """The leader: send `told`, then the parameters if the call wrote them."""
        # a traceback holds the failed call's frames, which do not pickle
        error = None if told.error is None else _bare(told.error)
        dist.broadcast_object_list([dataclasses.replace(told, error=error)], group=self.group, group_src=0)
        if told.wrote:
            dist.broadcast(self.flat.gather_data(), group=self.group, group_src=0)

    def take(self) -> Told:
        """A follower: what the leader's call did, its parameters taken; its error raised."""
        received: list[Any] = [None]
        dist.broadcast_object_list(received, group=self.group, group_src=0)
        told: Told = received[0]
        if told.error is not None:
            raise told.error
        if told.wrote:
            flat = torch.empty(self.flat.numel, device=self.flat.params[0].device)
            dist.broadcast(flat, group=self.group, group_src=0)
            self.flat.scatter_data(flat)
        return told


def _bare(error: BaseException) -> BaseException:
    """`error` without its traceback, as it pickles; a RuntimeError of its line when it cannot be rebuilt."""
    try:
        copy = pickle.loads(pickle.dumps(error))
    except Exception:
        copy = RuntimeError(f"{type(error).__name__}: {error}")
    copy.__traceback__ = copy.__cause__ = copy.__context__ = None
    return copy


class FollowerSync:
    """The trainer's sync on a replica that follows replica 0 of its stage (`StageMirror`): every call takes what
    the leader's call did. It sends nothing over the slow link and keeps no outer state of its own."""

    def __init__(self, mirror: StageMirror, *, name: str, inner_optimizer: torch.optim.Optimizer | None) -> None:
        if mirror.leads:
            raise ValueError("FollowerSync runs on the replicas that follow: this rank leads its stage")
        self.mirror = mirror
        self.name = name
        self.inner_optimizer = inner_optimizer
        self.step = 0
        self._status: SyncStatus | None = None

    def reduce_gradients(self) -> None:
        """Nothing: the replicas' gradients arrive averaged by DDP, as the leader's do."""

    def after_inner_step(self, step: int, *, step_s: float = 0.0) -> RoundStats | None:
        self.step = step
        return self._take().value

    def flush(self) -> RoundStats | None:
        return self._take().value

    def rejoin(self) -> tuple[int, str] | None:
        joined = self._take().value
        if joined is not None:
            self.step = joined[0]
            if self.inner_optimizer is not None:
                self.inner_optimizer.state.clear()
        return joined

    def _take(self) -> Told:
        told = self.mirror.take()
        if told.healed:  # as the leader's `OuterSync._reset_if_healed`
            clear_non_finite_state(self.inner_optimizer)
        assert told.status is not None
        self._status = dataclasses.replace(told.status, numel=self.mirror.flat.numel, state_bytes=0)
        return told

    def status(self) -> SyncStatus:
        if self._status is None:
            raise RuntimeError("a following replica knows its stage's status once the trainer rejoined the run")
        return self._status

    def agreed_model(self) -> AbstractContextManager[bool]:
        raise ValueError("this replica follows replica 0 of its stage and holds no outer params: evaluate on replica 0")

    def state_dict(self) -> dict[str, Any]:
        """Its step and the leader's last status: the outer state is the leader's, which a checkpoint holds once for
        the stage."""
        status = {} if self._status is None else dataclasses.asdict(self._status)
        kept = {key: value for key, value in status.items() if key not in ("messages", "events")}
        return {"num_steps": self.step, "follows": kept}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "follows" not in state:
            raise ValueError(
                "this checkpoint's outer-sync state is not a following replica's (another topology, or clusters of "
                "different dp saved before replica 0 synced for its cluster): resume it with the topology and version "
                "it was saved with, or start a new run"
            )
        self.step = int(state["num_steps"])
        if state["follows"]:
            self._status = SyncStatus(**state["follows"], messages=[])

    def close(self, *, cancel: bool = False) -> None:
        """Nothing to stop: no channel of its own."""
