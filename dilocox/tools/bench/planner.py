"""An analytic model of one training round: projected tokens/s of AllReduce, DiLoCo and DiLoCoX at any scale.

DiLoCoX (Qi et al. 2025, arXiv 2506.21263) reports its throughput for a 107B model on 160 A800 GPUs joined by a
1 Gbps link, a setting that cannot be run here. This module turns a model size, a topology, a GPU, a batch and the
links into the time of one round of `inner_steps` (H) steps for each strategy, so that such settings can be
projected, compared with the paper's measured numbers, and scaled down faithfully (`paper_regime_bandwidth`).

    inp = paper_107b_input()                           # the paper's setting, as far as it is known (docs/planner.md)
    result = plan(inp)
    result.tokens_per_s("dilocox"), result.strategies["allreduce"].breakdown()

The model, per strategy (G GPUs = clusters x dp x tp x pp, T tokens per step, N parameters, H steps per round):

- compute of one step: `6 N T / (G * peak_flops * mfu)`, stretched by the pipeline bubble of GPipe / 1F1B, which
  idles a fraction `(pp - 1) / (m + pp - 1)` of the step for m microbatches;
- intra-cluster all-reduce of each stage's gradient over the dp replicas (fast links), every step, not overlapped;
- the slow link: a cluster's ranks all send at once, so a cluster pushes its whole share through its uplink(s):
  `2 (C-1)/C x bytes` for a ring all-reduce across C clusters (`dilocox.net.link` counts the same bytes per rank),
  in `bytes / uplink_bandwidth + latency` (one latency per collective, as the link emulation charges). The uplink is
  one per node (`slow_link_scope="node"`: the GPUs of a node share its link) or one per cluster ("cluster");
- AllReduce: every step, the gradient (`grad_bytes_per_element`, bf16 by default) crosses the slow link, blocking;
- DiLoCo (OpenDiLoCo): data parallel only, so one GPU must hold the model and its optimizer state; every H steps
  the uncompressed pseudo-gradient crosses the slow link, blocking;
- DiLoCoX: the same pipeline layout as AllReduce; every H steps the pseudo-gradient, compressed `compression_ratio`
  times relative to fp32, crosses the slow link; with the one-step delay it overlaps the next round and only
  `max(0, T_comm - H * T_step)` is exposed, without it all of `T_comm` is.

Not modeled: activation traffic between pipeline stages and tensor-parallel traffic (inside the MFU), the outer
optimizer step and the codec's own compute, activations' memory, and stragglers. docs/planner.md has the details and
what is known of the paper's setting.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from dilocox.net.link import parse_bandwidth, parse_duration

__all__ = [
    "CPU_CORE_FLOPS",
    "GPU_PRESETS",
    "INT4_COMPRESSION_RATIO",
    "PAPER",
    "GpuSpec",
    "PaperNumbers",
    "PaperRegime",
    "PlanInput",
    "PlanResult",
    "StrategyPlan",
    "allreduce_transfer_s",
    "calibrate_cpu_core",
    "codec_compression_ratio",
    "cpu_core",
    "flavor_param_shapes",
    "format_bandwidth",
    "gpu_preset",
    "paper_107b_input",
    "paper_regime",
    "paper_regime_bandwidth",
    "paper_regime_ratio",
    "plan",
    "resolve_flavor",
]

GIB = 1024**3

SlowLinkScope = Literal["node", "cluster"]
CompressedReduce = Literal["ring", "all_gather"]

# Bytes per parameter of the training state, as counted for the memory check (activations are not counted):
_WEIGHTS_AND_GRADS_BYTES = 4.0  # bf16 weights + bf16 gradients, held by every replica of a stage
_INNER_OPTIMIZER_BYTES = 12.0  # fp32 master weights + AdamW's two fp32 moments, shardable over dp
_OUTER_OPTIMIZER_BYTES = 8.0  # DiLoCoX's fp32 outer parameters + outer momentum, shardable over dp


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator: its dense bf16 peak rate and memory.

    gpu = GpuSpec("A800-40G", peak_flops=312e12, memory_bytes=40 * GIB)
    gpu = gpu_preset("H100-80G")
    gpu = calibrate_cpu_core(num_params=1_312_896, tokens_per_s=5_600.0)   # a measured rate, used at mfu 1
    """

    name: str
    """Label printed in tables."""
    peak_flops: float
    """Dense bf16 (tensor core) peak, FLOP/s; for `cpu-core` the measured end-to-end rate on the 6N basis."""
    memory_bytes: float
    """Device memory, bytes."""
    default_mfu: float = 0.4
    """Model FLOPs utilization assumed when none is given (1.0 for a measured rate, which already includes it)."""


CPU_CORE_FLOPS = 4.5e10
"""Effective FLOP/s of one core of the 2-core CI machine on the 6N basis: the `tiny` flavor (1.31M params) ran
fwd + bwd + AdamW at 16 x 256 tokens at 5,674 tokens/s on one thread (6 x 1.31e6 x 5,674 = 4.5e10); PLATFORM.md's
table gives 4.1e10-8.1e10 for 0.13M-30M params. Calibrate with a measured rate rather than trusting this."""

