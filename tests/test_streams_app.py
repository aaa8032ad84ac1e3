"""The streams stage's Faust app as declared, without Kafka: the changelog the worker creates before
Faust starts is the one Faust would declare."""
from __future__ import annotations

from dataclasses import replace

import pytest
from faust.transport.drivers import aiokafka as faust_aiokafka
from mode.utils.times import want_seconds

from kvbus.runtime.settings import Settings
from kvbus.streams.app import changelog_specs, create_app
from kvbus.streams.options import StreamsOptions


@pytest.mark.parametrize("windowed", [False, True])
def test_changelog_specs_are_what_faust_declares(windowed: bool):
    settings = replace(Settings(), bootstrap="127.0.0.1:1", partitions=6)
    app = create_app(settings, replace(StreamsOptions(), app_id="changelog-check", replication=3))
    table = app.Table("state", key_type=bytes, value_type=bytes, partitions=settings.partitions)
    if windowed:
        table = app.Table("counts", default=int).tumbling(10, expires=3600).table
    topic = table.changelog_topic
    want = faust_aiokafka.Transport._topic_config(None, int(want_seconds(topic.retention) * 1000) if topic.retention
                                                  else None, topic.compacting, topic.deleting)

    specs = {s.name: s for s in changelog_specs(app)}

    spec = specs[topic.get_topic_name()]
    assert spec.partitions == 6 and spec.replicas == 3
    assert spec.config == {k: str(v) for k, v in want.items()}
    assert spec.config["cleanup.policy"] == ("compact,delete" if windowed else "compact")
    assert ("retention.ms" in spec.config) == windowed
    assert sorted(specs) == sorted(t.changelog_topic.get_topic_name() for t in app.tables.values())
