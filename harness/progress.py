"""Progress of a sweep, advanced per stored chunk: cells and trials done, the time left, and the
one-time work (compiling the CPU loops) shown as what it is.

On a terminal a tqdm bar; otherwise (a log file, CI, a pipe) a plain line every few seconds,
e.g. `[12/72 cells, 1840/3600 trials, 31 trials/s, ETA 57 s]`, and one at the end. While the
process compiles, `compiling 12 s now` is added (and refreshed while no chunk arrives); while
cells have started and not finished, how many are under way (the cells that share data run
chunk by chunk and finish together). Trials stored by an earlier, interrupted run count as done;
rates are this run's own, its seconds of compiling left out.

The time left (RemainingTime) is not the trials left over the average rate: a cell's first chunk
carries one-time work (its codec's tables, the first use of a code path), the codecs' costs
differ tenfold, and a first run compiles for tens of seconds. It adds, cell by cell, the trials
left times the cell's own cost per trial after its first chunk (cell.chunk_plan puts the short
chunk first): measured on its latest chunk, compiling taken out; else an earlier run's on this
machine (CostHistory), scaled to this run's speed; else the mean of the known cells' (a first
chunk says little of it); a cell yet to run the current chunk of trials is scaled by the
machine's speed now against the chunk before (its load moves); the data still to draw and the
work around the cells (commits) are added as measured. Until some cost is known the ETA is
`unknown`. Its error, replayed on recorded runs, is in docs/performance.md.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import threading
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


class RemainingTime:
    """The seconds a sweep has left, cell by cell (the module docstring). trials_left: {cell:
    trials it has left}; prior: {cell: seconds per trial of its codec's own work measured by an
    earlier run on this machine (CostHistory)}. chunk(cell, trials, seconds, wall, first_trial)
    records a chunk of `trials` trials from `first_trial` on: `seconds` of the run's time since
    the chunk before (one-time work such as compiling taken out), of which `wall` the cell's own
    work (None: all of it). The rest is the run's work around the cells: the data drawn once for
    all the cells of a chunk of trials (in the first cell's gap), each commit."""

    def __init__(self, trials_left: dict, prior: dict | None = None):
        self.trials_left = dict(trials_left)
        self.prior = {cell: cost for cell, cost in (prior or {}).items() if cell in self.trials_left}
        self._first: dict = {}     # cell -> (trials, seconds) of its first chunk in this run
        self._later: dict = {}     # cell -> its own seconds per trial on its latest chunk after the first
        self._earlier: dict = {}   # cell -> the same on the later chunk before that
        self._at: dict = {}        # cell -> the first trial of its latest chunk
        self._draws: dict = {}     # first trial of a chunk of trials -> (trials, seconds around its first cell)
        self._around = [0.0, 0.0]  # over the other later chunks: seconds around the cells' work, their own
        self._drawn, self._end = 0, None   # the end of the trials drawn so far; of those to draw

    def chunk(self, cell, trials: int, seconds: float, wall: float | None = None, first_trial=None) -> None:
        if cell not in self.trials_left or trials <= 0:
            return
        seconds = max(seconds, 0.0)
        wall = seconds if wall is None else min(max(wall, 0.0), seconds)
        self.trials_left[cell] = max(0, self.trials_left[cell] - trials)
        self._drawn = max(self._drawn, (first_trial or 0) + trials)
        if first_trial is not None:
            self._end = first_trial + trials + self.trials_left[cell]   # the trials every cell runs to
        if cell not in self._first:   # its own work only: the run's start (building the codecs) is in the first gap
            self._first[cell] = (trials, wall)
            return
        if cell in self._later:
            self._earlier[cell] = self._later[cell]
        self._later[cell] = wall / trials
        self._at[cell] = first_trial
        if first_trial is not None and first_trial not in self._draws:
            self._draws[first_trial] = (trials, seconds - wall)
        else:
            self._around[0] += seconds - wall
            self._around[1] += wall

    def per_trial(self) -> dict:
        """Each cell's own cost per trial after its first chunk, where it can be told: measured on
        a later chunk; else the earlier run's, scaled by this run's speed against it (over the
        cells measured on both). (A first chunk says little of it: one-time work dominates it.)"""
        known = dict(self._later)
        # the machine's speed now against the chunk before (its load changes): measured on the
        # cells that have run the current chunk of trials, applied to those yet to run it
        current = max((at for at in self._at.values() if at is not None), default=None)
        moved = [c for c in self._earlier if self._at.get(c) == current]
        if moved and current is not None:
            drift = sum(self._later[c] for c in moved) / sum(self._earlier[c] for c in moved)
            known.update({c: cost * drift for c, cost in known.items() if self._at.get(c) != current})
        both = [c for c in self._later if c in self.prior and self.prior[c] > 0]
        speed = sum(self._later[c] for c in both) / sum(self.prior[c] for c in both) if both else 1.0
        for cell, cost in self.prior.items():
            known.setdefault(cell, cost * speed)
        return known

    def seconds(self) -> float | None:
        """The estimate, or None while it cannot be told: before any cell's cost per trial is
        known (a first run's first chunks carry one-time work of unknown size)."""
        known = self.per_trial()
        if not known:
            return None
        mean = statistics.fmean(known.values())   # a cell of unknown cost: the known cells' mean
        around = 1 + self._around[0] / self._around[1] if self._around[1] > 0 else 1.0
        # a cell yet to run its first chunk: that chunk as the first chunks so far cost (one-time
        # work included), then the rest of its trials
        firsts = list(self._first.values())
        first_trials = statistics.fmean(t for t, _ in firsts) if firsts else 0.0
        first_seconds = statistics.fmean(s for _, s in firsts) if firsts else 0.0
        total = 0.0
        for cell, left in self.trials_left.items():
            if not left:
                continue
            if cell in self._first or not firsts:
                total += left * known.get(cell, mean) * around
            else:
                total += first_seconds + max(left - first_trials, 0.0) * known.get(cell, mean) * around
        # the data still to draw: once per chunk of trials for all the cells that share them
        drawn_trials = sum(t for t, _ in self._draws.values())
        if drawn_trials:
            to_draw = self._end - self._drawn if self._end is not None else max(self.trials_left.values(), default=0)
            total += max(to_draw, 0) * sum(s for _, s in self._draws.values()) / drawn_trials
        return total


class CostHistory:
    """The cost per trial of each cell measured by earlier runs on this machine, in a JSON file
    ($KVHARNESS_COST_HISTORY, else kvharness/costs.json under $XDG_CACHE_HOME or ~/.cache): the
    prior of RemainingTime, so that a second run's time left is known from its first seconds.
    A key names the cell and what its cost depends on besides (device, dtype, implementation,
    heads, decode tokens); at most MAX_ENTRIES, the oldest dropped. An unreadable file is no
    history; one that cannot be written is left as it was."""

    MAX_ENTRIES = 20000

    def __init__(self, path: str | os.PathLike | None = None):
        if path is None:
            path = os.environ.get("KVHARNESS_COST_HISTORY") or os.path.join(
                os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvharness", "costs.json")
        self.path = path

    def load(self) -> dict:
        try:
            with open(self.path) as f:
                data = json.load(f)
            return {k: float(v) for k, v in data.items()} if isinstance(data, dict) else {}
        except (OSError, ValueError, TypeError):
            return {}

    def save(self, costs: dict) -> None:
        if not costs:
            return
        merged = {k: v for k, v in self.load().items() if k not in costs}
        merged.update(costs)
        merged = dict(list(merged.items())[-self.MAX_ENTRIES:])
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(merged, f)
            os.replace(tmp, self.path)
        except OSError:
            pass


class Progress:
    """mode: 'bar' (tqdm), 'lines' (plain lines every `interval` seconds) or None (silent).
    trials_left: {cell: trials it has left} (advance's `cell` names them), for the time left
    cell by cell (prior: RemainingTime's); without it, trials left over this run's rate. compiling: an object whose
    seconds() is the time this process has spent compiling so far and whose active() says whether
    it is compiling now (kvcommon.compiled.compile_clock), or None. clock: time.monotonic (tests
    replay recorded runs through another)."""

    def __init__(self, n_cells: int, n_trials: int, *, cells_done: int = 0, trials_done: int = 0,
                 mode: str | None = None, stream=None, interval: float | None = None,
                 trials_left: dict | None = None, prior: dict | None = None, compiling=None,
                 clock=time.monotonic):
        self.n_cells, self.n_trials = n_cells, n_trials
        self.cells_done, self.trials_done = cells_done, trials_done
        self.mode, self.stream = mode, stream or sys.stderr
        self.interval = interval if interval is not None else float(os.environ.get(INTERVAL_ENV, LINE_INTERVAL_S))
        self.clock, self.compiling = clock, compiling
        self.remaining = RemainingTime(trials_left, prior) if trials_left is not None else None
        self._start = self._last = self._last_chunk = clock()
        self._compiled_at_last_chunk = self._compiled()
        self._trials_start = trials_done
        self._started: set = set()
        self._finished: set = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._bar = None
        if mode == "bar":
            from tqdm import tqdm
            self._bar = tqdm(total=n_trials, initial=trials_done, unit="trial", file=self.stream,
                             dynamic_ncols=True, bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} trials [{elapsed}{postfix}]")
            self._bar.set_postfix_str(self._status())
        if mode is not None and compiling is not None:   # a long compile shows, not only chunks
            threading.Thread(target=self._tick, daemon=True, name="kvharness-progress").start()

    @classmethod
    def auto(cls, enabled: bool | None, n_cells: int, n_trials: int, **kwargs) -> "Progress":
        """enabled None: a bar on a terminal, plain lines elsewhere; True: a bar; False: silent."""
        stream = kwargs.get("stream") or sys.stderr
        mode = None if enabled is False else "bar" if enabled or stream.isatty() else "lines"
        return cls(n_cells, n_trials, mode=mode, **kwargs)

    def _compiled(self) -> float:
        return self.compiling.seconds() if self.compiling is not None else 0.0

    def rate(self) -> float:
        """This run's trials per second of work, the seconds spent compiling left out."""
        work = self.clock() - self._start - self._compiled()
        return (self.trials_done - self._trials_start) / work if work > 0 else 0.0

    def eta(self) -> float | None:
        """Seconds left (None: not yet known)."""
        if self.remaining is not None:
            return self.remaining.seconds()
        rate = self.rate()
        return (self.n_trials - self.trials_done) / rate if rate > 0 else None

    def _parts(self) -> list[str]:
        """The status: cells (and how many are under way while none of them has finished: cells
        sharing data run chunk by chunk and finish together), trials, rate, ETA, compiling."""
        cells = f"{self.cells_done}/{self.n_cells} cells"
        under_way = len(self._started - self._finished)
        if under_way and self.cells_done < self.n_cells:
            cells += f" ({under_way} under way)"
        eta = self.eta()
        parts = [cells, f"{self.trials_done}/{self.n_trials} trials", f"{self.rate():.3g} trials/s",
                 f"ETA {_duration(eta)}" if eta is not None else "ETA unknown"]
        if self.compiling is not None and (self.compiling.active() or self._compiled() >= 1):
            parts.append(f"compiling {self._compiled():.0f} s" + (" now" if self.compiling.active() else ""))
        return parts

    def _status(self) -> str:
        """The bar's postfix: the parts without the trials, which the bar shows."""
        parts = self._parts()
        return ", ".join(parts[:1] + parts[2:])

    def line(self) -> str:
        return "[" + ", ".join(self._parts()) + "]"

    def advance(self, trials: int, cells: int = 0, cell=None, wall: float | None = None,
                first_trial: int | None = None) -> None:
        """`trials` more trials stored (of `cell`, or of one cell or several), `cells` of them
        finishing a cell; wall, first_trial: the seconds of the cell's own work on them and the
        first of them (RemainingTime.chunk)."""
        with self._lock:
            now, compiled = self.clock(), self._compiled()
            if cell is not None:
                self._started.add(cell)
                if cells:
                    self._finished.add(cell)
                if self.remaining is not None:
                    work = (now - self._last_chunk) - (compiled - self._compiled_at_last_chunk)
                    self.remaining.chunk(cell, trials, work, wall, first_trial)
            self._last_chunk, self._compiled_at_last_chunk = now, compiled
            self.trials_done += trials
            self.cells_done += cells
            if self._bar is not None:
                self._bar.update(trials)
                self._bar.set_postfix_str(self._status(), refresh=False)
            elif self.mode == "lines" and now - self._last >= self.interval:
                self._print()

    def measured(self) -> dict:
        """{cell: seconds per trial} of the cells measured on a chunk after their first (what
        CostHistory keeps)."""
        return dict(self.remaining._later) if self.remaining is not None else {}

    def _tick(self) -> None:
        """While the run goes on: the bar's status, or a plain line, refreshed every interval
        (at least every second on a terminal) even when no chunk arrives (a long compile)."""
        while not self._stop.wait(1.0 if self._bar is not None else max(self.interval, 1.0)):
            with self._lock:
                if self._bar is not None:
                    self._bar.set_postfix_str(self._status())
                elif self.clock() - self._last >= self.interval and self.compiling.active():
                    self._print()

    def _print(self) -> None:
        self._last = self.clock()
        print(self.line(), file=self.stream, flush=True)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            if self._bar is not None:
                self._bar.close()
            elif self.mode == "lines" and self.trials_done > self._trials_start:
                self._print()
