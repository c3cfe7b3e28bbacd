"""SpectralQuant's eigensolvers: canonical eigenvector signs, and the exact `eigh` path against
the paper's block power iteration (eigenvalues, subspaces, rows)."""
import numpy as np
import torch

from schemes.eigen import canonical_signs, eigh_descending, leading_basis


def _covariances(gen, batch, d, spectrum):
    q, _ = np.linalg.qr(gen.standard_normal((*batch, d, d)))
    return torch.from_numpy(q @ (np.asarray(spectrum)[:, None] * np.swapaxes(q, -1, -2)))


def test_canonical_signs_are_a_function_of_the_lines_alone():
    gen = np.random.default_rng(0)
    _, vectors = eigh_descending(_covariances(gen, (3, 2), 16, np.linspace(4, 1, 16)))
    fixed = canonical_signs(vectors)
    peak = fixed.gather(-2, fixed.abs().argmax(-2, keepdim=True))
    assert bool((peak > 0).all())
    flips = torch.from_numpy(gen.choice([-1.0, 1.0], size=(3, 2, 1, 16)))
    assert torch.equal(canonical_signs(vectors * flips), fixed)


def test_leading_basis_has_canonical_signs():
    gen = np.random.default_rng(1)
    d = 32
    cov = _covariances(gen, (4,), d, np.arange(1, d + 1, dtype=float) ** -1.0)
    _, basis, _ = leading_basis(cov, torch.tensor([4, 5, 6, 7]), torch.from_numpy(gen.standard_normal((d, d))))
    assert torch.equal(canonical_signs(basis), basis)
