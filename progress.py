"""Progress on stderr for the long steps (conversion, quantization, evaluation): a bar
on a terminal; elsewhere (a log file, CI, a pipe) a line every few seconds, so a reader of the
log sees the work move instead of minutes of silence."""
import sys
import time

from tqdm import tqdm

EVERY_S = 10.0  # seconds between progress lines when stderr is not a terminal


class Lines:
    """tqdm's calls (update, iteration, a context) as a line on stderr every EVERY_S seconds."""

    def __init__(self, iterable=None, desc: str = "", total=None, unit: str = "it", every: float = None):
        self.iterable, self.desc, self.unit = iterable, desc, unit
        self.every = EVERY_S if every is None else every
        self.total = total if total is not None or iterable is None else getattr(iterable, "__len__", lambda: None)()
        self.n, self.start, self.postfix = 0, time.perf_counter(), ""
        self.last = self.start

    def update(self, n: int = 1):
        self.n += n
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            of = f"/{self.total}" if self.total else ""
            print(f"{self.desc}: {self.n}{of} {self.unit} ({now - self.start:.0f} s){self.postfix}",
                  file=sys.stderr, flush=True)

    def set_postfix(self, refresh: bool = True, **values):
        self.postfix = ", " + ", ".join(f"{k} {v}" for k, v in values.items())

    def refresh(self):
        pass

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def progress(iterable=None, desc: str = "", total=None, unit: str = "it"):
    """A bar over iterable (or one to update()) when stderr is a terminal, else progress lines."""
    if sys.stderr.isatty():
        return tqdm(iterable, desc=desc, total=total, unit=unit, file=sys.stderr, leave=False)
    return Lines(iterable, desc, total, unit)
