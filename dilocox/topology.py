"""Parallel degrees -> rank coordinates -> the process groups of docs/design.md §2.

Ranks are ordered cluster-major: cluster c's ranks start at `sum(dp_{c'} for c' < c) x pp_degree`, and inside a
cluster `rank = first + dp * pp_degree + pp`; with equal clusters that is `(cluster * dp_degree + dp) * pp_degree + pp`.

| group           | members                               | link |
| `pp_group`      | same cluster, same dp (the pipeline)  | fast |
| `dp_group`      | same cluster, same pp (the replicas)  | fast |
| `cluster_group` | same dp, same pp, one rank per cluster | slow |

Clusters may differ in data-parallel degree (`topology.clusters`, docs/design.md §2.1): then replica 0 of each stage
syncs the whole stage for its cluster, and only replica 0's cluster groups exist (the other replicas follow it over
the dp_group, `dilocox.sync.replica`).

    topo = Topology(num_clusters=2, dp_degree=2, pp_degree=1)
    coords = topo.coords(rank)                  # Coords(cluster=1, dp=0, pp=0)
    groups = build_process_groups(topo, rank)   # every rank must call this, in the same order
    mixed = Topology.of_clusters((2, 1, 1), pp_degree=1)   # 4 ranks; ranks 0, 2 and 3 form the cluster group
"""

from __future__ import annotations

import bisect
import datetime
import functools
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

_SHAPE = re.compile(r"pp(?P<pp>\d+)xdp(?P<dp>\d+)|dp(?P<dp2>\d+)xpp(?P<pp2>\d+)|dp(?P<dp3>\d+)")


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in `group`; None stands for "no group": one process that needs no communication."""
    import torch.distributed as dist  # here, not at the top: the config reads this module without torch

    return 1 if group is None else dist.get_world_size(group)


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor of its stage: a DTensor's local shard (`topology.dp_mode = shard`, the dim-0
    shard FSDP keeps on this dp rank, sharing its storage), else the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def fsdp_rows(rows: int, dp: int, index: int) -> tuple[int, int]:
    """The dim-0 rows (start, end) that replica `index` of `dp` holds of a tensor of `rows` rows, as FSDP2 cuts it
    (`torch.chunk`: ceil(rows / dp) each, the last ones short or empty)."""
    chunk = -(-rows // dp)
    start = min(index * chunk, rows)
    return start, min(start + chunk, rows)


def parse_cluster_shapes(shapes: Sequence[str], *, pp_degree: int) -> tuple[tuple[int, ...], int]:
    """`topology.clusters` -> (each cluster's data-parallel degree, the common pipeline degree).

    A shape is "pp{P}xdp{D}", "dp{D}xpp{P}" or "dp{D}" (pp from `pp_degree`, topology.pp_degree). Raises a ValueError
    naming the bad entry for an unknown shape, a degree below 1, or clusters of different pipeline degrees."""
    dp_degrees, pps = [], []
    for index, shape in enumerate(shapes):
        match = _SHAPE.fullmatch(shape.strip().lower()) if isinstance(shape, str) else None
        if match is None:
            raise ValueError(
                f'topology.clusters[{index}] = {shape!r} is not a cluster shape: write "pp{{P}}xdp{{D}}" (e.g. '
                f'"pp2xdp1"), "dp{{D}}xpp{{P}}" or "dp{{D}}" (pp from topology.pp_degree)'
            )
        dp = int(match["dp"] or match["dp2"] or match["dp3"])
        pp = int(match["pp"] or match["pp2"] or pp_degree)
        if dp < 1 or pp < 1:
            raise ValueError(f"topology.clusters[{index}] = {shape!r}: the degrees must be >= 1")
        dp_degrees.append(dp)
        pps.append(pp)
    if not dp_degrees:
        raise ValueError("topology.clusters is empty: list one shape per cluster, or leave it out (num_clusters)")
    if len(set(pps)) > 1:
        each = ", ".join(f"cluster {c} pp {pp}" for c, pp in enumerate(pps))
        raise ValueError(
            f"topology.clusters = {list(shapes)}: every cluster needs the same pipeline degree: {each}; clusters may "
            "differ in data-parallel degree only"
        )
    return tuple(dp_degrees), pps[0]


@dataclass(frozen=True)
class Coords:
    cluster: int
    dp: int
    pp: int


@dataclass(frozen=True)
class Topology:
    num_clusters: int
    dp_degree: int = 1
    """Data-parallel degree of every cluster; where clusters differ (`dp_degrees`), the largest."""
    pp_degree: int = 1
    dp_degrees: tuple[int, ...] = ()
    """Each cluster's data-parallel degree; () means `dp_degree` for every cluster (`of_clusters` sets it)."""

    def __post_init__(self) -> None:
        for name in ("num_clusters", "dp_degree", "pp_degree"):
            if getattr(self, name) < 1:
                raise ValueError(f"topology.{name} = {getattr(self, name)} must be >= 1")
        if not self.dp_degrees:
            object.__setattr__(self, "dp_degrees", (self.dp_degree,) * self.num_clusters)
        object.__setattr__(self, "dp_degrees", tuple(int(d) for d in self.dp_degrees))
        if len(self.dp_degrees) != self.num_clusters or min(self.dp_degrees) < 1:
            raise ValueError(
                f"dp_degrees = {self.dp_degrees} must hold one degree >= 1 for each of the {self.num_clusters} clusters"
            )
        if self.dp_degree != max(self.dp_degrees):
            raise ValueError(f"dp_degree = {self.dp_degree} must be the largest of dp_degrees = {self.dp_degrees}")

    @classmethod
    def of_clusters(cls, dp_degrees: Sequence[int], pp_degree: int = 1) -> Topology:
        """Clusters of data-parallel degrees `dp_degrees` (equal ones give the uniform topology) and one pp."""
        degrees = tuple(dp_degrees)
        if not degrees:
            raise ValueError("a topology needs at least one cluster")
        return cls(len(degrees), max(degrees), pp_degree, degrees)

    @property
    def uniform(self) -> bool:
        """Every cluster has the same data-parallel degree (every replica syncs its slice of the stage; else replica 0
        syncs the whole stage)."""
        return len(set(self.dp_degrees)) == 1

    @functools.cached_property
    def _first_replica(self) -> tuple[int, ...]:
        """Replicas (data shards) before each cluster's, and their total last."""
        return tuple(itertools.accumulate(self.dp_degrees, initial=0))

    @property
    def world_size(self) -> int:
        return self.num_shards * self.pp_degree

    def ranks_of_cluster(self, cluster: int) -> range:
        """The global ranks of `cluster`, consecutive (dp_c x pp of them)."""
        first = self._first_replica[cluster] * self.pp_degree
        return range(first, first + self.dp_degrees[cluster] * self.pp_degree)

    def rank_of(self, cluster: int, dp: int, pp: int) -> int:
        return (self._first_replica[cluster] + dp) * self.pp_degree + pp

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size} ranks")
        pp = rank % self.pp_degree
        replica = rank // self.pp_degree
        cluster = bisect.bisect_right(self._first_replica, replica) - 1
        return Coords(cluster, replica - self._first_replica[cluster], pp)

    def shard_index(self, rank: int) -> int:
        """Data shard of a rank: one per (cluster, dp), numbered cluster-major; the stages of one pipeline read the
        same data."""
        c = self.coords(rank)
        return self._first_replica[c.cluster] + c.dp

    @property
    def num_shards(self) -> int:
        """Data shards: every replica of every cluster (sum of the dp degrees)."""
        return self._first_replica[-1]

    def pp_group_ranks(self, cluster: int, dp: int) -> list[int]:
        return [self.rank_of(cluster, dp, pp) for pp in range(self.pp_degree)]

    def dp_group_ranks(self, cluster: int, pp: int) -> list[int]:
        return [self.rank_of(cluster, dp, pp) for dp in range(self.dp_degrees[cluster])]

    def cluster_group_ranks(self, dp: int, pp: int) -> list[int]:
        return [self.rank_of(cluster, dp, pp) for cluster in range(self.num_clusters)]

    def describe(self) -> str:
        """`2 clusters x dp 2 x pp 1`, or `3 clusters of dp 2, 1, 1 x pp 1` where they differ."""
        if self.uniform:
            return f"{self.num_clusters} clusters x dp {self.dp_degree} x pp {self.pp_degree}"
        return f"{self.num_clusters} clusters of dp {', '.join(map(str, self.dp_degrees))} x pp {self.pp_degree}"

    def all_groups(self) -> dict[str, list[list[int]]]:
        """Every group of each kind, in the fixed order in which all ranks create them: pp, dp and the slow cluster
        groups; where the clusters' dp degrees differ, replica 0's only (it syncs the stage for its cluster), and the
        group of every replica 0, the ranks that sync."""
        groups = {
            "pp": [self.pp_group_ranks(c, d) for c in range(self.num_clusters) for d in range(self.dp_degrees[c])],
            "dp": [self.dp_group_ranks(c, p) for c in range(self.num_clusters) for p in range(self.pp_degree)],
            "cluster": [
                self.cluster_group_ranks(d, p)
                for d in range(self.dp_degree if self.uniform else 1)
                for p in range(self.pp_degree)
            ],
        }
        if not self.uniform:
            groups["sync"] = [[self.rank_of(c, 0, p) for c in range(self.num_clusters) for p in range(self.pp_degree)]]
        return groups


