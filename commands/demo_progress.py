"""The demo's live progress line: events/s in (bridges), consolidated and applied
(the Faust worker and the sink), and consumer lag, read from the stages' Prometheus
endpoints and from Kafka's committed offsets."""
from __future__ import annotations

import http.client
import re
import time
import urllib.request
from typing import Any, Mapping, Sequence

from confluent_kafka import KafkaException, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from kvbus.runtime.kafka_clients import GroupOffsets
from kvbus.runtime.settings import Settings


def scrape(port: int, pattern: str) -> float:
    """Sum of the samples whose name matches ``pattern`` at ``127.0.0.1:<port>/metrics`` (0 if down)."""
    return scrape_all(port, (pattern,))[0]


def scrape_all(port: int, patterns: Sequence[str]) -> list[float]:
    """Per pattern, the sum of the samples whose name matches it at ``127.0.0.1:<port>/metrics``, from
    one request (a scrape costs the process a few ms of CPU: asking once per counter doubled what a
    benchmark's sampler charged the stages); 0 each if down, or if the process died while answering: a
    cut response is ``http.client.IncompleteRead``, which once killed the fault suite's sampler thread."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as r:
            text = r.read().decode()
    except (OSError, http.client.HTTPException):
        return [0.0] * len(patterns)
    rxs = [re.compile(p) for p in patterns]
    sums = [0.0] * len(patterns)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            for j, rx in enumerate(rxs):
                if rx.fullmatch(s.name):
                    sums[j] += s.value
    return sums


class GroupLag:
    """Records in topics matching ``topic_regex`` that consumer ``group`` has not committed yet.

    Keeps one :class:`~kvbus.runtime.kafka_clients.GroupOffsets` (its consumer reads ``group``'s
    committed offsets and the watermarks), so a caller asking every second does not connect anew
    each time. ``timeout``: seconds each Kafka request may take; ``conf``: more librdkafka settings
    (e.g. a ``logger``)."""

    def __init__(self, kafka: "str | Mapping[str, Any]", group: str, topic_regex: str, timeout: float = 5.0,
                 conf: dict | None = None) -> None:
        self.rx = re.compile(topic_regex)
        self.timeout = timeout
        self.offsets = GroupOffsets(kafka, group, conf)

    def partitions(self) -> list[tuple[str, int, int, int]]:
        """``(topic, partition, committed, end)`` of every partition of the matching topics, sorted:
        ``end`` is the high watermark, ``committed`` the group's next offset (the low watermark when
        the group committed nothing there); the lag is ``end - committed``. Raises KafkaException
        while Kafka cannot say (e.g. a coordinator moving)."""
        c, t = self.offsets.consumer(), self.timeout
        md = c.list_topics(timeout=t)
        tps = [(n, p) for n, tm in md.topics.items() if self.rx.fullmatch(n) for p in tm.partitions]
        out = []
        for (topic, partition), done in self.offsets.committed(tps, timeout=t).items():
            low, high = c.get_watermark_offsets(TopicPartition(topic, partition), timeout=t, cached=False)
            out.append((topic, partition, low if done is None else done, high))
        return sorted(out)

    def lag(self) -> int:
        """The lag now, summed over :meth:`partitions` (raises like it)."""
        return sum(max(0, end - done) for _t, _p, done, end in self.partitions())

    def close(self) -> None:
        self.offsets.close()


class Progress:
    """Rates since the previous call, plus lag of the worker and the sink."""

    def __init__(self, settings: Settings, bridge_ports: list[int], worker_port: int, sink_port: int,
                 worker_group: str, sink_group: str) -> None:
        self.settings = settings
        self.bridge_ports = bridge_ports
        self.worker_port = worker_port
        self.sink_port = sink_port
        self.worker_group = worker_group
        self.sink_group = sink_group
        self._last = (time.monotonic(), 0.0, 0.0, 0.0)
        t = settings.topics
        self._raw_lag = GroupLag(settings.kafka(), worker_group, re.escape(t.raw))
        self._blocks_lag = GroupLag(settings.kafka(), sink_group, t.blocks_pattern()[1:])

    def counts(self) -> tuple[float, float, float]:
        """(events acknowledged by Kafka from all bridges, events consolidated, events applied to Redis)."""
        acked = sum(scrape(p, r"kvbus_bridge_events_acked_total") for p in self.bridge_ports)
        consolidated = scrape(self.worker_port, r"kvbus_streams_(consolidated|passthrough)_total")
        applied = scrape(self.sink_port, r"kvbus_sink_events_applied_total")
        return acked, consolidated, applied

    def lags(self) -> tuple[int, int] | None:
        """(raw records the worker has not committed, block events the sink has not committed);
        None while Kafka cannot say (e.g. a group coordinator moving: transient)."""
        try:
            return self._raw_lag.lag(), self._blocks_lag.lag()
        except KafkaException:
            return None

    def line(self) -> str:
        """One progress line; rates are per second since the previous line."""
        now = time.monotonic()
        acked, consolidated, applied = self.counts()
        t0, a0, c0, p0 = self._last
        dt = max(now - t0, 1e-6)
        self._last = (now, acked, consolidated, applied)
        lags = self.lags()
        raw_lag, sink_lag = lags if lags is not None else ("?", "?")
        return (f"in {(acked - a0) / dt:8.0f} ev/s | consolidated {(consolidated - c0) / dt:8.0f} ev/s | "
                f"applied {(applied - p0) / dt:8.0f} ev/s | totals {acked:.0f}/{consolidated:.0f}/{applied:.0f} | "
                f"lag raw {raw_lag} blocks {sink_lag}")

    def drained(self) -> bool:
        """True when the worker and the sink have committed everything in their topics."""
        return self.lags() == (0, 0)
