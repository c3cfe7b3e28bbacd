"""The verdict framework of the AMD paper's claims (stats/claims/paper.py states them):
`harness reproduce amd-paper` runs the sweeps, the claim modules of this package judge them on
this framework, one module per claim (claims 2 and 3, and 5 and 12, share one). The helpers
named with a leading underscore are the package's own, shared by its claim modules only.

Each claim is one function of trial frames returning a ClaimResult: the claim in words with its
section, the operational test (which cells, which statistic, paired or not), one row per
comparison (`tests`), the headline effect with its 95 % CI and a verdict with its reason.

The rule, the same for every claim (the *shape* of stats/validation.py):
1. Every comparison of a claim states the direction the claim predicts (`expect`). Rows of one
   setting (scenario, d, S, Nq, n_cal) share their K, V and Q draws (kvcommon.rows), so codecs,
   budgets, calibration sizes and query temperatures of a setting are compared trial by trial:
   Wilcoxon signed-rank, effect = mean paired difference with a bootstrap 95 % CI
   (stats.paired). Rows of different settings (another d, another scenario) are compared with
   Mann–Whitney U, effect = difference of means with an unpaired bootstrap CI.
2. The p-values of one claim are one family: Holm (stats.inference.holm), α = ALPHA.
3. A comparison comes out `as claimed` (significant in the predicted direction, or, where the
   claim predicts no difference, equivalent by TOST within the stated margin, or, where it
   predicts no change in one direction, a change that way shown smaller than the margin by the
   one-sided half of a TOST: non-inferiority), `opposite` (significant against the prediction,
   or equivalent where the claim predicts a difference), `not significant` (nothing shown: a
   non-significant test never counts for a claim), or `no comparison` (the run has no cell to
   compare with). A comparison shown inside its margin where the claim predicts no difference is
   `as claimed` even when significant (a negligible difference). Margin tests run at ALPHA per
   comparison (an intersection-union test, as in stats.validation); the column `equivalent` of a
   comparison holds its margin test's result.
4. Verdict: `reproduced` if every comparison is `as claimed`; `partly` if some comparison is
   `opposite` but the comparisons split by scope: for the first of SCOPES (scenario, head
   width d, bit width b) whose values split so, the comparisons of at least one value are all
   `as claimed` and those of another include an `opposite` (the claim holds there and fails
   there; the reason names both, in words); `refuted` if some comparison is `opposite` and no
   scope splits; `inconclusive` otherwise, with the comparisons that are neither named. Under
   `partly` the headline is taken where the claim holds (_holding) and the effect says where.
   (Claim 1 adds its existential part, see claim_non_dominated.)
5. Every reason sentence is generated from the comparisons' outcomes (_basis, _tally): it counts
   the comparisons by what their tests showed (significant at Holm-adjusted ALPHA, equivalent or
   shown within the margin by TOST, by construction, by a validation verdict) and never calls a
   test significant whose Holm p is not below ALPHA.

Direction is read from the test's own effect (matched-pairs rank-biserial r, Cliff's δ), so a
significant test and its direction never disagree; the reported estimate is the mean difference.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from kvcommon.rows import SETTING_COLUMNS
from ..equal_storage import TOLERANCE
from ..inference import as_generator, bootstrap_ci, cliffs_delta, holm, mann_whitney, tost
from ..margins import ALPHA
from ..paired import rank_biserial, wilcoxon
from .paper import CLAIMS

N_BOOT = 2000
METRIC = "d2_t"
VERDICTS = ("reproduced", "partly", "refuted", "inconclusive")
SCOPES = ("scenario", "dim", "budget")   # where a claim can hold in part: by scenario, head width d, bit width b
OUTCOMES = ("as claimed", "opposite", "not significant", "no comparison")
STORAGE_SLACK = TOLERANCE / 2  # "stores no more" = measured storage at most 2.5 % above

TEST_COLUMNS = ("claim", "part", "label", "scenario", "dim", "budget", "test", "paired", "n", "estimate", "ci_low",
                "ci_high", "p_value", "p_holm", "equivalent", "expect", "outcome", "in_verdict")
CLAIM_COLUMNS = ("id", "section", "claim", "test", "paired", "verdict", "reason", "effect", "estimate", "ci_low",
                 "ci_high", "n_tests", "n_as_claimed", "n_opposite")


@dataclass(frozen=True)
class ClaimResult:
    """One claim judged: its test in words, the verdict with its reason, the headline effect
    (`effect` says what it is; estimate with its 95 % CI) and every comparison (`tests`)."""
    id: int
    section: str
    claim: str
    test: str
    paired: str
    verdict: str
    reason: str
    effect: str = ""
    estimate: float = float("nan")
    ci_low: float = float("nan")
    ci_high: float = float("nan")
    tests: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=list(TEST_COLUMNS)), repr=False)

    def to_row(self) -> dict:
        judged = self.tests[self.tests["in_verdict"].astype(bool)] if len(self.tests) else self.tests
        outcome = judged["outcome"] if len(judged) else pd.Series(dtype=object)
        return {"id": self.id, "section": self.section, "claim": self.claim, "test": self.test,
                "paired": self.paired, "verdict": self.verdict, "reason": self.reason, "effect": self.effect,
                "estimate": self.estimate, "ci_low": self.ci_low, "ci_high": self.ci_high,
                "n_tests": int(len(judged)), "n_as_claimed": int((outcome == "as claimed").sum()),
                "n_opposite": int((outcome == "opposite").sum())}


# --- statistics of one comparison -------------------------------------------------------------
def _gen(*labels):
    return as_generator(0, "claims", *labels)


def paired_row(x, y, label: str, **fields_) -> dict:
    """Wilcoxon signed-rank of x_i − y_i (same trials), estimate mean(x − y) with a bootstrap CI;
    direction = sign of the matched-pairs rank-biserial r."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    d = x - y
    test = wilcoxon(x, y)
    low, high = bootstrap_ci(d, n_boot=N_BOOT, seed=_gen(label))
    return dict(label=label, test="wilcoxon signed-rank", paired=True, n=int(np.isfinite(d).sum()),
                estimate=float(np.nanmean(d)) if len(d) else np.nan, ci_low=low, ci_high=high,
                p_value=test.p_value, direction=np.sign(rank_biserial(x, y)), **fields_)


