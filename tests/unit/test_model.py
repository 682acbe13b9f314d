"""Decoder, rotary embeddings, keyed initialization, pipeline-stage consistency, flavors and parameter counts."""

import ast
import math
import pathlib
import resource
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import dilocox.models
from dilocox.models import (
    FLAVORS,
    Attention,
    Decoder,
    ModelArgs,
    apply_rope,
    count_parameters,
    list_flavors,
    model_args,
    rope_tables,
)

VOCAB = 256


def _debug_args(**overrides) -> ModelArgs:
    return replace(model_args("debug", vocab_size=VOCAB, max_seq_len=64), **overrides)


def _expected_num_params(args: ModelArgs) -> int:
    """Parameter count written out by hand from the architecture."""
    if args.style == "gpt2":  # biases everywhere, two LayerNorm vectors per norm, learned positions
        attention = 4 * args.dim * args.dim + 4 * args.dim
        feed_forward = 2 * args.dim * args.ffn_dim + args.ffn_dim + args.dim
        embeddings = args.vocab_size * args.dim * (1 if args.tie_embeddings else 2) + args.max_seq_len * args.dim
        return args.num_layers * (attention + feed_forward + 4 * args.dim) + embeddings + 2 * args.dim
    kv_dim = args.num_kv_heads * args.head_dim
    attention = 2 * args.dim * args.dim + 2 * args.dim * kv_dim + (args.dim + 2 * kv_dim if args.qkv_bias else 0)
    feed_forward = 3 * args.dim * args.ffn_dim
    block = attention + feed_forward + 2 * args.dim  # two RMSNorm scales
    embeddings = args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)
    return args.num_layers * block + embeddings + args.dim  # + final norm


