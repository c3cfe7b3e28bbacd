"""The Scheme protocol, the Encoded container and the bit ledger.

Shapes (DESIGN.md): k, v (B, H, S, d); q (B, H, Nq, d); logits (B, H, Nq, S). B indexes
independent trials (caches); a scheme never mixes trials, so its output for one trial does
not depend on which others share the batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvcommon import compiled
from kvcommon.memo import IdentityMemo
from kvcommon.rng import check_family


@dataclass
class Encoded:
    """A compressed cache, holding exactly what a deployment would store.

    codes: tensors with leading dim B, one slice per trial (packed uint8 codes, float32
        norms, per-trial packed rotation signs and sketch seeds, ...); side: tensors stored once
        for the whole batch (codebooks). shape: the (B, H, S, d) of the original k and v; dtype:
        the dtype decode returns.
    model: the keys (of codes or side) of the per-model constants (DESIGN.md, Scheme `bits`):
        entries shared by every cache a layer-head ever stores, calibrated on separate tokens
        (SQ's bases and allocation tables) or data-independent (Lloyd–Max codebooks, rotation
        signs, QJL projections, seeds). Every other entry is per cache: a function of this
        cache's tokens, or fitted on them. The codes/side split says how a tensor is shared
        across the batch; the model set says who pays for it in a deployment.
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
    model: set[str] = field(default_factory=set)

    @property
    def n_trials(self) -> int:
        return self.shape[0]

    def add(self, part: "Encoded") -> None:
        """Take in part, the coding of one tensor (PerTensorScheme.coded): its codes, side tables
        and model keys; an exact_bits entry both hold (a side table K and V share) counts the
        larger of the two, as a scheme coding into one Encoded counts it."""
        self.codes.update(part.codes)
        self.side.update(part.side)
        for key, bits in part.exact_bits.items():
            self.exact_bits[key] = torch.maximum(self.exact_bits[key], bits) if key in self.exact_bits else bits
        self.model |= part.model


def stored_bits(tensor: torch.Tensor) -> int:
    """Bits a tensor's own elements occupy: elements × element width (uint8 holds packed codes)."""
    return tensor.numel() * tensor.element_size() * 8


def entry_bits(enc: "Encoded") -> dict[tuple[str, str], int]:
    """Bits each entry ("codes" or "side", key) of enc occupies as serialized: its elements
    (stored_bits), and the bits of its storage that no entry's elements cover. torch.save writes
    a view's whole storage (once, however many entries view it), so a one-element view of a tensor
    holding the whole cache stores the whole cache; the uncovered bits go to the entry with the
    largest view of that storage. For a codec whose entries own their storage, exactly
    stored_bits."""
    entries = [(part, key, t) for part in ("codes", "side") for key, t in getattr(enc, part).items()]
    bits = {(part, key): stored_bits(t) for part, key, t in entries}
    by_storage: dict[tuple, list] = {}
    for part, key, t in entries:
        by_storage.setdefault((t.device, t.untyped_storage().data_ptr()), []).append((part, key, t))
    for views in by_storage.values():
        uncovered = views[0][2].untyped_storage().nbytes() * 8 - sum(bits[p, k] for p, k, _ in views)
        if uncovered > 0:
            part, key, _ = max(views, key=lambda view: bits[view[0], view[1]])
            bits[part, key] += uncovered
    return bits