def unpaired_row(x, y, label: str, **fields_) -> dict:
    """Mann–Whitney U of x vs y (different draws), estimate mean(x) − mean(y) with an unpaired
    bootstrap CI (x and y resampled independently); direction = sign of Cliff's δ."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    x, y = x[np.isfinite(x)], y[np.isfinite(y)]
    p = float(mann_whitney(pd.DataFrame({"m": x}), pd.DataFrame({"m": y})).p_value.iloc[0])
    gen = _gen(label)
    boot = (x[gen.integers(0, len(x), (N_BOOT, len(x)))].mean(1) - y[gen.integers(0, len(y), (N_BOOT, len(y)))].mean(1))
    low, high = np.quantile(boot, [0.025, 0.975])
    return dict(label=label, test="mann-whitney", paired=False, n=int(min(len(x), len(y))),
                estimate=float(x.mean() - y.mean()), ci_low=float(low), ci_high=float(high), p_value=p,
                direction=np.sign(cliffs_delta(x, y)), **fields_)


def _equivalent(x, y, margin: float, paired: bool) -> bool:
    return bool(margin > 0 and tost(x, y, margin, ALPHA, paired=paired).equivalent)


def _pooled_sd(x, y) -> float:
    """sqrt((var x + var y) / 2): the pooled trial-to-trial sd the verdicts' margins are scaled by."""
    return float(np.sqrt((np.nanvar(x, ddof=1) + np.nanvar(y, ddof=1)) / 2))


