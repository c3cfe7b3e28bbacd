"""The sweep: a configuration whose cross product of flags gives the cells.

A cell is one (scenario, scheme, budget, dim, seq_len, queries, calib_tokens); cells that
share (scenario, dim, seq_len, queries, calib_tokens) share their data, trial by trial, so
every scheme and budget is compared on the same draws. Cells that differ only in calib_tokens
share K, V and Q as well (the calibration sample has streams of its own): calibration sizes
are compared on the same draws too.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field

from kvcommon.rng import RNG_FAMILIES

from .devices import DEVICES, DTYPES

# scenarios and schemes (torch, numba) are imported where a sweep is validated or listed, not
# here: the store reads a manifest's configuration (SweepConfig, cells) for `harness report`,
# which needs neither
MAX_SEED = 2 ** 63 - 1   # the largest root seed: sqlite stores INTEGER as signed 64-bit


def paper_schemes() -> tuple[str, ...]:
    """The AMD paper's sixteen TQ/SQ schemes, as far as they are registered. From the built-ins
    and plug-ins only: listing the optional families would import kvpress and transformers
    (seconds and hundreds of MB) for names that are never paper schemes."""
    import schemes
    return tuple(n for n in schemes.registry.all_schemes() if n.split("-")[0] in ("plain", "tq", "sq", "squ"))


# Named presets of `run --grid` / `bench --grid`: values of SweepConfig fields (callables are
# evaluated when used, so plug-ins registered later are included).
GRIDS = {
    "paper": {  # AMD paper §3: six scenarios, 16 schemes, b = 2..7, d ∈ {64, 128, 256}, 200 trials
        "scenarios": lambda: ("gaussian", "heavy_tail", "lowrank_aligned", "lowrank_misaligned",
                              "spectral_decay", "outlier_channels"),
        "schemes": paper_schemes,
        "budgets": (2, 3, 4, 5, 6, 7), "dims": (64, 128, 256), "seq_lens": (1024,), "queries": (64,),
        "trials": 200, "calib_tokens": (512,),
    },
}


def grid(name: str) -> dict:
    if name not in GRIDS:
        raise ValueError(f"unknown grid {name!r}; valid: {', '.join(GRIDS)}")
    return {k: v() if callable(v) else v for k, v in GRIDS[name].items()}


@dataclass(frozen=True)
class Cell:
    scenario: str
    scheme: str
    budget: int
    dim: int
    seq_len: int
    queries: int
    calib_tokens: int

    @property
    def key(self) -> tuple:
        """The cell's identity, in field order (Cell(*key) rebuilds it; rows.CELL_COLUMNS names it)."""
        return (self.scenario, self.scheme, self.budget, self.dim, self.seq_len, self.queries, self.calib_tokens)

    @property
    def data_key(self) -> tuple:
        """What the cell's drawn data depend on: cells with equal data_key run on one draw."""
        return (self.scenario, self.dim, self.seq_len, self.queries, self.calib_tokens)


