"""How ``python -m wfpass bench`` and ``python -m wfpass demo`` measure:
progress lines on stderr and interleaved timing (every variant once per
round, medians of rounds, so a noisy machine slows all of them alike)."""
from __future__ import annotations

import dataclasses
import statistics
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, TextIO


# -- progress on stderr ----------------------------------------------------------------


class Progress:
    """A progress bar on stderr: ``[#####.....] 12/40 label 3.1 s``. On a
    terminal it redraws one line (and ticks the seconds while a long step,
    such as a compile, runs); otherwise it prints one line per labelled
    step, so logs stay readable."""

    def __init__(self, total: int, stream: Optional[TextIO] = None, enabled: bool = True) -> None:
        self.total, self.done = max(total, 1), 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.label = ""
        self.t0 = time.perf_counter()
        self._lock = threading.Lock()

    def _line(self, extra: str = "") -> str:
        n = 24
        full = min(n, n * self.done // self.total)
        return f"[{'#' * full}{'.' * (n - full)}] {self.done}/{self.total} {self.label}{extra}"

    def _draw(self, extra: str = "") -> None:
        if not self.tty:
            return
        with self._lock:
            self.stream.write("\r\033[K" + self._line(extra))
            self.stream.flush()

    def say(self, label: str) -> None:
        """A new step begins."""
        self.label = label
        if not self.enabled:
            return
        if self.tty:
            self._draw()
        else:
            print(self._line(), file=self.stream, flush=True)

    def advance(self, n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        self._draw()

    @contextmanager
    def working(self, label: str) -> Iterator[None]:
        """A long step: the seconds tick on a terminal; the time it took is
        printed either way."""
        self.say(label)
        start = time.perf_counter()
        stop = threading.Event()
        ticker = None
        if self.tty:
            def tick() -> None:
                while not stop.wait(0.25):
                    self._draw(f" {time.perf_counter() - start:.1f} s")

            ticker = threading.Thread(target=tick, daemon=True)
            ticker.start()
        try:
            yield
        finally:
            stop.set()
            if ticker is not None:
                ticker.join()
            took = time.perf_counter() - start
            if self.enabled and not self.tty:
                print(f"    {label}: {took:.1f} s", file=self.stream, flush=True)
            self.advance()

    def close(self) -> None:
        if self.tty:
            with self._lock:
                self.stream.write("\r\033[K")
                self.stream.flush()


# -- interleaved timing ----------------------------------------------------------------


@dataclasses.dataclass
class Timing:
    """Per-call seconds, one sample per round."""

    samples: List[float]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        """Half the interquartile range over rounds, relative to the median:
        one disturbed round (another process on a shared machine) moves it
        little, unlike the full range."""
        q1, q3 = self.quartiles
        return (q3 - q1) / 2 / self.median if self.median else 0.0

    @property
    def quartiles(self) -> tuple:
        if len(self.samples) < 2:
            return self.median, self.median
        q1, _, q3 = statistics.quantiles(self.samples, n=4, method="inclusive")
        return q1, q3

    def cell(self, unit: float = 1e3) -> str:
        return f"{self.median * unit:.3f} ±{self.spread * 100:.0f}%"


def calls_per_sample(fn: Callable[[], None], min_s: float) -> int:
    """Calls per sample to last ``min_s``. One call first, uncounted: wformat
    decides a row count new to a graph on its second call (timing the
    candidates where the decision file does not hold them), which would
    otherwise be the first call counted here and set the sample size."""
    fn()
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if time.perf_counter() - t0 >= min_s or n >= 1 << 16:
            return n
        n *= 2


def interleaved_samples(samplers: Dict[str, Callable[[], float]], rounds: int,
                        progress: Optional[Progress] = None) -> Dict[str, Timing]:
    """Take ``rounds`` samples of every sampler (each returns one per-call
    time), the variants interleaved inside each round and their order
    rotated from round to round, so machine noise reaches all alike."""
    names = list(samplers)
    out: Dict[str, List[float]] = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            out[k].append(samplers[k]())
        if progress is not None:
            progress.advance()
    return {k: Timing(v) for k, v in out.items()}


def interleaved(steps: Dict[str, Callable[[], None]], rounds: int, min_s: float = 0.02,
                progress: Optional[Progress] = None) -> Dict[str, Timing]:
    """Time every step in one process, ``interleaved_samples`` with each
    sample enough calls to last ``min_s``. Each step must already have run
    once (compiled)."""
    calls = {k: calls_per_sample(fn, min_s) for k, fn in steps.items()}

    def sampler(fn: Callable[[], None], n: int) -> Callable[[], float]:
        def sample() -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            return (time.perf_counter() - t0) / n
        return sample

    return interleaved_samples({k: sampler(fn, calls[k]) for k, fn in steps.items()}, rounds, progress)
