"""Codecs, error feedback and the adaptive rank (dilocox.compress): pure tensor tests, no process group."""

import ast
import copy
import io
import math
import pathlib

import pytest
import torch

import dilocox.compress as compress_package
from dilocox.compress import (
    CODEC_KINDS,
    AdaptiveRank,
    CompressionConfig,
    ErrorFeedback,
    Payload,
    build_codec,
    compression_ratio,
    decode_int4,
    elias_fano,
    encode_int4,
    factorize,
    int4_nbytes,
    pack_int4,
    quantize_int4,
    unpack_int4,
)
from dilocox.compress import int4 as int4_module
from dilocox.compress.config import SPARSE_KINDS, drain_config
from dilocox.compress.lowbit import LowBitFormat
from dilocox.compress.payload import ByteReader

MIXED_SHAPES = [(64, 48), (48,), (3, 5, 7), (1,), (), (2, 2), (0, 4), (4, 5), (33,), (0,), (31, 17), (1, 100)]
NBYTES_SHAPES = [*MIXED_SHAPES, (7,), (64,), (65,), (4, 4), (100, 1), (128, 256), (2, 3, 4, 5)]


def adaptive_rank(**options) -> AdaptiveRank:
    """The spectra below are built for a 90% energy target (`spectrum_keeping`), whatever the default target."""
    return AdaptiveRank(CompressionConfig(kind="adaptive", **{"energy": 0.9, **options}))


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def random_list(shapes, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in shapes]


def matrix_with_spectrum(singular_values: torch.Tensor, num_rows: int, num_cols: int, seed: int = 0) -> torch.Tensor:
    """(num_rows, num_cols) with exactly these singular values (random singular vectors)."""
    generator = torch.Generator().manual_seed(seed)
    left = torch.linalg.qr(torch.randn(num_rows, len(singular_values), generator=generator)).Q
    right = torch.linalg.qr(torch.randn(num_cols, len(singular_values), generator=generator)).Q
    return left * singular_values @ right.T


def spectrum_keeping(rank: int, size: int, head: float = 0.93) -> torch.Tensor:
    """Singular values (size,) whose first `rank` squares hold `head` of the energy in equal parts (rank - 1 hold
    at most 0.93 * (rank - 1) / rank), the rest spread evenly: the 90%-energy rank is exactly `rank`."""
    squares = torch.full((size,), (1 - head) / (size - rank))
    squares[:rank] = head / rank
    return squares.sqrt()


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx - exact).norm() / exact.norm())


# ------------------------------------------------------------------------------------------------------- byte sizes


def hand_nbytes(kind: str, shape, **options) -> int:
    """The byte formulas of the modules' docstrings, written out independently of the codecs."""
    return hand_nbytes_list(kind, [shape], **options)


def hand_nbytes_list(
    kind, shapes, *, rank=8, group_size=64, small_tensors="raw", factor_dtype="fp32", density=0.075, chunk_size=4096
) -> int:
    """The byte formulas of the modules' docstrings for one list of tensors, written out independently of the codecs."""

    def int4_size(count: int) -> int:
        return 2 * math.ceil(count / group_size) + math.ceil(count / 2)

    if kind in ("int2", "sign"):  # every group's fp16 scale, then every value's bits as one stream
        value_bits = {"int2": 2, "sign": 1}[kind]
        numels = [math.prod(shape) for shape in shapes]
        return sum(2 * math.ceil(n / group_size) for n in numels) + math.ceil(value_bits * sum(numels) / 8)
    if kind == "lowrank_topk":  # lowrank_int4's payload, then topk_sign's
        options = dict(rank=rank, group_size=group_size, small_tensors=small_tensors, density=density)
        return hand_nbytes_list("lowrank_int4", shapes, **options) + hand_nbytes_list(
            "topk_sign", shapes, group_size=group_size, density=density, chunk_size=chunk_size
        )
    if kind.startswith("randk_"):  # a 4-byte draw counter, then every tensor's m values as one low-bit section
        kept = [min(math.prod(s), max(1, round(density * math.prod(s)))) if math.prod(s) else 0 for s in shapes]
        value_bits = {"randk_int2": 2, "randk_sign": 1}[kind]
        scales = sum(2 * math.ceil(count / group_size) for count in kept)
        return 4 + scales + math.ceil(value_bits * sum(kept) / 8)
    if kind == "dct_sign":  # the payload of topk_sign on the DCT coefficients
        kind = "topk_sign"
    if kind.startswith("topk_"):
        positions, kept_per_tensor = 0, []
        for shape in shapes:
            numel = math.prod(shape)
            chunks = [chunk_size] * (numel // chunk_size) + ([numel % chunk_size] if numel % chunk_size else [])
            kept = [min(length, max(1, round(density * length))) for length in chunks]
            bits = 0
            for length, count in zip(chunks, kept, strict=True):
                # Elias-Fano: l = floor(log2(L / k)) low bits per position, then a bitmap of k + ((L - 1) >> l) + 1
                # bits; or plain positions of ceil(log2 L) bits each, whichever is shorter
                low = math.floor(math.log2(length / count)) if 2 * count <= length else 0
                plain = count * math.ceil(math.log2(length)) if length > 1 else 0
                bits += min(count * low + count + ((length - 1) >> low) + 1, plain)
            positions += math.ceil(bits / 8)
            kept_per_tensor.append(sum(kept))
        if kind == "topk_int4":
            return positions + sum(int4_size(count) for count in kept_per_tensor)
        value_bits = {"topk_int2": 2, "topk_sign": 1}[kind]
        scales = sum(2 * math.ceil(count / group_size) for count in kept_per_tensor)
        return positions + scales + math.ceil(value_bits * sum(kept_per_tensor) / 8)
    if len(shapes) != 1:
        options = dict(rank=rank, group_size=group_size, small_tensors=small_tensors, factor_dtype=factor_dtype)
        return sum(hand_nbytes(kind, shape, **options) for shape in shapes)
    (shape,) = shapes
    numel = math.prod(shape)
    if kind == "none":
        return 4 * numel
    if kind in ("fp16", "bf16"):
        return 2 * numel
    if kind == "int4":
        return int4_size(numel)
    if len(shape) <= 1:
        return 4 * numel if small_tensors == "raw" else int4_size(numel)
    num_rows, num_cols = shape[0], math.prod(shape[1:])
    if kind == "lowrank_int4":
        size = int4_size
    else:
        itemsize = 4 if factor_dtype == "fp32" else 2
        size = lambda count: itemsize * count  # noqa: E731
    effective = min(rank, num_rows, num_cols)
    if effective * (num_rows + num_cols) >= num_rows * num_cols:
        return 2 + size(num_rows * num_cols)
    return 2 + size(effective * num_rows) + size(effective * num_cols)


@pytest.mark.parametrize(
    "kind, options",
    [
        ("none", {}),
        ("fp16", {}),
        ("bf16", {}),
        ("int4", {}),
        ("int4", {"group_size": 7}),
        ("int4", {"group_size": 128}),
        ("lowrank", {}),
        ("lowrank", {"rank": 2, "factor_dtype": "fp16"}),
        ("lowrank", {"rank": 3, "small_tensors": "int4"}),
        ("lowrank_int4", {}),
        ("lowrank_int4", {"rank": 2, "group_size": 32, "small_tensors": "int4"}),
        ("topk_int4", {}),
        ("topk_int4", {"density": 0.1, "chunk_size": 16, "group_size": 4}),
        ("topk_int4", {"density": 1.0, "chunk_size": 100}),
        ("topk_int4", {"density": 0.3, "chunk_size": 4097}),
        ("topk_int4", {"density": 0.3, "chunk_size": 65536}),
        ("topk_int4", {"density": 1 / 64, "chunk_size": 64}),
        ("topk_int2", {"density": 0.01}),
        ("topk_int2", {"density": 0.1, "chunk_size": 16, "group_size": 4}),
        ("topk_sign", {"density": 0.01}),
        ("topk_sign", {"density": 1 / 64, "chunk_size": 64, "group_size": 128}),
        ("topk_sign", {"density": 1.0, "chunk_size": 7, "group_size": 5}),
        ("dct_sign", {"density": 0.01}),
        ("dct_sign", {"density": 1 / 64, "chunk_size": 64}),
        ("int2", {}),
        ("sign", {"group_size": 7}),
        ("randk_sign", {"density": 0.08}),
        ("randk_int2", {"density": 0.3, "group_size": 5}),
        ("lowrank_topk", {"rank": 2, "density": 0.05, "chunk_size": 64}),
    ],
)
def test_nbytes_match_hand_formula_and_payloads(kind, options):
    codec = build_codec(kind, **options)
    for shape in NBYTES_SHAPES:
        expected = hand_nbytes(kind, shape, **options)
        assert codec.expected_nbytes(shape) == expected, shape
        assert codec.max_nbytes(shape) == expected, shape
        assert codec.encode(randn(*shape)).nbytes == expected, shape
    tensors = random_list(NBYTES_SHAPES, seed=1)
    payload = codec.encode_list(tensors)
    assert payload.nbytes == payload.data.numel() == codec.expected_nbytes_list(NBYTES_SHAPES)
    assert payload.nbytes == hand_nbytes_list(kind, NBYTES_SHAPES, **options)
    assert codec.max_nbytes_list(NBYTES_SHAPES) == payload.nbytes


def test_lowrank_sends_dense_when_factors_are_not_smaller():
    codec = build_codec("lowrank", rank=2)
    square = randn(4, 4)  # 2 * (4 + 4) = 16 >= 16: dense, and exact in fp32
    payload = codec.encode(square)
    assert payload.data[:2].tolist() == [0, 0] and payload.nbytes == 2 + 4 * 16
    assert torch.equal(codec.decode(payload, square.shape), square)
    wide = randn(4, 5)  # 2 * 9 = 18 < 20: low rank, header = rank 2 (little-endian)
    payload = codec.encode(wide)
    assert payload.data[:2].tolist() == [2, 0] and payload.nbytes == 2 + 4 * 18


# -------------------------------------------------------------------------------------------------------- round trips


def test_none_is_bit_identical():
    values = randn(1000)
    values[:6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45])
    tensors = [values.view(10, 100), randn(3, 5, 7), torch.tensor(3.5)]
    codec = build_codec("none")
    decoded = codec.decode_list(codec.encode_list(tensors), [t.shape for t in tensors])
    for original, roundtrip in zip(tensors, decoded, strict=True):
        assert roundtrip.dtype == torch.float32
        assert torch.equal(roundtrip.view(torch.int32), original.view(torch.int32))


