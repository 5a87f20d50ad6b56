"""Stop strings, matched on the host against a request's detokenized text as it grows.

A stop string may span several tokens, so each check looks at the newly added characters
plus enough of the old text to complete a stop string that started before them. For
streaming, `held_back` says how many trailing characters must not be sent yet because they
could be the beginning of a stop string (which would then be cut from the output).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopMatch:
    text: str    # the output text cut at the stop (ends with the stop string only if it is included)
    stop: str    # the stop string that matched


@dataclass(frozen=True)
class StopStrings:
    stops: tuple[str, ...]             # non-empty strings (SamplingParams.stop)
    include_in_output: bool = False    # SamplingParams.include_stop_str_in_output

    @classmethod
    def of(cls, stops: Sequence[str], include_in_output: bool = False) -> "StopStrings":
        return cls(tuple(stops), include_in_output)

    def find(self, text: str, num_new_chars: int | None = None) -> StopMatch | None:
        """The earliest stop string in `text` that ends within its last `num_new_chars` characters.

        `num_new_chars=None` searches the whole text. Earlier text is assumed to have been
        checked already (so no stop ends before the new characters). Of two stop strings that
        start at the same place, the one listed first wins.
        """
        best: tuple[int, str] | None = None
        for stop in self.stops:
            start = 0 if num_new_chars is None else max(0, len(text) - num_new_chars - len(stop) + 1)
            at = text.find(stop, start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        return StopMatch(text=text[:at + len(stop)] if self.include_in_output else text[:at], stop=stop)

    def held_back(self, text: str) -> int:
        """How many trailing characters of `text` might start a stop string (send them later)."""
        if self.include_in_output:
            return 0   # a stop string that completes is sent anyway, so its prefix may go now
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
