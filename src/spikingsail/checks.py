"""The two checks every part of a config goes through: its keys are known, and its numbers are in range.

A number's range is finite, an integer where its consumer needs one, and within the bounds its
consumer needs (numpy's seed range, float32 for a loss scale, a timeout torch can count).
"""

from __future__ import annotations

import difflib
import math
import sys
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from spikingsail.errors import ConfigError

FLOAT32_MAX = 3.4028234663852886e38
"""The largest float32: the loss is scaled in float32, so a larger scale makes every step overflow."""
INT64_MAX = 2**63 - 1
"""torch sizes and seeds are int64 (or uint64) in C++."""


@dataclass(frozen=True, slots=True)
class Range:
    """An interval of numbers, closed unless ``low_open`` / ``high_open``; ``integer`` for counts."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    why: str = ""
    """What the consumer does with the value that makes these the bounds."""
    fix: str = ""
    """A typical value to use instead; the default fix names the range."""

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        if self.low is not None and self.high is not None:
            if self.integer:
                return f"{kind} from {_show(self.low)} to {_show(self.high)}"
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"{kind} in {left}{_show(self.low)}, {_show(self.high)}{right}"
        if self.low is not None:
            return f"{kind} {'>' if self.low_open else '≥'} {_show(self.low)}"
        if self.high is not None:
            return f"{kind} {'<' if self.high_open else '≤'} {_show(self.high)}"
        return f"a finite {kind.removeprefix('a ').removeprefix('an ')}"

    def contains(self, number: float) -> bool:
        low_ok = self.low is None or (number > self.low if self.low_open else number >= self.low)
        high_ok = self.high is None or (number < self.high if self.high_open else number <= self.high)
        return low_ok and high_ok


def check_number(value: Any, allowed: Range, key: str, where: str) -> int | float:
    """``value`` as read from JSON, if it is a number within ``allowed``; else a ``ConfigError``.

    An integral float (``1e3``, ``1000.0``) counts as an integer, as it does for DeepSpeed; the
    result is an int for an integer range and a float otherwise (torch reads a Python int as int64).
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        _refuse(value, allowed, key, where, f"found {type(value).__name__}, not a number")
    infinite_as_float = isinstance(value, int) and not allowed.integer and abs(value) > sys.float_info.max
    if infinite_as_float or (isinstance(value, float) and not math.isfinite(value)):
        _refuse(value, allowed, key, where, "it must be a finite number")
    if allowed.integer and isinstance(value, float) and not value.is_integer():
        _refuse(value, allowed, key, where, "it counts something, so it must be a whole number")
    if not allowed.contains(value):
        _refuse(value, allowed, key, where, allowed.why)
    return int(value) if allowed.integer else float(value)


def refuse_non_finite(value: Any, key: str, where: str) -> None:
    """A ``ConfigError`` for the first NaN or infinity anywhere in a JSON object or list, by its path."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: {key} is {value!r}", "it must be a finite number",
                          f"set {key} to a finite number, or remove it")  # fmt: skip
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for name, inner in items:
        refuse_non_finite(inner, f"{key}.{name}" if isinstance(name, str) else f"{key}[{name}]", where)


def _refuse(value: Any, allowed: Range, key: str, where: str, why: str) -> None:
    reasons = [r for r in (why, allowed.why) if r]
    raise ConfigError(
        f"{where}: {key} is {value!r}",
        "; ".join(dict.fromkeys(reasons)) or f"it must be {allowed.describe()}",
        f"set {key} to {allowed.describe()}" + (f" ({allowed.fix})" if allowed.fix else ""),
    )


def _show(number: float) -> str:
    if isinstance(number, float) and number.is_integer() and abs(number) < 1e16:
        number = int(number)
    if isinstance(number, int) and number >= 2**20 and number & (number + 1) == 0:
        return f"2**{number.bit_length()}-1"
    return f"{number:g}" if isinstance(number, float) else str(number)


def closest(key: str, valid: Collection[str]) -> str | None:
    """The valid name a mistyped ``key`` most likely meant, if one is close: the "did you mean"."""
    close = difflib.get_close_matches(key, list(valid), n=1)
    return close[0] if close else None


def reject_unknown(raw: dict[str, Any], valid: Collection[str], where: str, scope: str) -> None:
    """A ``ConfigError`` for the first key of ``raw`` not in ``valid``, with a "did you mean"."""
    for key in raw:
        if key not in valid:
            close = closest(key, valid)
            hint = f"did you mean '{close}'? " if close else ""
            raise ConfigError(
                f"{where}: unknown key '{key}' in {scope}",
                "SpikingSail rejects keys it does not know so that a typo never goes unnoticed",
                f"{hint}valid keys: {', '.join(sorted(valid))}",
            )
