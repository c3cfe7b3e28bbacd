"""The Scheme protocol, the Encoded container and the bit ledger.

Shapes (DESIGN.md): k, v (B, H, S, d); q (B, H, Nq, d); logits (B, H, Nq, S). B indexes
independent trials (caches); a scheme never mixes trials, so its output for one trial does
not depend on which others share the batch.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .rng import check_family


@dataclass
class Encoded:
    """A compressed cache, holding exactly what a deployment would store.

    codes: tensors with leading dim B, one slice per trial (packed uint8 codes, float32
        norms, ...); side: tensors shared by every cache the scheme encodes (codebooks,
        packed rotation signs, bases). shape: the (B, H, S, d) of the original k and v;
        dtype: the dtype decode returns.
    """
    shape: tuple[int, int, int, int]
    dtype: torch.dtype
    codes: dict[str, torch.Tensor] = field(default_factory=dict)
    side: dict[str, torch.Tensor] = field(default_factory=dict)
    # For a codes entry padded to the longest trial of the batch (variable-length streams), the
    # bits each trial's own copy occupies, (B,); for a side entry that only some trials need
    # (the codebook of a width only some trials use), its bits for the trials that need it and
    # 0 for the others: a trial's ledger then does not depend on the batch it was coded in.
    exact_bits: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def n_trials(self) -> int:
        return self.shape[0]


def stored_bits(tensor: torch.Tensor) -> int:
    """Bits a tensor occupies as stored: elements × element width (uint8 holds packed codes)."""
    return tensor.numel() * tensor.element_size() * 8


@dataclass(frozen=True)
class BitLedger:
    """Bits one trial's cache occupies, by component, measured from the stored tensors.

    Side data shared by every cache of the scheme (codebooks, rotations, bases) is charged
    in full to each cache: the honest cost of a cache that stands alone.
    """
    components: dict[str, int]
    n_elements: int  # elements of K and V together: 2·H·S·d

    @property
    def total(self) -> int:
        return sum(self.components.values())

    @property
    def bits_per_element(self) -> float:
        return self.total / self.n_elements

    @classmethod
    def of(cls, enc: Encoded) -> "BitLedger":
        """The ledger of the stored tensors, per trial (padding of variable-length streams included)."""
        b, h, s, d = enc.shape
        parts = {f"codes.{k}": stored_bits(t) // b for k, t in enc.codes.items()}
        parts.update({f"side.{k}": stored_bits(t) for k, t in enc.side.items()})
        return cls(parts, 2 * h * s * d)

    @staticmethod
    def per_trial_bits_per_element(enc: Encoded) -> torch.Tensor:
        """Bits per element of each trial (B,), float64: as `of`, but a variable-length stream
        counts the bits its own trial needs (Encoded.exact_bits), not the batch's padding."""
        b, h, s, d = enc.shape
        total = torch.zeros(b, dtype=torch.float64)
        for key, t in enc.codes.items():
            exact = enc.exact_bits.get(key)
            total += exact.detach().cpu().double() if exact is not None else float(stored_bits(t) // b)
        for key, t in enc.side.items():
            exact = enc.exact_bits.get(key)
            total += exact.detach().cpu().double() if exact is not None else float(stored_bits(t))
        return total / (2 * h * s * d)



def call_with_optional(method, *args, **optional):
    """method(*args, **the optional keywords its signature names): how the runner hands a scheme
    what only some schemes take (encode's token `positions`, fit's trial indices `trials`)
    without widening the protocol for every other one."""
    taken = inspect.signature(method).parameters
    return method(*args, **{name: value for name, value in optional.items() if name in taken})

@dataclass
class Scheme:
    """Base class of every codec: configuration in the constructor, work in the methods.

    Subclasses set `name` and implement encode/decode; fit is a no-op for
    data-independent schemes; score defaults to q·k̂ᵀ/√d.
    """
    name: ClassVar[str] = ""
    budget: int
    dim: int
    seed: int = 0
    rng: str = "pcg64"  # bit-generator family of the scheme's own randomness (schemes.rng)

    def validate(self) -> None:
        """Raise ValueError naming the problem and what is valid; called by `create`."""
        check_family(self.rng)

    def diagnostics(self) -> dict[str, torch.Tensor]:
        """Per-trial facts of the last fit, (B,) each, stored beside the metrics when their name
        is one of harness.store.DIAGNOSTIC_COLUMNS (e.g. d_eff_k of a calibrated basis)."""
        return {}

    def fit(self, k_cal: torch.Tensor, v_cal: torch.Tensor) -> "Scheme":
        """Calibrate on k_cal, v_cal (B, H, n_cal, d); data-independent schemes ignore them."""
        return self

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> Encoded:
        raise NotImplementedError

    def decode(self, enc: Encoded) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    @property
    def scores_on_codes(self) -> bool:
        """True when `score` is not q·k̂ᵀ/√d (the runner then calls it instead of reusing k̂)."""
        return type(self).score is not Scheme.score

    def score(self, q: torch.Tensor, enc: Encoded) -> torch.Tensor:
        """Attention logits (B, H, Nq, S) from q (B, H, Nq, d) and the compressed cache."""
        k_hat, _ = self.decode(enc)
        return q @ k_hat.transpose(-1, -2) / math.sqrt(self.dim)

    def kept(self, enc: Encoded) -> torch.Tensor | None:
        """The tokens the cache still holds, bool (B, H, S), for a codec that evicts tokens (h2o,
        streaming); None, the default, when it holds every token. Evicted tokens decode to zero;
        attention over an evicting cache is the softmax over the kept tokens (stats.metrics)."""
        return None

    def bits(self, enc: Encoded) -> BitLedger:
        return BitLedger.of(enc)