def nonzero_bits(tensor: torch.Tensor) -> torch.Tensor:
    """8 × the non-zero bytes of each trial's slice of a codes entry (B, ...), float64 (B,): what a
    trial's own copy holds at least, whatever its layout (a batch pads with zeros), so the floor
    under the bits it may claim (Encoded.exact_bits)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8).reshape(len(tensor), -1)
    return 8 * (flat != 0).sum(dim=1).cpu().double()


def _check_model_keys(enc: Encoded) -> None:
    unknown = sorted(enc.model - enc.codes.keys() - enc.side.keys())
    if unknown:
        raise ValueError(f"Encoded.model names entries that are not stored: {', '.join(unknown)}")
    both = sorted(enc.model & enc.codes.keys() & enc.side.keys())
    if both:
        raise ValueError(f"Encoded.model names keys stored in both codes and side: {', '.join(both)}")


@dataclass(frozen=True)
class TrialBits:
    """Bits of each trial's stored cache, (B,) float64 each (whole numbers), in the two parts
    deployments pay differently (DESIGN.md, Scheme `bits`): `cache`, what this cache's tokens
    cost, and `model`, the per-model constants it uses, summed over its n_heads layer-heads.
    n_elements: 2·H·S·d, the elements of K and V together."""
    cache: torch.Tensor
    model: torch.Tensor
    n_heads: int
    n_elements: int

    @property
    def bits_per_element(self) -> torch.Tensor:
        """Per-cache bits per element (B,)."""
        return self.cache / self.n_elements

    @property
    def model_bits(self) -> torch.Tensor:
        """Model bits per layer-head (B,)."""
        return self.model / self.n_heads

    @property
    def model_bits_per_element(self) -> torch.Tensor:
        """Model bits amortised over this one cache (B,)."""
        return self.model / self.n_elements

    def storage_bits_per_element(self, model_caches: int | None = None) -> torch.Tensor:
        """Per-cache bits plus the model constants amortised over `model_caches` caches (B,);
        per-cache bits alone when None. model_caches = 1 is the stand-alone cache: (cache +
        model)/n_elements, summed in whole bits, so it equals the undivided ledger exactly."""
        if model_caches is None:
            return self.bits_per_element
        return (self.cache + self.model / model_caches) / self.n_elements

    @property
    def standalone_bits_per_element(self) -> torch.Tensor:
        """A cache that stands alone, model constants charged in full (B,)."""
        return self.storage_bits_per_element(1)

    def __add__(self, other: "TrialBits") -> "TrialBits":
        """Two segments of the same trials' caches (a prefill and its decode tokens) as one."""
        if self.n_heads != other.n_heads or self.cache.shape != other.cache.shape:
            raise ValueError("only the segments of one batch of caches (same B and H) add up")
        return TrialBits(self.cache + other.cache, self.model + other.model, self.n_heads,
                         self.n_elements + other.n_elements)


