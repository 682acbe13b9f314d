"""Parallel degrees -> rank coordinates -> the three process groups of docs/design.md §2.

Ranks are ordered cluster-major: `rank = (cluster * dp_degree + dp) * pp_degree + pp`.

| group           | members                               | link |
| `pp_group`      | same cluster, same dp (the pipeline)  | fast |
| `dp_group`      | same cluster, same pp (the replicas)  | fast |
| `cluster_group` | same dp, same pp, one rank per cluster | slow |

    topo = Topology(num_clusters=2, dp_degree=2, pp_degree=1)
    coords = topo.coords(rank)                  # Coords(cluster=1, dp=0, pp=0)
    groups = build_process_groups(topo, rank)   # every rank must call this, in the same order
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in `group`; None stands for "no group": one process that needs no communication."""
    return 1 if group is None else dist.get_world_size(group)


@dataclass(frozen=True)
class Coords:
    cluster: int
    dp: int
    pp: int


@dataclass(frozen=True)
class Topology:
    num_clusters: int
    dp_degree: int = 1
    pp_degree: int = 1

    def __post_init__(self) -> None:
        for name in ("num_clusters", "dp_degree", "pp_degree"):
            if getattr(self, name) < 1:
                raise ValueError(f"topology.{name} = {getattr(self, name)} must be >= 1")

    @property
    def world_size(self) -> int:
        return self.num_clusters * self.dp_degree * self.pp_degree

    def rank_of(self, cluster: int, dp: int, pp: int) -> int:
        return (cluster * self.dp_degree + dp) * self.pp_degree + pp

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size} ranks")
        pp = rank % self.pp_degree
        dp = (rank // self.pp_degree) % self.dp_degree
        cluster = rank // (self.pp_degree * self.dp_degree)
        return Coords(cluster, dp, pp)

    def shard_index(self, rank: int) -> int:
        """Data shard of a rank: one per (cluster, dp); the stages of one pipeline read the same data."""
        c = self.coords(rank)
        return c.cluster * self.dp_degree + c.dp

    @property
    def num_shards(self) -> int:
        return self.num_clusters * self.dp_degree

    def pp_group_ranks(self, cluster: int, dp: int) -> list[int]:
        return [self.rank_of(cluster, dp, pp) for pp in range(self.pp_degree)]

    def dp_group_ranks(self, cluster: int, pp: int) -> list[int]:
        return [self.rank_of(cluster, dp, pp) for dp in range(self.dp_degree)]

    def cluster_group_ranks(self, dp: int, pp: int) -> list[int]:
        return [self.rank_of(cluster, dp, pp) for cluster in range(self.num_clusters)]

    def all_groups(self) -> dict[str, list[list[int]]]:
        """Every group of each kind, in the fixed order in which all ranks create them."""
        return {
            "pp": [self.pp_group_ranks(c, d) for c in range(self.num_clusters) for d in range(self.dp_degree)],
            "dp": [self.dp_group_ranks(c, p) for c in range(self.num_clusters) for p in range(self.pp_degree)],
            "cluster": [self.cluster_group_ranks(d, p) for d in range(self.dp_degree) for p in range(self.pp_degree)],
        }


@dataclass
class ProcessGroups:
    """The process groups this rank belongs to (created collectively by `build_process_groups`)."""

    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    cluster_group: dist.ProcessGroup


def build_process_groups(
    topo: Topology, rank: int, *, intra_backend: str = "gloo", timeout: datetime.timedelta | None = None
) -> ProcessGroups:
    """Create every pp, dp and cluster group (all ranks call this in the same order) and return this rank's.

    `intra_backend` is the backend of the fast groups inside a cluster (pp, dp): nccl when the ranks compute on
    GPUs. The cluster groups, the slow link, are always gloo: the channel sends host tensors over TCP. `timeout`
    bounds each collective of every group (`network.timeout`; None: the backend's default, 30 min for gloo)."""
    if dist.get_world_size() != topo.world_size:
        raise ValueError(
            f"the process group has {dist.get_world_size()} ranks but the topology needs {topo.world_size} "
            f"({topo.num_clusters} clusters x dp {topo.dp_degree} x pp {topo.pp_degree})"
        )
    mine: dict[str, dist.ProcessGroup] = {}
    for kind, groups in topo.all_groups().items():
        for ranks in groups:
            backend = "gloo" if kind == "cluster" else intra_backend
            group = dist.new_group(ranks=ranks, backend=backend, timeout=timeout)
            if rank in ranks:
                mine[kind] = group
    return ProcessGroups(pp_group=mine["pp"], dp_group=mine["dp"], cluster_group=mine["cluster"])
