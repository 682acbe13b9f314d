"""What an elastic launcher and its ranks tell each other (docs/design.md §10.1): the `ClusterBoard` of cluster
statuses, shared with the processes the launcher forks, and the lines ranks leave in the launcher's store."""

import datetime
import multiprocessing

import torch.distributed as dist

from dilocox.launch.processes import first_user_error, report_user_error
from dilocox.launch.status import ClusterBoard, ClusterStatus
from dilocox.net.listen import LOOPBACK, serve_store


def test_the_board_names_a_restart_until_it_joins_and_whether_it_asked():
    board = ClusterBoard(3)
    assert board.get(2) is None  # never started by this launcher (another machine's cluster)
    for cluster in range(3):
        board.set(cluster, ClusterStatus.STARTING)
    assert board.restarts_in_progress() == {}  # first starts are not restarts: the first quorum waits for them
    board.set(0, ClusterStatus.JOINED)
    board.set(2, ClusterStatus.RESTARTING)
    assert board.restarts_in_progress() == {2: False}
    board.set(2, ClusterStatus.REJOINING)  # just before it asks the Lighthouse for its first quorum
    assert board.restarts_in_progress() == {2: True}
    board.set(2, ClusterStatus.JOINED)  # it healed in a quorum with its peers
    assert board.restarts_in_progress() == {}


def test_a_restart_stays_on_its_way_until_the_launcher_gives_up_on_it():
    board = ClusterBoard(2)
    board.set(1, ClusterStatus.RESTARTING)
    board.set(1, ClusterStatus.REJOINING)
    board.set(1, ClusterStatus.NO_LIVE_PEER)  # reported by its ranks as they exit
    assert board.restarts_in_progress() == {1: True}
    board.set(1, ClusterStatus.LOST)  # the launcher's decision: the others stop waiting for it
    assert board.restarts_in_progress() == {}
    assert board.get(1) is ClusterStatus.LOST


def _rejoin(board: ClusterBoard, cluster: int) -> None:
    if board.restarts_in_progress() != {cluster: False}:  # the launcher's mark, seen from the forked process
        raise SystemExit(1)
    board.set(cluster, ClusterStatus.REJOINING)


def test_a_status_written_by_a_forked_process_is_seen_by_the_launcher_at_once():
    board = ClusterBoard(3)
    board.set(1, ClusterStatus.RESTARTING)
    process = multiprocessing.get_context("forkserver").Process(target=_rejoin, args=(board, 1))
    process.start()
    process.join(timeout=120)
    assert process.exitcode == 0
    assert board.get(1) is ClusterStatus.REJOINING
    assert board.restarts_in_progress() == {1: True}


def test_a_status_line_and_the_lowest_ranks_user_error_come_through_the_store():
    timeout = datetime.timedelta(seconds=30)
    served = serve_store(LOOPBACK, timeout)  # the launcher's end
    rank_end = dist.TCPStore(LOOPBACK, served.port, None, is_master=False, timeout=timeout)
    assert first_user_error(served, range(4)) is None
    report_user_error(rank_end, 3, "train.lr = -1 must be positive")
    report_user_error(rank_end, 1, "sync.min_clusters = 3 is more than topology.num_clusters = 2")
    assert first_user_error(served, range(4)) == "sync.min_clusters = 3 is more than topology.num_clusters = 2"
    assert first_user_error(served, range(2, 4)) == "train.lr = -1 must be positive"

    board = ClusterBoard(2)
    board.report(
        1, ClusterStatus.NO_LIVE_PEER, "cluster 1 was started again, but no other cluster is alive", store=rank_end
    )
    assert board.get(1) is ClusterStatus.NO_LIVE_PEER
    assert ClusterBoard.message(served) == "cluster 1 was started again, but no other cluster is alive"
