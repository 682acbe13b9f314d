"""Error feedback (`ErrorFeedback.compress`) round by round against the textbook loop written out here:

    observe(x_t);  corrected_t = x_t + r_{t-1};  sent_t = decode(encode(corrected_t));  r_t = corrected_t - sent_t

(`observe` lets the adaptive codec measure the spectrum of the pseudo-gradient itself; the others ignore it.)

"sum of what was sent + final residual == sum of the inputs" holds for any residual rule (it is how the residual is
defined), so these tests compare what each round sends instead, and show that the comparison catches the classic
bugs (residual never added, added with the wrong sign, computed from the wrong tensor, given to the wrong tensor).
"""

import pytest
import torch

from dilocox.compress import ErrorFeedback, build_codec

# Two tensors of one shape, so that a residual handed to the wrong tensor still fits it.
SHAPES = [(12, 10), (12, 10), (10,), (6, 2, 4)]
ROUNDS = 4


def pseudo_grads(round_index: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + round_index)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def reference_rounds(codec, rounds) -> list[tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]]:
    """The textbook loop on `codec`: (payload bytes, what the others decode, residuals) of every round."""
    residuals = None
    out = []
    for tensors in rounds:
        codec.observe(tensors)
        if residuals is None:
            corrected = [x.float() for x in tensors]
        else:
            corrected = [x + r for x, r in zip(tensors, residuals, strict=True)]
        payload = codec.encode_list(corrected)
        sent = codec.decode_list(payload, [x.shape for x in tensors])
        residuals = [c - s for c, s in zip(corrected, sent, strict=True)]
        out.append((payload.data, sent, residuals))
    return out


def first_mismatch(feedback, kind: str, options: dict) -> int | None:
    """The first round in which `feedback` sends or keeps something else than the reference loop (None: none)."""
    rounds = [pseudo_grads(t) for t in range(ROUNDS)]
    # Two codecs with the same settings and seed: their state (RNG, warm starts) evolves alike on equal inputs.
    want = reference_rounds(build_codec(kind, **options), rounds)
    codec = build_codec(kind, **options)
    for t, (tensors, (want_bytes, want_sent, want_residuals)) in enumerate(zip(rounds, want, strict=True)):
        payload, sent = feedback.compress(codec, tensors)
        same = payload.nbytes == want_bytes.numel() and all(
            torch.allclose(a, b, rtol=0, atol=1e-6)
            for a, b in zip([*sent, *feedback.residuals], [*want_sent, *want_residuals], strict=True)
        )
        if not same:
            return t
        # what the other clusters decode from the payload is what this cluster believes it sent
        assert payload.nbytes <= codec.max_nbytes_list(SHAPES)
        decoded = codec.decode_list(payload, SHAPES)
        assert all(torch.equal(a, b) for a, b in zip(decoded, sent, strict=True))
    return None


CODECS = [
    ("int4", {"group_size": 8}),
    ("int4", {"group_size": 16, "stochastic_rounding": True, "seed": 3}),
    ("lowrank", {"rank": 1}),
    ("lowrank_int4", {"rank": 2, "group_size": 16}),
    ("adaptive", {"rank_min": 1, "rank_max": 4, "energy": 0.5}),
    ("topk_int4", {"density": 0.25, "chunk_size": 8, "group_size": 4}),
    ("topk_int2", {"density": 0.25, "chunk_size": 8, "group_size": 4}),
    ("topk_sign", {"density": 0.1, "chunk_size": 64, "group_size": 16}),
    ("dct_sign", {"density": 0.1, "chunk_size": 64, "group_size": 16}),
    ("randk_sign", {"density": 0.2, "group_size": 16}),
    ("randk_int2", {"density": 0.2, "group_size": 16, "seed": 5}),
    ("lowrank_topk", {"rank": 1, "density": 0.1, "chunk_size": 16, "group_size": 8}),
]


@pytest.mark.parametrize(("kind", "options"), CODECS, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CODECS)])
def test_error_feedback_matches_the_textbook_loop(kind, options):
    assert first_mismatch(ErrorFeedback(), kind, options) is None