GPU_PRESETS: dict[str, GpuSpec] = {
    # A800 is the export variant of the A100: same SMs and tensor-core peak, NVLink cut to 400 GB/s.
    "A800-40G": GpuSpec("A800-40G", peak_flops=312e12, memory_bytes=40 * GIB),
    "A100-80G": GpuSpec("A100-80G", peak_flops=312e12, memory_bytes=80 * GIB),
    "H100-80G": GpuSpec("H100-80G", peak_flops=989e12, memory_bytes=80 * GIB),
    "H200": GpuSpec("H200", peak_flops=989e12, memory_bytes=141e9),
    "cpu-core": GpuSpec("cpu-core", peak_flops=CPU_CORE_FLOPS, memory_bytes=8 * GIB, default_mfu=1.0),
}
"""Named accelerators for `gpu_preset` and `dilocox plan --gpu`."""


def gpu_preset(name: str) -> GpuSpec:
    """The preset called `name` (case-insensitive); a ValueError lists the names otherwise."""
    for key, spec in GPU_PRESETS.items():
        if key.lower() == name.strip().lower():
            return spec
    raise ValueError(f"gpu (--gpu) = {name!r} is not a known GPU; use one of {', '.join(GPU_PRESETS)}")


def cpu_core(flops_per_s: float = CPU_CORE_FLOPS, memory_bytes: float = 8 * GIB) -> GpuSpec:
    """One CPU core as a 'GPU' whose rate is a measured end-to-end FLOP/s (6N basis), used at MFU 1."""
    if not (math.isfinite(flops_per_s) and flops_per_s > 0.0):
        raise ValueError(f"cpu-core rate {flops_per_s!r} FLOP/s must be positive and finite")
    return GpuSpec("cpu-core", peak_flops=flops_per_s, memory_bytes=memory_bytes, default_mfu=1.0)


def calibrate_cpu_core(num_params: int, tokens_per_s: float) -> GpuSpec:
    """A `cpu-core` whose rate reproduces `tokens_per_s`, measured for the whole model (no pipeline) on one rank.

    The rate is `6 * num_params * tokens_per_s`, the same 6N rule the planner uses, so that `plan` with this GPU,
    one rank and MFU 1 gives back exactly the measured tokens/s; the planner then adds bubbles and communication.
    """
    if not (isinstance(tokens_per_s, int | float) and math.isfinite(tokens_per_s) and tokens_per_s > 0.0):
        raise ValueError(
            f"calibrate_tokens_per_s (--calibrate-tokens-per-s) = {tokens_per_s!r} must be a positive, finite "
            "tokens/s measured for one rank running the whole model, e.g. 5600"
        )
    if num_params < 1:
        raise ValueError(f"num_params = {num_params} must be >= 1 to calibrate a rate")
    return cpu_core(6.0 * num_params * tokens_per_s)


# --------------------------------------------------------------------------------------------------------------
# Model size and codec payloads


@functools.lru_cache(maxsize=32)
def _flavor_shapes(flavor: str, vocab_size: int | None) -> tuple[tuple[tuple[int, ...], ...], int]:
    import torch

    from dilocox.models import Decoder, model_args

    args = model_args(flavor, vocab_size=vocab_size)
    with torch.device("meta"):
        model = Decoder(args)
    # Parameters, not named_parameters with duplicates: a tied head is one tensor and is counted once.
    shapes = tuple(tuple(param.shape) for param in model.parameters())
    return shapes, args.num_layers


def _flavor_vocab(flavor: str, vocab_size: int | None) -> int | None:
    from dilocox.models import FIXED_VOCAB_FLAVORS

    # The Qwen1.5 flavors carry their vocabulary; the small ones take the tokenizer's, 2048 by default here.
    if flavor in FIXED_VOCAB_FLAVORS:
        return vocab_size
    return 2048 if vocab_size is None else vocab_size


def flavor_param_shapes(flavor: str, vocab_size: int | None = None) -> list[tuple[int, ...]]:
    """Shapes of every parameter tensor of a flavor (built on the meta device, nothing allocated)."""
    return list(_flavor_shapes(flavor, _flavor_vocab(flavor, vocab_size))[0])


def resolve_flavor(flavor: str, vocab_size: int | None = None) -> tuple[int, int]:
    """(num_params, num_layers) of a model flavor; small flavors use `vocab_size`, 2048 (the default BPE) if None.

    The count is `dilocox.models.count_parameters` of `model_args(flavor, vocab_size=...)`: unique parameters, a
    tied head once.
    """
    shapes, num_layers = _flavor_shapes(flavor, _flavor_vocab(flavor, vocab_size))
    return sum(math.prod(shape) for shape in shapes), num_layers


def _payload_bytes(numel: int, bits: int | None, group_size: int, scale_bytes: int) -> int:
    if bits is None:
        return 4 * numel  # fp32
    return math.ceil(numel * bits / 8) + math.ceil(numel / group_size) * scale_bytes