@dataclass
class ProcessGroups:
    """The process groups this rank belongs to (created collectively by `build_process_groups`)."""

    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    cluster_group: dist.ProcessGroup | None
    """The slow link: one rank per cluster; None on the replicas that follow their replica 0 (clusters of different
    dp degrees)."""
    sync_group: dist.ProcessGroup | None = None
    """Clusters of different dp degrees: every replica 0 of every stage, the ranks that sync (they agree on
    `sync.round.fit_link`'s H); None where every rank syncs, or on a following replica."""


def build_process_groups(
    topo: Topology, rank: int, *, intra_backend: str = "gloo", timeout: datetime.timedelta | None = None
) -> ProcessGroups:
    """Create every pp, dp and cluster group (all ranks call this in the same order) and return this rank's.

    `intra_backend` is the backend of the fast groups inside a cluster (pp, dp): nccl when the ranks compute on
    GPUs. The cluster groups, the slow link, are always gloo: the channel sends host tensors over TCP. `timeout`
    bounds each collective of every group (`network.timeout`; None: the backend's default, 30 min for gloo)."""
    import torch.distributed as dist

    if dist.get_world_size() != topo.world_size:
        raise ValueError(
            f"the process group has {dist.get_world_size()} ranks but the topology needs {topo.world_size} "
            f"({topo.describe()})"
        )
    mine: dict[str, dist.ProcessGroup] = {}
    for kind, groups in topo.all_groups().items():
        for ranks in groups:
            backend = "gloo" if kind in ("cluster", "sync") else intra_backend
            group = dist.new_group(ranks=ranks, backend=backend, timeout=timeout)
            if rank in ranks:
                mine[kind] = group
    return ProcessGroups(mine["pp"], mine["dp"], mine.get("cluster"), mine.get("sync"))
