"""``kvbus bridge``: wire engine publisher streams to Kafka.

One stream (``--endpoint``, ``--replica``, ...: a sidecar beside its engine), or several
(``--streams FILE``: a node-level bridge serving every engine of its node), in one loop with one
producer (:mod:`kvbus.producers.bridge_group`). Each stream recovers, sequences and replays on its own.


Start-up order: schema id from the registry, then the last position this bridge
produced (read back from the raw topic), then the ZMQ subscription and the
start-up replay. Both services are waited for (with retries) before the SUB
socket connects; the engine is never slowed by a missing bridge (PUB drops), and
its replay buffer covers the time the bridge needed to come up.

With ``--metrics-port``, ``/readyz`` answers 503 while the bridge starts (saying what it waits
for), while its engine socket is not connected, and while its producer fails (backlog full,
records unacknowledged for 10 s, a Kafka error since the last acknowledgement).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import threading
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from kvbus.producers.bridge import Bridge, BridgeConfig
from kvbus.producers.bridge_group import (
    DEFAULT_BATCH_BUSY,
    DEFAULT_BATCH_LARGE,
    DEFAULT_BATCH_WAIT,
    DEFAULT_BUSY_WAIT,
    Batching,
    BridgeGroup,
)
from kvbus.producers.metrics import BridgeMetrics
from kvbus.producers.raw_producer import DEFAULT_MAX_BACKLOG, DEFAULT_MAX_BACKLOG_BYTES, RawProducer
from kvbus.producers.recovery import Resume, find_last_produced, wait_and_recover
from kvbus.runtime import logs
from kvbus.runtime.backoff import Backoff, sleep
from kvbus.runtime.collector import tune_gc
from kvbus.runtime.env import (
    COUNT,
    FILE,
    NATURAL,
    PORT,
    RATE,
    SECONDS,
    SWITCH,
    Form,
    SettingError,
    add_flags,
    declared,
    from_flags,
    one_of,
    setting,
)
from kvbus.runtime.probes import Readiness
from kvbus.runtime.security import RegistrySecurity, SecurityRefused, check_kafka_access, registry_security_hint
from kvbus.runtime.settings import Settings
from kvbus.schemas.codec import FastSerde
from kvbus.schemas.events import holder_key
from kvbus.schemas.serde import RecordSerde, registry_client

log = logging.getLogger("kvbus.producers")


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(text)
    return key.strip(), value.strip()


KEY_VALUE: Form[tuple[str, str]] = Form("KEY=VALUE (a librdkafka producer setting)", _key_value)
"""``--producer-conf``'s form."""
SERIALIZER = one_of("fast", "confluent")
"""``--serializer``'s forms."""


@dataclass(frozen=True)
class BridgeOptions:
    """How one bridge process runs, besides what its bridge reads (:class:`BridgeConfig`): its
    endpoint, recovery, producer and exit; each option is a flag of ``kvbus bridge``."""

    metrics_port: int | None = setting(None, PORT, None, "serve /metrics (Prometheus), /healthz and /readyz on "
                                       "this port; unset: no endpoint", flag="--metrics-port")
    no_recover: bool = setting(None, SWITCH, False, "do not read the raw topic for the last position "
                               "(start a new epoch)", flag="--no-recover")
    max_backlog: int = setting(None, COUNT, DEFAULT_MAX_BACKLOG, "records held beyond librdkafka's queue",
                               flag="--max-backlog")
    max_backlog_mb: int = setting(None, COUNT, DEFAULT_MAX_BACKLOG_BYTES >> 20, "MiB held beyond librdkafka's queue",
                                  flag="--max-backlog-mb")
    max_record_bytes: int | None = setting(None, COUNT, None, "largest EventBatch value produced as one record; "
                                           "larger engine batches are split into several; unset: "
                                           "KVBUS_MAX_RECORD_BYTES", flag="--max-record-bytes")
    serializer: str = setting(None, SERIALIZER, "fast", "fast: direct Avro encoder with the registry's schema id; "
                              "confluent: AvroSerializer", flag="--serializer")
    flush_timeout: float = setting(None, SECONDS, 30.0, "seconds to deliver queued records on exit",
                                   flag="--flush-timeout")
    producer_conf: tuple[tuple[str, str], ...] = setting(None, KEY_VALUE, (), "extra librdkafka producer setting "
                                                         "(repeatable)", flag="--producer-conf", many=True,
                                                         metavar="KEY=VALUE")
    streams: str | None = setting(None, FILE, None, "JSON file listing the engine streams this bridge serves, "
                                  "one object per stream whose keys are the stream flags' names (endpoint, replica, "
                                  "replay_endpoint, worker_rank, workers, dp_rank, topic, engine, model, "
                                  "replay_timeout); a key left out takes the flag's value; unset: the one stream "
                                  "of --endpoint and --replica", flag="--streams")
    batch_wait: float = setting(None, SECONDS, DEFAULT_BATCH_WAIT, "seconds the loop pauses, after reading at "
                                "least --batch-large engine batches at once, for more to gather (0: never)",
                                flag="--batch-wait")
    batch_large: int = setting(None, NATURAL, DEFAULT_BATCH_LARGE, "engine batches read at once that make the "
                               "loop pause (--batch-wait)", flag="--batch-large")
    batch_busy: float = setting(None, RATE, DEFAULT_BATCH_BUSY, "engine batches a second (all streams) "
                                "from which the loop pauses after every pass (--batch-busy-wait), until they "
                                "fall below half of it; 0: never", flag="--batch-busy")
    batch_busy_wait: float = setting(None, SECONDS, DEFAULT_BUSY_WAIT, "seconds the loop pauses after every pass "
                                     "while busy (--batch-busy), for more engine batches to gather",
                                     flag="--batch-busy-wait")