def _not_below(x, y, margin: float) -> bool:
    """Non-inferiority (the lower one-sided test of TOST, paired): mean(x − y) > −margin at ALPHA."""
    return bool(np.isfinite(margin) and margin > 0 and tost(x, y, margin, ALPHA, paired=True).p_lower <= ALPHA)


def _no_comparison(label: str, **fields_) -> dict:
    return dict(label=label, test="none", paired=False, n=0, estimate=np.nan, ci_low=np.nan, ci_high=np.nan,
                p_value=np.nan, direction=0.0, **fields_)


def _significant(row) -> bool:
    p = row["p_holm"]
    return bool(p is not None and np.isfinite(p) and p < ALPHA)


def _margin_shown(row) -> bool:
    """The margin test of the row's expectation passed (column `equivalent`): two-sided TOST for
    `equivalent`, `differs`, `greater`, `less`; for `not greater`/`not less` the one-sided test that
    the effect does not go the excluded way by more than the margin (or the two-sided TOST)."""
    eq = row.get("equivalent")
    return isinstance(eq, (bool, np.bool_)) and bool(eq)


def _outcome(row: dict) -> str:
    """Rule 3 of the module doc for one comparison after Holm."""
    if row.get("outcome") in OUTCOMES:       # decided by its own rule (validation verdicts)
        return row["outcome"]
    if row["test"] == "none":
        return "no comparison"
    significant, sign, expect, shown = _significant(row), row["direction"], row["expect"], _margin_shown(row)
    if expect in ("greater", "less"):
        want = 1 if expect == "greater" else -1
        if significant:
            return "as claimed" if sign == want else "opposite"
        return "opposite" if shown else "not significant"
    if expect in ("not greater", "not less"):   # no change in the excluded direction
        bad = 1 if expect == "not greater" else -1
        if significant:
            return "opposite" if sign == bad else "as claimed"
        return "as claimed" if shown else "not significant"   # a non-significant test shows nothing
    if expect == "differs":
        return "as claimed" if significant else ("opposite" if shown else "not significant")
    if expect == "equivalent":   # shown inside the margin: as claimed even when significant (negligible)
        return "as claimed" if shown else ("opposite" if significant else "not significant")
    raise ValueError(f"unknown expectation {expect!r}")


_HOLM = f" at Holm-adjusted alpha {ALPHA}"


def _basis(row) -> str:
    """Why a comparison came out as it did, in words, from its own test outcomes: what every
    reason sentence says about it (never `significant` unless its Holm p is below ALPHA)."""
    outcome, expect = row["outcome"], row["expect"]
    if row["test"] == "ledger":
        return (f"{'within' if outcome == 'as claimed' else 'more than'} {STORAGE_SLACK:.1%} of the paper's figure "
                f"(exact bit count)")
    if row["test"] == "none":
        return "by construction" if outcome == "as claimed" else "no comparison"
    significant, shown = _significant(row), _margin_shown(row)
    one_sided = expect in ("not greater", "not less")
    margin = ("shown not to move the excluded way beyond the margin (TOST)" if one_sided
              else "equivalent within the margin by TOST")
    if not np.isfinite(float(row["p_value"])) and not shown:
        return f"{outcome} by its own verdict"
    if outcome == "as claimed":
        if expect == "equivalent":
            return margin + (" (significant but inside it)" if significant else "")
        return f"significant in the claimed direction{_HOLM}" if significant else margin
    if outcome == "opposite":
        return (f"significant against the claim{_HOLM}" if significant
                else f"{margin} where the claim needs a difference")
    return "not significant" + ("" if expect in ("greater", "less", "differs") else ", margin not shown")


