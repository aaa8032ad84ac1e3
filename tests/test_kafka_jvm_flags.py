"""The brokers' JVM flags (kvbus.infra.kafka_broker.java_argv): C1 only in a cluster of several, C2
for a single broker, and the operator's KVBUS_KAFKA_JVM_OPTS after the defaults so that they win."""

from __future__ import annotations

import pytest

from kvbus.infra.kafka_broker import java_argv
from kvbus.infra.stack_env import Paths

C1_ONLY = "-XX:TieredStopAtLevel=1"


def flags(tmp_path, brokers: int, *, server: bool = True) -> list[str]:
    argv = java_argv(Paths(root=tmp_path), brokers, "kafka.Kafka", ["server.properties"], server=server)
    return argv[:argv.index("-cp")]


@pytest.mark.parametrize("brokers, c1_only", [(1, False), (3, True)])
def test_brokers_of_a_cluster_run_c1_only_a_single_broker_keeps_c2(tmp_path, monkeypatch, brokers, c1_only) -> None:
    monkeypatch.delenv("KVBUS_KAFKA_JVM_OPTS", raising=False)
    assert (C1_ONLY in flags(tmp_path, brokers)) is c1_only


def test_tools_run_c1_only_without_the_brokers_extra_flags(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVBUS_KAFKA_JVM_OPTS", "-XX:TieredStopAtLevel=4")
    tool = flags(tmp_path, 1, server=False)
    assert C1_ONLY in tool and "-XX:TieredStopAtLevel=4" not in tool


def test_operator_flags_come_after_the_defaults(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVBUS_KAFKA_JVM_OPTS", "-XX:TieredStopAtLevel=4 -Xmx1g")
    argv = flags(tmp_path, 3)
    assert argv.index("-XX:TieredStopAtLevel=4") > argv.index(C1_ONLY)
    assert argv.index("-Xmx1g") > argv.index("-Xmx384m")
