"""A Qwen/Llama-style decoder-only transformer that can be cut into pipeline stages.

The model is the one of Qwen1.5 (the family of the DiLoCoX paper's 107B model, arXiv 2506.21263): RMSNorm pre-norm
blocks, rotary position embeddings, grouped-query attention with optional bias on q/k/v, and a SwiGLU feed-forward.
`ModelArgs.style = "gpt2"` builds GPT-2's block instead (Radford et al. 2019): LayerNorm, learned absolute positions,
multi-head attention with biases and a GELU feed-forward (the second workload of the gap protocol, docs/results.md).

Two properties matter for the rest of dilocox:

- Pipeline stages are made by removing what a stage does not own (torchtitan's way): `layers` is a `ModuleDict`
  keyed by the original layer index, and `tok_embeddings`, `norm` and `output` may be set to None. Parameter names
  therefore stay those of the full model on every stage.
- `init_weights(seed)` draws every parameter from a generator keyed by (seed, parameter name), so a stage built on
  the meta device and materialized alone gets exactly the weights that the full model would give it.

This module never imports torch.distributed.
"""

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

# Fully qualified name suffixes of the projections that write into the residual stream; their init std is scaled by
# 1/sqrt(2 * num_layers) so that the residual stream's variance does not grow with depth (GPT-2 / Megatron practice).
_RESIDUAL_PROJECTIONS = ("attention.wo", "feed_forward.w2")
_INIT_STD = 0.02
STYLES = ("qwen", "gpt2")
"""`ModelArgs.style`: the block of Qwen1.5 (RMSNorm, RoPE, SwiGLU) or of GPT-2 (LayerNorm, learned positions, GELU)."""