def add_bridge_args(p: argparse.ArgumentParser) -> None:
    """Options of ``kvbus bridge``: the flags of :class:`BridgeConfig` and :class:`BridgeOptions`."""
    add_flags(p, BridgeConfig)
    add_flags(p, BridgeOptions)


class _Stopped(Exception):
    """SIGTERM/SIGINT arrived while waiting for a service."""


def _retry(what: str, fn: Callable[[], Any], stop: Callable[[], bool], backoff: Backoff | None = None,
           registry: RegistrySecurity | None = None) -> Any:
    """``fn()`` until it succeeds, pausing as ``backoff`` says (default: a :class:`Backoff`'s pauses);
    raises :class:`_Stopped` if asked to stop meanwhile, and :class:`SecurityRefused` if the
    registry refuses ``registry``'s credentials or rights (no retry can fix that)."""
    backoff = backoff or Backoff()
    while True:
        try:
            return fn()
        except Exception as exc:
            hint = registry_security_hint(exc, registry) if registry is not None else None
            if hint:
                raise SecurityRefused(f"{what}: {exc} -- {hint}") from exc
            pause = backoff.next()
            log.warning("%s failed (%s); retrying in %.1fs", what, exc, pause)
            if not sleep(pause, stop):
                raise _Stopped(what) from exc


def config_from_args(args: argparse.Namespace) -> BridgeConfig:
    """BridgeConfig of the one stream the flags name (``--endpoint``, ``--replica``, ...)."""
    cfg = from_flags(BridgeConfig, args)
    if cfg.endpoint is None or cfg.replica is None:
        raise SettingError("kvbus bridge: --endpoint and --replica are required (or --streams FILE)")
    return cfg


def configs_from_args(args: argparse.Namespace) -> list[BridgeConfig]:
    """The BridgeConfig of every stream: those of ``--streams`` (each key over the flags' values),
    else the one of the flags (:func:`config_from_args`). :class:`SettingError` names what is wrong."""
    path = getattr(args, "streams", None)
    if not path:
        return [config_from_args(args)]
    try:
        entries = json.loads(open(path, encoding="utf-8").read())
    except (OSError, ValueError) as exc:
        raise SettingError(f"kvbus bridge --streams {path}: {exc}") from None
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise SettingError(f"kvbus bridge --streams {path}: expected a JSON list of objects, one per stream")
    flags = from_flags(BridgeConfig, args)
    forms = {name: s for name, s in declared(BridgeConfig) if s.flag is not None}
    out = []
    for i, entry in enumerate(entries):
        given = {}
        for key, value in entry.items():
            s = forms.get(key)
            if s is None:
                raise SettingError(f"kvbus bridge --streams {path}: stream {i}: unknown key {key!r} "
                                   f"(known: {', '.join(forms)})")
            try:
                given[key] = None if value is None else s.form.parse(str(value))
            except (ValueError, TypeError):
                raise SettingError(f"kvbus bridge --streams {path}: stream {i}: {key}={value!r}: "
                                   f"expected {s.form.expected}") from None
        cfg = dataclasses.replace(flags, **given)
        if cfg.endpoint is None or cfg.replica is None:
            raise SettingError(f"kvbus bridge --streams {path}: stream {i} needs an endpoint and a replica")
        out.append(cfg)
    holders = [(c.replica, c.dp_rank, c.worker_rank) for c in out]
    if len(set(holders)) != len(holders):
        raise SettingError(f"kvbus bridge --streams {path}: two streams of one (replica, dp_rank, worker_rank)")
    return out