def _family(rows: list[dict], claim: int, in_verdict: bool = True) -> pd.DataFrame:
    """The comparisons of one claim as a frame, Holm-adjusted together, with their outcomes;
    in_verdict=False for comparisons reported alongside the verdict's family (another storage
    accounting), Holm-adjusted among themselves."""
    if not rows:
        return pd.DataFrame(columns=list(TEST_COLUMNS))
    frame = pd.DataFrame(rows)
    frame["claim"] = claim
    for c in TEST_COLUMNS:
        if c not in frame.columns:
            frame[c] = np.nan if c not in ("equivalent", "outcome") else None
    frame["p_holm"] = holm(frame["p_value"].to_numpy(float))
    frame["outcome"] = [_outcome(r) for r in frame.to_dict("records")]
    frame["in_verdict"] = in_verdict
    return frame[list(TEST_COLUMNS)]


def _fmt(x: float, digits: int = 3) -> str:
    if x is None or not np.isfinite(x):
        return "n/a"
    return f"{x:+.{digits}g}" if abs(x) < 1e4 else f"{x:+.3e}"


def _describe(row) -> str:
    """One comparison in words: label, estimate [CI], Holm p, and its basis (_basis)."""
    if row["test"] == "none":
        return f"{row['label']}: no comparison"
    if row["test"] == "ledger":
        spread = row["ci_low"] != row["ci_high"]
        return row["label"] + (f" (trials {row['ci_low']:.4g} to {row['ci_high']:.4g})" if spread else "")
    p = row["p_holm"]
    ptext = f", Holm p {p:.2g}" if p is not None and np.isfinite(p) else ""
    if _margin_shown(row):
        ptext += (", not beyond the margin the excluded way (TOST)" if row["expect"] in ("not greater", "not less")
                  else ", equivalent (TOST)")
    return f"{row['label']}: {_fmt(row['estimate'])} [{_fmt(row['ci_low'])}, {_fmt(row['ci_high'])}]{ptext}"


def _tally(tests: pd.DataFrame) -> str:
    """How many comparisons stand on each basis, e.g. '4 significant in the claimed direction at
    Holm-adjusted alpha 0.05, 2 equivalent within the margin by TOST'."""
    if tests.empty:
        return "none"
    counts = pd.Series([_basis(r) for r in tests.to_dict("records")]).value_counts(sort=False)
    return ", ".join(f"{n} {b}" for b, n in counts.items())


def _summary(tests: pd.DataFrame) -> str:
    """How many comparisons came out each way, e.g. '3 as claimed, 1 not significant'."""
    counts = tests.outcome.value_counts()
    return ", ".join(f"{int(counts[o])} {o}" for o in OUTCOMES if o in counts) or "no comparisons"


def _plain_verdict(tests: pd.DataFrame) -> str:
    """Rule 4 without scopes: refuted on any opposite, reproduced when all are as claimed."""
    counts = tests["outcome"].value_counts()
    if counts.get("opposite", 0):
        return "refuted"
    return "reproduced" if len(tests) and counts.get("as claimed", 0) == len(tests) else "inconclusive"


def _scope_words(column: str, values) -> str:
    """Scope values in words: 'gaussian, outlier_channels', 'd=64', 'b=3, b=4'."""
    prefix = {"scenario": "", "dim": "d=", "budget": "b="}[column]
    return ", ".join(f"{prefix}{v}" for v in values)


def _scope_split(tests: pd.DataFrame):
    """(column, {value: verdict of its comparisons}) for the first of SCOPES under which some
    value's comparisons are all as claimed and another's include an opposite; None when no
    scope splits so (rule 4). Only the comparisons in the verdict (`in_verdict`) count."""
    if "in_verdict" in tests.columns:
        tests = tests[tests["in_verdict"].astype(bool)]
    for column in SCOPES:
        if column not in tests.columns or tests[column].isna().any() or tests[column].nunique() < 2:
            continue
        verdicts = {value: _plain_verdict(g) for value, g in tests.groupby(column, sort=True)}
        if "reproduced" in verdicts.values() and "refuted" in verdicts.values():
            return column, verdicts
    return None


def _holding(tests: pd.DataFrame, verdict: str) -> pd.DataFrame:
    """The comparisons where the claim holds when it holds in part (verdict `partly`: the scope
    values whose comparisons are all as claimed), else all of them: where the headline is taken."""
    split = _scope_split(tests) if verdict == "partly" else None
    if split is None:
        return tests
    column, verdicts = split
    return tests[tests[column].isin([v for v, verdict_ in verdicts.items() if verdict_ == "reproduced"])]


