"""The console's two service sources: Kafka (consumer lag per hop and partition, topic ends) and
the Redis residency view (through its reader, as routers read it). Each read either returns its data
or raises; :mod:`kvbus.top.collect` turns a raise into "unreachable: <what>"."""
from __future__ import annotations

import re

from kvbus.demo_progress import GroupLag
from kvbus.runtime.settings import Settings

QUIET_LIBRDKAFKA = {"log_level": 0}
"""librdkafka settings of the console's clients: no log lines on stderr (they would tear the
screen); an unreachable broker shows in the Kafka panel instead."""


class KafkaSource:
    """Lag of the two consumer hops, per partition, and the ends of the raw and dead-letter topics."""

    def __init__(self, settings: Settings, worker_group: str, sink_group: str, timeout: float) -> None:
        t, kafka = settings.topics, settings.kafka()  # with the KVBUS_KAFKA_* security settings
        self.bootstrap = settings.bootstrap
        self.hops = {
            "raw -> worker": (worker_group, t.raw,
                              GroupLag(kafka, worker_group, re.escape(t.raw), timeout, QUIET_LIBRDKAFKA)),
            "blocks -> sink": (sink_group, t.blocks_pattern(),
                               GroupLag(kafka, sink_group, t.blocks_pattern()[1:], timeout, QUIET_LIBRDKAFKA)),
        }
        self.dlq_topic = t.dlq
        self.timeout = timeout

    def read(self) -> dict:
        """``{"hops": [{"hop", "group", "topics", "lag", "end", "committed", "partitions": [{"topic",
        "partition", "committed", "end", "lag"}]}], "dlq": {"topic", "records"}}``: ``end`` is a
        partition's high watermark, ``committed`` the group's next offset there (the low watermark if
        it committed nothing), ``lag`` their difference; a hop's ``end``/``committed`` are sums over
        its partitions (their growth per second is records/s produced to / consumed from the hop),
        ``dlq.records`` the records the dead-letter topic holds now. Raises KafkaException when Kafka
        cannot answer within the timeout."""
        hops = []
        for hop, (group, topics, lag) in self.hops.items():
            parts = [{"topic": topic, "partition": p, "committed": done, "end": end, "lag": max(0, end - done)}
                     for topic, p, done, end in lag.partitions()]
            hops.append({"hop": hop, "group": group, "topics": topics, "lag": sum(x["lag"] for x in parts),
                         "end": sum(x["end"] for x in parts), "committed": sum(x["committed"] for x in parts),
                         "partitions": parts})
        return {"hops": hops, "dlq": {"topic": self.dlq_topic, "records": self._records(self.dlq_topic)}}

    def _records(self, topic: str) -> int:
        """Records ``topic`` holds (high - low watermark, summed over partitions; 0 if it does not exist)."""
        from confluent_kafka import TopicPartition

        c = self.hops["raw -> worker"][2].offsets.consumer()
        md = c.list_topics(topic, timeout=self.timeout).topics.get(topic)
        if md is None or md.error is not None:
            return 0
        total = 0
        for p in md.partitions:
            low, high = c.get_watermark_offsets(TopicPartition(topic, p), timeout=self.timeout, cached=False)
            total += high - low
        return total

    def close(self) -> None:
        for _group, _topics, lag in self.hops.values():
            lag.close()


class ViewSource:
    """The residency view, read as every reader reads it (:class:`kvbus.client.ViewClient`, single or sharded)."""

    def __init__(self, settings: Settings, prefix: str, timeout: float) -> None:
        self.url, self.prefix = settings.redis_url, prefix
        # credentials and TLS (KVBUS_REDIS_*), and timeouts: a hung Redis must not hang the screen
        self.client_kwargs = {**settings.redis_kwargs(), "socket_timeout": timeout, "socket_connect_timeout": timeout}
        self._view = None

    def _open(self):
        if self._view is None:
            from kvbus.client import ViewClient

            self._view = ViewClient(self.url, self.prefix, **self.client_kwargs)
        return self._view

    def read(self) -> dict:
        """``{"state", "size": {"entries", "blocks", "holders"}, "stale": [holder], "replicas":
        {holder: {tier: blocks}}, "tiers": [tier]}``: ``state`` is the view's status for routers
        (ready, rebuilding, missing), ``replicas`` the blocks each holder (display name: the replica, or
        ``<replica>#<dp_rank>``) holds per tier label (``GPU``, ``CPU``, ``CPU@kvcr``), ``tiers`` every
        label in it, ``stale`` the holders expired for silence. Raises redis errors when Redis cannot
        answer (the client is opened again on the next read)."""
        try:
            view = self._open()
            replicas = view.summary()
            size = view.size(exact=False)
            stale = sorted(view.stale())
            state = view.status().state
        except Exception:
            if self._view is not None:
                self._view.close()
            self._view = None
            raise
        tiers = sorted({t for per in replicas.values() for t in per})
        return {"state": state, "size": size, "stale": stale, "replicas": replicas, "tiers": tiers}