def codec_compression_ratio(
    shapes: list[tuple[int, ...]],
    *,
    rank: int | None = None,
    bits: int | None = 4,
    group_size: int = 64,
    scale_bytes: int = 2,
) -> float:
    """fp32 bytes of a pseudo-gradient divided by its payload bytes under a low-rank and/or quantizing codec.

    Each 2-D tensor (m, n) is sent as rank-`rank` factors (m, r) and (r, n) when that is smaller than the matrix,
    otherwise dense; 1-D tensors go dense. Every sent tensor is quantized group-wise to `bits` bits with one
    `scale_bytes` scale per `group_size` values, or sent as fp32 when `bits` is None. int4 alone (rank None) gives
    `32 / (4 + 16/64) = 7.53`, see `INT4_COMPRESSION_RATIO`.
    """
    if rank is not None and rank < 1:
        raise ValueError(f"codec_rank (--codec-rank) = {rank} must be >= 1, or left out for no low-rank step")
    if bits is not None and not 1 <= bits <= 16:
        raise ValueError(f"codec_bits (--codec-bits) = {bits} must be between 1 and 16 (4 for int4)")
    if group_size < 1 or scale_bytes < 0:
        raise ValueError(f"group_size = {group_size} must be >= 1 and scale_bytes = {scale_bytes} >= 0")
    if not shapes:
        raise ValueError("codec_compression_ratio needs at least one parameter shape")
    dense_bytes = 0
    payload = 0
    for shape in shapes:
        numel = math.prod(shape)
        dense_bytes += 4 * numel
        if rank is not None and len(shape) == 2 and rank * (shape[0] + shape[1]) < numel:
            payload += _payload_bytes(shape[0] * rank, bits, group_size, scale_bytes)
            payload += _payload_bytes(rank * shape[1], bits, group_size, scale_bytes)
        else:
            payload += _payload_bytes(numel, bits, group_size, scale_bytes)
    return dense_bytes / payload


INT4_COMPRESSION_RATIO = 32.0 / (4.0 + 16.0 / 64.0)
"""Group-wise int4 with one fp16 scale per 64 values, relative to fp32 (about 7.53), ignoring rounding up."""


# --------------------------------------------------------------------------------------------------------------
# Inputs

# Option names of the CLI for the fields whose flag is not the field name with dashes.
_FLAGS = {
    "slow_link_bps": "--bandwidth",
    "slow_latency_s": "--latency",
    "intra_link_bps": "--intra-bandwidth",
    "intra_latency_s": "--intra-latency",
    "grad_bytes_per_element": "--grad-bytes",
    "pseudo_grad_bytes_per_element": "--pseudo-grad-bytes",
    "diloco_state_bytes_per_param": "--diloco-state-bytes",
}


def _opt(field_name: str) -> str:
    return f"{field_name} ({_FLAGS.get(field_name, '--' + field_name.replace('_', '-'))})"