@dataclass(frozen=True)
class BitLedger:
    """Bits one trial's cache occupies, by component, measured from the stored tensors.

    `model_components` names the components that are per-model constants (Encoded.model);
    `total` and `bits_per_element` count the others, the per-cache part. Side data stored once
    for a batch is charged in full to each of its trials. `standalone_total` adds the model
    constants in full: the honest cost of a cache that stands alone.
    """
    components: dict[str, int]
    n_elements: int  # elements of K and V together: 2·H·S·d
    model_components: frozenset[str] = frozenset()
    n_heads: int = 1

    @property
    def total(self) -> int:
        """Per-cache bits."""
        return sum(b for name, b in self.components.items() if name not in self.model_components)

    @property
    def model_total(self) -> int:
        """Bits of the per-model constants, all heads together."""
        return sum(b for name, b in self.components.items() if name in self.model_components)

    @property
    def standalone_total(self) -> int:
        return sum(self.components.values())

    @property
    def bits_per_element(self) -> float:
        return self.total / self.n_elements

    @property
    def model_bits(self) -> float:
        """Model bits per layer-head."""
        return self.model_total / self.n_heads

    @property
    def model_bits_per_element(self) -> float:
        return self.model_total / self.n_elements

    @property
    def standalone_bits_per_element(self) -> float:
        return self.standalone_total / self.n_elements

    @classmethod
    def of(cls, enc: Encoded) -> "BitLedger":
        """The ledger of the stored tensors, per trial (padding of variable-length streams included)."""
        _check_model_keys(enc)
        b, h, s, d = enc.shape
        serialized = entry_bits(enc)
        parts = {f"{part}.{k}": bits // b if part == "codes" else bits for (part, k), bits in serialized.items()}
        model = frozenset(f"{part}.{k}" for part in ("codes", "side") for k in getattr(enc, part) if k in enc.model)
        return cls(parts, 2 * h * s * d, model, h)

    @staticmethod
    def per_trial(enc: Encoded) -> TrialBits:
        """Each trial's bits, per cache and per model: as `of`, but a variable-length stream
        counts the bits its own trial needs (Encoded.exact_bits), not the batch's padding, and an
        entry only some trials use is charged only to them. A claim never goes below what the
        trial's own slice holds (nonzero_bits), and storage no entry's elements cover is charged
        on top (entry_bits)."""
        _check_model_keys(enc)
        b, h, s, d = enc.shape
        cache = torch.zeros(b, dtype=torch.float64)
        model = torch.zeros(b, dtype=torch.float64)
        serialized = entry_bits(enc)
        for part, per_trial in (("codes", True), ("side", False)):
            for key, t in getattr(enc, part).items():
                whole = serialized[part, key]
                exact = enc.exact_bits.get(key)
                if exact is None:
                    bits = float(whole // b if per_trial else whole)
                else:
                    uncovered = whole - stored_bits(t)
                    bits = exact.detach().cpu().double().reshape(-1)
                    if per_trial:
                        bits = torch.maximum(bits, nonzero_bits(t)) + uncovered // b
                    else:
                        bits = bits + uncovered
                if key in enc.model:
                    model += bits
                else:
                    cache += bits
        return TrialBits(cache, model, h, 2 * h * s * d)

    @staticmethod
    def per_trial_bits_per_element(enc: Encoded) -> torch.Tensor:
        """Per-cache bits per element of each trial (B,), float64 (BitLedger.per_trial)."""
        return BitLedger.per_trial(enc).bits_per_element


@dataclass(frozen=True)
class Capabilities:
    """What a codec does beyond the plain protocol (fit(k_cal, v_cal), encode(k, v), decode,
    score = q·k̂ᵀ/√d), declared by the codec (Scheme.capabilities) and read by the one place that
    calls codecs (fit_codec, encode_codec, codec_logits): the sweep, the conformance checks,
    `reproduce` and `effect` hand a codec what it declares it takes, and nothing else. The
    defaults are a plain codec's."""
    fit_trials: bool = False       # fit(k_cal, v_cal, trials=) takes the batch's trial indices (B,)
    positions: bool = False        # encode(k, v, positions=) takes the tokens' RoPE positions (S,)
    prefill_queries: bool = False  # encode(k, v, queries=) takes the cached tokens' own queries (B, H, S, d)
    decode_tokens: bool = False    # encode_decode_tokens / decode_decode_tokens code tokens after the prefill
    scores_on_codes: bool = False  # score(q, enc) is not q·k̂ᵀ/√d of the decoded keys: the sweep calls it


def fit_codec(scheme, k_cal: torch.Tensor, v_cal: torch.Tensor, trials: torch.Tensor | None = None):
    """scheme.fit as every caller fits a codec: with the trial indices where it declares it takes
    them (Capabilities.fit_trials), so a trial's draw does not depend on the batch it is in."""
    if trials is not None and scheme.capabilities.fit_trials:
        return scheme.fit(k_cal, v_cal, trials=trials)
    return scheme.fit(k_cal, v_cal)


def encode_codec(scheme, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None,
                 queries: torch.Tensor | None = None) -> Encoded:
    """scheme.encode as every caller encodes: with the tokens' positions where the codec declares
    it takes them (a codec that undoes RoPE) and the cached tokens' own queries where it declares
    those (a codec that observes the prefill's attention)."""
    declared = scheme.capabilities
    extra = {}
    if positions is not None and declared.positions:
        extra["positions"] = positions
    if queries is not None and declared.prefill_queries:
        extra["queries"] = queries
    return scheme.encode(k, v, **extra)


def codec_logits(scheme, q: torch.Tensor, enc: Encoded, k_hat: torch.Tensor, through_decode) -> torch.Tensor:
    """The codec's attention logits: its own score where it declares that it scores on its codes,
    through_decode(q, k̂) (q·k̂ᵀ/√d, computed by the caller) otherwise."""
    return scheme.score(q, enc) if scheme.capabilities.scores_on_codes else through_decode(q, k_hat)


@dataclass
class Scheme:
    """Base class of every codec: configuration in the constructor, work in the methods.

    Subclasses set `name` and implement encode/decode; fit is a no-op for
    data-independent schemes; score defaults to q·k̂ᵀ/√d. What a codec takes beyond the plain
    protocol it declares in `capabilities`.
    """
    name: ClassVar[str] = ""
    # What the codec takes and does beyond the plain protocol (Capabilities), declared as a class
    # attribute or, where it depends on the configuration, a property; a plain codec's by default.
    capabilities: ClassVar[Capabilities] = Capabilities()
    budget: int
    dim: int
    seed: int = 0
    rng: str = "pcg64"  # bit-generator family of the scheme's own randomness (kvcommon.rng)

    def validate(self) -> None:
        """Raise ValueError naming the problem and what is valid; called by schemes.registry.build
        once the configuration, the RNG family included, is set."""
        check_family(self.rng)

    def check_cache(self, seq_len: int) -> None:
        """Raise ValueError when the scheme cannot code a cache of seq_len tokens (a kvpress press
        whose observation window is longer); the sweep calls it before anything is written."""

    def diagnostics(self) -> dict[str, torch.Tensor]:
        """Per-trial facts of the last fit, (B,) each, every one stored: in its trials column when
        kvcommon.rows.DIAGNOSTIC_COLUMNS names it (e.g. d_eff_k of a calibrated basis), in the
        store's `diagnostics` table under its own name otherwise (an identifier no metric uses)."""
        return {}

    def fit(self, k_cal: torch.Tensor, v_cal: torch.Tensor) -> "Scheme":
        """Calibrate on k_cal, v_cal (B, H, n_cal, d); data-independent schemes ignore them."""
        return self

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> Encoded:
        raise NotImplementedError

    def decode(self, enc: Encoded) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

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


# One tensor's coding and its decoding, shared by the cells of a chunk that code the tensor alike
# (PerTensorScheme.coding_key): a chunk's cells run budget by budget (harness.cell.run_chunk), so a
# few entries per tensor hold every variant's; an entry lives no longer than the data it codes.
_CODINGS = IdentityMemo(16)
_DECODED = IdentityMemo(8)
_SCORES = IdentityMemo(4)


@dataclass
class PerTensorScheme(Scheme):
    """A codec that codes K and V each on its own writes `encode_tensor` and `decode_tensor` once;
    encode and decode apply them to "k" and then "v" (whose entries are named "k.…", "v.…").

    A codec whose coding of a tensor is a function of the tensor and of a few options (the same in
    several variants of one family: tq-kv and tq-kqv code K alike) says so with `coding_key`; the
    cells of a chunk then code and decode that tensor once and share the result (identical to
    coding it again: the same computation on the same inputs)."""

    def coding_key(self, prefix: str) -> tuple | None:
        """Everything encode_tensor(x, prefix, ·) depends on besides x and coding_tensors(prefix),
        hashable (options, seed, trial indices), for schemes of this class; None (the default):
        never shared. Two schemes whose keys are equal must write the same entries for the same x."""
        return None

    def coding_tensors(self, prefix: str) -> tuple[torch.Tensor, ...]:
        """Fitted tensors the coding of `prefix` depends on (a calibrated basis), matched by identity."""
        return ()

    def encode_tensor(self, x: torch.Tensor, prefix: str, enc: Encoded) -> None:
        """Code x (B, H, S, d), the tensor `prefix` ("k" or "v"), into enc."""
        raise NotImplementedError

    def decode_tensor(self, enc: Encoded, prefix: str) -> torch.Tensor:
        """The decoded tensor `prefix`, (B, H, S, d) in enc.dtype."""
        raise NotImplementedError

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> Encoded:
        enc = Encoded(tuple(k.shape), k.dtype)
        with compiled.batched():                  # K's and V's compiled passes in one hand-off to the threads
            for prefix, x in (("k", k), ("v", v)):
                key = self.coding_key(prefix)
                if key is None:
                    self.encode_tensor(x, prefix, enc)
                else:
                    enc.add(self.coded(x, prefix, key))
        return enc

    def coded(self, x: torch.Tensor, prefix: str, key: tuple) -> Encoded:
        """The coding of x as the tensor `prefix` (coding key `key`), on its own Encoded: remembered
        (_CODINGS) for the very x and coding tensors under the key, so another scheme with the same
        key reuses it. Shared: its users never write its tensors in place."""
        def code() -> Encoded:
            part = Encoded(tuple(x.shape), x.dtype)
            self.encode_tensor(x, prefix, part)
            return part
        return _CODINGS.get_or_compute((x, *self.coding_tensors(prefix)), code, (type(self), prefix, key))

    def decode(self, enc: Encoded) -> tuple[torch.Tensor, torch.Tensor]:
        with compiled.batched():
            decoded = self.decoded(enc, "k"), self.decoded(enc, "v")
        return decoded

    def decoded(self, enc: Encoded, prefix: str) -> torch.Tensor:
        """decode_tensor(enc, prefix), remembered (_DECODED) for the very code tensors of `prefix`
        under the coding key when the scheme has one. Shared: never written in place."""
        key = self.coding_key(prefix)
        if key is None:
            return self.decode_tensor(enc, prefix)
        return _DECODED.get_or_compute(self._codes_of(enc, prefix), lambda: self.decode_tensor(enc, prefix),
                                   (type(self), prefix, key, enc.shape, enc.dtype))

    def memoized_score(self, q: torch.Tensor, enc: Encoded, compute) -> torch.Tensor:
        """compute(q, enc), a score on the codes that reads q and K's entries alone, remembered
        (_SCORES) for the very q and K code tensors under K's coding key: variants that code K
        alike and score on its codes (tq-qkv, tq-qkqv) score once. Shared: never written in place."""
        key = self.coding_key("k")
        if key is None:
            return compute(q, enc)
        return _SCORES.get_or_compute((q, *self._codes_of(enc, "k")), lambda: compute(q, enc), (type(self), key, enc.shape))

    @staticmethod
    def _codes_of(enc: Encoded, prefix: str) -> tuple[torch.Tensor, ...]:
        return tuple(enc.codes[name] for name in sorted(enc.codes) if name.startswith(f"{prefix}."))


