"""What a round leaves behind does not pile up: the outer sync's memory and its checkpointed state stay the same size
round after round (benchmarks/memory_soak.py measures the processes of a long run)."""

import gc

import torch

from dilocox.compress import CompressionConfig
from dilocox.net.channel import WanChannel
from dilocox.sync import DiLoCoSync, SyncConfig
from dilocox.sync.reducers import PendingMean


def _tensor_shapes(state: object, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """The shape of every tensor in a nested state, by its path."""
    if isinstance(state, torch.Tensor):
        return {prefix: tuple(state.shape)}
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in _tensor_shapes(value, f"{prefix}/{key}").items()}
    if isinstance(state, list):
        return {k: v for i, value in enumerate(state) for k, v in _tensor_shapes(value, f"{prefix}/{i}").items()}
    return {}


def test_rounds_leave_no_cyclic_garbage_and_a_state_of_the_same_size():
    """One cluster, the adaptive codec with error feedback, the one-step delay, 40 rounds with the cyclic garbage
    collector off: every finished round's PendingMean (with the pseudo-gradient and payloads it holds) is freed by
    reference counting as soon as it is applied, so at most the one in flight exists; the codec keeps the decisions of
    its last `window` rounds, and the sync's state has the same tensors of the same shapes at round 8 as at round 40."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 16), torch.nn.Linear(16, 8))
    cfg = SyncConfig(kind="dilocox", inner_steps=1, sync_delay=1)
    compression = CompressionConfig(kind="adaptive", rank_min=1, rank_max=6, window=3)
    shapes = {}
    with WanChannel(None, bandwidth=None, latency_s=0.0) as channel:
        sync = DiLoCoSync(model.parameters(), cfg, compression, channel=channel, dp_group=None)
        gc.collect()
        # PendingMeans another test of this worker process still holds are not this sync's rounds
        before = [o for o in gc.get_objects() if type(o) is PendingMean]
        gc.disable()
        try:
            for step in range(1, 41):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.01 * torch.randn_like(p))
                sync.after_inner_step(step)
                if step in (2, 8, 40):
                    alive = sum(type(o) is PendingMean and all(o is not b for b in before) for o in gc.get_objects())
                    assert alive == 1, (step, alive)  # the round just launched; none of the earlier ones
                    shapes[step] = _tensor_shapes(sync.state_dict())
        finally:
            gc.enable()
        policy = sync.fragments[0].reducer.codec.policy
        assert policy.rounds == 40 and [d.round for d in policy.history] == [37, 38, 39]
    assert shapes[8] == shapes[40]
    assert shapes[40]["/fragments/0/reducer/codec/policy/history"] == (3, 4)
    assert shapes[40]["/fragments/0/reducer/codec/policy/matrix_ranks"] == (3, 2, 2)