def build_bridge(args: argparse.Namespace, settings: Settings, stop: Callable[[], bool],
                 metrics: BridgeMetrics | None = None, readiness: Readiness | None = None) -> BridgeGroup | None:
    """Registry, recovery of every stream, the shared Kafka sink and the streams' bridges in one
    group; None if stopped while waiting for services. ``readiness`` is told what is awaited
    (:attr:`Readiness.starting`), then checks the group."""
    cfgs = configs_from_args(args)
    topics = settings.topics
    readiness = readiness or Readiness()
    readiness.starting = "Kafka"
    check_kafka_access(settings.kafka())  # refused credentials or protocol: exit 2 naming the setting
    readiness.starting = "the schema registry"
    registry = registry_client(settings)
    dl_serde = RecordSerde(registry, "DeadLetter")
    batch_serde = RecordSerde(registry, "EventBatch")
    if args.serializer == "fast":
        fast = FastSerde(registry, "EventBatch")
        schema_id = _retry("registering the EventBatch schema", lambda: fast.schema_id(topics.raw), stop,
                           registry=settings.security.registry)
        serialize_batch = lambda b: fast.dumps(b, topics.raw)  # noqa: E731
        log.info("EventBatch schema id %d for %s-value", schema_id, topics.raw)
    else:
        serialize_batch = lambda b: batch_serde.dumps(b, topics.raw)  # noqa: E731
    resumes: list[Resume | None] = []
    for cfg in cfgs:
        resume: Resume | None = None
        if not args.no_recover:
            readiness.starting = f"the last position produced (reading {topics.raw})"
            ok, resume = wait_and_recover(
                lambda: find_last_produced(settings.kafka(), topics.raw, cfg.replica, cfg.dp_rank, cfg.worker_rank,
                                           lambda v: batch_serde.loads(v, topics.raw)),
                stop,
            )
            if not ok:
                return None
            if resume is None:
                log.info("no earlier record of %s#%d worker %d in %s: first start", cfg.replica, cfg.dp_rank,
                         cfg.worker_rank, topics.raw)
        resumes.append(resume)
    metrics = metrics or BridgeMetrics()
    sink = RawProducer.build(
        settings.kafka(), topics.raw, topics.dlq, serialize_batch, lambda dl: dl_serde.dumps(dl, topics.dlq),
        metrics, dict(args.producer_conf), max_backlog=args.max_backlog,
        max_backlog_bytes=args.max_backlog_mb << 20,
        max_record_bytes=args.max_record_bytes or settings.max_record_bytes,
    )
    poller = zmq.Poller()
    bridges = [Bridge(cfg, sink, metrics, resume=resume, poller=poller) for cfg, resume in zip(cfgs, resumes)]
    batching = Batching(args.batch_wait, args.batch_large, args.batch_busy, args.batch_busy_wait)
    group = BridgeGroup(bridges, sink, metrics, poller, batching)
    readiness.add(group.not_ready)
    readiness.starting = None
    return group


def run_bridge(args: argparse.Namespace, settings: Settings) -> int:
    """Run the bridge (its streams) until SIGTERM/SIGINT; flushes on exit. Returns 0, or 1 if records
    were left undelivered."""
    stopping = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping", signum)
        stopping.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    if not args.streams:
        logs.bind(holder=holder_key(args.replica, args.dp_rank))
    metrics, readiness = BridgeMetrics(), Readiness(starting="Kafka")
    if args.metrics_port:  # first: /healthz answers, and /readyz says what the bridge waits for
        metrics.serve(args.metrics_port, readiness)
        log.info("metrics on :%d/metrics, probes on /healthz and /readyz", args.metrics_port)
    try:
        bridge = build_bridge(args, settings, stopping.is_set, metrics, readiness)
    except _Stopped as exc:
        log.info("stopped while waiting for: %s", exc)
        return 0
    if bridge is None:
        return 0
    tune_gc()
    try:
        bridge.open()
        bridge.run(stopping.is_set)
    finally:
        left = bridge.close(args.flush_timeout)
        m = bridge.metrics
        log.info("bridge stopped (%d stream(s)): in %d batches / %d events, acked %d batches / %d events, "
                 "dlq %d, resets %d, recovered %d, left undelivered %d", len(bridge.bridges), m.value("batches_in"),
                 m.value("events_in"), m.value("batches_acked"), m.value("events_acked"), m.value("dlq"),
                 m.value("resets"), m.value("recovered"), left)
    return 1 if left else 0
