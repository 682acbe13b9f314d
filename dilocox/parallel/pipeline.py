"""Run one pipeline stage of a cluster with torch.distributed.pipelining, and the two pipeline-wide reductions.

Inside each DiLoCoX cluster (arXiv 2506.21263) the model is cut into `pp_degree` stages joined by the fast
`pp_group`; each rank runs its stage's forward and backward for every microbatch of the step in a GPipe or 1F1B
order, sending activations forward and their gradients back. The loss exists on the last stage only.

Gradient scaling: the schedule is given a per-microbatch loss already divided by `num_microbatches` and built with
`scale_grads=False` (torchtitan does the same). `scale_grads=True` would instead divide every `.grad` of the stage
by the number of microbatches after the backward, including gradients that were there before the step, so the stage
would not accumulate gradients the way `loss.backward()` does.

Activation shapes are given to `PipelineStage` up front (static metadata), so torch skips its dynamic shape inference,
which runs an extra forward and backward of a microbatch at the first step and again after every switch between
`eval_step` and `train_step`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dilocox.config import PIPELINE_SCHEDULES as SCHEDULES  # the schedules `PipelineRunner` accepts
from dilocox.topology import group_size, local_shard

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe


def mean_token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token; logits (batch, seq, vocab) are upcast to fp32 first."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def microbatch_size(batch_size: int, num_microbatches: int) -> int:
    """Sequences per microbatch when a rank's batch of `batch_size` sequences is cut into `num_microbatches`."""
    if not isinstance(num_microbatches, int) or isinstance(num_microbatches, bool) or num_microbatches < 1:
        raise ValueError(f"train.num_microbatches = {num_microbatches!r} must be a positive integer")
    if batch_size % num_microbatches != 0:
        raise ValueError(
            f"train.num_microbatches = {num_microbatches} does not divide the batch of {batch_size} sequences "
            f"(train.micro_batch_size); choose a divisor of {batch_size}"
        )
    return batch_size // num_microbatches