def _standard_verdict(tests: pd.DataFrame, what: str, cases=None) -> tuple[str, str]:
    """Rule 4: refuted on any opposite unless the comparisons split by scope (then partly, the
    scopes in words), reproduced when all are as claimed; the reason counts the comparisons by
    what their tests showed (_tally), never more significant ones than there are. cases: optional
    words for the comparisons of one failing scope value (its rows -> e.g. 'K; V as claimed'), so a
    scope that fails in part is named with what fails there, not as if all of it did."""
    if tests.empty:
        return "inconclusive", "no comparison could be made: the run lacks the cells this claim needs"
    counts = tests["outcome"].value_counts()
    n, n_ok, n_bad = len(tests), int(counts.get("as claimed", 0)), int(counts.get("opposite", 0))
    if n_bad:
        worst = tests[tests.outcome == "opposite"]
        examples = "; ".join(_describe(r) for r in worst.head(2).to_dict("records"))
        more = f" (and {n_bad - 2} more)" if n_bad > 2 else ""
        split = _scope_split(tests)
        if split is None:
            return "refuted", f"{n_bad} of {n} {what} against the claim ({_tally(worst)}): {examples}{more}"
        column, verdicts = split
        held = [v for v, verdict in verdicts.items() if verdict == "reproduced"]
        failed = [v for v, verdict in verdicts.items() if verdict == "refuted"]
        unshown = [v for v, verdict in verdicts.items() if verdict == "inconclusive"]
        ok = tests[tests[column].isin(held)]
        bad_scope = tests[tests[column].isin(failed)]
        failing = (", ".join(f"{_scope_words(column, [v])} ({cases(tests[tests[column] == v])})" for v in failed)
                   if cases is not None else _scope_words(column, failed))
        reason = (f"holds for {_scope_words(column, held)} (all {len(ok)} {what} there as claimed: {_tally(ok)}); "
                  f"fails for {failing} ({n_bad} of {len(bad_scope)} {what} there against the "
                  f"claim: {_tally(worst)}): {examples}{more}")
        if unshown:
            reason += f"; not shown for {_scope_words(column, unshown)}"
        return "partly", reason
    if n_ok == n:
        return "reproduced", f"all {n} {what} as claimed: {_tally(tests)}"
    rest = tests[tests.outcome != "as claimed"]
    examples = "; ".join(_describe(r) for r in rest.head(2).to_dict("records"))
    ok = f" ({_tally(tests[tests.outcome == 'as claimed'])})" if n_ok else ""
    return "inconclusive", (f"{n_ok} of {n} {what} as claimed{ok}, none against; not shown: {examples}"
                            + (f" (and {len(rest) - 2} more)" if len(rest) > 2 else ""))


def _headline(tests: pd.DataFrame, prefer: str, key: str = "estimate", part: str | None = None):
    """The comparison the effect column reports: the one least favourable to the claim (the
    smallest `key` when prefer='min', the largest when 'max') among the compared rows."""
    rows = tests[tests.test != "none"]
    if part is not None:
        rows = rows[rows.part == part]
    rows = rows[np.isfinite(rows[key].astype(float))]
    if rows.empty:
        return None
    return rows.loc[rows[key].astype(float).idxmin() if prefer == "min" else rows[key].astype(float).idxmax()]