@pytest.mark.parametrize("kind, bits", [("fp16", 11), ("bf16", 8)])
def test_half_precision_round_trip_error(kind, bits):
    values = randn(50, 40)
    codec = build_codec(kind)
    decoded = codec.decode(codec.encode(values), values.shape)
    assert ((decoded - values).abs() <= values.abs() * 2.0**-bits + 1e-7).all()


def test_bf16_input_is_accepted_and_decoded_as_fp32():
    values = randn(16, 8).to(torch.bfloat16)
    codec = build_codec("none")
    decoded = codec.decode(codec.encode(values), values.shape)
    assert decoded.dtype == torch.float32 and torch.equal(decoded, values.float())


@pytest.mark.parametrize("kind", CODEC_KINDS)
def test_encode_list_round_trip_over_mixed_shapes(kind):
    tensors = random_list(MIXED_SHAPES, seed=2)
    sender = build_codec(kind, rank=4, rank_min=2, rank_max=8)
    payload = sender.encode_list(tensors)
    # The receiver knows only the settings and the shapes.
    receiver = build_codec(kind, rank=4, rank_min=2, rank_max=8)
    decoded = receiver.decode_list(Payload(payload.data.clone()), MIXED_SHAPES)
    assert [d.shape for d in decoded] == [torch.Size(s) for s in MIXED_SHAPES]
    assert all(d.dtype == torch.float32 for d in decoded)
    for original, approx in zip(tensors, decoded, strict=True):
        if original.numel() == 0:
            continue
        if (original.dim() <= 1 and kind not in SPARSE_KINDS) or kind in ("none", "fp16", "bf16"):
            tolerance = {"int4": 0.2, "lowrank_int4": 0.2, "adaptive": 0.2, "int2": 0.45, "sign": 0.7}.get(kind, 0.01)
            assert relative_error(approx, original) <= tolerance
    if kind in ("none", "fp16", "bf16", "int4", "int2", "sign"):
        # Elementwise: the list payload decodes exactly like each tensor encoded alone.
        for original, approx in zip(tensors, decoded, strict=True):
            assert torch.equal(approx, sender.decode(sender.encode(original), original.shape))


def test_decode_rejects_a_payload_that_does_not_fit_the_shapes():
    codec = build_codec("lowrank_int4", rank=2)
    payload = codec.encode_list(random_list([(16, 12), (12,)]))
    with pytest.raises(ValueError, match="same compression settings"):
        codec.decode_list(payload, [(16, 12)])  # bytes left over
    with pytest.raises(ValueError, match="same compression settings"):
        codec.decode_list(payload, [(16, 12), (12,), (5,)])  # payload ends early
    corrupted = payload.data.clone()
    corrupted[0] = 200  # rank 200 for a (16, 12) matrix
    with pytest.raises(ValueError, match="rank 200"):
        codec.decode_list(Payload(corrupted), [(16, 12), (12,)])


def test_payload_helpers():
    first, second = Payload(torch.arange(5, dtype=torch.uint8)), Payload(torch.arange(3, dtype=torch.uint8))
    joined = Payload.concat([first, second])
    assert joined.nbytes == 8
    assert [part.data.tolist() for part in joined.split([5, 3])] == [first.data.tolist(), second.data.tolist()]
    assert Payload.concat([]).nbytes == 0
    with pytest.raises(ValueError, match="uint8"):
        Payload(torch.zeros(4))
    with pytest.raises(ValueError, match="add up"):
        joined.split([4, 3])
    assert compression_ratio(100, 100) == 4.0
    assert compression_ratio(400, 100) == 1.0
    with pytest.raises(ValueError, match="payload_nbytes"):
        compression_ratio(0, 10)


# -------------------------------------------------------------------------------------------------------------- int4


def pack_reference(codes: list[int]) -> list[int]:
    """Slow, obvious nibble packing: pairs low-then-high, an odd tail padded with code 8 (the value 0)."""
    padded = codes + [8] * (len(codes) % 2)
    return [padded[i] | (padded[i + 1] << 4) for i in range(0, len(padded), 2)]


