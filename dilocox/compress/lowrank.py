"""Low-rank factorization by subspace (power) iteration with a warm start: pure tensor functions.

`factorize` is the PowerSGD-style step (Vogels et al. 2019): P = orth(M Q), Q' = M^T P, so M ~= P Q'^T, optionally
followed by a Rayleigh-Ritz rotation that the eigendecomposition of the small (r, r) matrix Q'^T Q' turns into
sorted singular triplets. Sorted triplets let a caller keep any leading subset (the adaptive rank) and give
singular-value estimates for free (the "small core" of the iteration), never a full SVD of a big matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Factors:
    """Rank-r approximation M ~= left @ diag(sigma) @ right.T: unit columns, orthonormal and sorted when from Ritz.

    factors = factorize(matrix, warm_start)           # matrix: (m, n), warm_start: (n, r)
    approx = factors.left * factors.sigma @ factors.right.T
    next_warm_start = factors.right                   # (n, r)
    """

    left: torch.Tensor
    """(m, r) orthonormal columns."""
    sigma: torch.Tensor
    """(r,) sorted: singular-value estimates, descending (Ritz values: each <= the true one); else column norms."""
    right: torch.Tensor
    """(n, r) unit columns (orthonormal when sorted); the warm start of the next round."""

    @property
    def rank(self) -> int:
        return self.sigma.numel()

    def truncate(self, rank: int) -> Factors:
        """The leading `rank` triplets (the best rank-`rank` approximation within this subspace)."""
        return Factors(self.left[:, :rank], self.sigma[:rank], self.right[:, :rank])

    def balanced(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Factors to send, (r, m) and (r, n), each row scaled by sqrt(sigma) so that both have the same magnitude.

        Rows rather than columns: a quantization group then runs along one singular vector, whose entries share a
        scale, instead of mixing components of very different size.
        """
        root = self.sigma.sqrt()  # (r,)
        return (self.left * root).T, (self.right * root).T  # callers flatten them (one copy each)


def orthonormalize(matrix: torch.Tensor) -> torch.Tensor:
    """(m, r) with m >= r -> (m, r) orthonormal columns spanning the same space (reduced QR)."""
    return torch.linalg.qr(matrix, mode="reduced").Q


def factorize(matrix: torch.Tensor, warm_start: torch.Tensor, *, iterations: int = 1, sort: bool = True) -> Factors:
    """Rank-r factors of `matrix` (m, n) from `iterations` subspace iterations started at `warm_start` (n, r).

    Started from last round's right vectors, one iteration is close when the pseudo-gradient's dominant subspace
    moves slowly between rounds, and error feedback carries what it misses; a second one still paid off for the
    adaptive codec (`compression.power_iterations`, default 2: docs/design.md §4.1). An exactly rank-r matrix is
    recovered in one iteration from a generic start. `sort=False` skips the Rayleigh-Ritz step (an (r, r)
    eigendecomposition) when the caller needs neither sorted triplets nor singular values: `right` then has unit
    but not orthogonal columns and `sigma` holds their norms before normalization (the same approximation, not sorted).
    """
    if iterations < 1:
        raise ValueError(f"compression.power_iterations = {iterations} must be >= 1")
    if not bool(torch.isfinite(matrix).all()):
        # Garbage in, garbage visibly out: the receivers' guard sees non-finite values (docs/design.md §4.5)
        # instead of the eigensolver failing on this rank. Honest clusters with the guard never encode these.
        nan = float("nan")
        rank = warm_start.shape[1]
        return Factors(
            left=matrix.new_full((matrix.shape[0], rank), nan),
            sigma=matrix.new_full((rank,), nan),
            right=matrix.new_full((matrix.shape[1], rank), nan),
        )
    right = warm_start  # (n, r)
    for iteration in range(iterations):
        left = orthonormalize(matrix @ right)  # (m, r)
        # (r, m) @ (m, n) reads the matrix row by row, about twice as fast on CPU as matrix.T @ left.
        projected = (left.T @ matrix).T  # (n, r): matrix ~= left @ projected.T
        if iteration + 1 < iterations:
            right = orthonormalize(projected)
    if not sort:
        sigma = torch.linalg.vector_norm(projected, dim=0)  # (r,)
        return Factors(left=left, sigma=sigma, right=projected / torch.where(sigma > 0, sigma, 1.0))
    # Rayleigh-Ritz through the (r, r) Gram matrix: projected^T projected = V S^2 V^T, so with
    # right = projected V / S we get left @ projected.T = (left V) S right^T, sorted. The eigendecomposition of an
    # (r, r) matrix costs a tenth of an SVD of the (n, r) one; small singular values lose relative precision, which
    # neither the product (V is orthogonal, whatever S is) nor the energy share of the leading ones notices.
    eigenvalues, eigenvectors = torch.linalg.eigh(projected.T @ projected)  # ascending: (r,), (r, r)
    rotation = eigenvectors.flip(1)  # (r, r), columns by descending eigenvalue
    sigma = eigenvalues.flip(0).clamp(min=0).sqrt()  # (r,)
    right = (projected @ rotation) / torch.where(sigma > 0, sigma, 1.0)  # (n, r)
    return Factors(left=left @ rotation, sigma=sigma, right=right)


def randomized_factors(
    matrix: torch.Tensor,
    rank: int,
    *,
    oversample: int = 8,
    iterations: int = 2,
    generator: torch.Generator | None = None,
) -> Factors:
    """Randomized SVD (Halko et al. 2011) of `matrix` (m, n): the leading min(rank, m, n) triplets.

    Seeded through `generator` (the Gaussian start is drawn on the CPU) so that it never touches the global RNG,
    which the training loop's reproducibility depends on.
    """
    num_rows, num_cols = matrix.shape
    width = min(rank + oversample, num_rows, num_cols)
    start = torch.randn(num_cols, width, generator=generator, dtype=torch.float32).to(matrix)  # (n, width)
    return factorize(matrix, start, iterations=iterations).truncate(min(rank, width))
