"""When a schedule fires: cron expressions (read by ``croniter``) or fixed intervals, in an IANA time zone.

Owns turning a cadence into nominal fire times (seconds since the epoch, UTC) in a range,
the rules for wall-clock times that a daylight-saving change skips or repeats, and the
deterministic jitter of a fire. It reads no database and no clock: the scheduler passes times in.

Daylight saving, defined (and tested):
- a wall-clock time skipped by a spring-forward gap (02:30 on a night that jumps 02:00 -> 03:00)
  fires at the instant it names with the offset before the change: shifted forward by the gap
  (03:30). When that instant is another fire's too, it fires once (a fire is an instant);
- a wall-clock time repeated by a fall-back (01:30 twice) fires once, at its first occurrence;
- an interval counts seconds of real time from its anchor and ignores wall clocks entirely.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterError, croniter

from .errors import CronError

__all__ = ["Cadence", "jitter_offset"]

# How far around a range's ends the wall clock is walked: more than any DST change (at most 2 h).
_MARGIN = timedelta(hours=3)


def _zone(name: str) -> ZoneInfo:
    if not isinstance(name, str) or not name.strip():
        raise CronError("a time zone is an IANA name such as Europe/Paris or UTC", field="timezone")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError, TypeError) as exc:  # a folder, a NUL, a path
        raise CronError(f"unknown time zone {name!r}: use an IANA name such as Europe/Paris or UTC",
                        field="timezone") from exc


@dataclass(frozen=True)
class Cadence:
    """A cron expression (5 fields, or 6 with seconds) or an interval in seconds, in ``timezone``.

    ``anchor`` is where an interval counts from (its first fire is ``anchor + k * interval``).
    """

    cron: str | None = None
    interval: float | None = None
    timezone: str = "UTC"
    anchor: float = 0.0

    def __post_init__(self) -> None:
        if (self.cron is None) == (self.interval is None):
            raise CronError("a schedule has either a cron expression or an interval, not both or neither",
                            field="cron")
        zone = _zone(self.timezone)
        object.__setattr__(self, "_zone", zone)
        if self.cron is not None:
            if not isinstance(self.cron, str) or "\x00" in self.cron or not croniter.is_valid(self.cron):
                raise CronError(f"bad cron expression {self.cron!r}: five fields (minute hour day month weekday), "
                                f"e.g. '*/5 * * * *'", field="cron")
            try:
                croniter(self.cron, datetime(2001, 1, 1)).get_next(datetime)
            except (CroniterError, ValueError, OverflowError) as exc:  # 30 February: valid fields, no time
                raise CronError(f"cron expression {self.cron!r} never fires: {exc}", field="cron") from exc
        else:
            if not isinstance(self.interval, int | float) or not math.isfinite(self.interval) or \
                    not 0.001 <= self.interval <= 10**10:
                raise CronError(f"an interval is a positive number of seconds (1 ms to 10^10 s), got "
                                f"{self.interval!r}", field="interval")

    def times(self, after: float, until: float, *, limit: int | None = None) -> list[float]:
        """Nominal fire times in ``(after, until]``, ascending; at most ``limit`` (the earliest)."""
        if until <= after:
            return []
        if self.interval is not None:
            first = math.floor((after - self.anchor) / self.interval) + 1
            out, index = [], first
            while True:
                when = self.anchor + index * self.interval
                if when > until or (limit is not None and len(out) >= limit):
                    return out
                if when > after:
                    out.append(round(when, 3))
                index += 1
        zone = self._zone  # type: ignore[attr-defined]
        start = datetime.fromtimestamp(after, zone).replace(tzinfo=None) - _MARGIN
        stop = datetime.fromtimestamp(until, zone).replace(tzinfo=None) + _MARGIN
        found: set[float] = set()
        walker = croniter(self.cron, start)
        while True:
            try:
                wall = walker.get_next(datetime)
            except (CroniterError, OverflowError):  # no further time (a year with no 29 February, the end)
                break
            if wall > stop:
                break
            # fold=0: a repeated wall time is its first occurrence; a skipped one takes the offset before the gap.
            instant = wall.replace(tzinfo=zone, fold=0).astimezone(UTC).timestamp()
            if after < instant <= until:
                found.add(float(instant))
            # Past the first hours, the walk gives instants in order (a gap's times repeat later ones).
            if limit is not None and len(found) > limit and wall > start + 2 * _MARGIN:
                break
        times = sorted(found)
        return times if limit is None else times[:limit]

    def count(self, after: float, until: float, *, cap: int) -> int:
        """How many fire times ``(after, until]`` holds, counting no further than ``cap + 1``."""
        return len(self.times(after, until, limit=cap + 1))


def jitter_offset(schedule_id: str, nominal: float, jitter: float) -> float:
    """A fire's delay in ``[0, jitter)``, the same in every scheduler (a hash of the fire's key)."""
    if jitter <= 0:
        return 0.0
    digest = hashlib.sha256(f"{schedule_id}@{nominal:.3f}".encode()).digest()
    return round(int.from_bytes(digest[:8], "big") / 2**64 * jitter, 3)
