"""DiLoCo (Douillard et al. 2023, arXiv 2311.08105; OpenDiLoCo): H local steps, then an outer step on the
averaged pseudo-gradient. This is the blocking form (`sync_delay = 0`), the "OpenDiLoCo" row of DiLoCoX's table.

    sync = DiLoCoSync(model.parameters(), channel=channel, dp_group=dp_group, inner_steps=50)
    ...inner step...; sync.after_inner_step(step)     # every H steps: outer sync + outer step
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dilocox.net.channel import WanChannel
from dilocox.sync.base import FlatParams, dp_mean_, launch_cross_cluster_mean


class DiLoCoSync:
    """Keeps `outer_params` (phi, fp32) and the outer SGD with Nesterov momentum for this rank's parameters.

    End of round t (DESIGN.md section 3): `pseudo_grad = phi - theta`, averaged over the clusters (sharded over
    the dp replicas), fed as the gradient of phi to the outer optimizer, and theta = phi for the next round.
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
        total_steps: int | None = None,
    ) -> None:
        self.flat = FlatParams(params)
        self.channel = channel
        self.dp_group = dp_group
        self.inner_steps = inner_steps
        self.total_steps = total_steps
        self.outer_params = self.flat.gather_data().clone()  # (numel,) fp32, phi
        self.outer_optimizer = torch.optim.SGD(
            [self.outer_params],
            lr=outer_lr,
            momentum=outer_momentum,
            nesterov=nesterov and outer_momentum > 0,  # torch rejects Nesterov without momentum
        )
        self.outer_step = 0

    def reduce_gradients(self) -> None:
        self.flat.scatter_grads(dp_mean_(self.flat.gather_grads(), self.dp_group))

    def is_round_boundary(self, step: int) -> bool:
        return step % self.inner_steps == 0 or step == self.total_steps

    def after_inner_step(self, step: int) -> bool:
        if not self.is_round_boundary(step):
            return False
        self.outer_sync()
        return True

    def outer_sync(self) -> None:
        """Average this round's pseudo-gradient over the clusters and take one outer step; theta = phi after."""
        pseudo_grad = self.outer_params - self.flat.gather_data()  # (numel,) delta = phi - theta
        avg_pseudo_grad = launch_cross_cluster_mean(pseudo_grad, channel=self.channel, dp_group=self.dp_group).wait()
        self.outer_params.grad = avg_pseudo_grad
        self.outer_optimizer.step()
        self.outer_params.grad = None
        self.flat.scatter_data(self.outer_params)
        self.outer_step += 1

    def flush(self) -> None:
        pass  # blocking: nothing is ever pending after a round boundary; the last step is always a boundary

    def state_dict(self) -> dict[str, Any]:
        return {
            "outer_params": self.outer_params.detach().clone(),
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "outer_step": self.outer_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self.outer_params.copy_(state["outer_params"])
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.outer_step = int(state["outer_step"])
