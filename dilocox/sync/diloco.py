"""DiLoCo (Douillard et al. 2023, arXiv 2311.08105) and its one-step-delay form from DiLoCoX (arXiv 2506.21263).

H local steps, then an outer step on the pseudo-gradient averaged over the clusters. With `sync_delay = 0` the
trainer waits for the average (blocking DiLoCo, the "OpenDiLoCo" row of DiLoCoX's table). With `sync_delay = 1`
the sync of round t travels while round t+1 trains and is applied at the end of round t+1, one round stale.

    sync = DiLoCoSync(model.parameters(), channel=channel, dp_group=dp_group, inner_steps=50, sync_delay=1)
    ...inner step...; sync.after_inner_step(step)     # every H steps: launch this round's sync, apply the last one
    sync.flush()                                      # end of training: apply the update still in flight
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist

from dilocox.compress import Codec, ErrorFeedback, compression_ratio
from dilocox.net.channel import WanChannel
from dilocox.sync.base import FlatParams, PendingMean, dp_mean_, launch_cross_cluster_mean
from dilocox.sync.compressed import launch_compressed_mean, relaunch_compressed_mean
from dilocox.sync.scalable import REDUCTIONS, ScalableMean

MERGE_RULES = ("reset", "keep_local")
FIT_HEADROOM = 1.1
"""`fit_link` sizes a round so that its compute is at least this multiple of the last sync's link time."""