@pytest.mark.parametrize("length", [0, 1, 2, 3, 9, 63, 64, 65, 1001])
def test_int4_pack_unpack_bit_exact(length):
    codes = torch.randint(0, 16, (length,), generator=torch.Generator().manual_seed(length), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.tolist() == pack_reference(codes.tolist())
    assert torch.equal(unpack_int4(packed, length), codes)
    # Bytes -> codes -> bytes is exact too (an odd length's pad nibble is the canonical 8).
    assert torch.equal(pack_int4(unpack_int4(packed, length)), packed)


@pytest.mark.parametrize("length, group_size", [(1, 64), (63, 64), (64, 64), (1000, 64), (1001, 128), (77, 7)])
def test_int4_error_is_at_most_half_a_scale(length, group_size):
    values = randn(length, seed=length) * torch.logspace(-6, 1, length)  # groups of very different magnitude
    values[: min(length, group_size)] *= 0 if length > group_size else 1  # an all-zero group when there are several
    data = encode_int4(values, group_size)
    assert data.numel() == int4_nbytes(length, group_size)
    num_groups = math.ceil(length / group_size)
    scales = data[: 2 * num_groups].clone().view(torch.float16).float()  # the scales exactly as sent
    scale_of_value = scales.repeat_interleave(group_size)[:length]
    decoded = decode_int4(data, length, group_size)
    assert ((decoded - values).abs() <= scale_of_value / 2 * (1 + 1e-6)).all()
    # Every scale covers its group's absmax with codes in [-7, 7].
    absmax = torch.nn.functional.pad(values.abs(), (0, -length % group_size)).view(-1, group_size).amax(1)
    assert (scales * 7 >= absmax).all()
    codes, _ = quantize_int4(values, group_size)
    assert int(codes.min()) >= 1 and int(codes.max()) <= 15


def test_int4_runs_encode_like_separate_runs_in_small_windows(monkeypatch):
    """The batched, windowed path against per-run quantization (the obvious reference)."""
    lengths = [0, 1, 5, 64, 65, 127, 1000, 3]
    runs = random_list([(length,) for length in lengths], seed=3)
    for group_size in (64, 7):
        scales, codes = [], []
        for run in runs:
            if run.numel():
                run_codes, run_scales = quantize_int4(run, group_size)
                scales.append(run_scales)
                codes.append(pack_int4(run_codes))
        reference = torch.cat([torch.cat(scales).view(torch.uint8), *codes])
        for window in (1 << 20, 16, 130):
            monkeypatch.setattr(int4_module, "WINDOW", window)
            int4_module._decode_plan.cache_clear()
            data = int4_module.encode_int4_runs(runs, group_size)
            assert torch.equal(data, reference)
            decoded = int4_module.decode_int4_runs(data, lengths, group_size)
            for run, approx in zip(runs, decoded, strict=True):
                expected = int4_module.dequantize_int4(*quantize_int4(run, group_size), group_size)
                assert torch.equal(approx, expected)
    int4_module._decode_plan.cache_clear()


def test_int4_stochastic_rounding_is_unbiased_and_reproducible():
    values = randn(256, seed=4)
    tiled = values.repeat(2000)  # the same groups 2000 times: same scales, independent rounding noise
    stochastic = build_codec("int4", stochastic_rounding=True, seed=7)
    decoded = stochastic.decode(stochastic.encode(tiled), tiled.shape).view(2000, 256)
    scale = float(values.view(-1, 64).abs().amax(1).max()) / 7
    assert float((decoded.mean(0) - values).abs().max()) < 0.06 * scale  # 5 sigma of the mean of 2000
    nearest = build_codec("int4").decode(build_codec("int4").encode(values), values.shape)
    assert float((nearest - values).abs().max()) > 0.2 * scale  # the deterministic bias the test would catch
    # Reproducible from the seed, different across seeds, and never drawn from the global RNG.
    global_state = torch.random.get_rng_state()
    first = build_codec("int4", stochastic_rounding=True, seed=7).encode(values)
    again = build_codec("int4", stochastic_rounding=True, seed=7).encode(values)
    other = build_codec("int4", stochastic_rounding=True, seed=8).encode(values)
    assert torch.equal(first.data, again.data) and not torch.equal(first.data, other.data)
    assert torch.equal(torch.random.get_rng_state(), global_state)


# ----------------------------------------------------------------------------------------------------------- lowrank


def test_topk_keeps_the_largest_of_every_chunk_and_nothing_else():
    codec = build_codec("topk_int4", density=0.25, chunk_size=8, group_size=3)
    values = randn(3, 7, seed=5)  # 21 values: chunks of 8, 8 and 5 keep 2, 2 and 1
    decoded = codec.decode(codec.encode(values), values.shape).reshape(-1)
    flat = values.reshape(-1)
    kept_positions = []
    for start, length, kept in ((0, 8, 2), (8, 8, 2), (16, 5, 1)):
        chunk, got = flat[start : start + length], decoded[start : start + length]
        largest = chunk.abs().topk(kept).indices
        assert set(torch.nonzero(got).reshape(-1).tolist()) == set(largest.tolist()), start
        kept_positions += sorted((start + largest).tolist())
    # The 5 kept values, in order of position, are one run: groups of 3 span the chunks.
    for group in (kept_positions[:3], kept_positions[3:]):
        half_scale = float(flat[group].abs().max()) / 7 / 2 * 1.001  # the fp16 scale is rounded up
        assert float((decoded[group] - flat[group]).abs().max()) <= half_scale, group


@pytest.mark.parametrize("chunk_size", [4000, 5000, 100_000])  # a last chunk of 2000 / 0 / all 10,000 values
def test_topk_positions_round_trip_for_any_chunk_size(chunk_size):
    codec = build_codec("topk_int4", density=0.05, chunk_size=chunk_size)
    values = randn(100, 100, seed=8)
    decoded = codec.decode(codec.encode(values), values.shape).reshape(-1)
    flat = values.reshape(-1)
    for start in range(0, flat.numel(), chunk_size):
        chunk = flat[start : start + chunk_size]
        largest = chunk.abs().topk(codec.kept(chunk.numel())).indices
        assert set(torch.nonzero(decoded[start : start + chunk_size]).reshape(-1).tolist()) == set(largest.tolist())


@pytest.mark.parametrize("universe, count", [(4096, 307), (4096, 1), (4096, 4096), (4096, 2049), (7, 3), (1, 1)])
def test_elias_fano_round_trips_and_takes_its_bits(universe, count):
    """Every chunk's code is exactly nbits long; sets at the edges (the first and last positions, every position,
    a single one) come back; 307 of 4096 take 5.7 bits each, under half of a 12-bit position."""
    generator = torch.Generator().manual_seed(universe + count)
    rows = 5
    positions = torch.stack([torch.randperm(universe, generator=generator)[:count].sort().values for _ in range(rows)])
    positions[0, 0], positions[-1, -1] = 0, universe - 1  # both ends of the range
    positions = positions.sort(dim=1).values.unique_consecutive(dim=1) if count > 1 else positions
    bits = elias_fano.encode(positions, universe=universe)
    assert bits.numel() == rows * elias_fano.nbits(universe, count)
    data = elias_fano.pack_bits(bits)
    assert data.numel() == math.ceil(bits.numel() / 8)
    decoded = elias_fano.decode(elias_fano.unpack_bits(data, bits.numel()), rows, universe=universe, count=count)
    assert torch.equal(decoded, positions)
    if (universe, count) == (4096, 307):
        assert elias_fano.nbits(universe, count) / count == pytest.approx(5.67, abs=0.01)


def test_elias_fano_rejects_codes_no_sorted_positions_give():
    positions = torch.tensor([[1, 5, 6, 12]])
    bits = elias_fano.encode(positions, universe=16)  # l = 2: 8 low bits, then 4 + 4 high bits (plain: 16 too)
    assert not elias_fano.is_plain(16, 4) and bits.numel() == 16
    extra = bits.clone()
    extra[8] = 1 - extra[8]  # one set bit too many or too few in the high part
    with pytest.raises(ValueError, match="does not hold 4 positions"):
        elias_fano.decode(extra, 1, universe=16, count=4)
    swapped = elias_fano.encode(torch.tensor([[1, 6, 5, 12]]), universe=16)  # not ascending: 6 then 5 in one bucket
    with pytest.raises(ValueError, match="out of order"):
        elias_fano.decode(swapped, 1, universe=16, count=4)
    plain = elias_fano.encode(torch.tensor([[6, 5]]), universe=8)  # two 3-bit positions: 6 < Elias-Fano's 8
    assert elias_fano.is_plain(8, 2) and plain.tolist() == [0, 1, 1, 1, 0, 1]
    with pytest.raises(ValueError, match="out of order"):
        elias_fano.decode(plain, 1, universe=8, count=2)


@pytest.mark.parametrize(
    "universe, count, bits",
    [(64, 1, 6), (4096, 1, 12), (128, 2, 14), (256, 4, 32), (4096, 64, 512), (1, 1, 0), (2, 1, 1), (16, 3, 12)],
)
def test_position_codes_take_the_shorter_of_elias_fano_and_plain(universe, count, bits):
    """A few positions go plain (one of 64 in 6 bits, Elias-Fano's 8); ties and larger counts go Elias-Fano."""
    assert elias_fano.nbits(universe, count) == bits
    ef = elias_fano.ef_nbits(universe, count)
    assert bits == min(ef, count * math.ceil(math.log2(universe)))
    positions = torch.randperm(universe, generator=torch.Generator().manual_seed(count))[:count].sort().values
    code = elias_fano.encode(positions.view(1, -1), universe=universe)
    assert code.numel() == bits
    assert torch.equal(elias_fano.decode(code, 1, universe=universe, count=count), positions.view(1, -1))


def test_topk_at_density_one_is_int4_of_every_value_in_order():
    codec = build_codec("topk_int4", density=1.0, chunk_size=16, group_size=16)
    values = randn(16, seed=6)
    assert torch.equal(codec.decode(codec.encode(values), (16,)), decode_int4(encode_int4(values, 16), 16, 16))


def test_topk_error_feedback_sends_a_constant_pseudo_gradient_in_full_over_rounds():
    """What a round leaves out waits in the residual until it is among the largest: over many rounds the decoded
    updates add up to the inputs, where the codec alone drops nine tenths of every round."""
    codec = build_codec("topk_int4", density=0.1, chunk_size=50, group_size=8)
    feedback = ErrorFeedback()
    value = randn(10, 20, seed=7)
    total = torch.zeros_like(value)
    rounds = 100
    for _ in range(rounds):
        _, (sent,) = feedback.compress(codec, [value])
        total += sent
    assert torch.allclose(total + feedback.residuals[0], rounds * value, atol=1e-3)
    assert relative_error(total / rounds, value) < 0.1
    assert relative_error(codec.decode(codec.encode(value), value.shape), value) > 0.5


def test_topk_rejects_a_corrupt_position_code_and_state_of_other_settings():
    codec = build_codec("topk_int4", density=0.25, chunk_size=32)
    # chunks of 32 and 8 keep 8 and 2: Elias-Fano of 8 x 2 low bits (bytes 0-1) and an 8 + 7 + 1-bit bitmap (bytes
    # 2-3), then two plain 3-bit positions (byte 4, bits 0-5)
    payload = codec.encode(randn(40))
    assert codec.position_nbytes(40) == 5
    corrupted = payload.data.clone()
    corrupted[2:4] = 0xFF  # the bitmap sets 16 bits where the chunk keeps 8 positions
    with pytest.raises(ValueError, match="does not hold 8 positions per chunk of 32"):
        codec.decode_list(Payload(corrupted), [(40,)])
    corrupted = payload.data.clone()
    corrupted[4] = 0b000_111  # the last chunk's positions 7 then 0
    with pytest.raises(ValueError, match="out of order"):
        codec.decode_list(Payload(corrupted), [(40,)])
    with pytest.raises(ValueError, match="density, chunk_size"):
        build_codec("topk_int4", density=0.5, chunk_size=32).load_state_dict(codec.state_dict())


# ---------------------------------------------------------------------------------------------------- 1 and 2 bits


def lowbit_reference(runs, bits: int, group_size: int) -> tuple[list[float], list[int]]:
    """Slow, obvious 1- and 2-bit quantization of runs, value by value: every group's scale and every value's code.

    1 bit: scale = mean |x|, code 1 for x >= 0. 2 bits: levels (-3, -1, 1, 3) x scale, scale from mean |x| / 2, then
    twice: nearest level (|x| > 2 scale -> 3), least-squares scale sum |x| level / sum level^2."""
    scales, codes = [], []
    for run in runs:
        values = run.tolist()
        for start in range(0, len(values), group_size):
            group = values[start : start + group_size]
            scale = sum(abs(x) for x in group) / len(group)
            level = [1.0] * len(group)
            if bits == 2:
                scale /= 2
                for _ in range(2):
                    level = [3.0 if abs(x) > 2 * scale else 1.0 for x in group]
                    scale = sum(abs(x) * q for x, q in zip(group, level, strict=True)) / sum(q * q for q in level)
            scales.append(scale)
            for x, q in zip(group, level, strict=True):
                if bits == 1:
                    codes.append(0 if x < 0 else 1)
                else:
                    codes.append((1 if q == 1 else 0) if x < 0 else (2 if q == 1 else 3))
    return scales, codes


@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("lengths, group_size", [([1], 64), ([5, 0, 70, 3], 64), ([13, 13], 4), ([100], 7)])
def test_lowbit_bytes_are_the_reference_bit_for_bit(bits, lengths, group_size):
    """Scales as fp16, then the codes of every run as one bit stream (lowest bit first), padded once at the end."""
    runs = random_list([(length,) for length in lengths], seed=sum(lengths) + bits)
    fmt = LowBitFormat(bits, group_size)
    data = fmt.encode_runs(runs)
    scales, codes = lowbit_reference(runs, bits, group_size)
    stream = [(code >> j) & 1 for code in codes for j in range(bits)]
    stream += [0] * (-len(stream) % 8)
    code_bytes = [sum(bit << j for j, bit in enumerate(stream[i : i + 8])) for i in range(0, len(stream), 8)]
    want_scales = torch.tensor(scales, dtype=torch.float32).to(torch.float16)
    assert data.numel() == fmt.section_nbytes(lengths) == 2 * len(scales) + math.ceil(bits * sum(lengths) / 8)
    assert torch.equal(data[: 2 * len(scales)], want_scales.view(torch.uint8))
    assert data[2 * len(scales) :].tolist() == code_bytes
    decoded = fmt.decode_runs(ByteReader(data), lengths)
    levels = {1: [-1, 1], 2: [-3, -1, 1, 3]}[bits]
    group_of = [first + i // group_size for length, first in zip(lengths, _firsts(lengths, group_size), strict=True)
                for i in range(length)]  # fmt: skip
    want = [levels[c] * float(want_scales[g]) for c, g in zip(codes, group_of, strict=True)]
    assert torch.cat(decoded).tolist() == want


def _firsts(lengths, group_size):
    """The index of each run's first group."""
    firsts, first = [], 0
    for length in lengths:
        firsts.append(first)
        first += -(-length // group_size)
    return firsts


def test_lowbit_scales_are_least_squares_and_errors_bounded():
    """1 bit: the mean |x| is the best scale of the signs; 2 bits: the fitted scale is the best for the codes sent,
    and Gaussian values keep about the textbook error (1 bit: sqrt(1 - 2 / pi) = 0.60; 2 bits: about 0.35)."""
    values = randn(64 * 200, seed=11)
    for bits, bound in ((1, 0.61), (2, 0.36)):
        fmt = LowBitFormat(bits, 64)
        (decoded,) = fmt.decode_runs(ByteReader(fmt.encode_runs([values])), [values.numel()])
        assert relative_error(decoded, values) < bound, bits
        groups, approx = values.view(-1, 64), decoded.view(-1, 64)
        for factor in (0.97, 1.03):  # any other scale of the same codes does worse, group by group
            assert ((approx * factor - groups).square().sum(1) >= (approx - groups).square().sum(1) * 0.999).all()
    zeros = LowBitFormat(1, 4).encode_runs([torch.zeros(6)])  # a zero group decodes to zeros
    assert LowBitFormat(1, 4).decode_runs(ByteReader(zeros), [6])[0].tolist() == [0.0] * 6


def test_topk_sign_at_density_one_is_the_sign_format_of_every_value():
    codec = build_codec("topk_sign", density=1.0, chunk_size=16, group_size=8)
    values = randn(40, seed=6)
    fmt = LowBitFormat(1, 8)
    want = fmt.decode_runs(ByteReader(fmt.encode_runs([values])), [40])[0]
    assert torch.equal(codec.decode(codec.encode(values), (40,)), want)
    sent = codec.decode(codec.encode(values), (40,))
    assert torch.equal(sent.sign(), values.sign())


def slow_dct(values: list[float]) -> list[float]:
    """The orthonormal DCT-II of one block, term by term."""
    size = len(values)
    return [
        math.sqrt((1 if k else 0.5) * 2 / size)
        * sum(x * math.cos(math.pi / size * (i + 0.5) * k) for i, x in enumerate(values))
        for k in range(size)
    ]


def slow_idct(coefficients: list[float]) -> list[float]:
    """Its inverse (the DCT-III), term by term."""
    size = len(coefficients)
    return [
        sum(
            math.sqrt((1 if k else 0.5) * 2 / size) * c * math.cos(math.pi / size * (i + 0.5) * k)
            for k, c in enumerate(coefficients)
        )
        for i in range(size)
    ]


def test_dct_sign_is_topk_sign_of_the_dct_of_every_block_of_64():
    """Blocks of 64 go through the DCT (the last 10 values of 138 as they are), topk_sign encodes the coefficients,
    and the receiver applies the inverse DCT: parity with a term-by-term reference."""
    values = randn(138, seed=9)
    codec = build_codec("dct_sign", density=2 / 64, chunk_size=64, group_size=8)
    inner = build_codec("topk_sign", density=2 / 64, chunk_size=64, group_size=8)
    blocks = [values[i : i + 64].tolist() for i in (0, 64)]
    coefficients = torch.tensor([c for block in blocks for c in slow_dct(block)] + values[128:].tolist())
    sent = inner.decode(inner.encode(coefficients), (138,)).double()
    want = [x for i in (0, 64) for x in slow_idct(sent[i : i + 64].tolist())] + sent[128:].tolist()
    payload = codec.encode(values)
    assert payload.nbytes == inner.expected_nbytes((138,))
    got = codec.decode(payload, (138,))
    assert got.tolist() == pytest.approx(want, abs=1e-5)
    assert torch.equal(inner.decode(payload, (138,)) != 0, sent != 0)  # the wire holds the coefficients' top-k
    state = codec.state_dict()
    assert state["kind"] == "dct_sign"
    build_codec("dct_sign", density=2 / 64, chunk_size=64, group_size=8).load_state_dict(state)
    with pytest.raises(ValueError, match="density, chunk_size"):
        build_codec("dct_sign", density=0.5, chunk_size=64).load_state_dict(state)


def test_randk_draws_the_same_stratified_positions_on_every_cluster_and_new_ones_each_round():
    shapes = [(10, 30), (7,), (0, 3)]
    first, second = build_codec("randk_sign", density=0.1, seed=3), build_codec("randk_sign", density=0.1, seed=3)
    sent = []
    for draws in range(3):
        tensors = random_list(shapes, seed=draws)
        payload, other = first.encode_list(tensors), second.encode_list(random_list(shapes, seed=10 + draws))
        assert payload.data[:4].tolist() == [draws, 0, 0, 0] and first.draws == draws + 1
        decoded = build_codec("randk_sign", density=0.1, seed=3).decode_list(payload, shapes)  # stateless decoding
        kept = [torch.nonzero(d.reshape(-1)).reshape(-1) for d in decoded]
        assert [k.tolist() for k in kept] == [p.tolist() for p in first.positions([300, 7, 0], draws)]
        others = [torch.nonzero(d.reshape(-1)).reshape(-1) for d in second.decode_list(other, shapes)]
        assert [k.tolist() for k in kept] == [k.tolist() for k in others]  # the same positions on both clusters
        assert kept[0].numel() == 30 and kept[1].numel() == 1
        assert (kept[0] // 10).tolist() == list(range(30))  # one position in each stratum of 10
        signs = decoded[0].reshape(-1)[kept[0]].sign()
        assert torch.equal(signs, tensors[0].reshape(-1)[kept[0]].sign())
        sent.append(kept[0].tolist())
    assert sent[0] != sent[1] != sent[2]
    assert build_codec("randk_sign", density=0.1, seed=4).positions([300], 0)[0].tolist() != sent[0]
    state = first.state_dict()
    resumed = build_codec("randk_sign", density=0.1, seed=3)
    resumed.load_state_dict(state)
    assert resumed.draws == 3
    with pytest.raises(ValueError, match="density"):
        build_codec("randk_sign", density=0.2, seed=3).load_state_dict(state)


def test_lowrank_topk_sends_low_rank_then_the_top_k_signs_of_what_it_missed():
    tensors = random_list([(64, 48), (48,), (3, 5, 7)], seed=12)
    shapes = [t.shape for t in tensors]
    hybrid = build_codec("lowrank_topk", rank=2, density=0.05, chunk_size=64)
    first = build_codec("lowrank_int4", rank=2)
    second = build_codec("topk_sign", density=0.05, chunk_size=64)
    head = first.encode_list(tensors)
    low = first.decode_list(head, shapes)
    tail = second.encode_list([t - d for t, d in zip(tensors, low, strict=True)])
    payload = hybrid.encode_list(tensors)
    assert torch.equal(payload.data, torch.cat([head.data, tail.data]))  # the same warm starts and draws
    decoded = build_codec("lowrank_topk", rank=2, density=0.05, chunk_size=64).decode_list(payload, shapes)
    for got, a, b in zip(decoded, low, second.decode_list(tail, shapes), strict=True):
        assert torch.equal(got, a + b)
    assert relative_error(decoded[0], tensors[0]) < relative_error(low[0], tensors[0])
    resumed = build_codec("lowrank_topk", rank=2, density=0.05, chunk_size=64)
    resumed.load_state_dict(hybrid.state_dict())
    assert torch.equal(resumed.encode_list(tensors).data, hybrid.encode_list(tensors).data)  # warm starts restored


def test_lowrank_recovers_an_exactly_low_rank_matrix():
    generator = torch.Generator().manual_seed(5)
    matrix = torch.randn(96, 4, generator=generator) @ torch.randn(4, 80, generator=generator)
    codec = build_codec("lowrank", rank=4)
    assert relative_error(codec.decode(codec.encode(matrix), matrix.shape), matrix) < 1e-5
    # A 3-D tensor is the matrix (shape[0], rest): rank 3 over (12, 4 * 10).
    tensor = (torch.randn(12, 3, generator=generator) @ torch.randn(3, 40, generator=generator)).view(12, 4, 10)
    codec = build_codec("lowrank", rank=3)
    assert relative_error(codec.decode(codec.encode(tensor), tensor.shape), tensor) < 1e-5
    # fp16 factors: the same up to half precision; int4 factors: about int4's 11% on each of the two factors.
    half = build_codec("lowrank", rank=4, factor_dtype="fp16")
    assert relative_error(half.decode(half.encode(matrix), matrix.shape), matrix) < 2e-3
    quantized = build_codec("lowrank_int4", rank=4)
    assert relative_error(quantized.decode(quantized.encode(matrix), matrix.shape), matrix) < 0.2


def test_lowrank_warm_start_converges_to_the_truncated_svd():
    singular_values = 0.7 ** torch.arange(40, dtype=torch.float32)
    matrix = matrix_with_spectrum(singular_values, 64, 48, seed=6)
    optimal = float(singular_values[4:].square().sum().sqrt() / singular_values.square().sum().sqrt())
    # The slow, obvious reference: a full SVD truncated to rank 4.
    u, s, vh = torch.linalg.svd(matrix)
    assert relative_error(u[:, :4] * s[:4] @ vh[:4], matrix) == pytest.approx(optimal, rel=1e-3)
    codec = build_codec("lowrank", rank=4)
    errors = [relative_error(codec.decode(codec.encode(matrix), matrix.shape), matrix) for _ in range(20)]
    assert errors[-1] < errors[0]
    assert errors[-1] <= optimal * 1.01
    # A random matrix: every round is no worse than rank-4 truncation allows, and no better.
    noise = randn(64, 48, seed=7)
    flat_optimal = float(torch.linalg.svdvals(noise)[4:].square().sum().sqrt() / noise.norm())
    assert flat_optimal - 1e-4 <= relative_error(codec.decode(codec.encode(noise), noise.shape), noise) <= 1.0


def test_factorize_sorted_triplets_match_the_svd():
    singular_values = torch.logspace(0, -3, 30)
    matrix = matrix_with_spectrum(singular_values, 50, 40, seed=8)
    factors = factorize(matrix, randn(40, 10, seed=9), iterations=6)
    # Leading Ritz values converge first; the last of the subspace lags by (s_11 / s_10)^(2 * iterations).
    assert torch.allclose(factors.sigma[:8], singular_values[:8], rtol=1e-4)
    assert torch.allclose(factors.sigma, singular_values[:10], rtol=1e-2)
    assert (factors.sigma <= singular_values[:10] * (1 + 1e-5)).all()  # Ritz values never overestimate
    assert torch.allclose(factors.left.T @ factors.left, torch.eye(10), atol=1e-5)
    assert torch.allclose(factors.right.T @ factors.right, torch.eye(10), atol=1e-3)


def test_warm_start_state_dict_round_trip_gives_identical_next_payload():
    shapes = [(40, 30), (30,), (20, 3, 5)]
    first_round, second_round = random_list(shapes, seed=10), random_list(shapes, seed=11)
    for kind in ("lowrank", "lowrank_int4", "adaptive"):
        original = build_codec(kind, rank=3, rank_max=8, stochastic_rounding=True, seed=1)
        original.encode_list(first_round)
        buffer = io.BytesIO()
        torch.save(original.state_dict(), buffer)  # as a checkpoint would store it
        buffer.seek(0)
        restored = build_codec(kind, rank=3, rank_max=8, stochastic_rounding=True, seed=99)
        restored.load_state_dict(torch.load(buffer))
        expected = original.encode_list(second_round)
        assert torch.equal(restored.encode_list(second_round).data, expected.data), kind
        fresh = build_codec(kind, rank=3, rank_max=8, stochastic_rounding=True, seed=1)
        assert not torch.equal(fresh.encode_list(second_round).data, expected.data), kind  # the state matters
    with pytest.raises(ValueError, match="compression.kind"):
        build_codec("lowrank").load_state_dict(build_codec("int4").state_dict())


def test_lowrank_does_not_touch_the_global_rng():
    state = torch.random.get_rng_state()
    build_codec("lowrank_int4", rank=4).encode_list(random_list([(30, 20), (20,)]))
    adaptive_rank(rank_max=4).update([randn(30, 20)])
    assert torch.equal(torch.random.get_rng_state(), state)


# --------------------------------------------------------------------------------------------------- error feedback


def test_error_feedback_state_and_pass_through():
    shapes = [(12, 10), (10,)]
    rounds = [random_list(shapes, seed=30 + index) for index in range(3)]
    codec = build_codec("lowrank_int4", rank=2)
    feedback = ErrorFeedback()
    feedback.compress(codec, rounds[0])
    restored_codec, restored = build_codec("lowrank_int4", rank=2), ErrorFeedback()
    restored_codec.load_state_dict(copy.deepcopy(codec.state_dict()))
    restored.load_state_dict(copy.deepcopy(feedback.state_dict()))
    for pseudo_grads in rounds[1:]:
        payload, _ = feedback.compress(codec, pseudo_grads)
        assert torch.equal(restored.compress(restored_codec, pseudo_grads)[0].data, payload.data)
    with pytest.raises(ValueError, match="ErrorFeedback"):
        feedback.compress(codec, random_list([(12, 10)]))
    # Disabled: encode and decode what is given, keep nothing.
    off = ErrorFeedback(enabled=False)
    codec = build_codec("int4")
    payload, decoded = off.compress(codec, rounds[0])
    assert off.residuals is None
    assert torch.equal(payload.data, codec.encode_list(rounds[0]).data)
    assert all(torch.equal(a, b) for a, b in zip(decoded, codec.decode_list(payload, shapes), strict=True))


def test_error_feedback_undo_returns_to_the_residuals_before_the_last_encoding_and_survives_a_checkpoint():
    shapes = [(12, 10), (10,)]
    rounds = [random_list(shapes, seed=40 + index) for index in range(3)]
    codec = build_codec("topk_int4", density=0.1)
    feedback = ErrorFeedback(undoable=True)
    feedback.compress(codec, rounds[0])
    feedback.undo()  # the first encoding left out: nothing was held back before it
    assert feedback.residuals is None
    feedback.compress(codec, rounds[0])
    after_first = [r.clone() for r in feedback.residuals]
    feedback.compress(codec, [4 * t for t in rounds[1]])  # a lie, left out: back to what the first round left
    restored = ErrorFeedback(undoable=True)
    restored.load_state_dict(copy.deepcopy(feedback.state_dict()))  # a checkpoint while its sync is in flight
    for undone in (feedback, restored):
        undone.undo()
        assert all(torch.equal(a, b) for a, b in zip(undone.residuals, after_first, strict=True))
    # the next encoding is the one that round 1 alone would have led to, bit for bit
    straight = ErrorFeedback()
    straight.compress(codec, rounds[0])
    expected, _ = straight.compress(codec, rounds[2])
    assert torch.equal(feedback.compress(codec, rounds[2])[0].data, expected.data)
    assert feedback.state_bytes(130) == 2 * straight.state_bytes(130)  # the copy it keeps to undo
    # not undoable (or resumed without the copy): undo forgets every residual, as reset does
    straight.undo()
    assert straight.residuals is None


# --------------------------------------------------------------------------------------------------------- adaptive


def test_adaptive_rank_finds_the_90_percent_energy_rank():
    for rank in (3, 5, 7):
        matrix = matrix_with_spectrum(spectrum_keeping(rank, 64), 96, 64, seed=rank)
        policy = adaptive_rank(rank_min=1, rank_max=16, energy=0.9, window=1)
        assert policy.update([matrix, randn(64)]) == rank  # 1-D tensors carry no spectrum
        assert policy.history[-1].raw_rank == rank and policy.ranks == [rank]


def test_adaptive_rank_clips_to_its_range():
    matrix = matrix_with_spectrum(spectrum_keeping(5, 64), 96, 64)
    assert adaptive_rank(rank_min=7, rank_max=16, energy=0.9, window=1).update([matrix]) == 7  # raw rank 5
    assert adaptive_rank(rank_min=1, rank_max=3, energy=0.9, window=1).update([matrix]) == 3
    assert adaptive_rank(rank_min=2, rank_max=16).update([torch.zeros(10, 8)]) == 2  # no energy: the minimum


def test_adaptive_rank_rules_give_several_matrices_one_rank():
    large = matrix_with_spectrum(spectrum_keeping(3, 64), 96, 64, seed=1) * math.sqrt(20)
    small = matrix_with_spectrum(spectrum_keeping(7, 64), 96, 64, seed=2)
    picks = {
        rule: adaptive_rank(rank_min=1, rank_max=16, window=1, rank_rule=rule).update([large, small])
        for rule in ("pooled", "mean", "max")
    }
    # Pooled energy is dominated by the large matrix; the mean of (3, 7) is 5; the max is 7.
    assert picks == {"pooled": 3, "mean": 5, "max": 7}


def test_adaptive_budget_ranks_keep_the_pooled_energy_for_the_fewest_values():
    """Matrix A: squared sigmas 8, 1, 1 at 1 value per rank; B: 4, 4, 2 at 2 values per rank; 20 in all. Keeping 90%
    (18) by energy per value takes A 8, B 4, B 4, then A 1, A 1 (ratio 1, before B's 2 / 2 = 1 by order): ranks
    (3, 2), 7 values. Each matrix at 90% of its own energy would take (2, 3): 8 values for the same 18."""
    spectra = [torch.tensor([8.0, 1.0, 1.0]).sqrt(), torch.tensor([4.0, 4.0, 2.0]).sqrt()]
    budget = adaptive_rank(rank_rule="budget", rank_min=1, rank_max=3, window=1)
    budget.update_from_spectra(spectra, [10.0, 10.0], [1, 2])
    assert budget.history[-1].matrix_raw_ranks == (3, 2) and budget.history[-1].matrix_ranks == (3, 2)
    per_matrix = adaptive_rank(rank_rule="per_matrix", rank_min=1, rank_max=3, window=1)
    per_matrix.update_from_spectra(spectra, [10.0, 10.0])
    assert per_matrix.history[-1].matrix_ranks == (2, 3)
    # a target the estimated spectra cannot reach sends every matrix at rank_max
    short = adaptive_rank(rank_rule="budget", rank_min=1, rank_max=3, window=1)
    short.update_from_spectra(spectra, [10.0, 20.0], [1, 2])  # B's 3 singular values hold half of its energy
    assert short.history[-1].matrix_raw_ranks == (3, 3)


def test_adaptive_rank_smooths_over_its_window():
    low = matrix_with_spectrum(spectrum_keeping(3, 64), 96, 64)
    high = matrix_with_spectrum(spectrum_keeping(7, 64), 96, 64)
    policy = adaptive_rank(rank_min=1, rank_max=16, window=2)
    ranks, raw_ranks = [], []
    for matrix in (low, high, high, low):
        ranks.append(policy.update([matrix]))
        raw_ranks.append(policy.history[-1].raw_rank)
    assert raw_ranks == [3, 7, 7, 3]
    assert ranks == [3, 5, 7, 5]
    assert policy.ranks == [7, 5] and policy.rounds == 4  # the last `window` decisions are kept
    # The state carries the window: a restored policy makes the same next choice.
    restored = adaptive_rank(rank_min=1, rank_max=16, window=2)
    restored.load_state_dict(copy.deepcopy(policy.state_dict()))
    assert restored.history == policy.history and restored.rounds == 4
    assert restored.update([high]) == policy.update([high]) == 5


def test_adaptive_schedules_move_the_target_in_opposite_directions():
    options = {"energy": 0.9, "energy_floor": 0.5, "ramp_rounds": 4, "rank_min": 1, "rank_max": 24, "window": 1}
    early = adaptive_rank(schedule="early_strong", **options)
    late = adaptive_rank(schedule="late_strong", **options)
    flat = adaptive_rank(schedule="spectrum", **options)
    assert [early.target_energy(t) for t in (0, 2, 4, 9)] == pytest.approx([0.5, 0.7, 0.9, 0.9])
    assert [late.target_energy(t) for t in (0, 2, 4, 9)] == pytest.approx([0.9, 0.7, 0.5, 0.5])
    assert [flat.target_energy(t) for t in (0, 2, 4, 9)] == pytest.approx([0.9] * 4)
    # A smoothly decaying spectrum: a lower target keeps fewer directions.
    matrix = matrix_with_spectrum(0.85 ** torch.arange(48, dtype=torch.float32), 64, 48)
    early_ranks = [early.update([matrix]) for _ in range(5)]
    late_ranks = [late.update([matrix]) for _ in range(5)]
    assert early_ranks == sorted(early_ranks) and early_ranks[0] < early_ranks[-1]
    assert late_ranks == sorted(late_ranks, reverse=True) and late_ranks[0] > late_ranks[-1]
    assert early_ranks[-1] == late_ranks[0]


def test_adaptive_codec_sends_the_chosen_rank():
    matrix = matrix_with_spectrum(spectrum_keeping(5, 48), 64, 48, seed=3)
    tensors = [matrix, randn(48)]
    codec = build_codec("adaptive", rank_min=2, rank_max=16, energy=0.9, window=1)
    for _ in range(4):  # the warm start sharpens the measured spectrum round after round
        payload = codec.encode_list(tensors)
    assert codec.policy.rank == 5 and codec.policy.rounds == 4
    assert payload.data[:2].tolist() == [5, 0]  # the rank travels in the matrix's header
    assert payload.nbytes == codec.nbytes_at_rank((64, 48), 5) + 4 * 48
    assert codec.expected_nbytes((64, 48)) is None and codec.expected_nbytes((48,)) == 4 * 48
    assert codec.expected_nbytes((3, 4)) == 2 + int4_nbytes(12, 64)  # dense at every rank
    receiver = build_codec("adaptive", rank_min=2, rank_max=16, energy=0.9, window=1)
    decoded = receiver.decode_list(payload, [t.shape for t in tensors])
    assert relative_error(decoded[0], matrix) < math.sqrt(0.07) + 0.05  # the 7% tail is all it drops
    assert torch.equal(decoded[1], tensors[1])


def exact_rank(rank: int, num_rows: int, num_cols: int, *, seed: int, noise: float = 1e-4) -> torch.Tensor:
    """A matrix of exactly `rank` equal singular values of 1 plus Gaussian noise of std `noise` per entry."""
    noise_matrix = noise * randn(num_rows, num_cols, seed=seed + 100)
    return matrix_with_spectrum(torch.ones(rank), num_rows, num_cols, seed=seed) + noise_matrix


def test_adaptive_rank_of_a_matrix_of_known_rank_is_that_rank_per_matrix_under_error_feedback():
    """Each matrix of known rank r (plus tiny noise) is sent at rank r, round after round, under error feedback:
    per matrix, read from the pseudo-gradient (the defaults `rank_rule = per_matrix`, `spectrum_of = pseudo_grad`)."""
    shapes = [(96, 64), (80, 48), (64, 64)]
    true_ranks = [3, 6, 1]
    codec = build_codec("adaptive", rank_min=1, rank_max=24, energy=0.9, window=1, group_size=16)
    feedback = ErrorFeedback()
    for round_index in range(4):
        pseudo_grads = [
            exact_rank(r, *shape, seed=10 * round_index + i)
            for i, (r, shape) in enumerate(zip(true_ranks, shapes, strict=True))
        ]
        payload, _ = feedback.compress(codec, [*pseudo_grads, randn(7)])
        decision = codec.policy.history[-1]
        assert decision.matrix_raw_ranks == decision.matrix_ranks == tuple(true_ranks)
        assert payload.data[:6].view(torch.int16).tolist() == true_ranks  # the headers carry each matrix's rank
        assert decision.rank == math.ceil(sum(true_ranks) / 3) == codec.current_rank()  # the round record's rank
    # the per-matrix decisions survive a checkpoint
    restored = build_codec("adaptive", rank_min=1, rank_max=24, energy=0.9, window=1, group_size=16)
    restored.load_state_dict(copy.deepcopy(codec.state_dict()))
    assert restored.policy.history == codec.policy.history


def test_adaptive_rank_reads_the_pseudo_gradient_not_the_residual_that_builds_up():
    """The same pseudo-gradient every round, 93% of its energy in 4 directions: its 90% rank is 4. Error feedback
    piles the dropped 7% tail into the residual, so the spectrum of pseudo-gradient + residual flattens and the rank
    read there climbs round after round (the rule before, `spectrum_of = codec_input`); read from the
    pseudo-gradient it stays 4."""
    pseudo_grads = [matrix_with_spectrum(spectrum_keeping(4, 48), 64, 48, seed=5)]
    options = {"rank_min": 1, "rank_max": 24, "energy": 0.9, "window": 1}
    codec, feedback = build_codec("adaptive", **options), ErrorFeedback()
    old_rule, old_feedback = build_codec("adaptive", spectrum_of="codec_input", **options), ErrorFeedback()
    ranks, old_ranks = [], []
    for _ in range(6):
        feedback.compress(codec, pseudo_grads)
        old_feedback.compress(old_rule, pseudo_grads)
        ranks.append(codec.policy.rank)
        old_ranks.append(old_rule.policy.rank)
    assert ranks == [4] * 6
    assert old_ranks[-1] > old_ranks[0] and old_ranks[-1] > 4


def test_adaptive_schedules_give_different_rank_sequences_on_the_same_pseudo_gradients():
    """On the same decaying spectra, spectrum / early_strong / late_strong choose different ranks round by round,
    per matrix: early_strong climbs, late_strong falls, spectrum stays."""
    decaying = [matrix_with_spectrum(0.8 ** torch.arange(48, dtype=torch.float32), 64, 48, seed=s) for s in (1, 2)]
    options = {"energy": 0.95, "energy_floor": 0.5, "ramp_rounds": 4, "rank_min": 1, "rank_max": 24, "window": 1}
    sequences = {}
    for schedule in ("spectrum", "early_strong", "late_strong"):
        codec, feedback = build_codec("adaptive", schedule=schedule, **options), ErrorFeedback()
        sequences[schedule] = []
        for _ in range(5):
            feedback.compress(codec, decaying)
            sequences[schedule].append(codec.policy.history[-1].matrix_ranks)
    assert len({tuple(seq) for seq in sequences.values()}) == 3
    assert len(set(sequences["spectrum"])) == 1
    early, late = [r[0] for r in sequences["early_strong"]], [r[0] for r in sequences["late_strong"]]
    assert early == sorted(early) and early[0] < early[-1]
    assert late == sorted(late, reverse=True) and late[0] > late[-1]


def test_adaptive_history_and_its_state_stay_within_the_window_and_resume_exactly():
    """Over many rounds the policy keeps the decisions of the last `window` rounds only: its history and its
    checkpointed state have the same exact size at round 3 as at round 40, and a codec restored from the state of
    round 17 (early_strong: the schedule's clock matters) encodes the next rounds byte for byte like the codec that
    never stopped. A state saved while every round was kept (the layout before the window) resumes the same way."""
    options = {"rank_min": 1, "rank_max": 12, "window": 3, "schedule": "early_strong", "ramp_rounds": 30}
    options |= {"energy": 0.95, "energy_floor": 0.5, "group_size": 16}

    def pseudo_grads(round_index: int) -> list[torch.Tensor]:
        decaying = 0.75 ** torch.arange(24, dtype=torch.float32)
        return [
            matrix_with_spectrum(decaying, 40, 24, seed=round_index),
            matrix_with_spectrum(decaying[:16] * (1 + round_index % 3), 32, 32, seed=100 + round_index),
            randn(24, seed=200 + round_index),
        ]

    def state_size(state: dict) -> dict[str, tuple[int, ...]]:
        return {key: tuple(value.shape) for key, value in state.items() if key != "generator"}

    codec, feedback = build_codec("adaptive", **options), ErrorFeedback()
    decisions, sizes, saved = [], {}, None
    for round_index in range(40):
        feedback.compress(codec, pseudo_grads(round_index))
        decisions.append(codec.policy.history[-1])
        assert len(codec.policy.history) == min(round_index + 1, 3) and codec.policy.rounds == round_index + 1
        if round_index + 1 in (3, 17, 40):
            sizes[round_index + 1] = state_size(codec.policy.state_dict())
        if round_index + 1 == 17:
            saved = copy.deepcopy((codec.state_dict(), feedback.state_dict()))
            legacy_policy = {
                "history": torch.tensor(
                    [[d.round, d.target_energy, d.raw_rank, d.rank] for d in decisions], dtype=torch.float64
                ),
                "matrix_ranks": torch.tensor([[d.matrix_raw_ranks, d.matrix_ranks] for d in decisions]),
                "generator": codec.policy.generator.get_state(),
            }
    assert sizes[3] == sizes[17] == sizes[40] == {"history": (3, 4), "matrix_ranks": (3, 2, 2)}
    assert [d.round for d in decisions] == list(range(40))
    assert len({d.target_energy for d in decisions}) > 10  # the ramp moved the target: the clock was read
    for legacy in (False, True):
        codec_state, feedback_state = copy.deepcopy(saved)
        if legacy:
            codec_state["policy"] = legacy_policy
        restored, restored_feedback = build_codec("adaptive", **options), ErrorFeedback()
        restored.load_state_dict(codec_state)
        restored_feedback.load_state_dict(feedback_state)
        assert restored.policy.rounds == 17 and list(restored.policy.history) == decisions[14:17]
        again, again_feedback = build_codec("adaptive", **options), ErrorFeedback()
        again.load_state_dict(copy.deepcopy(saved[0]))
        again_feedback.load_state_dict(copy.deepcopy(saved[1]))
        for round_index in range(17, 40):
            payload, _ = restored_feedback.compress(restored, pseudo_grads(round_index))
            assert restored.policy.history[-1] == decisions[round_index]
            assert torch.equal(payload.data, again_feedback.compress(again, pseudo_grads(round_index))[0].data)


def test_payloads_of_different_sizes_are_walked_in_a_concatenation():
    shapes = [(64, 48), (48,)]
    low = [matrix_with_spectrum(spectrum_keeping(3, 48), 64, 48), randn(48)]
    high = [matrix_with_spectrum(spectrum_keeping(9, 48), 64, 48), randn(48, seed=1)]
    sender_a = build_codec("adaptive", rank_min=1, rank_max=16, energy=0.9, window=1)
    sender_b = build_codec("adaptive", rank_min=1, rank_max=16, energy=0.9, window=1)
    payload_a, payload_b = sender_a.encode_list(low), sender_b.encode_list(high)
    assert payload_a.nbytes != payload_b.nbytes
    assert max(payload_a.nbytes, payload_b.nbytes) <= sender_a.max_nbytes_list(shapes)
    wire = Payload.concat([payload_a, payload_b])
    receiver = build_codec("adaptive", rank_min=1, rank_max=16, energy=0.9, window=1)
    first, offset = receiver.decode_list_at(wire, shapes)
    second, end = receiver.decode_list_at(wire, shapes, offset)
    assert (offset, end) == (payload_a.nbytes, wire.nbytes)
    assert torch.equal(first[1], low[1]) and torch.equal(second[1], high[1])
    assert all(torch.equal(a, b) for a, b in zip(second, receiver.decode_list(payload_b, shapes), strict=True))


# ------------------------------------------------------------------------------------------------------ bad options


@pytest.mark.parametrize(
    "kind, options, field",
    [
        ("zip", {}, "compression.kind"),
        ("lowrank", {"rank": 0}, "compression.rank"),
        ("lowrank_int4", {"rank": 70000}, "compression.rank"),
        ("int4", {"group_size": 0}, "compression.group_size"),
        ("lowrank", {"small_tensors": "fp8"}, "compression.small_tensors"),
        ("lowrank", {"factor_dtype": "int8"}, "compression.factor_dtype"),
        ("int4", {"stochastic_rounding": "yes"}, "compression.stochastic_rounding"),
        ("int4", {"seed": -1}, "run.seed"),
        ("lowrank", {"power_iterations": 0}, "compression.power_iterations"),
        ("adaptive", {"rank_min": 0}, "compression.rank_min"),
        ("adaptive", {"rank_min": 8, "rank_max": 4}, "compression.rank_max"),
        ("adaptive", {"energy": 1.5}, "compression.energy"),
        ("adaptive", {"energy": 0.8, "energy_floor": 0.9}, "compression.energy_floor"),
        ("adaptive", {"window": 0}, "compression.window"),
        ("adaptive", {"schedule": "cosine"}, "compression.schedule"),
        ("adaptive", {"ramp_rounds": 0}, "compression.ramp_rounds"),
        ("adaptive", {"rank_rule": "median"}, "compression.rank_rule"),
        ("int4", {"feedback_decay": 1.5}, "compression.feedback_decay"),
        ("topk_int4", {"density": 0.0}, "compression.density"),
        ("topk_int4", {"density": 1.5}, "compression.density"),
        ("topk_int4", {"chunk_size": 0}, "compression.chunk_size"),
    ],
)
def test_bad_options_raise_value_error_naming_the_field(kind, options, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")) as error:
        build_codec(kind, **options)
    if kind == "zip":
        assert all(name in str(error.value) for name in CODEC_KINDS)


def test_compress_never_imports_torch_distributed():
    for path in pathlib.Path(compress_package.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import | ast.ImportFrom) else []
            module = (node.module or "") if isinstance(node, ast.ImportFrom) else ""
            assert not any(name.startswith("torch.distributed") for name in [*names, module]), path


def test_state_bytes_count_the_warm_starts():
    """The memory report's outer state includes the low-rank codecs' warm starts: one (n, r) fp32 per matrix."""
    codec = build_codec("lowrank_int4", rank=4)
    assert codec.state_bytes() == 0
    codec.encode_list(random_list([(30, 20), (20,), (16, 40)]))
    assert codec.state_bytes() == 4 * (20 * 4 + 40 * 4)  # Q of (30, 20) is (20, 4), of (16, 40) is (40, 4)
    assert build_codec("int4").state_bytes() == 0


def test_the_drained_residual_goes_dense_at_the_width_of_the_codecs_values():
    """sync.drain_residual sends every value once at the end: in 1 or 2 bits for the codecs whose values are that
    narrow, in int4 for the others; always without error feedback, with the codec's group size."""
    widths = {"int2": 2.25, "sign": 1.25, "int4": 4.25}  # bits a value at groups of 64
    for kind in CODEC_KINDS:
        drain = drain_config(CompressionConfig(kind=kind, group_size=64))
        want = "sign" if kind.endswith("_sign") else "int2" if kind.endswith("_int2") else "int4"
        assert drain.kind == want and not drain.error_feedback and drain.group_size == 64, kind
        assert build_codec(drain).expected_nbytes((64 * 1000,)) * 8 == widths[want] * 64 * 1000