@dataclass(frozen=True)
class SweepConfig:
    scenarios: tuple[str, ...]
    schemes: tuple[str, ...]
    budgets: tuple[int, ...] = (2, 3, 4)
    dims: tuple[int, ...] = (128,)
    seq_lens: tuple[int, ...] = (1024,)
    queries: tuple[int, ...] = (64,)
    trials: int = 200
    seed: int = 0
    heads: int = 1
    calib_tokens: tuple[int, ...] = (512,)
    device: str = "auto"
    dtype: str = "float32"
    rng: str = "pcg64"
    impl: str = "torch"
    scenario_params: dict = field(default_factory=dict, hash=False, compare=True)
    decode_tokens: int = 0   # N tokens after the S prefill, compressed as they arrive (0: no decode phase)
    # N caches per layer-head over which the per-model constants are amortised in the rows'
    # storage_bits_per_element (None: per-cache bits only; 1: each cache stands alone)
    model_caches: int | None = None
    # the root of the codecs' own draws and their RNG family (None: seed and rng, as the data's):
    # `harness validate` changes them alone for a null on the same data as its paired comparison
    scheme_seed: int | None = None
    scheme_rng: str | None = None

    def validate(self, skip_unfit: bool = False) -> dict[str, tuple[int, int, str]]:
        """ValueError naming the first bad value and what is valid: the settings, then the schemes,
        each (scheme, budget, dim) built once (unfit_schemes). skip_unfit: the schemes that cannot
        take some budget, dim or cache length are returned (`run --scheme all` skips them) instead."""
        self._validate_settings()
        unfit = self.unfit_schemes()
        if unfit and not skip_unfit:
            name, (budget, dim, reason) = next(iter(unfit.items()))
            raise ValueError(f"scheme {name} (budget {budget}, dim {dim}): {reason}")
        return unfit

    def _validate_settings(self) -> None:
        def positive(name, values):
            for x in values:
                if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                    raise ValueError(f"{name} {x!r} must be a positive integer")
        positive("--dim", self.dims)
        positive("--seq-len", self.seq_lens)
        positive("--queries", self.queries)
        positive("--trials", (self.trials,))
        positive("--heads", (self.heads,))
        positive("--calib-tokens", self.calib_tokens)
        if isinstance(self.decode_tokens, bool) or not isinstance(self.decode_tokens, int) or self.decode_tokens < 0:
            raise ValueError(f"--decode-tokens {self.decode_tokens!r} must be a non-negative integer")
        if self.model_caches is not None:
            positive("--model-caches", (self.model_caches,))
        if not self.scenarios or not self.schemes or not self.budgets or not self.calib_tokens:
            raise ValueError("the sweep is empty: give at least one scenario, scheme, budget and calibration size")
        if self.device not in DEVICES:
            raise ValueError(f"unknown device {self.device!r}; valid: {', '.join(DEVICES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; valid: {', '.join(DTYPES)}")
        if self.rng not in RNG_FAMILIES:
            raise ValueError(f"unknown RNG family {self.rng!r}; valid: {', '.join(RNG_FAMILIES)}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"--seed {self.seed!r} must be an integer in 0..{MAX_SEED} (the store's seed column is "
                             f"a signed 64-bit integer)")
        if self.scheme_seed is not None and (isinstance(self.scheme_seed, bool) or not isinstance(self.scheme_seed, int)
                                             or not 0 <= self.scheme_seed <= MAX_SEED):
            raise ValueError(f"scheme seed {self.scheme_seed!r} must be an integer in 0..{MAX_SEED}")
        if self.scheme_rng is not None and self.scheme_rng not in RNG_FAMILIES:
            raise ValueError(f"unknown scheme RNG family {self.scheme_rng!r}; valid: {', '.join(RNG_FAMILIES)}")
        import scenarios
        for name in self.scenarios:
            scenario = scenarios.create(name, **self.scenario_params.get(name, {}))
            for dim, seq_len, n_queries, n_cal in itertools.product(self.dims, self.seq_lens, self.queries,
                                                                     self.calib_tokens):
                scenario.check_shape(scenarios.TrialShape(self.heads, seq_len, n_queries, dim, n_cal,
                                                          self.decode_tokens))

    def unfit_schemes(self) -> dict[str, tuple[int, int, str]]:
        """{scheme: (budget, dim, why)} for the schemes that cannot take some budget, dim or cache
        length of the sweep, in the sweep's order, with the first (budget, dim) each refuses; each
        (scheme, budget, dim) is built once (schemes.create, as the sweep builds it)."""
        import schemes
        unfit = {}
        for name, budget, dim in itertools.product(self.schemes, self.budgets, self.dims):
            if name in unfit:
                continue
            try:
                scheme = schemes.create(name, budget=budget, dim=dim, rng=self.codec_rng, impl=self.impl)
                for seq_len in self.seq_lens:
                    scheme.check_cache(seq_len + self.decode_tokens)
            except ValueError as exc:
                unfit[name] = (budget, dim, str(exc))
        return unfit

    def check_data(self) -> None:
        """ValueError (one line) when a scenario's parameters make its data overflow or vanish in
        the metrics (Scenario.check_data, a probe draw per shape). Apart from validate: the probe
        draws a (d, d) population, so it runs once one trial is known to fit in memory."""
        import scenarios
        for name in self.scenarios:
            scenario = scenarios.create(name, **self.scenario_params.get(name, {}))
            for dim, seq_len, n_queries, n_cal in itertools.product(self.dims, self.seq_lens, self.queries,
                                                                     self.calib_tokens):
                scenario.check_data(scenarios.TrialShape(self.heads, seq_len, n_queries, dim, n_cal,
                                                         self.decode_tokens))

    def cells(self) -> list[Cell]:
        """Every cell, grouped so that cells sharing data are adjacent."""
        return [Cell(sc, sch, b, d, s, nq, cal) for sc, d, s, nq, cal, sch, b in itertools.product(
            self.scenarios, self.dims, self.seq_lens, self.queries, self.calib_tokens, self.schemes, self.budgets)]

    @property
    def codec_seed(self) -> int:
        """The root seed of the codecs' own draws."""
        return self.seed if self.scheme_seed is None else self.scheme_seed

    @property
    def codec_rng(self) -> str:
        """The RNG family of the codecs' own draws."""
        return self.rng if self.scheme_rng is None else self.scheme_rng

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @staticmethod
    def upgrade_json(data: dict) -> dict:
        """A to_json dict written by an older version in today's form: calib_tokens was one int."""
        if isinstance(data.get("calib_tokens"), int) and not isinstance(data["calib_tokens"], bool):
            return {**data, "calib_tokens": [data["calib_tokens"]]}
        return data

    @classmethod
    def from_json(cls, data: dict) -> "SweepConfig":
        """The configuration of to_json's dict (or an older version's); fields added since it was
        written take their defaults."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in cls.upgrade_json(data).items()})
