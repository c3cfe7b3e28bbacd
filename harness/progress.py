"""Progress of a sweep, advanced per stored chunk: cells and trials done, rate and ETA.

On a terminal a tqdm bar; otherwise (a log file, CI, a pipe) a plain line every few seconds,
e.g. `[12/72 cells, 1840/3600 trials, 31 trials/s, ETA 57 s]`, and one at the end. Trials stored
by an earlier, interrupted run count as done; the rate is this run's own.
"""
from __future__ import annotations

import os
import sys
import time

LINE_INTERVAL_S = 5.0
# Tests shorten the interval of the plain lines (seconds) through this variable.
INTERVAL_ENV = "KVHARNESS_PROGRESS_INTERVAL"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class Progress:
    """mode: 'bar' (tqdm), 'lines' (plain lines every `interval` seconds) or None (silent)."""

    def __init__(self, n_cells: int, n_trials: int, *, cells_done: int = 0, trials_done: int = 0,
                 mode: str | None = None, stream=None, interval: float | None = None):
        self.n_cells, self.n_trials = n_cells, n_trials
        self.cells_done, self.trials_done = cells_done, trials_done
        self.mode, self.stream = mode, stream or sys.stderr
        self.interval = interval if interval is not None else float(os.environ.get(INTERVAL_ENV, LINE_INTERVAL_S))
        self._start = self._last = time.monotonic()
        self._trials_start = trials_done
        self._bar = None
        if mode == "bar":
            from tqdm import tqdm
            self._bar = tqdm(total=n_trials, initial=trials_done, unit="trial", file=self.stream,
                             dynamic_ncols=True)
            self._bar.set_postfix_str(self._cells())

    @classmethod
    def auto(cls, enabled: bool | None, n_cells: int, n_trials: int, **kwargs) -> "Progress":
        """enabled None: a bar on a terminal, plain lines elsewhere; True: a bar; False: silent."""
        stream = kwargs.get("stream") or sys.stderr
        mode = None if enabled is False else "bar" if enabled or stream.isatty() else "lines"
        return cls(n_cells, n_trials, mode=mode, **kwargs)

    def _cells(self) -> str:
        return f"{self.cells_done}/{self.n_cells} cells"

    def rate(self) -> float:
        elapsed = time.monotonic() - self._start
        return (self.trials_done - self._trials_start) / elapsed if elapsed > 0 else 0.0

    def line(self) -> str:
        rate = self.rate()
        left = self.n_trials - self.trials_done
        eta = _duration(left / rate) if rate > 0 else "unknown"
        return (f"[{self._cells()}, {self.trials_done}/{self.n_trials} trials, {rate:.3g} trials/s, "
                f"ETA {eta}]")

    def advance(self, trials: int, cells: int = 0) -> None:
        """`trials` more trials stored (of one cell or several), `cells` of them finishing a cell."""
        self.trials_done += trials
        self.cells_done += cells
        if self._bar is not None:
            self._bar.update(trials)
            self._bar.set_postfix_str(self._cells(), refresh=False)
        elif self.mode == "lines" and time.monotonic() - self._last >= self.interval:
            self._print()

    def _print(self) -> None:
        self._last = time.monotonic()
        print(self.line(), file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.mode == "lines" and self.trials_done > self._trials_start:
            self._print()
