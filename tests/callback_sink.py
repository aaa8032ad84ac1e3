"""A bridge sink for unit tests: it hands each record to a callback instead of Kafka."""
from __future__ import annotations

from typing import Any, Callable

from kvbus.schemas.events import DeadLetter, EventBatch


class CallbackSink:
    """A sink calling ``on_batch(batch)`` / ``on_dead_letter(dl)`` synchronously (unit tests)."""

    def __init__(self, on_batch: Callable[[EventBatch], Any],
                 on_dead_letter: Callable[[DeadLetter], Any] | None = None) -> None:
        self.on_batch = on_batch
        self.on_dead_letter = on_dead_letter or (lambda dl: None)
        self.accept = True
        """Set False to simulate a full backlog."""

    def produce_batch(self, batch: EventBatch) -> None:
        self.on_batch(batch)

    def produce_dead_letter(self, dl: DeadLetter) -> None:
        self.on_dead_letter(dl)

    def service(self) -> None:
        pass

    def accepting(self) -> bool:
        return self.accept

    def update_gauges(self) -> None:
        pass

    def failure(self) -> str | None:
        return None if self.accept else "backlog full"

    def close(self, timeout: float = 30.0) -> int:
        return 0
