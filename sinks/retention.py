"""The block topics' retention against the sink's snapshot interval, checked when a sink starts.

A view Redis lost is rebuilt from the latest snapshot and replayed from the snapshot's offsets
(sinks/rebuild.py): the block topics must still hold every record after them, that is, retain more
than one snapshot interval (``--snapshot-every`` / ``KVBUS_SINK_SNAPSHOT_EVERY``). Retention by time
can be compared with it; retention by size cannot (how long ``retention.bytes`` lasts depends on the
flow), and a topic kept forever by time but bounded by size is common, so:

| the topic's retention | the sink |
|---|---|
| ``retention.ms`` below the snapshot interval | refuses to start (exit 2), naming both settings |
| ``retention.ms`` below twice the interval (one failed snapshot leaves a gap of two) | warns |
| ``retention.bytes`` set (not -1) | warns: the bytes must hold more than one interval of records |
| no snapshots (``--snapshot-every 0``), ``retention.ms`` finite | says (INFO): a lost view is rebuilt from the start |

Only the block topics that exist when the sink starts are checked (a tier topic created later is not).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from confluent_kafka.admin import AdminClient, ConfigResource

from kvbus.runtime.env import SettingError

log = logging.getLogger("kvbus.sinks")

INTERVAL_SETTING = "--snapshot-every / KVBUS_SINK_SNAPSHOT_EVERY"
"""How messages name the sink's snapshot interval."""
WARN_FACTOR = 2.0
"""Retention by time below this many snapshot intervals is warned about."""


@dataclass(frozen=True)
class Retention:
    """One topic's retention: ``ms`` (``retention.ms``) and ``bytes`` (``retention.bytes`` per
    partition); -1 = unbounded."""

    topic: str
    ms: int
    bytes: int


def judge(retention: Retention, snapshot_every: float) -> tuple[str | None, list[tuple[int, str]]]:
    """(why the sink must refuse this topic, or None; what to log about it, (level, line)) for
    ``snapshot_every`` seconds between snapshots (0: none). Pure: the table of the module doc."""
    t, ms, by = retention.topic, retention.ms, retention.bytes
    every_ms = snapshot_every * 1000
    keeps = f"topic {t} keeps records retention.ms={ms} ({ms / 1000:g} s)"
    interval = f"{INTERVAL_SETTING}={snapshot_every:g} s"
    notes: list[tuple[int, str]] = []
    if snapshot_every <= 0:
        if ms >= 0:
            notes.append((logging.INFO, f"no snapshots ({INTERVAL_SETTING} is 0): a view Redis loses is rebuilt by "
                                        f"reading {t} from its start, and {keeps}"))
        return None, notes
    if 0 <= ms < every_ms:
        return (f"{keeps}, less than the sink's snapshot interval {interval}: a view Redis loses could not be "
                f"rebuilt exactly (records after the latest snapshot would be deleted first); raise retention.ms "
                f"above {WARN_FACTOR * every_ms:.0f} or snapshot more often"), notes
    if 0 <= ms < WARN_FACTOR * every_ms:
        notes.append((logging.WARNING, f"{keeps}, less than twice the snapshot interval {interval}: after one "
                                       "failed snapshot a lost view may not be rebuilt exactly"))
    if by >= 0:
        notes.append((logging.WARNING, f"topic {t} is bounded by size (retention.bytes={by} per partition): it must "
                                       f"hold more than {interval} of records for a lost view to be rebuilt exactly"))
    return None, notes


def retentions(kafka: Mapping[str, Any], pattern: str) -> list[Retention]:
    """The retention of every topic whose name matches ``pattern`` (the block topics' regex)."""
    admin = AdminClient(dict(kafka))
    rx = re.compile(pattern)
    names = sorted(n for n in admin.list_topics(timeout=10).topics if rx.match(n))
    if not names:
        return []
    futures = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, n) for n in names],
                                     request_timeout=10)
    out = []
    for res, fut in sorted(futures.items(), key=lambda kv: kv[0].name):
        cfg = fut.result(15)
        out.append(Retention(res.name, int(cfg["retention.ms"].value), int(cfg["retention.bytes"].value)))
    return out


def check_retention(found: Iterable[Retention], snapshot_every: float) -> None:
    """Log what :func:`judge` says of each topic, then refuse (:class:`SettingError`: ``kvbus sink`` exits 2
    with its one line) if a topic retains less than one snapshot interval."""
    refusals = []
    for r in found:
        why, warnings = judge(r, snapshot_every)
        for level, line in warnings:
            log.log(level, "%s", line)
        if why:
            refusals.append(why)
    if refusals:
        raise SettingError(refusals[0] + (f" (and {len(refusals) - 1} more topics)" if len(refusals) > 1 else ""))
