"""The CocktailSGD baseline: every step's gradients cross the slow link sparse and 4-bit, with error feedback.

sync = CocktailSync(model.parameters(), CocktailConfig(sample_ratio=0.1, topk_ratio=0.01), channel=channel,
                    dp_group=groups.dp_group)
loss.backward(); sync.reduce_gradients(); inner_optimizer.step()
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from dilocox.compress import CocktailConfig, ErrorFeedback
from dilocox.compress.payload import Payload
from dilocox.compress.sparse import SparseInt4Codec
from dilocox.net.channel import WanChannel, ring_all_gather_bytes, ring_all_reduce_bytes
from dilocox.sync.base import FlatParams, RoundStats, StepRounds, dp_mean_, shard_bounds
from dilocox.sync.reducers import gather_slices_
from dilocox.topology import group_size


class CocktailSync(StepRounds):
    """CocktailSGD (Wang et al. 2023, "CocktailSGD: Fine-tuning Foundation Models over 500Mbps Networks", ICML),
    the compressed per-step baseline of DiLoCoX's comparison (arXiv 2506.21263, docs/design.md §6).

    Every step, on each rank (docs/design.md §2 for the groups):
    1. the gradients are averaged over the fast dp_group, and this rank takes its contiguous 1/dp shard;
    2. `corrected = shard + residual` is encoded by `SparseInt4Codec` (shared random sample, top-k, int4) with the
       sync's step counter, which every cluster advances in lockstep, so all draw the same sample;
    3. the payloads are all-gathered over the slow cluster_group (`(C-1) x payload` per rank, exact for any
       codec), every one is decoded and their sum divided by C is this shard's averaged gradient;
    4. `residual = corrected - decoded(own payload)` (`ErrorFeedback`: what this step did not send is sent later);
    5. the averaged shards are all-gathered over the fast dp_group and written into the gradients.

    With a single cluster nothing crosses a slow link, so the gradients pass through exact (steps 2-4 skipped):
    CocktailSGD compresses only to spare the link.
    """

    name = "cocktail"

    def __init__(
        self,
        params,
        cfg: CocktailConfig,
        *,
        channel: WanChannel,
        dp_group: dist.ProcessGroup | None,
        seed: int = 0,
        dp_reduced: bool = False,
    ) -> None:
        """`dp_reduced`: the gradients arrive averaged over `dp_group` already (the trainer's DDP stage)."""
        self.codec = SparseInt4Codec(cfg, seed=seed)  # validates the [cocktail] options
        self.flat = FlatParams(params)
        self.numel = self.flat.numel
        self.channel = channel
        self.dp_group = dp_group
        self.dp_reduced = dp_reduced
        dp_size = group_size(dp_group)
        self.bounds = [shard_bounds(self.flat.numel, dp_size, i) for i in range(dp_size)]  # every replica's shard
        self.shard_start, self.shard_end = self.bounds[dist.get_rank(dp_group) if dp_size > 1 else 0]
        self.feedback = ErrorFeedback(enabled=cfg.error_feedback)  # one residual: this rank's shard, fp32
        self.sync_step = 0  # compressed syncs done: the step of the shared sample, saved for an exact resume
        self.last_step_stats: RoundStats | None = None  # link accounting of this step's exchange
        self.warnings: list[str] = []
        self._checked_cost = False

    @property
    def shard_numel(self) -> int:
        """Values of this rank's shard of the flat gradient (what it puts on the slow link, before compression)."""
        return self.shard_end - self.shard_start

    @property
    def num_clusters(self) -> int:
        return self.channel.world_size

    # ---------------------------------------------------------------------------------------------- protocol
    def reduce_gradients(self) -> None:
        grads = self.flat.gather_grads()  # (numel,)
        if not self.dp_reduced:
            dp_mean_(grads, self.dp_group)  # identical on the dp replicas
        if self.num_clusters == 1:
            self.flat.scatter_grads(grads)
            return
        shard = grads[self.shard_start : self.shard_end]  # (shard,)
        (corrected,) = self.feedback.corrected([shard])
        payload = self.codec.encode(corrected, step=self.sync_step)
        blocked_from = self.channel.clock.now()
        transfer = self.channel.launch_all_gather(payload.data)
        payloads = transfer.wait()  # one (nbytes,) uint8 per cluster, in cluster order; None: its tag failed
        exposed, peer_wait = transfer.split_wait(blocked_from, self.channel.clock.now())
        avg_shard = torch.zeros(self.shard_numel, device=grads.device)  # (shard,) fp32
        for cluster, data in enumerate(payloads):
            if data is None:
                continue
            indices, values = self.codec.decode_sparse(Payload(data), self.shard_numel, step=self.sync_step)
            avg_shard.index_add_(0, indices, values)
            if cluster == self.channel.group_rank:
                # From the bytes, not the values before quantization: the residual must hold exactly what the
                # other clusters did not receive.
                self.feedback.keep([corrected.index_add_(0, indices, values, alpha=-1.0)])
        avg_shard.div_(sum(data is not None for data in payloads))
        self.flat.scatter_grads(gather_slices_(grads, avg_shard, self.bounds, self.dp_group))
        self.sync_step += 1
        self.last_step_stats = RoundStats(
            link_s=transfer.link_s, exposed_s=exposed, bytes_sent=transfer.nbytes_sent, peer_wait_s=peer_wait
        )
        if not self._checked_cost:
            self._checked_cost = True
            self._check_cost(transfer.nbytes_sent)

    def after_inner_step(self, step: int, *, step_s: float = 0.0) -> RoundStats | None:
        self.step = step
        stats, self.last_step_stats = self.last_step_stats, None
        return stats

    def flush(self) -> RoundStats | None:
        return None  # every exchange completes within its step

    def agreed_model(self) -> AbstractContextManager[bool]:
        return nullcontext(False)  # the clusters apply the same averaged gradient every step: always agreed

    def _check_cost(self, nbytes_sent: int) -> None:
        """Warn when the all-gather of payloads sends more than the fp32 all-reduce it replaces (many clusters)."""
        dense_sent, _ = ring_all_reduce_bytes(self.shard_numel, 4, self.num_clusters, self.channel.group_rank)
        if nbytes_sent >= dense_sent:
            self.warnings.append(
                f"warning: CocktailSGD sends {nbytes_sent:,} bytes per step on the slow link, not less than the "
                f"{dense_sent:,} of an fp32 all-reduce: an all-gather of payloads grows with the {self.num_clusters} "
                "clusters; lower cocktail.topk_ratio or use sync.kind = 'allreduce'"
            )

    # ---------------------------------------------------------------------------------------------- accounting
    def payload_nbytes(self) -> int:
        """Exact bytes of this rank's payload each step (0 for a single cluster, which sends nothing)."""
        return 0 if self.num_clusters == 1 else self.codec.expected_nbytes(self.shard_numel)

    def bytes_per_step(self) -> tuple[int, int]:
        """(sent, received) slow-link payload bytes of this rank per step, by the ring all-gather convention.

        Every rank of a cluster_group holds a shard of the same length (same dp index), so all payloads are equal.
        """
        sizes = [self.payload_nbytes() + self.channel.tag_bytes] * self.num_clusters  # a tag counts as payload
        return ring_all_gather_bytes(sizes, self.channel.group_rank)

    # ---------------------------------------------------------------------------------------------- state
    def state_bytes(self) -> int:
        """Bytes of the error-feedback residual (fp32, this rank's shard; 0 without error feedback)."""
        return self.feedback.state_bytes(self.shard_numel)

    def state_dict(self) -> dict[str, Any]:
        return {"feedback": self.feedback.state_dict(), "sync_step": self.sync_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        residuals = state["feedback"]["residuals"]
        if residuals and residuals["0"].numel() != self.shard_numel:
            raise ValueError(
                f"the checkpoint's CocktailSGD residual has {residuals['0'].numel()} values but this rank's shard has "
                f"{self.shard_numel}; resume with the topology it was saved with"
            )
        self.feedback.load_state_dict(state["feedback"])
        self.sync_step = int(state["sync_step"])