class PipelineRunner:
    """Forward and backward of one pipeline stage over all microbatches of a step (GPipe or 1F1B), with
    `torch.distributed.pipelining` over the cluster's fast `pp_group` (DiLoCoX, arXiv 2506.21263, section 3).

    runner = PipelineRunner(build_stage(args, pp, pp_degree, seed=0), stage_index=pp, num_stages=pp_degree,
                            pp_group=groups.pp_group, schedule="1f1b", num_microbatches=4, microbatch_size=4,
                            seq_len=256, dim=args.dim, vocab_size=args.vocab_size)
    loss = runner.train_step(inputs, targets)  # every stage gets the batch; loss on the last stage, None elsewhere

    With one stage the module runs directly on the whole batch, so callers use one code path for any pp_degree.
    `train_step` adds to `.grad` (like `loss.backward()`) the gradient of the mean token cross-entropy of the batch.
    """

    def __init__(
        self,
        stage_module: nn.Module,
        *,
        stage_index: int,
        num_stages: int,
        pp_group: dist.ProcessGroup | None,
        schedule: str,
        num_microbatches: int,
        microbatch_size: int,
        seq_len: int,
        dim: int,
        vocab_size: int,
    ) -> None:
        if not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"topology.pp_degree = {num_stages!r} must be a positive integer")
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index {stage_index} is outside the {num_stages} pipeline stages")
        if schedule not in SCHEDULES:
            raise ValueError(f"train.pipeline_schedule = {schedule!r} is not one of {', '.join(SCHEDULES)}")
        if not isinstance(num_microbatches, int) or isinstance(num_microbatches, bool) or num_microbatches < 1:
            raise ValueError(f"train.num_microbatches = {num_microbatches!r} must be a positive integer")
        if schedule == "1f1b" and num_microbatches < num_stages:
            raise ValueError(
                f"train.num_microbatches = {num_microbatches} is smaller than topology.pp_degree = {num_stages}: "
                f"the 1F1B schedule needs at least one microbatch per stage; use num_microbatches >= {num_stages} "
                "or the gpipe schedule"
            )
        if not isinstance(microbatch_size, int) or microbatch_size < 1:
            raise ValueError(
                f"microbatch_size = {microbatch_size!r} must be a positive integer: train.micro_batch_size must hold "
                "at least train.num_microbatches sequences"
            )
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"train.seq_len = {seq_len!r} must be a positive integer")
        pp_size = group_size(pp_group)
        if num_stages > 1 and pp_size != num_stages:
            raise ValueError(
                f"topology.pp_degree = {num_stages} but pp_group has {pp_size} ranks; build the groups with "
                "dilocox.topology.build_process_groups for the same topology"
            )
        if num_stages > 1 and dist.get_rank(pp_group) != stage_index:
            raise ValueError(
                f"stage_index {stage_index} must be this rank's index in pp_group ({dist.get_rank(pp_group)}): "
                "stage p of a pipeline runs on its p-th rank"
            )
        self.module = stage_module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.pp_group = pp_group
        self.schedule_name = schedule
        self.num_microbatches = num_microbatches
        self.microbatch_size = microbatch_size
        self.seq_len = seq_len
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self._stage: PipelineStage | None = None
        self._schedule: ScheduleGPipe | Schedule1F1B | None = None
        if num_stages > 1:
            # Imported here, not at the top: torch.distributed.pipelining pulls in dynamo, DTensor and sympy (about
            # 2 s per process on 2 cores), which every launcher, tool and single-stage rank would pay for nothing.
            from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

            self._stage = self._build_stage(dim=dim, vocab_size=vocab_size)
            schedule_class = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
            self._schedule = schedule_class(
                self._stage, n_microbatches=num_microbatches, loss_fn=self._microbatch_loss, scale_grads=False
            )

    @property
    def batch_size(self) -> int:
        """Sequences per step that `train_step` and `eval_step` expect."""
        return self.num_microbatches * self.microbatch_size

    def _build_stage(self, *, dim: int, vocab_size: int) -> PipelineStage:
        from torch.distributed.pipelining import PipelineStage

        params = list(self.module.parameters())
        if not params:
            raise ValueError(f"pipeline stage {self.stage_index} owns no parameters; check the stage split")
        device, dtype = params[0].device, params[0].dtype
        mb, seq = self.microbatch_size, self.seq_len
        # Meta tensors carry only shape, stride, dtype and requires_grad: all torch needs to allocate the receive
        # buffers of activations and gradients without inferring them from a real microbatch.
        with torch.device("meta"):
            if self.is_first:
                example_input = torch.empty(mb, seq, dtype=torch.int64)  # token ids (mb, seq)
            else:
                example_input = torch.empty(mb, seq, dim, dtype=dtype, requires_grad=True)  # (mb, seq, dim)
            width = vocab_size if self.is_last else dim
            example_output = torch.empty(mb, seq, width, dtype=dtype, requires_grad=True)  # (mb, seq, dim | vocab)
        return PipelineStage(
            self.module,
            self.stage_index,
            self.num_stages,
            device,
            input_args=(example_input,),
            output_args=(example_output,),
            group=self.pp_group,
        )

    def _microbatch_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Equal microbatches: the sum over microbatches of their mean loss / M is the mean loss of the whole batch,
        # and so is the sum of the gradients.
        return mean_token_cross_entropy(logits, targets) / self.num_microbatches

    def _check_batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        if inputs.shape != targets.shape or inputs.dim() != 2:
            raise ValueError(
                f"inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} must both be (batch, seq) token ids"
            )
        batch, seq = inputs.shape
        if batch % self.num_microbatches != 0:
            raise ValueError(
                f"train.num_microbatches = {self.num_microbatches} does not divide the batch of {batch} sequences; "
                "choose a divisor of train.micro_batch_size"
            )
        if batch != self.batch_size:
            raise ValueError(
                f"batch of {batch} sequences but the pipeline was built for {self.num_microbatches} microbatches of "
                f"{self.microbatch_size} = {self.batch_size} (train.micro_batch_size); activation buffers have fixed "
                "shapes"
            )
        if seq != self.seq_len:
            raise ValueError(f"sequence length {seq} but the pipeline was built for train.seq_len = {self.seq_len}")

    def _on_device(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch on the stage's device (host batches are copied asynchronously where they are pinned)."""
        device = next(self.module.parameters()).device
        return inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)

    def _run(self, inputs: torch.Tensor, targets: torch.Tensor, *, train: bool) -> float | None:
        assert self._schedule is not None and self._stage is not None  # only called with num_stages > 1
        losses: list[torch.Tensor] = []
        args = (inputs.contiguous(),) if self.is_first else ()
        target = targets.contiguous() if self.is_last else None
        if train:
            self._schedule.step(*args, target=target, losses=losses, return_outputs=False)
        else:
            with torch.no_grad():
                self._schedule.eval(*args, target=target, losses=losses, return_outputs=False)
            # The forward-only pass leaves each microbatch's output cached in the stage until the next step; free it.
            self._stage.clear_runtime_states()
        if not self.is_last:
            return None
        return torch.stack(losses).sum().item()

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        """Forward and backward of the batch (inputs, targets: (batch, seq) int64, the same on every stage).

        Adds to each parameter's `.grad` the gradient of the mean token cross-entropy over the whole batch; returns
        that loss on the last stage and None on the others.
        """
        self._check_batch(inputs, targets)
        inputs, targets = self._on_device(inputs, targets)
        if self.num_stages == 1:
            loss = mean_token_cross_entropy(self.module(inputs), targets)  # logits (batch, seq, vocab)
            loss.backward()
            return loss.item()
        return self._run(inputs, targets, train=True)

    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        """Mean token cross-entropy of the batch without gradients (last stage; None on the others).

        Leaves `.grad` untouched; the next `train_step` re-arms the backward buffers (a small exchange of flags).
        """
        self._check_batch(inputs, targets)
        inputs, targets = self._on_device(inputs, targets)
        if self.num_stages == 1:
            with torch.no_grad():
                return mean_token_cross_entropy(self.module(inputs), targets).item()
        return self._run(inputs, targets, train=False)