def _result(claim_id: int, test: str, paired: str, tests: pd.DataFrame, verdict_reason, headline=None,
            effect: str = "", transform=None) -> ClaimResult:
    spec = CLAIMS[claim_id]
    verdict, reason = verdict_reason
    est = low = high = float("nan")
    if headline is not None:
        est, low, high = (float(headline[c]) for c in ("estimate", "ci_low", "ci_high"))
        if transform is not None:   # a decreasing transform swaps the interval's ends
            est, (low, high) = transform(est), sorted((transform(low), transform(high)))
        effect = f"{effect} ({headline['label']})" if effect else str(headline["label"])
    split = _scope_split(tests) if verdict == "partly" else None
    if split is not None:
        column, verdicts = split
        effect += f"; where the claim holds: {_scope_words(column, [v for v, x in verdicts.items() if x == 'reproduced'])}"
    return ClaimResult(spec.id, spec.section, spec.claim, test, paired, verdict, reason, effect, est, low, high, tests)


def lacking(claim_id: int, test: str, paired: str, what: str) -> ClaimResult:
    """A claim the run cannot test (cells missing): inconclusive, saying what is missing."""
    return _result(claim_id, test, paired, _family([], claim_id), ("inconclusive", f"the run lacks {what}"))


# --- access to cells ---------------------------------------------------------------------------
def _cells(trials: pd.DataFrame) -> dict[tuple, pd.DataFrame]:
    """(setting, scheme, budget) -> that cell's rows indexed by trial (setting = SETTING_COLUMNS)."""
    keys = list(SETTING_COLUMNS) + ["scheme", "budget"]
    return {(tuple(k[:-2]), k[-2], int(k[-1])): g.set_index("trial").sort_index()
            for k, g in trials.groupby(keys, sort=True)}


def _aligned(a: pd.DataFrame, b: pd.DataFrame, column: str, column_b: str | None = None):
    """Values of two cells of one setting on their shared trials (paired)."""
    shared = a.index.intersection(b.index)
    return a.loc[shared, column].to_numpy(float), b.loc[shared, column_b or column].to_numpy(float)


def _where(setting: tuple) -> dict:
    s = dict(zip(SETTING_COLUMNS, setting))
    return {"scenario": s["scenario"], "dim": int(s["dim"])}


def _name(setting: tuple, budget=None) -> str:
    s = dict(zip(SETTING_COLUMNS, setting))
    return f"{s['scenario']} d={s['dim']}" + (f" b={budget}" if budget is not None else "")


def _settings(cells) -> list[tuple]:
    return sorted({k[0] for k in cells})


def _missing(trials: pd.DataFrame, schemes=(), scenarios=()) -> list[str]:
    out = [s for s in schemes if s not in set(trials.get("scheme", ()))]
    out += [s for s in scenarios if s not in set(trials.get("scenario", ()))]
    return out


# --- all claims --------------------------------------------------------------------------------
def claims_frame(results) -> pd.DataFrame:
    """One row per claim (CLAIM_COLUMNS), in claim order: what `harness reproduce` stores as table
    `claims` and what reports show."""
    return pd.DataFrame([r.to_row() for r in sorted(results, key=lambda r: r.id)], columns=list(CLAIM_COLUMNS))


def tests_frame(results) -> pd.DataFrame:
    """Every comparison of every claim, one row each (TEST_COLUMNS)."""
    frames = [r.tests for r in sorted(results, key=lambda r: r.id) if len(r.tests)]
    if not frames:
        return pd.DataFrame(columns=list(TEST_COLUMNS))
    out = pd.concat(frames, ignore_index=True)
    out["equivalent"] = out["equivalent"].map(lambda v: None if v is None or (isinstance(v, float) and np.isnan(v))
                                              else bool(v))
    return out


def format_claims(frame: pd.DataFrame) -> str:
    """The claims table as text, one line per claim: id, verdict, effect [95 % CI], claim (section),
    reason."""
    lines = []
    for r in frame.itertuples(index=False):
        ci = f"{_fmt(r.estimate, 3)} [{_fmt(r.ci_low, 3)}, {_fmt(r.ci_high, 3)}]" if np.isfinite(r.estimate) else "n/a"
        lines.append(f"{r.id:>2}  {r.verdict:<12} {ci:<28} {r.claim} ({r.section}) | effect: {r.effect} | "
                     f"{r.reason}")
    return "\n".join(lines)