def test_int4_error_feedback_by_hand():
    """int4, groups of 4, round to nearest (ties to even), scale = absmax / 7: every value below is worked out by
    hand. The scales are 1 (absmax 7) and 2 (absmax 14), exact in fp16."""
    codec = build_codec("int4", group_size=4)
    feedback = ErrorFeedback()
    rounds = [
        # input x_t; what is sent, decode(encode(x_t + r_{t-1})); the residual r_t kept for the next round
        (
            [7, 3.25, -1.75, 0.5, 14, -5, 3, 1],
            [7, 3, -2, 0, 14, -4, 4, 0],  # 3.25 -> 3, -1.75 -> -2, 0.5 -> 0; /2: -2.5 -> -2, 1.5 -> 2, 0.5 -> 0
            [0, 0.25, 0.25, 0.5, 0, -1, -1, 1],
        ),
        (
            [-7, 0.5, 0.25, 1, -14, 1, 1, 1],  # + r_1 = [-7, 0.75, 0.5, 1.5 | -14, 0, 0, 2]
            [-7, 1, 0, 2, -14, 0, 0, 2],  # without the residual this round would send [-7, 0, 0, 1 | -14, 0, 0, 0]
            [0, -0.25, 0.5, -0.5, 0, 0, 0, 0],
        ),
        (
            [7, 0, 1, 0, 14, 0, 0, 0],  # + r_2 = [7, -0.25, 1.5, -0.5 | 14, 0, 0, 0]
            [7, 0, 2, 0, 14, 0, 0, 0],
            [0, -0.25, -0.5, -0.5, 0, 0, 0, 0],
        ),
    ]
    for t, (values, want_sent, want_residual) in enumerate(rounds):
        payload, (sent,) = feedback.compress(codec, [torch.tensor(values, dtype=torch.float32)])
        assert sent.tolist() == want_sent, t
        assert feedback.residuals[0].tolist() == want_residual, t
        if t == 0:
            # fp16 scales 1.0 (0x3C00) and 2.0 (0x4000), little-endian; codes q + 8, two per byte, low nibble first
            assert payload.data.tolist() == [0x00, 0x3C, 0x00, 0x40, 0xBF, 0x86, 0x6F, 0x8A]
    # round 2 without feedback, for contrast: what a feedback that never adds its residual would send
    without = codec.decode(codec.encode(torch.tensor(rounds[1][0], dtype=torch.float32)), (8,))
    assert without.tolist() == [-7, 0, 0, 1, -14, 0, 0, 0] != rounds[1][1]


def test_feedback_decay_scales_the_residual_before_adding_it():
    """int4, one group of 4, scale 1 (absmax 7): round 1 leaves [0, 0.25, 0.25, 0.5] behind, as in the test above."""
    codec = build_codec("int4", group_size=4)
    decayed, whole = ErrorFeedback(decay=0.5), ErrorFeedback()
    first, second = torch.tensor([7, 3.25, -1.75, 0.5]), torch.tensor([-7, 0.5, 0.25, 1.0])
    for feedback in (decayed, whole):
        feedback.compress(codec, [first])
        assert feedback.residuals[0].tolist() == [0, 0.25, 0.25, 0.5]
    assert decayed.corrected([second])[0].tolist() == [-7, 0.625, 0.375, 1.25]  # second + 0.5 * residual
    _, (sent,) = decayed.compress(codec, [second])
    assert sent.tolist() == [-7, 1, 0, 1]
    assert decayed.residuals[0].tolist() == [0, -0.375, 0.375, 0.25]
    _, (sent_whole,) = whole.compress(codec, [second])  # second + residual = [-7, 0.75, 0.5, 1.5]
    assert sent_whole.tolist() == [-7, 1, 0, 2]
    with pytest.raises(ValueError, match=r"compression\.feedback_decay = 0"):
        ErrorFeedback(decay=0.0)


# ------------------------------------------------------------------------------ the bugs the comparison must catch


class _Buggy:
    """Error feedback written wrongly in one place (`corrected` or `residual`); the rest is the textbook loop."""

    def __init__(self) -> None:
        self.residuals = None

    def corrected(self, tensors):
        return [x + r for x, r in zip(tensors, self.residuals, strict=True)]

    def residual(self, tensors, corrected, sent):
        return [c - s for c, s in zip(corrected, sent, strict=True)]

    def compress(self, codec, tensors):
        tensors = [x.float() for x in tensors]
        corrected = tensors if self.residuals is None else self.corrected(tensors)
        payload = codec.encode_list(corrected)
        sent = codec.decode_list(payload, [x.shape for x in tensors])
        self.residuals = self.residual(tensors, corrected, sent)
        return payload, sent


class ResidualNotAdded(_Buggy):
    def corrected(self, tensors):
        return tensors


class ResidualSignFlipped(_Buggy):
    def corrected(self, tensors):
        return [x - r for x, r in zip(tensors, self.residuals, strict=True)]


class ResidualOfTheInput(_Buggy):
    """r_t = x_t - sent_t: forgets the residual carried in, which is then lost for good."""

    def residual(self, tensors, corrected, sent):
        return [x - s for x, s in zip(tensors, sent, strict=True)]


class ResidualOfAnotherTensor(_Buggy):
    """Residuals shifted by one place in the list (an off-by-one over the parameters of a stage)."""

    def corrected(self, tensors):
        shifted = [self.residuals[1], self.residuals[0], *self.residuals[2:]]
        return [x + r for x, r in zip(tensors, shifted, strict=True)]


@pytest.mark.parametrize("bug", [ResidualNotAdded, ResidualSignFlipped, ResidualOfTheInput, ResidualOfAnotherTensor])
@pytest.mark.parametrize(("kind", "options"), [CODECS[0], CODECS[2]], ids=["int4", "lowrank"])
def test_the_comparison_catches_classic_feedback_bugs(bug, kind, options):
    """The check above tells each wrong feedback from the right one as soon as there is a residual (round 1)."""
    assert first_mismatch(bug(), kind, options) == 1