def group_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a tensor must live to go through `group`: this rank's GPU for an NCCL group, else the CPU."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_from_last_stage(value: float | None, pp_group: dist.ProcessGroup | None) -> float:
    """The last stage's `value` (e.g. the loss) on every stage of the pipeline; a no-op for a group of one."""
    size = group_size(pp_group)
    is_last = size == 1 or dist.get_rank(pp_group) == size - 1
    if is_last and value is None:
        raise ValueError("broadcast_from_last_stage needs a value on the last stage of the pipeline")
    if size == 1:
        return float(value)
    # float64 so that the logged loss is bit-identical on every stage.
    buffer = torch.tensor([float(value) if is_last else 0.0], dtype=torch.float64, device=group_device(pp_group))
    dist.broadcast(buffer, src=dist.get_global_rank(pp_group, size - 1), group=pp_group)
    return buffer.item()


def clip_grad_norm_(
    params: Iterable[torch.Tensor],
    max_norm: float,
    *,
    pp_group: dist.ProcessGroup | None,
    shard_group: dist.ProcessGroup | None = None,
) -> float:
    """Clip the gradients of a stage so that the whole model's gradient norm is at most `max_norm`.

    The squared norms of the stages are summed over `pp_group`, so every stage scales by the factor that
    `torch.nn.utils.clip_grad_norm_` would apply to the unsplit model. Returns the total norm (before clipping).
    Gradients are the same on every dp replica after their all-reduce, so the pipeline group is enough; a stage
    sharded over the dp ranks (`shard_group`, topology.dp_mode = shard) sums its shards' squares over it first.
    """
    if not max_norm > 0:
        raise ValueError(f"train.grad_clip = {max_norm!r} must be > 0 to clip (0 disables clipping: skip the call)")
    grads = [local_shard(param.grad) for param in params if param.grad is not None]
    # Per-tensor norms in fp32 as torch does, their squares summed in fp64 so that the sum over stages loses nothing.
    squared = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else group_device(pp_group))
    for grad in grads:
        squared += torch.linalg.vector_norm(grad.detach(), 2.0, dtype=torch.float32).double().square()
    for group in (shard_group, pp_group):
        if group_size(group) > 1:
            dist.all_reduce(squared, group=group)
    total_norm = math.sqrt(squared.item())
    # The same coefficient as torch.nn.utils.clip_grad_norm_ (including its 1e-6 guard), clamped to never scale up.
    coefficient = min(max_norm / (total_norm + 1e-6), 1.0)
    if coefficient < 1.0:
        for grad in grads:
            grad.detach().mul_(coefficient)
    return total_norm