@dataclass
class ModelArgs:
    """Shape of a decoder. `dilocox.models.flavors` holds named instances; `validate()` checks it."""

    dim: int = 128
    """Width of the residual stream (hidden size)."""
    num_layers: int = 4
    """Number of transformer blocks in the full model (also what scales the residual projections' init)."""
    num_heads: int = 4
    """Number of query heads; `dim` must be divisible by it."""
    num_kv_heads: int = 2
    """Number of key/value heads: grouped-query attention when smaller than `num_heads`, which it must divide."""
    ffn_dim: int = 384
    """Hidden size of the SwiGLU feed-forward."""
    vocab_size: int = 2048
    """Rows of the token embedding and of the output projection."""
    max_seq_len: int = 1024
    """Longest sequence the model accepts; sizes the precomputed rotary table."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies (Qwen1.5 uses 1e6)."""
    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    qkv_bias: bool = True
    """Bias on the q, k and v projections, as in Qwen; Llama has none."""
    tie_embeddings: bool = False
    """Share the output projection's weight with the token embedding (only when a module holds both)."""
    style: str = "qwen"
    """qwen: RMSNorm, rotary positions, SwiGLU; gpt2: LayerNorm, learned positions (max_seq_len of them), GELU MLP
    with biases, a bias on every attention projection (`qkv_bias` and `rope_theta` unused)."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    def validate(self) -> None:
        """Raise a ValueError naming the first impossible field and how to fix it."""
        for name in ("dim", "num_layers", "num_heads", "num_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"model {name}={value!r} must be a positive integer")
        if self.style not in STYLES:
            raise ValueError(f"model style={self.style!r} is not one of: {', '.join(STYLES)}")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"model {name}={value!r} must be a positive number")
        if self.dim % self.num_heads != 0:
            raise ValueError(
                f"model dim={self.dim} is not divisible by num_heads={self.num_heads}; choose a dim that is a "
                "multiple of num_heads"
            )
        if self.head_dim % 2 != 0 and self.style == "qwen":
            raise ValueError(
                f"head_dim = dim / num_heads = {self.dim} / {self.num_heads} = {self.head_dim} is odd; rotary "
                "embeddings rotate pairs of channels, so choose dim and num_heads that give an even head_dim"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"model num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}; "
                "num_kv_heads must divide num_heads (use num_kv_heads=num_heads for plain multi-head attention)"
            )


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale and no bias (Zhang & Sennrich 2019), as in Llama and Qwen.

    norm = RMSNorm(dim=64)
    y = norm(x)  # x: (..., 64)
    assert y.shape == x.shape
    """

    def __init__(self, dim: int, *, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 even for bf16 activations: the mean of squares loses too much precision otherwise.
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine of the rotary angles, each (max_seq_len, head_dim // 2), float32 on the CPU.

    Channel pair i of position p is rotated by p * theta^(-2i / head_dim) (Su et al. 2021, RoFormer). The angles are
    computed in float64 so that long positions (Qwen's 32768) keep full float32 accuracy after the cast.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (head_dim // 2,)
    positions = torch.arange(max_seq_len, dtype=torch.float64)  # (max_seq_len,)
    angles = torch.outer(positions, inv_freq)  # (max_seq_len, head_dim // 2)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the channels of `x` (batch, seq, heads, head_dim) by the angles of `cos`/`sin` (seq, head_dim // 2).

    Channel j is paired with channel j + head_dim // 2 (the "rotate half" layout of Llama/Qwen in Hugging Face), so
    that weights keep the layout of the released checkpoints.
    """
    x_fp32 = x.float()
    half = x.shape[-1] // 2
    x1, x2 = x_fp32[..., :half], x_fp32[..., half:]  # (batch, seq, heads, head_dim // 2) each
    cos = cos[None, :, None, :]  # (1, seq, 1, head_dim // 2)
    sin = sin[None, :, None, :]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # (batch, seq, heads, head_dim)
    return rotated.type_as(x)


class Attention(nn.Module):
    """Causal self-attention with rotary embeddings and grouped-query attention (Ainslie et al. 2023).

    attention = Attention(ModelArgs(dim=64, num_heads=4, num_kv_heads=2))
    cos, sin = rope_tables(16, 128, 10000.0)
    y = attention(x, cos[:seq], sin[:seq])  # x, y: (batch, seq, 64)
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.num_heads = args.num_heads
        self.num_kv_heads = args.num_kv_heads
        self.head_dim = args.head_dim
        self.rotary = args.style == "qwen"
        bias = args.qkv_bias or not self.rotary
        self.wq = nn.Linear(args.dim, args.num_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(args.dim, args.num_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(args.dim, args.num_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(args.num_heads * self.head_dim, args.dim, bias=not self.rotary)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape  # (batch, seq, dim)
        q = self.wq(x).view(batch, seq, self.num_heads, self.head_dim)  # (batch, seq, heads, head_dim)
        k = self.wk(x).view(batch, seq, self.num_kv_heads, self.head_dim)  # (batch, seq, kv_heads, head_dim)
        v = self.wv(x).view(batch, seq, self.num_kv_heads, self.head_dim)
        if self.rotary:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (batch, heads or kv_heads, seq, head_dim)
        # enable_gqa lets each kv head serve num_heads / num_kv_heads query heads without materializing copies.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.num_kv_heads != self.num_heads)
        out = out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim)  # (batch, seq, dim)
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU feed-forward w2(silu(w1 x) * w3 x) without biases (Shazeer 2020), as in Llama and Qwen.

    ffn = FeedForward(dim=64, hidden_dim=192)
    y = ffn(x)  # x, y: (batch, seq, 64)
    assert y.shape == x.shape
    """

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # hidden: (batch, seq, hidden_dim)


class GeluFeedForward(nn.Module):
    """GPT-2's feed-forward w2(gelu(w1 x)), with biases.

    ffn = GeluFeedForward(dim=64, hidden_dim=256)
    y = ffn(x)  # x, y: (batch, seq, 64)
    """

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim)
        self.w2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))  # hidden: (batch, seq, hidden_dim)


def build_norm(args: ModelArgs) -> nn.Module:
    """The block's norm: RMSNorm (qwen) or LayerNorm with a bias (gpt2)."""
    return RMSNorm(args.dim, eps=args.norm_eps) if args.style == "qwen" else nn.LayerNorm(args.dim, eps=args.norm_eps)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then h + feed_forward(norm(h)).

    block = TransformerBlock(ModelArgs(dim=64, num_heads=4, num_kv_heads=2, ffn_dim=192))
    cos, sin = rope_tables(16, 128, 10000.0)
    y = block(x, cos[:seq], sin[:seq])  # x, y: (batch, seq, 64)
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = build_norm(args)
        self.attention = Attention(args)
        self.ffn_norm = build_norm(args)
        self.feed_forward = (FeedForward if args.style == "qwen" else GeluFeedForward)(args.dim, args.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)  # (batch, seq, dim)
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    """Decoder-only transformer (Qwen1.5 / Llama layout) whose modules a pipeline stage can delete.

    model = Decoder(model_args("tiny", vocab_size=2048)); model.init_weights(seed=0)
    logits = model(tokens)  # tokens: (batch, seq) int64 -> logits: (batch, seq, vocab)
    del model.layers["0"]; model.tok_embeddings = None  # a later stage: hidden states (batch, seq, dim) in

    Built on a real device the model is initialized with `init_weights(0)` at once; built on the meta device it is
    materialized with `to_empty(device=...)` followed by `init_weights(seed)`, which gives the same weights as the
    direct build for every module that is present. The rotary tables are non-persistent buffers: they are not in
    the state dict and `init_weights` recomputes them.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings: nn.Embedding | None = (
            nn.Embedding(args.max_seq_len, args.dim) if args.style == "gpt2" else None
        )
        """gpt2: learned absolute positions, held with tok_embeddings (the first pipeline stage)."""
        self.layers = nn.ModuleDict({str(index): TransformerBlock(args) for index in range(args.num_layers)})
        self.norm: nn.Module | None = build_norm(args)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self._tie_output()
        # torch.empty follows the ambient device, so under `torch.device("meta")` the tables take no memory.
        self.register_buffer("rope_cos", torch.empty(args.max_seq_len, args.head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(args.max_seq_len, args.head_dim // 2), persistent=False)
        if not self.rope_cos.is_meta:
            self.init_weights(0)
        self.activation_checkpointing = False
        """Recompute each block's activations in the backward pass instead of keeping them: the activation memory
        of one block instead of all of them, for about one more forward pass of compute."""
        self.autocast_dtype: torch.dtype | None = None
        """Run the forward pass under autocast to this dtype (bf16): matmuls in bf16, weights and their gradients
        stay fp32 (the optimizer's master copy). Inside forward, so a pipeline stage's backward runs outside it."""

    def _tie_output(self) -> None:
        # Re-run by init_weights because to_empty() from the meta device replaces parameters and breaks the tie.
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, seq) if this module has the embedding, else hidden states (batch, seq, dim).

        Returns logits (batch, seq, vocab) if it has the head, else hidden states (batch, seq, dim).
        """
        if self.tok_embeddings is not None:
            if x.dim() != 2 or x.dtype not in (torch.int64, torch.int32):
                raise ValueError(
                    f"Decoder with tok_embeddings expects token ids of shape (batch, seq) and an integer dtype, got "
                    f"shape {tuple(x.shape)} and dtype {x.dtype}; pass hidden states only to a stage without "
                    "tok_embeddings"
                )
            h = self.tok_embeddings(x)  # (batch, seq, dim)
            if self.pos_embeddings is not None:
                self._check_length(x.shape[1])
                h = h + self.pos_embeddings.weight[: x.shape[1]]  # (seq, dim) broadcast over the batch
        else:
            if x.dim() != 3 or x.shape[-1] != self.args.dim:
                raise ValueError(
                    f"Decoder without tok_embeddings expects hidden states of shape (batch, seq, {self.args.dim}), "
                    f"got shape {tuple(x.shape)}"
                )
            h = x
        with torch.autocast(
            h.device.type, dtype=self.autocast_dtype or torch.bfloat16, enabled=self.autocast_dtype is not None
        ):
            return self._blocks_and_head(h)

    def _check_length(self, seq: int) -> None:
        if seq > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {seq} exceeds max_seq_len={self.args.max_seq_len}; shorten the sequences or "
                "build the model with a larger max_seq_len"
            )

    def _blocks_and_head(self, h: torch.Tensor) -> torch.Tensor:
        seq = h.shape[1]
        self._check_length(seq)
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]  # (seq, head_dim // 2)
        # Sorted by index so that a stage runs its layers in the order of the full model whatever their insertion.
        for _, layer in sorted(self.layers.items(), key=lambda item: int(item[0])):
            if self.activation_checkpointing and torch.is_grad_enabled():
                h = checkpoint(layer, h, cos, sin, use_reentrant=False)  # (batch, seq, dim)
            else:
                h = layer(h, cos, sin)  # (batch, seq, dim)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            # fp32 logits under bf16 autocast too: the loss is computed in fp32 anyway, and a pipeline stage's output
            # must keep the dtype it was declared with
            h = self.output(h).float()  # (batch, seq, vocab)
        return h

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialize every parameter from (seed, its name) and recompute the rotary tables.

        Linear and embedding weights are normal(0, 0.02), the attention and feed-forward output projections
        normal(0, 0.02 / sqrt(2 * num_layers)), norms 1 and biases 0 (learned positions are an embedding). Each tensor is drawn from its own CPU
        generator seeded with a hash of (seed, fully qualified name), so the result does not depend on which other
        modules exist, on the device, or on the parameter dtype. `seed=None` means 0.
        """
        seed = 0 if seed is None else seed
        self._tie_output()
        residual_std = _INIT_STD / math.sqrt(2 * self.args.num_layers)
        for module_name, module in self.named_modules():
            if isinstance(module, RMSNorm | nn.LayerNorm):
                module.weight.fill_(1.0)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                _keyed_normal_(module.weight, seed=seed, key=f"{module_name}.weight", std=_INIT_STD)
            elif isinstance(module, nn.Linear):
                if module is self.output and self.args.tie_embeddings:
                    # Keyed like the embedding: the tied head of a last stage starts equal to the first stage's
                    # embedding, as it is in the full model (where this re-draws the same values in place).
                    key = "tok_embeddings.weight"
                else:
                    key = f"{module_name}.weight"
                std = residual_std if module_name.endswith(_RESIDUAL_PROJECTIONS) else _INIT_STD
                _keyed_normal_(module.weight, seed=seed, key=key, std=std)
                if module.bias is not None:
                    module.bias.zero_()
        cos, sin = rope_tables(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta)
        # Assigned, not copied, so that the tables are fp32 again even if the model was cast to bf16 before.
        self.rope_cos = cos.to(self.rope_cos.device)
        self.rope_sin = sin.to(self.rope_sin.device)


def _keyed_normal_(param: torch.Tensor, *, seed: int, key: str, std: float) -> None:
    """Fill `param` with normal(0, std) values that depend only on (seed, key)."""
    # A stable hash (not Python's salted hash()) so that every process and every run derives the same stream.
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    if param.device.type == "cpu" and param.dtype == torch.float32:
        param.normal_(0.0, std, generator=generator)
    else:
        # Drawn in fp32 on the CPU and copied, so that a GPU or bf16 model gets the same values as the CPU one.
        param.copy_(torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=generator))


def count_parameters(args: ModelArgs) -> int:
    """Number of unique parameters of the full model (a tied head counts once), counted on the meta device."""
    with torch.device("meta"):
        model = Decoder(args)
    return sum(param.numel() for param in model.parameters())