def _reference_attention(attention: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Slow attention: kv heads copied explicitly, scores masked and softmaxed by hand."""
    batch, seq, _ = x.shape
    q = apply_rope(attention.wq(x).view(batch, seq, attention.num_heads, -1), cos, sin).transpose(1, 2)
    k = apply_rope(attention.wk(x).view(batch, seq, attention.num_kv_heads, -1), cos, sin).transpose(1, 2)
    v = attention.wv(x).view(batch, seq, attention.num_kv_heads, -1).transpose(1, 2)
    repeat = attention.num_heads // attention.num_kv_heads
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)  # (batch, heads, seq, head_dim)
    scores = q @ k.transpose(-1, -2) / math.sqrt(attention.head_dim)  # (batch, heads, seq, seq)
    future = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
    scores = scores.masked_fill(future, float("-inf"))
    out = scores.softmax(dim=-1) @ v  # (batch, heads, seq, head_dim)
    return attention.wo(out.transpose(1, 2).reshape(batch, seq, -1))


def test_forward_maps_token_ids_to_logits():
    model = Decoder(_debug_args())
    tokens = torch.randint(0, VOCAB, (3, 17))
    logits = model(tokens)
    assert logits.shape == (3, 17, VOCAB)
    assert torch.isfinite(logits).all()


def test_stage_without_embedding_or_head_takes_and_returns_hidden_states():
    args = _debug_args()
    model = Decoder(args)
    model.tok_embeddings = None
    hidden = torch.randn(2, 9, args.dim)
    assert model(hidden).shape == (2, 9, VOCAB)
    model.norm, model.output = None, None
    assert model(hidden).shape == (2, 9, args.dim)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "qkv_bias"), [(4, 4, False), (4, 2, True), (4, 1, True)])
def test_attention_matches_slow_reference(num_heads, num_kv_heads, qkv_bias):
    args = _debug_args(num_heads=num_heads, num_kv_heads=num_kv_heads, qkv_bias=qkv_bias)
    torch.manual_seed(0)
    attention = Attention(args)
    if qkv_bias:
        # Non-zero biases, so that the test sees them used.
        for linear in (attention.wq, attention.wk, attention.wv):
            assert linear.bias is not None and linear.bias.shape == (linear.out_features,)
            torch.nn.init.normal_(linear.bias)
    else:
        assert attention.wq.bias is None and attention.wk.bias is None and attention.wv.bias is None
    assert attention.wk.out_features == num_kv_heads * args.head_dim
    cos, sin = rope_tables(args.head_dim, 12, args.rope_theta)
    x = torch.randn(2, 12, args.dim)
    torch.testing.assert_close(attention(x, cos, sin), _reference_attention(attention, x, cos, sin))


def test_rope_matches_complex_rotation_and_depends_on_relative_position():
    head_dim, seq = 8, 10
    cos, sin = rope_tables(head_dim, seq, 10000.0)
    x = torch.randn(1, seq, 2, head_dim)
    # Reference: channel j and j + head_dim / 2 as the real and imaginary parts of a complex number.
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * 10000.0 ** (
        -torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    )  # (seq, head_dim // 2)
    as_complex = torch.complex(x[..., : head_dim // 2].double(), x[..., head_dim // 2 :].double())
    rotated = as_complex * torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    expected = torch.cat((rotated.real, rotated.imag), dim=-1).float()
    torch.testing.assert_close(apply_rope(x, cos, sin), expected)
    # The score of a rotated query and key depends only on how far apart they are.
    q, k = torch.randn(head_dim), torch.randn(head_dim)
    qs = apply_rope(q.expand(1, seq, 1, head_dim), cos, sin)[0, :, 0]  # (seq, head_dim)
    ks = apply_rope(k.expand(1, seq, 1, head_dim), cos, sin)[0, :, 0]
    torch.testing.assert_close(qs[5] @ ks[2], qs[7] @ ks[4])


def test_changing_a_later_token_leaves_earlier_logits_unchanged():
    model = Decoder(_debug_args())
    tokens = torch.randint(0, VOCAB, (2, 16))
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % VOCAB
    logits, changed_logits = model(tokens), model(changed)
    torch.testing.assert_close(logits[:, :10], changed_logits[:, :10], rtol=0, atol=0)
    assert not torch.allclose(logits[:, 10:], changed_logits[:, 10:])


def test_state_dict_has_full_model_names_and_no_rope_tables():
    model = Decoder(_debug_args())
    keys = set(model.state_dict())
    assert {"tok_embeddings.weight", "layers.1.attention.wq.bias", "layers.1.feed_forward.w2.weight"} <= keys
    assert {"norm.weight", "output.weight"} <= keys
    assert not any("rope" in key for key in keys)
    assert model.rope_cos.shape == (64, model.args.head_dim // 2)


@pytest.mark.parametrize("tie_embeddings", [False, True])
def test_meta_build_then_init_equals_direct_build(tie_embeddings):
    args = _debug_args(tie_embeddings=tie_embeddings)
    direct = Decoder(args)
    direct.init_weights(seed=11)
    with torch.device("meta"):
        lazy = Decoder(args)
    assert all(param.is_meta for param in lazy.parameters())
    lazy.to_empty(device="cpu")
    lazy.init_weights(seed=11)
    assert lazy.state_dict().keys() == direct.state_dict().keys()
    for key, value in direct.state_dict().items():
        assert torch.equal(lazy.state_dict()[key], value), key
    assert torch.equal(lazy.rope_cos, direct.rope_cos) and torch.equal(lazy.rope_sin, direct.rope_sin)
    assert (lazy.output.weight is lazy.tok_embeddings.weight) == tie_embeddings
    tokens = torch.randint(0, VOCAB, (2, 8))
    assert torch.equal(lazy(tokens), direct(tokens))


def test_init_weights_statistics_and_seeding():
    args = replace(model_args("tiny", vocab_size=VOCAB), num_layers=8)
    model = Decoder(args)
    model.init_weights(seed=3)
    params = dict(model.named_parameters())
    assert params["layers.0.attention.wq.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert params["tok_embeddings.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    residual_std = 0.02 / math.sqrt(2 * args.num_layers)
    assert params["layers.0.attention.wo.weight"].std().item() == pytest.approx(residual_std, rel=0.05)
    assert params["layers.7.feed_forward.w2.weight"].std().item() == pytest.approx(residual_std, rel=0.05)
    assert torch.equal(params["layers.0.attention.wq.bias"], torch.zeros(args.dim))
    assert torch.equal(params["layers.0.ffn_norm.weight"], torch.ones(args.dim))
    # Every tensor has its own stream: two layers of the same shape differ.
    assert not torch.equal(params["layers.0.attention.wq.weight"], params["layers.1.attention.wq.weight"])
    before = {name: param.clone() for name, param in params.items()}
    model.init_weights(seed=4)
    assert not torch.equal(params["layers.0.attention.wq.weight"], before["layers.0.attention.wq.weight"])
    model.init_weights(seed=3)
    assert all(torch.equal(param, before[name]) for name, param in params.items())
    model.init_weights(seed=None)
    none_seed = params["output.weight"].clone()
    model.init_weights(seed=0)
    assert torch.equal(params["output.weight"], none_seed)


def test_init_weights_in_bf16_matches_fp32_and_keeps_fp32_rope():
    reference = Decoder(_debug_args())
    reference.init_weights(seed=5)
    model = Decoder(_debug_args()).to(torch.bfloat16)
    model.init_weights(seed=5)
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value.to(torch.bfloat16)), key
    assert model.rope_cos.dtype == torch.float32
    assert torch.equal(model.rope_cos, reference.rope_cos)


def _materialize_stage(args: ModelArgs, keep_layers: set[str], *, first: bool, last: bool, seed: int) -> Decoder:
    """Build on meta, delete what the stage does not own, then materialize and initialize what is left."""
    with torch.device("meta"):
        stage = Decoder(args)
    for key in list(stage.layers):
        if key not in keep_layers:
            del stage.layers[key]
    if not first:
        stage.tok_embeddings, stage.pos_embeddings = None, None
    if not last:
        stage.norm, stage.output = None, None
    stage.to_empty(device="cpu")
    stage.init_weights(seed)
    return stage


@pytest.mark.parametrize("style", ["qwen", "gpt2"])
@pytest.mark.parametrize("tie_embeddings", [False, True])
def test_pipeline_stages_get_full_model_weights_and_reproduce_its_logits(tie_embeddings, style):
    args = _debug_args(num_layers=4, tie_embeddings=tie_embeddings, style=style)
    full = Decoder(args)
    full.init_weights(seed=21)
    first = _materialize_stage(args, {"0", "1"}, first=True, last=False, seed=21)
    last = _materialize_stage(args, {"2", "3"}, first=False, last=True, seed=21)
    full_state = full.state_dict()
    assert list(last.layers) == ["2", "3"]
    for stage in (first, last):
        for key, value in stage.state_dict().items():
            assert torch.equal(value, full_state[key]), key
    assert "output.weight" not in first.state_dict() and "tok_embeddings.weight" not in last.state_dict()
    tokens = torch.randint(0, VOCAB, (2, 12))
    hidden = first(tokens)  # (batch, seq, dim)
    assert hidden.shape == (2, 12, args.dim)
    assert torch.equal(last(hidden), full(tokens))


def test_gpt2_style_computes_gpt2s_block_written_out_by_hand():
    """LayerNorm pre-norm blocks, learned positions added to the token embedding, multi-head attention without
    rotation and with biases, GELU (tanh) MLP, a tied head: the formulas of GPT-2, sharing no code with the model."""
    args = model_args("gpt2-char", vocab_size=VOCAB, max_seq_len=32)
    model = Decoder(args)
    model.init_weights(seed=5)
    with torch.no_grad():  # the init zeroes biases and sets LayerNorm to 1 / 0: give them values the formulas see
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(0.1 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    tokens = torch.randint(0, VOCAB, (2, 20))
    state = dict(model.named_parameters())

    def layer_norm(x, prefix):
        mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
        return (x - mean) / torch.sqrt(var + args.norm_eps) * state[f"{prefix}.weight"] + state[f"{prefix}.bias"]

    def linear(x, prefix):
        return x @ state[f"{prefix}.weight"].T + state[f"{prefix}.bias"]

    h = state["tok_embeddings.weight"][tokens] + state["pos_embeddings.weight"][:20]
    heads, head_dim = args.num_heads, args.dim // args.num_heads
    for index in range(args.num_layers):
        p = f"layers.{index}"
        x = layer_norm(h, f"{p}.attention_norm")
        q, k, v = (linear(x, f"{p}.attention.w{w}").view(2, 20, heads, head_dim).transpose(1, 2) for w in "qkv")
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(head_dim)
        scores = scores.masked_fill(torch.triu(torch.ones(20, 20, dtype=torch.bool), diagonal=1), float("-inf"))
        h = h + linear((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 20, args.dim), f"{p}.attention.wo")
        x = layer_norm(h, f"{p}.ffn_norm")
        inner = linear(x, f"{p}.feed_forward.w1")
        gelu = 0.5 * inner * (1 + torch.tanh(math.sqrt(2 / math.pi) * (inner + 0.044715 * inner**3)))
        h = h + linear(gelu, f"{p}.feed_forward.w2")
    logits = layer_norm(h, "norm") @ state["tok_embeddings.weight"].T
    assert args.tie_embeddings and model.output.weight is model.tok_embeddings.weight
    torch.testing.assert_close(model(tokens), logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="exceeds max_seq_len=32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_flavor_parameter_counts():
    # Written out once by hand: debug 2 x (12,416 attention + 36,864 ffn + 128 norms) + 2 x 131,072 + 64.
    assert count_parameters(FLAVORS["debug"]) == 361_024
    # tiny: 4 x (49,408 + 147,456 + 256) + 2 x 262,144 + 128.
    assert count_parameters(FLAVORS["tiny"]) == 1_312_896
    for name in list_flavors():
        assert count_parameters(FLAVORS[name]) == _expected_num_params(FLAVORS[name]), name
    # gpt2-char at vocab 257 (one id per byte): 3 x (16,640 + 33,088 + 256) + 257 x 64 + 256 x 64 + 128.
    assert count_parameters(model_args("gpt2-char", vocab_size=257)) == 182_912
    assert 9e6 < count_parameters(FLAVORS["small"]) < 11e6
    assert 27e6 < count_parameters(FLAVORS["medium"]) < 33e6
    # A tied head counts once.
    assert FLAVORS["qwen1.5-0.5b"].tie_embeddings
    assert count_parameters(FLAVORS["qwen1.5-0.5b"]) == _expected_num_params(FLAVORS["qwen1.5-0.5b"])


def test_paper_model_is_counted_on_meta_without_allocating():
    rss_before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    num_params = count_parameters(model_args("qwen1.5-107b"))
    # 107B fp32 parameters would be 428 GB; the meta build must not even touch a few hundred MB.
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before_kib < 300 * 1024
    assert abs(num_params - 107e9) / 107e9 < 0.01
    args = FLAVORS["qwen1.5-107b"]
    assert (args.dim, args.num_heads, args.num_kv_heads, args.ffn_dim, args.vocab_size) == (8192, 64, 8, 49152, 152064)
    assert args.qkv_bias and not args.tie_embeddings and args.rope_theta == 1e6


def test_model_args_fills_vocab_and_overrides_sequence_length():
    args = model_args("tiny", vocab_size=1000, max_seq_len=128)
    assert (args.vocab_size, args.max_seq_len, args.dim) == (1000, 128, 128)
    assert FLAVORS["tiny"].vocab_size == 2048  # the registry entry is not modified
    qwen = model_args("qwen1.5-7b", vocab_size=2048)
    assert qwen.vocab_size == 151936 and qwen.max_seq_len == 32768
    assert model_args("qwen1.5-7b").vocab_size == 151936
    assert list_flavors()[:2] == ["debug", "tiny"] and "qwen1.5-107b" in list_flavors()


def test_model_args_errors_name_the_problem():
    with pytest.raises(
        ValueError, match=r"model\.flavor = 'huge' is not a known flavor.*debug, tiny, small, medium, gpt2-char, qwen1\.5-0\.5b"
    ):
        model_args("huge", vocab_size=100)
    with pytest.raises(ValueError, match=r"vocab_size=200000 does not fit .*'qwen1\.5-1\.8b'.*151936"):
        model_args("qwen1.5-1.8b", vocab_size=200_000)
    with pytest.raises(ValueError, match=r"'tiny' takes its vocab size from the tokenizer; pass vocab_size"):
        model_args("tiny")
    with pytest.raises(ValueError, match=r"vocab_size=0 must be a positive integer"):
        model_args("tiny", vocab_size=0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"dim": 66}, r"dim=66 is not divisible by num_heads=4"),
        ({"dim": 36}, r"head_dim = dim / num_heads = 36 / 4 = 9 is odd"),
        ({"num_kv_heads": 3}, r"num_heads=4 is not divisible by num_kv_heads=3"),
        ({"num_layers": 0}, r"num_layers=0 must be a positive integer"),
        ({"ffn_dim": -1}, r"ffn_dim=-1 must be a positive integer"),
        ({"rope_theta": 0.0}, r"rope_theta=0.0 must be a positive number"),
    ],
)
def test_impossible_shapes_are_rejected(overrides, message):
    args = _debug_args(**overrides)
    with pytest.raises(ValueError, match=message):
        args.validate()
    with pytest.raises(ValueError, match=message):
        Decoder(args)


def test_forward_rejects_bad_inputs():
    model = Decoder(_debug_args())
    with pytest.raises(ValueError, match=r"sequence length 65 exceeds max_seq_len=64"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match=r"expects token ids"):
        model(torch.randn(1, 8, model.args.dim))
    model.tok_embeddings = None
    with pytest.raises(ValueError, match=r"expects hidden states of shape \(batch, seq, 64\)"):
        model(torch.zeros(1, 8, dtype=torch.long))


def test_models_package_does_not_import_torch_distributed():
    for path in pathlib.Path(dilocox.models.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            assert not any(name.startswith("torch.distributed") for name in names), path


def test_debug_model_memorizes_a_fixed_batch():
    torch.manual_seed(0)
    model = Decoder(model_args("debug", vocab_size=VOCAB, max_seq_len=32))
    model.init_weights(seed=0)
    tokens = torch.randint(0, VOCAB, (8, 33))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(30):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(VOCAB), abs=0.1)  # small init: near-uniform predictions
    assert losses[-1] < losses[0] - 2.0, losses


def _loss_and_grads(autocast_dtype=None, checkpointing=False):
    model = Decoder(model_args("debug", vocab_size=128, max_seq_len=32))
    model.init_weights(1)
    model.autocast_dtype, model.activation_checkpointing = autocast_dtype, checkpointing
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128, (4, 33), generator=generator)
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return logits.dtype, loss.item(), torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def test_activation_checkpointing_recomputes_exactly():
    """train.activation_checkpointing trades memory for compute and nothing else: the same loss and gradients."""
    _, loss, grads = _loss_and_grads()
    _, loss_ckpt, grads_ckpt = _loss_and_grads(checkpointing=True)
    assert loss == loss_ckpt and torch.equal(grads, grads_ckpt)


def test_bf16_autocast_keeps_fp32_weights_and_logits():
    """train.dtype = bf16: the forward runs in bf16 (the loss moves), logits and gradients stay fp32."""
    _, loss, grads = _loss_and_grads()
    logits_dtype, loss_bf16, grads_bf16 = _loss_and_grads(torch.bfloat16)
    assert logits_dtype == torch.float32 and grads_bf16.dtype == torch.float32
    assert loss_bf16 != loss and loss_bf16 == pytest.approx(loss, rel=1e-3)
    assert 1e-4 < ((grads_bf16 - grads).norm() / grads.norm()).item() < 0.05


@pytest.mark.slow
def test_compiled_blocks_compute_what_eager_blocks_compute():
    """train.compile: torch.compile of each block (inductor, C++ on the CPU) keeps the loss and the gradients, and
    the parameters keep their names (checkpoints and pipeline stages match by name). About 30 s to compile."""
    from dilocox.config import load_config
    from dilocox.trainer import configure_compute

    _, loss, grads = _loss_and_grads()
    model = Decoder(model_args("debug", vocab_size=128, max_seq_len=32))
    model.init_weights(1)
    names = [name for name, _ in model.named_parameters()]
    configure_compute(model, load_config(None, ["--train.compile=true"]))
    assert [name for name, _ in model.named_parameters()] == names
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128, (4, 33), generator=generator)
    compiled_loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    compiled_loss.backward()
    compiled_grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert compiled_loss.item() == pytest.approx(loss, rel=1e-6)
    torch.testing.assert_close(compiled_grads, grads, rtol=1e-4, atol=1e-6)