class DiLoCoSync:
    """Keeps `outer_params` (phi, fp32) and the outer SGD with Nesterov momentum for this rank's parameters.

    End of round t (DESIGN.md section 3), with `pseudo_grad = round start - theta`:
    - `sync_delay = 0`: wait for `avg_pseudo_grad` of round t, `phi = outer_step(phi, avg)`, theta = phi.
    - `sync_delay = 1`: launch round t's sync, wait for round t-1's (it had all of round t to travel), apply it.
      The merge rule says where round t+1 starts:
      - `reset`: at phi, like every cluster (round t's own progress returns, averaged, one round later);
      - `keep_local`: at phi minus this cluster's round-t pseudo-gradient, so local progress is not thrown away
        while its average is in flight (the idea of eager updates, arXiv 2502.12996, and Streaming DiLoCo,
        arXiv 2501.18512). Clusters then differ by their last round's progress until `flush()`.
    """

    name = "diloco"

    def __init__(
        self,
        params,
        *,
        channel: WanChannel,
        dp_group: dist.ProcessGroup | None,
        inner_steps: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        sync_delay: int = 0,
        merge: str = "reset",
        codec: Codec | None = None,
        error_feedback: bool = True,
        reduction: str = "gather",
        seed: int = 0,
        fit_link: bool = False,
        fit_link_max_steps: int = 0,
        total_steps: int | None = None,
    ) -> None:
        if sync_delay not in (0, 1):
            raise ValueError(f"sync.sync_delay = {sync_delay} must be 0 (blocking) or 1 (one-step delay)")
        if merge not in MERGE_RULES:
            raise ValueError(f"sync.merge = {merge!r} is not one of: {', '.join(MERGE_RULES)}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"compression.reduction = {reduction!r} is not one of: {', '.join(REDUCTIONS)}")
        self.flat = FlatParams(params)
        self.channel = channel
        self.dp_group = dp_group
        self.inner_steps = inner_steps  # H of the round in progress (fit_link may change it between rounds)
        self.base_inner_steps = inner_steps
        if fit_link and sync_delay != 1:
            raise ValueError("compression.fit_link needs sync.sync_delay = 1: it hides a sync behind the next round")
        self.fit_link = fit_link
        self.max_inner_steps = fit_link_max_steps or 8 * inner_steps
        self.round_end = inner_steps  # the step at which the round in progress ends
        self.last_boundary = 0  # the step at which the last round ended
        self.total_steps = total_steps
        self.sync_delay = sync_delay
        self.merge = merge
        self.codec = codec  # None: the fp32 all-reduce; else payloads are gathered and averaged (sync/compressed.py)
        self.feedback = ErrorFeedback(enabled=error_feedback)
        # compression.reduction = "scalable": ~2 x payload per rank for any C (sync/scalable.py), its own feedback
        self.scalable = (
            ScalableMean(codec, error_feedback=error_feedback, seed=seed)
            if codec is not None and reduction == "scalable"
            else None
        )
        self.outer_params = self.flat.gather_data().clone()  # (numel,) fp32, phi
        self.outer_optimizer = torch.optim.SGD(
            [self.outer_params],
            lr=outer_lr,
            momentum=outer_momentum,
            nesterov=nesterov and outer_momentum > 0,  # torch rejects Nesterov without momentum
        )
        self.round_start = self.outer_params.clone()  # theta at the start of the round (phi, except keep_local)
        self.pending: PendingMean | None = None  # the delayed sync, in flight
        self.outer_step = 0  # rounds completed
        self.last_round: dict[str, float] = {}  # link accounting of the sync waited for at the last boundary
        self.warnings: list[str] = []  # for the trainer to print once (the link cannot keep up)
        self._warned = False

    # ---------------------------------------------------------------------------------------------- protocol
    def reduce_gradients(self) -> None:
        self.flat.scatter_grads(dp_mean_(self.flat.gather_grads(), self.dp_group))

    def is_round_boundary(self, step: int) -> bool:
        return step in (self.round_end, self.total_steps) or (step > 0 and step == self.last_boundary)

    def after_inner_step(self, step: int) -> bool:
        if step not in (self.round_end, self.total_steps):
            return False
        self.end_round(step)
        return True

    def end_round(self, step: int) -> None:
        """Launch this round's sync and apply the one that is due (this one when blocking, the last one if delayed).

        Delayed: the last round's sync is waited for before this round's is launched. The link is FIFO, so this
        round's transfer could not start earlier anyway, and the launch then sees everything the last sync left
        behind (error-feedback residuals and shared warm starts of the scalable path)."""
        round_steps = step - self.last_boundary
        pseudo_grad = self.round_start - self.flat.gather_data()  # (numel,) delta = round start - theta
        if self.sync_delay == 0:
            self.apply(self.wait_sync(self.launch_sync(pseudo_grad), round_steps=round_steps))
            theta = self.outer_params
        else:
            due, self.pending = self.pending, None
            if due is not None:
                self.apply(self.wait_sync(due, round_steps=round_steps))
                if self.fit_link:
                    self._fit_inner_steps(round_steps)
            self.pending = self.launch_sync(pseudo_grad)  # pseudo_grad stays intact until the sync is waited for
            theta = self.outer_params - pseudo_grad if self.merge == "keep_local" else self.outer_params
        self.flat.scatter_data(theta)
        self.round_start = theta.clone()
        self.outer_step += 1
        self.last_boundary, self.round_end = step, step + self.inner_steps

    def flush(self) -> None:
        """Apply the sync still in flight; afterwards every cluster holds the same parameters (phi)."""
        if self.pending is None:
            return
        due, self.pending = self.pending, None
        self.apply(self.wait_sync(due))
        self.flat.scatter_data(self.outer_params)
        self.round_start = self.outer_params.clone()

    # ---------------------------------------------------------------------------------------------- steps
    def launch_sync(self, pseudo_grad: torch.Tensor) -> PendingMean:
        """Start averaging a pseudo-gradient over the clusters, compressed by the codec if there is one."""
        if self.codec is None:
            return launch_cross_cluster_mean(pseudo_grad, channel=self.channel, dp_group=self.dp_group)
        if self.scalable is not None:
            return self.scalable.launch(pseudo_grad, shapes=self.flat.shapes, channel=self.channel,
                                        dp_group=self.dp_group)  # fmt: skip
        return launch_compressed_mean(
            pseudo_grad,
            shapes=self.flat.shapes,
            codec=self.codec,
            feedback=self.feedback,
            channel=self.channel,
            dp_group=self.dp_group,
        )

    def relaunch_sync(self, sent: torch.Tensor, *, account: bool) -> PendingMean:
        """Send again what a checkpoint saved of a sync that was in flight (see `state_dict`); not accounted when
        the restored link counters already hold it (it had arrived on this rank before the checkpoint)."""
        if self.codec is None:
            return launch_cross_cluster_mean(sent.clone(), channel=self.channel, dp_group=self.dp_group,
                                             account=account)  # fmt: skip
        if self.scalable is not None:
            return self.scalable.relaunch(sent, self.flat.numel, shapes=self.flat.shapes, channel=self.channel,
                                          dp_group=self.dp_group, account=account)  # fmt: skip
        return relaunch_compressed_mean(
            sent, self.flat.numel, shapes=self.flat.shapes, codec=self.codec, channel=self.channel,
            dp_group=self.dp_group, account=account,
        )  # fmt: skip

    def wait_sync(self, pending: PendingMean, *, round_steps: int | None = None) -> torch.Tensor:
        """The averaged pseudo-gradient of a launched sync, with the link time it took and the part that was hidden.

        `round_steps`: inner steps computed since the sync was launched (this round's H), for the per-round log."""
        round_steps = self.inner_steps if round_steps is None else round_steps
        compute_s = time.perf_counter() - pending.transfer.launch_time
        blocked_from = time.perf_counter()
        avg = pending.wait()
        exposed = time.perf_counter() - blocked_from
        link_s = pending.transfer.link_s
        self.last_round = {
            "round_link_s": link_s,
            "round_exposed_s": exposed,
            "round_hidden_s": max(0.0, link_s - exposed),
            "round_bytes_sent": pending.transfer.nbytes_sent,
            "round_compute_s": compute_s,
            "round_inner_steps": round_steps,
        }
        if pending.info.get("payload_bytes"):  # compressed: what this rank's payload cost and saved
            self.last_round["round_codec_s"] = pending.info["codec_s"]
            self.last_round["round_payload_bytes"] = pending.info["payload_bytes"]
            self.last_round["round_compression_ratio"] = compression_ratio(
                pending.info["payload_bytes"], pending.info["dense_bytes"] // 4
            )
            # bits on the wire per pseudo-gradient value (32 for fp32, ~4.5 for int4 with its scales)
            values = pending.info["dense_bytes"] / 4
            self.last_round["round_bits_per_value"] = 8 * pending.info["payload_bytes"] / values
            current_rank = getattr(self.codec, "current_rank", None)
            if current_rank is not None:
                self.last_round["round_rank"] = current_rank()
        if self.sync_delay == 1 and link_s > compute_s > 0 and not self._warned and not self.fit_link:
            self._warned = True
            self.warnings.append(
                self._slow_link_advice(link_s, compute_s, pending.transfer.nbytes_sent, round_steps=round_steps)
            )
        return avg

    def _fit_inner_steps(self, round_steps: int) -> None:
        """compression.fit_link: choose the next round's H so that the sync launched now, which travels during
        it, fits in its compute with `FIT_HEADROOM`, judged by the sync just waited for (same size, same link).

        Never below the configured H (the user's choice when the link is fast) nor above `max_inner_steps`. Every
        rank measures its own link and step time, so they agree on the largest wish with one 8-byte all-reduce
        over every rank (a control message, not counted as slow-link payload): all clusters and stages must end
        their rounds at the same steps."""
        link_s, compute_s = self.last_round["round_link_s"], self.last_round["round_compute_s"]
        step_s = compute_s / max(1, round_steps)
        needed = math.ceil(FIT_HEADROOM * link_s / step_s) if step_s > 0 else self.inner_steps
        wish = torch.tensor([min(max(needed, self.base_inner_steps), self.max_inner_steps)], dtype=torch.int64)
        if dist.is_initialized():
            dist.all_reduce(wish, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
        self.inner_steps = int(wish.item())
        if needed > self.max_inner_steps and not self._warned:
            self._warned = True
            self.warnings.append(
                f"warning: compression.fit_link wants H = {needed} to hide a {link_s:.2f} s sync behind "
                f"{step_s:.3f} s steps, above compression.fit_link_max_steps = {self.max_inner_steps}; training waits "
                "for the link: raise fit_link_max_steps, compress harder or use a faster link"
            )

    def apply(self, avg_pseudo_grad: torch.Tensor) -> None:
        """One outer step: the averaged pseudo-gradient is the gradient of phi."""
        self.outer_params.grad = avg_pseudo_grad
        self.outer_optimizer.step()
        self.outer_params.grad = None

    def _slow_link_advice(self, link_s: float, compute_s: float, nbytes: int, *, round_steps: int) -> str:
        need_h = math.ceil(round_steps * link_s / compute_s)
        latency = self.channel.latency_s
        fit = (
            f" or network.bandwidth >= {nbytes * 8 * self.channel.num_sharing / (compute_s - latency) / 1e6:,.0f}Mbps"
            if compute_s > latency
            else ""
        )
        return (
            f"warning: the slow link cannot keep up: one outer sync takes {link_s:.2f} s on the link but a round "
            f"computes in {compute_s:.2f} s, so training waits for it; use sync.inner_steps >= {need_h}{fit} "
            "(or compression.fit_link = true to size H to the link as it goes)"
        )

    # ---------------------------------------------------------------------------------------------- state
    def state_bytes(self) -> int:
        """Bytes of the outer state: outer params, momentum, the round start and the delayed sync (all fp32)."""
        vectors = 2 + (self.outer_optimizer.defaults["momentum"] > 0) + (self.sync_delay == 1)
        residuals = sum(r.numel() * 4 for r in self.feedback.residuals or [])
        scalable = 0 if self.scalable is None else self.scalable.state_bytes()
        return 4 * self.flat.numel * vectors + residuals + scalable

    def state_dict(self) -> dict[str, Any]:
        """The outer state, including the delayed sync in flight: not waited for (a checkpoint must not stall the
        overlap) but saved as what this rank sent, which a resumed run sends again (`load_state_dict`), so it
        arrives and is applied at the same step as in an uninterrupted run."""
        return {
            "outer_params": self.outer_params.detach().clone(),
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "round_start": self.round_start.clone(),
            "pending_sent": None if self.pending is None else self.pending.sent.clone(),
            "pending_seq": -1 if self.pending is None else self.pending.transfer.seq,
            "outer_step": self.outer_step,
            "inner_steps": self.inner_steps,
            "round_end": self.round_end,
            "last_boundary": self.last_boundary,
            "feedback": self.feedback.state_dict(),
            "codec": None if self.codec is None else self.codec.state_dict(),
            "scalable": None if self.scalable is None else self.scalable.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self.outer_params.copy_(state["outer_params"])
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.round_start = state["round_start"].clone()
        self.outer_step = int(state["outer_step"])
        self.inner_steps = int(state["inner_steps"])
        self.round_end = int(state["round_end"])
        self.last_boundary = int(state["last_boundary"])
        self.feedback.load_state_dict(state["feedback"])
        if self.codec is not None:
            self.codec.load_state_dict(state["codec"])
        if self.scalable is not None:
            if state.get("scalable") is None:
                raise ValueError(
                    "this checkpoint was written with compression.reduction = 'gather'; resume with the same reduction"
                )
            self.scalable.load_state_dict(state["scalable"])
        # Every rank resumes from the same step and loads in the same order, so the re-sends pair up across
        # clusters. The link counters (restored first) hold the transfer exactly when it had arrived on this rank.
        if state["pending_sent"] is not None:
            counted = state["pending_seq"] < self.channel.num_transfers
            self.pending = self.relaunch_sync(state["pending_sent"], account=not counted)
        else:
            self.pending = None
