"""The conformance-check machinery shared by the codec checks (schemes.conformance) and the
scenario checks (scenarios.conformance): a check is a function of a factory that raises
ConformanceError with one sentence; `run_checks` runs a tuple of them and lists every failure."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


class ConformanceError(AssertionError):
    """A plug-in broke a stated property; the message says which and how, in words."""


def require(condition, sentence: str) -> None:
    if not bool(condition):
        raise ConformanceError(sentence)


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[..., None]
    states: str          # the property, in words

    @classmethod
    def of(cls, fn: Callable[..., None]) -> "Check":
        """A check named after its function, stating its docstring."""
        return cls(fn.__name__, fn, " ".join(fn.__doc__.split()))


def run_checks(checks: tuple[Check, ...], factory, skip: tuple[str, ...], subject: str) -> None:
    """Run every check (but those named in skip) on the factory; ConformanceError listing every
    failure, one sentence per check, if any fails. A check that raises something else reports it
    as the subject's ("the codec", "the scenario") error in that check."""
    unknown = set(skip) - {c.name for c in checks}
    if unknown:
        raise ValueError(f"unknown check(s) {sorted(unknown)}; valid: {', '.join(c.name for c in checks)}")
    failures = []
    for check in checks:
        if check.name in skip:
            continue
        try:
            check.run(factory)
        except ConformanceError as exc:
            failures.append(f"{check.name}: {exc}")
        except Exception as exc:    # the plug-in itself failed inside the check
            failures.append(f"{check.name}: {subject} raised {type(exc).__name__}: {exc}")
    if failures:
        raise ConformanceError(f"{len(failures)} of {len(checks) - len(skip)} checks failed:\n  "
                               + "\n  ".join(failures))
