"""`topology.dp_mode = replicate` with dp > 1: the stage in DDP (`replicate_stage`), on 2 real gloo ranks.

Checked: after one backward through the wrapper, every replica holds the mean of the two replicas' gradients, bit
for bit what the hand-written mean (`dp_mean_` of the flat gradient, which `OuterSync` still does in a user's loop
without DDP) gives; and from the second step on the reduction overlaps the backward: the first bucket (the last
layers' gradients) is all-reduced while the embedding's gradient, the last one the backward computes, does not exist
yet.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from dilocox.models import model_args
from dilocox.parallel import build_stage
from dilocox.parallel.fsdp import replicate_stage
from dilocox.parallel.pipeline import mean_token_cross_entropy
from dilocox.sync.base import FlatParams, dp_mean_
from tests.multiproc import run_ranks

pytestmark = pytest.mark.dist


def _worker(rank: int, world_size: int) -> dict:
    args = model_args("debug", 4096, max_seq_len=64)  # 2.4 MB of gradients: more than DDP's first bucket of 1 MiB
    batch = torch.randint(4096, (4, 65), generator=torch.Generator().manual_seed(rank))  # each replica its own data
    inputs, targets = batch[:, :-1], batch[:, 1:]

    reference = build_stage(args, 0, 1, seed=0)
    mean_token_cross_entropy(reference(inputs), targets).backward()
    flat = FlatParams(list(reference.parameters()))
    expected = dp_mean_(flat.gather_grads(), dist.group.WORLD)  # (numel,) the hand-written mean

    model = build_stage(args, 0, 1, seed=0)
    stage = replicate_stage(model, dist.group.WORLD)
    embedding = model.tok_embeddings.weight
    launched_before_embedding_grad = []

    def recording_hook(state, bucket):
        launched_before_embedding_grad.append(embedding.grad is None)
        return allreduce_hook(state, bucket)

    stage.register_comm_hook(None, recording_hook)
    for _ in range(2):  # DDP's first backward is one bucket; then it buckets in the order the gradients came
        launched_before_embedding_grad.clear()
        model.zero_grad(set_to_none=True)
        mean_token_cross_entropy(stage(inputs), targets).backward()
    got = FlatParams(list(model.parameters())).gather_grads()
    return {"equal": torch.equal(got, expected), "buckets": launched_before_embedding_grad}


def test_ddp_replicas_hold_the_hand_written_mean_and_reduce_during_the_backward():
    for result in run_ranks(_worker, 2):
        assert result["equal"]
        assert len(result["buckets"]) >= 2 and result["buckets"][0] and not result["buckets"][-1]
