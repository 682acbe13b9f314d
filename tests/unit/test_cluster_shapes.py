"""Clusters of different data-parallel degree (`topology.clusters`, docs/design.md §2.1): ranks, coordinates, data
shards and groups, checked against tables written out by hand; the uniform topology as it always was."""

import pytest

from dilocox.config import load_config
from dilocox.topology import Coords, Topology, parse_cluster_shapes


def test_uniform_topology_keeps_its_rank_order_shards_and_groups():
    topo = Topology(num_clusters=2, dp_degree=2, pp_degree=2)
    assert topo == Topology.of_clusters((2, 2), pp_degree=2) and topo.uniform
    # rank = (cluster * dp_degree + dp) * pp_degree + pp
    assert [topo.rank_of(c, d, p) for c in range(2) for d in range(2) for p in range(2)] == list(range(8))
    assert topo.coords(5) == Coords(cluster=1, dp=0, pp=1)
    assert [topo.shard_index(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert topo.num_shards == 4 and topo.world_size == 8
    assert topo.all_groups() == {
        "pp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "cluster": [[0, 4], [1, 5], [2, 6], [3, 7]],
    }


def test_clusters_of_dp_2_1_1_number_ranks_cluster_major_with_replica_0s_cluster_groups():
    topo = Topology.of_clusters((2, 1, 1), pp_degree=1)
    assert not topo.uniform and topo.world_size == 4 and topo.num_clusters == 3 and topo.dp_degree == 2
    assert [topo.coords(r) for r in range(4)] == [Coords(0, 0, 0), Coords(0, 1, 0), Coords(1, 0, 0), Coords(2, 0, 0)]
    assert [topo.rank_of(c, 0, 0) for c in range(3)] == [0, 2, 3]
    assert [topo.shard_index(r) for r in range(4)] == [0, 1, 2, 3] and topo.num_shards == 4
    assert topo.all_groups() == {
        "pp": [[0], [1], [2], [3]],
        "dp": [[0, 1], [2], [3]],
        "cluster": [[0, 2, 3]],
        "sync": [[0, 2, 3]],  # the ranks that sync: they agree on fit_link's H
    }
    assert [list(topo.ranks_of_cluster(c)) for c in range(3)] == [[0, 1], [2], [3]]
    with pytest.raises(ValueError, match="outside a world of 4"):
        topo.coords(4)


def test_pipelined_clusters_of_dp_2_and_3_sync_each_stage_over_replica_0():
    topo = Topology.of_clusters((2, 3), pp_degree=2)  # ranks 0-3 cluster 0, 4-9 cluster 1
    assert topo.world_size == 10 and topo.num_shards == 5
    assert topo.coords(7) == Coords(cluster=1, dp=1, pp=1)
    assert [topo.shard_index(r) for r in range(10)] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    groups = topo.all_groups()
    assert groups["pp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert groups["dp"] == [[0, 2], [1, 3], [4, 6, 8], [5, 7, 9]]
    assert groups["cluster"] == [[0, 4], [1, 5]]
    assert groups["sync"] == [[0, 1, 4, 5]]


def test_cluster_shapes_parse_in_every_spelling_and_refuse_mixed_pipelines():
    assert parse_cluster_shapes(["pp2xdp2", "dp1xpp2", "dp3"], pp_degree=2) == ((2, 1, 3), 2)
    with pytest.raises(ValueError, match=r"topology.clusters\[1\] = 'pp2x1' is not a cluster shape"):
        parse_cluster_shapes(["pp2xdp1", "pp2x1"], pp_degree=1)
    with pytest.raises(ValueError, match="every cluster needs the same pipeline degree.*data-parallel degree only"):
        parse_cluster_shapes(["pp2xdp2", "pp1xdp1"], pp_degree=1)
    with pytest.raises(ValueError, match="must be >= 1"):
        parse_cluster_shapes(["dp0"], pp_degree=1)


def test_clusters_set_the_global_degrees_over_the_files_and_refuse_a_contradiction():
    cfg = load_config("configs/debug.toml", ["--preset=diloco", "--topology.clusters=pp1xdp2,pp1xdp1,pp1xdp1"])
    cfg.validate(world_size=4)
    t = cfg.topology
    assert (t.num_clusters, t.dp_degree, t.pp_degree, cfg.world_size) == (3, 2, 1, 4)
    assert t.build() == Topology.of_clusters((2, 1, 1))
    # equal shapes are the uniform topology
    equal = load_config("configs/debug.toml", ['--topology.clusters=["dp2xpp2", "pp2xdp2"]'])
    assert equal.topology.build() == Topology(2, 2, 2)
    cases = {
        "--topology.num_clusters=3": "topology.num_clusters = 3 contradicts",
        "--topology.dp_degree=1": "topology.dp_degree = 1 contradicts",
        "--topology.dp_mode=shard": r"\(clusters of different data-parallel degrees\) does not work with topology.dp",
    }
    for flags, message in cases.items():
        cfg = load_config("configs/debug.toml", ["--preset=diloco", "--topology.clusters=dp2,dp1", *flags.split()])
        with pytest.raises(ValueError, match=message):
            cfg.validate()
    # the scalable reduction of every codec it can sum averages replica 0's stages, the low-rank ones too
    for kind in ("int4", "lowrank_int4"):
        flags = ["--topology.clusters=dp2,dp1", f"--compression.kind={kind}", "--compression.reduction=scalable"]
        load_config("configs/debug.toml", ["--preset=diloco", *flags]).validate(world_size=3)
    # an empty entry is refused: `,,` is not an ordinary run, nor `dp2,,dp1` two clusters; nothing given is none
    for flag in ("--topology.clusters=,,", "--topology.clusters=dp2,,dp1", "--topology.clusters=dp2,dp1,"):
        with pytest.raises(ValueError, match=r"topology.clusters = '[dp21,]*' has an empty entry; separate the"):
            load_config("configs/debug.toml", ["--preset=diloco", flag])
    assert load_config("configs/debug.toml", ["--topology.clusters="]).topology.clusters == []
    cfg = load_config("configs/debug.toml", ["--preset=diloco", "--topology.clusters=dp2,dp1"])
    with pytest.raises(ValueError, match=r"started 4 ranks but topology.clusters = \['dp2', 'dp1'\] makes 2 x 1 \+ 1"):
        cfg.validate(world_size=4)
