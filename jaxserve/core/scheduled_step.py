"""A step the scheduler scheduled and has not updated yet (core/scheduler.py)."""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.core.request import Request
from jaxserve.core.step_messages import ScheduledRequest


@dataclass(slots=True)
class ScheduledStep:
    """A scheduled step not yet updated: its requests (an id may be reused after an abort, so
    update() must not look requests up by id), their chunks, and those made void."""
    requests: list[Request]
    scheduled: list[ScheduledRequest]
    void: set[int]                      # id() of requests whose chunk is void (scheduler.py)
    _rows: dict[int, int] | None = None     # id() of each request -> its place, when asked

    def chunk_of(self, req: Request) -> ScheduledRequest | None:
        """The request's live chunk of this step (None: it has none, or it was made void)."""
        if self._rows is None:
            self._rows = {id(r): i for i, r in enumerate(self.requests)}
        i = self._rows.get(id(req))     # (the list keeps its requests alive: ids stay theirs)
        return None if i is None or id(req) in self.void else self.scheduled[i]
