"""A stand-in for ``confluent_kafka.Producer`` in unit tests (integration tests use real Kafka)."""
from __future__ import annotations

import time


class RecordingProducer:
    """Records produce() calls in order; ``full`` simulates librdkafka's queue being full
    (Kafka unreachable): produce() then raises BufferError as the real one does."""

    def __init__(self) -> None:
        self.records: list[tuple[str, bytes, bytes]] = []
        self.full = False

    def produce(self, topic, value, key=None, on_delivery=None):
        if self.full:
            raise BufferError("queue full")
        self.records.append((topic, value, key))

    def poll(self, timeout=0):
        time.sleep(min(timeout, 0.01))
        return 0

    def flush(self, timeout=0):
        return 0

    def __len__(self):
        return 0

    def on(self, topic: str) -> list[tuple[bytes, bytes]]:
        """(key, value) of the records produced to ``topic``."""
        return [(key, value) for t, value, key in self.records if t == topic]
