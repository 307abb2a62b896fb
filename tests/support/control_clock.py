"""A fake clock for the control plane's tests: time moves only when a test moves it."""

from __future__ import annotations


class FakeClock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = float(now)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now
