"""A whole scenario in one file: i.i.d. Laplace coordinates of unit variance, published under the
entry-point group kvharness.scenarios by this directory's pyproject.toml."""
from dataclasses import dataclass

import numpy as np

from scenarios import Population, Scenario


@dataclass(frozen=True)
class Laplace(Scenario):
    name = "laplace"
    description = "i.i.d. Laplace coordinates, unit variance"
    scale: float = 1.0

    def validate(self):
        super().validate()                    # NaN and inf are refused for every parameter
        if not self.scale > 0:
            raise ValueError(f"scenario laplace: parameter scale={self.scale} must be positive")

    def population(self, gen, dim):           # E‖k‖² = scale²·d; add `head` to the signature for a per-head law
        return Population(np.eye(dim) * self.scale, np.eye(dim) * self.scale)

    def latent(self, gen, shape):
        return gen.laplace(0.0, 1 / np.sqrt(2), shape)
