"""librdkafka queues a client's log lines (for a ``logger``) and errors until the client is polled,
and at every broker fault a client connected to that broker queues more: a long-lived client that
nothing polls keeps them for its process's whole life. The worker's admin client, its offsets reader
and its output producer (polled otherwise only while batches are in flight) are served at every
sweep (the sink's dead-letter producer: tests/test_sink_consumer.py).
The clients here point at a port where no broker listens, which logs at once."""
from __future__ import annotations

import logging
import time
from types import SimpleNamespace

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from kvbus.runtime.kafka_clients import GroupOffsets
from kvbus.runtime.settings import Settings
from kvbus.streams.options import StreamsOptions
from kvbus.streams.runtime import Runtime

NO_BROKER = "127.0.0.1:1"
"""A bootstrap address where nothing listens: every connection attempt logs and errs."""


class Lines(logging.Handler):
    """Counts the log records a logger of its own receives."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.count = 0
        self.logger = logging.getLogger(f"tests.served.{name}")
        self.logger.addHandler(self)
        self.logger.propagate = False

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def queued_for(seconds: float, *lines: Lines) -> None:
    """Let the clients queue for ``seconds``; nothing reaches their loggers meanwhile (queued, not served)."""
    time.sleep(seconds)
    assert [each.count for each in lines] == [0] * len(lines), "log lines were served without a poll"


def test_an_offsets_reader_serves_its_queued_log_lines():
    lines = Lines("offsets")
    reader = GroupOffsets({"bootstrap.servers": NO_BROKER, "logger": lines.logger}, "served-group")
    queued_for(2.0, lines)
    reader.serve()
    assert lines.count > 0, "serve() delivered none of the lines queued while no broker answered"


async def test_the_workers_sweep_serves_its_idle_clients():
    admin_lines, producer_lines, reader_lines = Lines("admin"), Lines("producer"), Lines("reader")
    runtime = Runtime(SimpleNamespace(consumer=None), Settings.from_env({}), StreamsOptions(), table={})
    runtime._admin = AdminClient({"bootstrap.servers": NO_BROKER, "logger": admin_lines.logger})
    runtime._producer = Producer({"bootstrap.servers": NO_BROKER, "logger": producer_lines.logger})
    runtime._group_offsets = GroupOffsets({"bootstrap.servers": NO_BROKER, "logger": reader_lines.logger}, "g")
    queued_for(2.0, admin_lines, producer_lines, reader_lines)
    assert not runtime.ready  # a worker not ready (rebalancing, no partition) serves them too
    with runtime._offsets_lock:  # a rebuild reading offsets: the reader is left to the next sweep
        await runtime.sweep()
    counts = (admin_lines.count, producer_lines.count, reader_lines.count)
    assert counts[0] > 0 and counts[1] > 0 and counts[2] == 0, f"lines served (admin, producer, reader): {counts}"
    await runtime.sweep()
    assert reader_lines.count > 0, "the sweep did not serve the offsets reader's queue"