@dataclass(frozen=True)
class PlanInput:
    """Everything `plan` needs: model size, layout, batch, GPU, links and the DiLoCo(X) settings.

    inp = PlanInput(num_params=1_312_896, seq_len=256, num_microbatches=1, microbatch_size=16, gpu=cpu_core())
    inp = replace(paper_107b_input(), slow_link_bps=10e9)     # the paper's setting at 10 Gbps
    plan(inp).tokens_per_s("dilocox")

    Errors name the field and its `dilocox plan` option. Bandwidths are in bits/s; None means unlimited.
    """

    num_params: int
    """Parameters of the whole model (use `resolve_flavor` for a named flavor)."""
    seq_len: int = 2048
    """Tokens per sequence."""
    global_batch_tokens: int | None = None
    """Tokens per inner step over all clusters; fixes num_microbatches (it must divide evenly). None: use
    num_microbatches."""
    num_microbatches: int | None = None
    """Microbatches per step of each pipeline replica (m of the bubble formula); None: from global_batch_tokens."""
    microbatch_size: int = 1
    """Sequences per microbatch."""
    num_layers: int | None = None
    """Transformer blocks, when known: pp_degree may not exceed it (each stage owns at least one block)."""
    num_clusters: int = 2
    """Clusters joined by the slow link (C)."""
    dp_degree: int = 1
    """Data-parallel replicas of each stage inside a cluster."""
    pp_degree: int = 1
    """Pipeline stages of one model replica."""
    tp_degree: int = 1
    """Tensor-parallel ranks per stage (inside a node; its traffic is part of the MFU). Pipeline and tensor
    parallelism together divide the model over `tp_degree * pp_degree` GPUs."""
    gpus_per_node: int = 8
    """GPUs sharing one node uplink when slow_link_scope is "node"."""
    gpu: GpuSpec = field(default_factory=lambda: GPU_PRESETS["A800-40G"])
    """The accelerator of every rank."""
    mfu: float | None = None
    """Model FLOPs utilization of the compute inside a step, bubbles excluded; None: the GPU's default_mfu."""
    intra_link_bps: float | None = 200e9
    """Per-rank bandwidth of the fast network inside a cluster (bits/s); None: unlimited."""
    intra_latency_s: float = 0.0
    """Latency of one intra-cluster collective."""
    slow_link_bps: float | None = 1e9
    """Bandwidth of one slow-link uplink (bits/s); None: unlimited (the no-communication limit)."""
    slow_latency_s: float = 0.01
    """Latency of one collective on the slow link."""
    slow_link_scope: SlowLinkScope = "node"
    """"node": every node has its own uplink of slow_link_bps, shared by its GPUs that send at once, so a cluster
    of k nodes has k uplinks; "cluster": the whole cluster shares one uplink of slow_link_bps."""
    inner_steps: int = 100
    """H: inner steps per round (DiLoCo, DiLoCoX); AllReduce's figures are per H steps too, for comparison."""
    compression_ratio: float = INT4_COMPRESSION_RATIO
    """DiLoCoX's pseudo-gradient payload: fp32 bytes divided by payload bytes (>= 1)."""
    overlap: bool = True
    """DiLoCoX's one-step delay: the sync of round t overlaps round t+1."""
    grad_bytes_per_element: float = 2.0
    """Bytes of a gradient element on the wire for AllReduce and the intra-cluster all-reduce (bf16 = 2)."""
    pseudo_grad_bytes_per_element: float = 4.0
    """Bytes of an uncompressed pseudo-gradient element (DiLoCo, DiLoCoX without compression; fp32 = 4)."""
    compressed_reduce: CompressedReduce = "ring"
    """How clusters combine compressed payloads: "ring" (reduce-scatter / all-gather of shards, 2 (C-1)/C x
    payload) or "all_gather" (exact for any codec, (C-1) x payload)."""
    shard_optimizer: bool = True
    """Shard the fp32 master weights and optimizer states over the dp replicas of a stage (the paper's
    "distributed" inner and outer optimizers) in the memory estimate."""
    diloco_state_bytes_per_param: float = 16.0
    """Training state OpenDiLoCo keeps on one GPU per parameter (bf16 weights and gradients, fp32 master and AdamW
    moments; its outer state lives on the CPU)."""
    label: str | None = None
    """Name of the model for tables (a flavor name)."""

    @property
    def num_gpus(self) -> int:
        """G = num_clusters * dp_degree * tp_degree * pp_degree."""
        return self.num_clusters * self.dp_degree * self.tp_degree * self.pp_degree

    @property
    def ranks_per_cluster(self) -> int:
        """dp_degree * tp_degree * pp_degree."""
        return self.dp_degree * self.tp_degree * self.pp_degree

    @property
    def effective_mfu(self) -> float:
        """mfu, or the GPU's default_mfu when mfu is None."""
        return self.gpu.default_mfu if self.mfu is None else self.mfu

    def resolved_num_microbatches(self) -> int:
        """m, from num_microbatches or from global_batch_tokens (validated)."""
        self.validate()
        return self._microbatches()

    @property
    def tokens_per_step(self) -> int:
        """T = clusters * dp * m * microbatch_size * seq_len."""
        per_microbatch = self.num_clusters * self.dp_degree * self.microbatch_size * self.seq_len
        return per_microbatch * self.resolved_num_microbatches()

    def _microbatches(self) -> int:
        per_microbatch = self.num_clusters * self.dp_degree * self.microbatch_size * self.seq_len
        if self.global_batch_tokens is None:
            assert self.num_microbatches is not None
            return self.num_microbatches
        return self.global_batch_tokens // per_microbatch

    def validate(self) -> None:
        """Raise ValueError naming the first bad field (and its CLI option) with the fix."""
        _positive_int(self.num_params, "num_params", "7e9 (or give --flavor NAME)")
        _positive_int(self.seq_len, "seq_len", "2048")
        _positive_int(self.microbatch_size, "microbatch_size", "1")
        examples = {
            "num_clusters": "2",
            "dp_degree": "1",
            "pp_degree": "1",
            "tp_degree": "1",
            "gpus_per_node": "8",
            "inner_steps": "100",
        }
        for name, example in examples.items():
            _positive_int(getattr(self, name), name, example)
        if self.num_layers is not None:
            _positive_int(self.num_layers, "num_layers", "32")
            if self.pp_degree > self.num_layers:
                raise ValueError(
                    f"{_opt('pp_degree')} = {self.pp_degree} exceeds the model's {self.num_layers} layers; every "
                    f"stage needs at least one block, use --pp-degree <= {self.num_layers}"
                )
        if self.global_batch_tokens is None and self.num_microbatches is None:
            raise ValueError(f"the batch is not set: give {_opt('global_batch_tokens')} or {_opt('num_microbatches')}")
        if self.num_microbatches is not None:
            _positive_int(self.num_microbatches, "num_microbatches", "8")
        if self.global_batch_tokens is not None:
            _positive_int(self.global_batch_tokens, "global_batch_tokens", "32768")
            per_microbatch = self.num_clusters * self.dp_degree * self.microbatch_size * self.seq_len
            if self.global_batch_tokens % per_microbatch:
                raise ValueError(
                    f"{_opt('global_batch_tokens')} = {self.global_batch_tokens} is not a whole number of "
                    f"microbatches of {per_microbatch} tokens (clusters {self.num_clusters} x dp {self.dp_degree} x "
                    f"microbatch_size {self.microbatch_size} x seq_len {self.seq_len}); use a multiple of "
                    f"{per_microbatch}"
                )
            derived = self.global_batch_tokens // per_microbatch
            if self.num_microbatches is not None and self.num_microbatches != derived:
                raise ValueError(
                    f"{_opt('num_microbatches')} = {self.num_microbatches} disagrees with "
                    f"{_opt('global_batch_tokens')} = {self.global_batch_tokens}, which gives {derived}; give one "
                    "of the two"
                )
        if not isinstance(self.gpu, GpuSpec):
            raise ValueError(f"{_opt('gpu')} = {self.gpu!r} must be a GpuSpec; use gpu_preset(name)")
        _positive_float(self.gpu.peak_flops, "gpu", "a positive peak FLOP/s")
        _positive_float(self.gpu.memory_bytes, "gpu", "a positive memory size")
        mfu = self.effective_mfu
        if not (isinstance(mfu, int | float) and math.isfinite(mfu) and 0.0 < mfu <= 1.0):
            raise ValueError(f"{_opt('mfu')} = {mfu!r} must be in (0, 1]; typical large-model training is 0.3-0.5")
        for name in ("intra_link_bps", "slow_link_bps"):
            value = getattr(self, name)
            if value is not None:
                _positive_float(value, name, "a rate like '1Gbps', or 'unlimited'")
        for name in ("intra_latency_s", "slow_latency_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0.0):
                raise ValueError(f"{_opt(name)} = {value!r} must be a non-negative, finite duration, e.g. '10ms'")
        if self.slow_link_scope not in ("node", "cluster"):
            raise ValueError(f"{_opt('slow_link_scope')} = {self.slow_link_scope!r} must be 'node' or 'cluster'")
        if self.compressed_reduce not in ("ring", "all_gather"):
            raise ValueError(f"{_opt('compressed_reduce')} = {self.compressed_reduce!r} must be 'ring' or 'all_gather'")
        _positive_float(self.compression_ratio, "compression_ratio", "a ratio >= 1 (1 = uncompressed fp32)")
        if self.compression_ratio < 1.0:
            raise ValueError(
                f"{_opt('compression_ratio')} = {self.compression_ratio} is below 1, i.e. larger than fp32; use a "
                "ratio >= 1 (int4 is about 7.5)"
            )
        for name in ("grad_bytes_per_element", "pseudo_grad_bytes_per_element", "diloco_state_bytes_per_param"):
            _positive_float(getattr(self, name), name, "a positive number of bytes, e.g. 2 for bf16")


def _positive_int(value: Any, name: str, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        flag = _FLAGS.get(name, "--" + name.replace("_", "-"))
        raise ValueError(f"{_opt(name)} = {value!r} must be a whole number >= 1, e.g. {flag} {example}")


def _positive_float(value: Any, name: str, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{_opt(name)} = {value!r} must be positive and finite; use {example}")


# --------------------------------------------------------------------------------------------------------------
# The round model


@dataclass(frozen=True)
class StrategyPlan:
    """The projected round of one strategy. Times are seconds; bytes are those of one cluster's uplink(s)."""

    name: str
    """Key: allreduce, diloco, dilocox, dilocox_no_overlap, dilocox_no_compression."""
    label: str
    """Name for tables."""
    can_run: bool
    """False when the layout cannot hold the model (DiLoCo beyond one GPU's memory)."""
    reason: str | None
    """Why it cannot run."""
    inner_steps: int
    """Steps per round (H)."""
    tokens_per_step: int
    """Tokens of one step over all clusters."""
    step_ideal_compute_s: float
    """Compute of one step without bubbles."""
    step_compute_s: float
    """Compute of one step, pipeline bubble included."""
    bubble_fraction: float
    """(pp - 1) / (m + pp - 1): the idle share of a pipelined step."""
    step_intra_comm_s: float
    """Intra-cluster all-reduce of gradients per step."""
    slow_bytes_per_round: float
    """Bytes through a cluster's uplinks per round."""
    slow_comm_per_round_s: float
    """Slow-link time of those bytes (per round; AllReduce: H per-step transfers)."""
    exposed_slow_comm_per_round_s: float
    """Slow-link time the trainer waits for, per round."""
    memory_bytes_per_gpu: float
    """Training state per GPU (activations not counted)."""
    fits_memory: bool
    """memory_bytes_per_gpu <= the GPU's memory."""

    @property
    def round_s(self) -> float:
        """Wall time of one round: H x (compute + intra all-reduce) + exposed slow-link time."""
        return self.inner_steps * (self.step_compute_s + self.step_intra_comm_s) + self.exposed_slow_comm_per_round_s

    @property
    def tokens_per_s(self) -> float | None:
        """Projected throughput over all clusters; None when the strategy cannot run."""
        if not self.can_run:
            return None
        return self.inner_steps * self.tokens_per_step / self.round_s

    @property
    def exposed_comm_per_step_s(self) -> float:
        """Non-compute time per step: the intra all-reduce plus the exposed slow-link share."""
        return self.step_intra_comm_s + self.exposed_slow_comm_per_round_s / self.inner_steps

    def breakdown(self) -> dict[str, float] | None:
        """Per-round times (seconds) and counts; None when the strategy cannot run."""
        if not self.can_run:
            return None
        h = self.inner_steps
        return {
            "inner_steps": h,
            "tokens": h * self.tokens_per_step,
            "compute_s": h * self.step_ideal_compute_s,
            "bubble_s": h * (self.step_compute_s - self.step_ideal_compute_s),
            "intra_comm_s": h * self.step_intra_comm_s,
            "slow_bytes": self.slow_bytes_per_round,
            "slow_comm_s": self.slow_comm_per_round_s,
            "slow_comm_exposed_s": self.exposed_slow_comm_per_round_s,
            "slow_comm_hidden_s": self.slow_comm_per_round_s - self.exposed_slow_comm_per_round_s,
            "round_s": self.round_s,
        }


_LABELS = {
    "allreduce": "AllReduce",
    "diloco": "DiLoCo (OpenDiLoCo)",
    "dilocox": "DiLoCoX",
    "dilocox_no_overlap": "DiLoCoX, no overlap",
    "dilocox_no_compression": "DiLoCoX, no compression",
}


@dataclass(frozen=True)
class PlanResult:
    """`plan`'s answer: one StrategyPlan per strategy, in table order, and the no-communication limit."""

    input: PlanInput
    num_microbatches: int
    strategies: dict[str, StrategyPlan]
    compute_only_tokens_per_s: float
    """Tokens/s of the pipeline layout with free communication: the ceiling of AllReduce and DiLoCoX."""

    def tokens_per_s(self, name: str) -> float | None:
        """Projected tokens/s of strategy `name` (None when it cannot run)."""
        return self.strategies[name].tokens_per_s

    def speedup_vs_allreduce(self, name: str) -> float | None:
        """tokens/s of `name` over AllReduce's; None when either cannot run."""
        tokens = self.tokens_per_s(name)
        base = self.tokens_per_s("allreduce")
        return None if tokens is None or not base else tokens / base

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (finite numbers only; None where a strategy cannot run)."""
        inp = self.input
        strategies = {}
        for name, item in self.strategies.items():
            strategies[name] = {
                "label": item.label,
                "can_run": item.can_run,
                "reason": item.reason,
                "tokens_per_s": item.tokens_per_s,
                "speedup_vs_allreduce": self.speedup_vs_allreduce(name),
                "step_compute_s": item.step_compute_s,
                "bubble_fraction": item.bubble_fraction,
                "exposed_comm_per_step_s": item.exposed_comm_per_step_s if item.can_run else None,
                "memory_bytes_per_gpu": item.memory_bytes_per_gpu,
                "fits_memory": item.fits_memory,
                "round": item.breakdown(),
            }
        return {
            "input": asdict(inp) | {"mfu": inp.effective_mfu},
            "num_gpus": inp.num_gpus,
            "num_microbatches": self.num_microbatches,
            "tokens_per_step": inp.tokens_per_step,
            "compute_only_tokens_per_s": self.compute_only_tokens_per_s,
            "allreduce_tokens_per_s": self.tokens_per_s("allreduce"),
            "diloco_tokens_per_s": self.tokens_per_s("diloco"),
            "dilocox_tokens_per_s": self.tokens_per_s("dilocox"),
            "strategies": strategies,
        }


def _bytes_per_s(bits_per_s: float | None) -> float | None:
    return None if bits_per_s is None else bits_per_s / 8.0


def _ring_all_reduce_s(total_bytes: float, world: int, bytes_per_s: float | None, latency_s: float) -> float:
    """Per-rank ring all-reduce of `total_bytes` over `world` ranks: 2 (world-1)/world x bytes + one latency."""
    if world == 1 or bytes_per_s is None:
        return 0.0
    return 2.0 * (world - 1) / world * total_bytes / bytes_per_s + latency_s


def _uplink_bytes_per_s(inp: PlanInput) -> float | None:
    link = _bytes_per_s(inp.slow_link_bps)
    if link is None or inp.slow_link_scope == "cluster":
        return link
    # The ranks of a cluster fill ceil(ranks / gpus_per_node) nodes, each with its own uplink that its GPUs share.
    return link * math.ceil(inp.ranks_per_cluster / inp.gpus_per_node)


def _slow_transfer_s(inp: PlanInput, cluster_bytes: float) -> float:
    uplink = _uplink_bytes_per_s(inp)
    if inp.num_clusters == 1 or uplink is None:
        return 0.0
    return cluster_bytes / uplink + inp.slow_latency_s


def _ring_factor(num_clusters: int) -> float:
    return 2.0 * (num_clusters - 1) / num_clusters


def plan(inp: PlanInput) -> PlanResult:
    """Project one round of every strategy for `inp` (validated first; ValueError names a bad field)."""
    inp.validate()
    m = inp._microbatches()
    n = float(inp.num_params)
    h = inp.inner_steps
    c = inp.num_clusters
    tokens = inp.tokens_per_step
    intra = _bytes_per_s(inp.intra_link_bps)

    ideal = 6.0 * n * tokens / (inp.num_gpus * inp.gpu.peak_flops * inp.effective_mfu)
    bubble = (inp.pp_degree - 1) / (m + inp.pp_degree - 1)
    step_compute = ideal / (1.0 - bubble)
    stage_params = n / (inp.tp_degree * inp.pp_degree)
    step_intra = _ring_all_reduce_s(
        stage_params * inp.grad_bytes_per_element, inp.dp_degree, intra, inp.intra_latency_s
    )
    dp_shard = inp.dp_degree if inp.shard_optimizer else 1
    memory_inner = stage_params * (_WEIGHTS_AND_GRADS_BYTES + _INNER_OPTIMIZER_BYTES / dp_shard)
    memory_dilocox = memory_inner + stage_params * _OUTER_OPTIMIZER_BYTES / dp_shard
    gpu_memory = inp.gpu.memory_bytes

    def pipelined(name: str, slow_bytes: float, slow_s: float, exposed_s: float, memory: float) -> StrategyPlan:
        return StrategyPlan(
            name=name,
            label=_LABELS[name],
            can_run=True,
            reason=None,
            inner_steps=h,
            tokens_per_step=tokens,
            step_ideal_compute_s=ideal,
            step_compute_s=step_compute,
            bubble_fraction=bubble,
            step_intra_comm_s=step_intra,
            slow_bytes_per_round=slow_bytes,
            slow_comm_per_round_s=slow_s,
            exposed_slow_comm_per_round_s=exposed_s,
            memory_bytes_per_gpu=memory,
            fits_memory=memory <= gpu_memory,
        )

    strategies: dict[str, StrategyPlan] = {}

    # AllReduce: the gradient crosses the slow link every step (hierarchically: reduce-scatter over dp, ring across
    # clusters of each dp rank's shard, all-gather over dp), and the step waits for it.
    step_bytes = _ring_factor(c) * n * inp.grad_bytes_per_element if c > 1 else 0.0
    step_slow = _slow_transfer_s(inp, step_bytes)
    strategies["allreduce"] = pipelined("allreduce", h * step_bytes, h * step_slow, h * step_slow, memory_inner)

    # DiLoCo as OpenDiLoCo runs it: every GPU is a data-parallel replica of the whole model.
    replicas = inp.ranks_per_cluster
    diloco_memory = n * inp.diloco_state_bytes_per_param
    diloco_bytes = _ring_factor(c) * n * inp.pseudo_grad_bytes_per_element if c > 1 else 0.0
    diloco_slow = _slow_transfer_s(inp, diloco_bytes)
    fits = diloco_memory <= gpu_memory
    strategies["diloco"] = StrategyPlan(
        name="diloco",
        label=_LABELS["diloco"],
        can_run=fits,
        reason=None
        if fits
        else (
            f"data parallel only: one GPU must hold the whole model's training state, {diloco_memory / GIB:,.1f} "
            f"GiB at {inp.diloco_state_bytes_per_param:g} bytes/param, but one {inp.gpu.name} has "
            f"{gpu_memory / GIB:,.1f} GiB"
        ),
        inner_steps=h,
        tokens_per_step=tokens,
        step_ideal_compute_s=ideal,
        step_compute_s=ideal,
        bubble_fraction=0.0,
        step_intra_comm_s=_ring_all_reduce_s(n * inp.grad_bytes_per_element, replicas, intra, inp.intra_latency_s),
        slow_bytes_per_round=diloco_bytes,
        slow_comm_per_round_s=diloco_slow,
        exposed_slow_comm_per_round_s=diloco_slow,
        memory_bytes_per_gpu=diloco_memory,
        fits_memory=fits,
    )

    # DiLoCoX and its two ablations: the pseudo-gradient crosses once per round, overlapped with the next round.
    window = h * (step_compute + step_intra)

    def dilocox(name: str, payload: float, overlap: bool, reduce: CompressedReduce) -> StrategyPlan:
        if c == 1:
            cluster_bytes = 0.0
        elif reduce == "ring":
            cluster_bytes = _ring_factor(c) * payload
        else:
            cluster_bytes = (c - 1) * payload
        comm = _slow_transfer_s(inp, cluster_bytes)
        exposed = max(0.0, comm - window) if overlap else comm
        return pipelined(name, cluster_bytes, comm, exposed, memory_dilocox)

    compressed = n * 4.0 / inp.compression_ratio
    uncompressed = n * inp.pseudo_grad_bytes_per_element
    strategies["dilocox"] = dilocox("dilocox", compressed, inp.overlap, inp.compressed_reduce)
    strategies["dilocox_no_overlap"] = dilocox("dilocox_no_overlap", compressed, False, inp.compressed_reduce)
    strategies["dilocox_no_compression"] = dilocox("dilocox_no_compression", uncompressed, inp.overlap, "ring")

    return PlanResult(
        input=inp, num_microbatches=m, strategies=strategies, compute_only_tokens_per_s=tokens / step_compute
    )


# --------------------------------------------------------------------------------------------------------------
# The paper


@dataclass(frozen=True)
class PaperNumbers:
    """Throughputs DiLoCoX reports for Qwen1.5-107B on 160 A800 over 1 Gbps (arXiv 2506.21263; DESIGN.md §1)."""

    allreduce_tokens_per_s: float = 10.4
    dilocox_tokens_per_s: float = 3728.0
    dilocox_no_compression_tokens_per_s: float = 1168.0
    no_overlap_throughput_drop: float = 0.40
    """DiLoCoX without the one-step-delay overlap: about 40% less throughput."""
    reported_speedup: float = 357.0

    @property
    def dilocox_no_overlap_tokens_per_s(self) -> float:
        """About 2,237: 40% below DiLoCoX (the paper gives the drop, not the figure)."""
        return self.dilocox_tokens_per_s * (1.0 - self.no_overlap_throughput_drop)


PAPER = PaperNumbers()
"""The paper's measured numbers."""


@dataclass(frozen=True)
class PaperRegime:
    """What the paper's measured throughputs imply, independent of the unknown batch, MFU and layout.

    Assumes (docs/planner.md): all methods run the same compute per step; DiLoCoX's overlapped sync is fully hidden
    (its round is pure compute); the ablations change only what they name.
    """

    allreduce_comm_over_compute: float
    """AllReduce's slow-link time per step / compute time per step = 3728 / 10.4 - 1 (about 357.5)."""
    dilocox_comm_over_round_compute: float
    """DiLoCoX's compressed sync time / a round's compute: without overlap the round grows by 1 / (1 - 0.4), so
    the sync takes 0.4 / 0.6 (about 0.667) of a round's compute."""
    uncompressed_comm_over_round_compute: float
    """The uncompressed sync time / a round's compute: overlapped but longer than the round, it sets the pace, so
    it is 3728 / 1168 (about 3.19) rounds of compute."""

    @property
    def implied_compression_ratio(self) -> float:
        """Uncompressed / compressed payload (about 4.8): relative to whatever uncompressed format was sent."""
        return self.uncompressed_comm_over_round_compute / self.dilocox_comm_over_round_compute

    @property
    def implied_inner_steps(self) -> float:
        """H (about 112) if a gradient and an uncompressed pseudo-gradient take the same bytes per element."""
        return self.allreduce_comm_over_compute / self.uncompressed_comm_over_round_compute


def paper_regime(paper: PaperNumbers = PAPER) -> PaperRegime:
    """The communication-to-compute ratios implied by the paper's measured throughputs."""
    return PaperRegime(
        allreduce_comm_over_compute=paper.dilocox_tokens_per_s / paper.allreduce_tokens_per_s - 1.0,
        dilocox_comm_over_round_compute=1.0 / (1.0 - paper.no_overlap_throughput_drop) - 1.0,
        uncompressed_comm_over_round_compute=paper.dilocox_tokens_per_s / paper.dilocox_no_compression_tokens_per_s,
    )


def paper_regime_ratio() -> float:
    """AllReduce's (slow-link transfer time per step) / (compute time per step) in the paper: about 357.5.

    Derivation: with equal compute per step and DiLoCoX's sync hidden, DiLoCoX's step is the compute time t and
    AllReduce's is t + transfer, so 3728 / 10.4 = (t + transfer) / t.
    """
    return paper_regime().allreduce_comm_over_compute


def allreduce_transfer_s(
    grad_bytes: float, bytes_per_s: float, *, num_clusters: int = 2, latency_s: float = 0.0
) -> float:
    """Slow-link time of one AllReduce step: `latency + 2 (C-1)/C x grad_bytes / bytes_per_s` for a cluster uplink.

    `grad_bytes` is a whole replica's gradient as sent (numel x bytes per element), summed over its stages.
    """
    if num_clusters < 2:
        raise ValueError(f"num_clusters = {num_clusters}: the slow link needs at least 2 clusters")
    return latency_s + _ring_factor(num_clusters) * grad_bytes / bytes_per_s


def paper_regime_bandwidth(
    compute_s_per_step: float,
    grad_bytes: float,
    *,
    num_clusters: int = 2,
    latency_s: float = 0.0,
    ratio: float | None = None,
) -> float:
    """Uplink bandwidth, in bytes/s, that puts a small run in the paper's regime.

    Returns B with `allreduce_transfer_s(grad_bytes, B, ...) == ratio * compute_s_per_step`, ratio defaulting to
    `paper_regime_ratio()`: AllReduce of this model then waits on the link as many times its compute as the
    paper's did, and DiLoCo(X) see the same proportions. `compute_s_per_step` is the measured compute time of one
    step (no communication); `grad_bytes` the gradient bytes one cluster sends per step in AllReduce's format.
    `format_bandwidth` turns the result into a `network.bandwidth` string.
    """
    ratio = paper_regime_ratio() if ratio is None else ratio
    for name, value in (("compute_s_per_step", compute_s_per_step), ("grad_bytes", grad_bytes), ("ratio", ratio)):
        if not (isinstance(value, int | float) and math.isfinite(value) and value > 0.0):
            raise ValueError(f"{name} = {value!r} must be positive and finite")
    if num_clusters < 2:
        raise ValueError(f"num_clusters = {num_clusters}: the slow link needs at least 2 clusters; use 2")
    if not (math.isfinite(latency_s) and latency_s >= 0.0):
        raise ValueError(f"latency_s = {latency_s!r} must be a non-negative, finite number of seconds")
    wire_s = ratio * compute_s_per_step - latency_s
    if wire_s <= 0.0:
        raise ValueError(
            f"latency_s = {latency_s} alone exceeds the target transfer time {ratio * compute_s_per_step:.4g} s "
            f"({ratio:.4g} x {compute_s_per_step:.4g} s of compute); lower the latency"
        )
    return _ring_factor(num_clusters) * grad_bytes / wire_s


def format_bandwidth(bytes_per_s: float) -> str:
    """A `network.bandwidth` string for `bytes_per_s` that `parse_bandwidth` reads back exactly (bits/s)."""
    if not (math.isfinite(bytes_per_s) and bytes_per_s > 0.0):
        raise ValueError(f"bandwidth {bytes_per_s!r} bytes/s must be positive and finite")
    return f"{bytes_per_s * 8.0:.17g}bps"


def paper_107b_input(**overrides: Any) -> PlanInput:
    """The paper's setting as a PlanInput; every value not stated in what we could read is an assumption.

    Stated: Qwen1.5-107B-class model, 20 nodes x 8 A800-40G, 1 Gbps between nodes (tc), dual optimizer with
    distributed state. Assumed (docs/planner.md explains each): 2 clusters of 10 nodes, tensor 8 x pipeline 10 per
    cluster, one shared 1 Gbps uplink per cluster, 10 ms latency, 200 Gbps inside a cluster, 16 sequences of 2048
    tokens per step, H = 125, int4 payload (no low-rank step), bf16 AllReduce gradients, fp32 pseudo-gradients, MFU
    0.4. `overrides` replace fields, e.g. `paper_107b_input(slow_link_bps=10e9)`.
    """
    num_params, num_layers = resolve_flavor("qwen1.5-107b")
    base = PlanInput(
        num_params=num_params,
        num_layers=num_layers,
        label="qwen1.5-107b",
        seq_len=2048,
        global_batch_tokens=16 * 2048,
        microbatch_size=1,
        num_clusters=2,
        dp_degree=1,
        tp_degree=8,
        pp_degree=10,
        gpus_per_node=8,
        gpu=GPU_PRESETS["A800-40G"],
        mfu=0.4,
        intra_link_bps=200e9,
        slow_link_bps=parse_bandwidth("1Gbps") * 8.0,
        slow_latency_s=parse_duration("10ms"),
        slow_link_scope="cluster",
        inner_steps=125,
        compression_ratio=INT4_COMPRESSION_RATIO,
        grad_bytes_per_element=2.0,
        pseudo_grad_bytes_per_element=4.0,
    )
    return replace(base, **overrides)
