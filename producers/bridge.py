"""The bridge: one engine publisher stream (ZMQ SUB) -> decoded EventBatch records -> a sink (Kafka).

Per loop pass: serve the producer (delivery callbacks, backlog), poll the live SUB
socket and the replay DEALER, feed the :class:`~kvbus.producers.sequencer.Sequencer`,
and hand what it releases, in order, to the sink:

* live frames ``[topic, seq8, payload]`` are parsed (bad frame sets -> DLQ), sequenced,
  and decoded only when released (undecodable payloads -> DLQ; their seq still counts);
* gaps trigger a replay from the engine's ROUTER; live batches are held meanwhile;
* reset markers become ``EventBatch(seq=-1, events=[Reset(...)])`` in the new epoch;
* events of unknown type are skipped by the decoder, the batch's known events are
  produced and its raw frames dead-lettered, so nothing disappears silently;
* a batch too large for one Kafka record is split by the sink (:mod:`kvbus.producers.split`); if the
  bridge stopped between the parts of one, the restarted bridge produces the missing parts
  (see :meth:`Bridge._same_as_resumed`).

The sink is a seam: :class:`~kvbus.producers.raw_producer.RawProducer` in production, any
object with the :class:`Sink` methods in unit tests (tests/callback_sink.py).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvbus.producers.decode import ENGINES, DecodeError, decode_batch, parse_frames
from kvbus.producers.engines import detect_engine
from kvbus.producers.metrics import BridgeMetrics
from kvbus.producers.recovery import Resume
from kvbus.producers.replay import DEFAULT_TIMEOUT, ReplayBad, ReplayClient, Replayed, ReplayEnd
from kvbus.producers.sequencer import Actions, Emit, ResetMarker, Sequencer, SequencerStats
from kvbus.runtime.env import COUNT, NATURAL, SECONDS, TEXT, Form, one_of, reuse, setting
from kvbus.runtime.settings import Settings
from kvbus.schemas.events import DeadLetter, EventBatch, Reset, check_model, dead_letter, without_tokens

log = logging.getLogger("kvbus.producers.bridge")


ENGINE = one_of(*ENGINES)
"""The forms of ``--engine``."""
DETECT_BATCHES = 1000
"""``engine="auto"``: batches with events examined for the engine label before keeping "vllm"."""


def _payload_fingerprint(item: tuple) -> int:
    """Sequencer item identity: the payload bytes (item = (topic, payload, frames, source))."""
    return hash(item[1])


MODEL: Form[str] = Form("a model name (not empty)", check_model)
"""``--model``'s form (and ``KVBUS_BRIDGE_MODEL``'s)."""


@dataclass(frozen=True)
class BridgeConfig:
    """What one bridge reads and how it labels what it produces; each option with a flag of
    ``kvbus bridge`` is declared by :func:`kvbus.runtime.env.setting`."""

    endpoint: str = setting(None, TEXT, None, "engine PUB endpoint to connect (the bridge connects), e.g. "
                            "tcp://127.0.0.1:5557; required unless --streams names the streams", flag="--endpoint")
    replica: str = setting(None, TEXT, None, "replica id written into every record (unique in the fleet); "
                           "required unless --streams names the streams", flag="--replica")
    replay_endpoint: str | None = setting(None, TEXT, None, "engine replay ROUTER endpoint, e.g. "
                                          "tcp://127.0.0.1:5558 (gap fill); unset: gaps become resets",
                                          flag="--replay-endpoint")
    engine: str = setting(None, ENGINE, "auto", "payload layout: auto (detected), vllm or sglang", flag="--engine")
    topic: str = setting(None, TEXT, "", "ZMQ topic prefix to subscribe to; unset: all", flag="--topic")
    dp_rank: int = setting(None, NATURAL, 0, "DP rank of this stream when batches do not carry one (vLLM 0.9.0); "
                           "also the rank whose history is recovered on start", flag="--dp-rank")
    worker_rank: int = setting(None, NATURAL, 0, "tensor-parallel worker whose stream this is (0..workers-1)",
                               flag="--worker-rank")
    workers: int = setting(None, COUNT, 1, "workers that each report the same events (1 = no aggregation)",
                           flag="--workers")
    replay_timeout: float = setting(None, SECONDS, DEFAULT_TIMEOUT,
                                    "seconds without a replay reply before the request is given up",
                                    flag="--replay-timeout")
    rcvhwm: int = 100_000
    """SUB receive high-water mark (messages queued in the bridge before ZMQ drops)."""
    max_held: int = 50_000
    """Live batches held during a replay before it is abandoned (bounds memory)."""
    model: str | None = setting("KVBUS_BRIDGE_MODEL", MODEL, None,
                                "the model the engine serves: its served model name, which requests name as "
                                "their model (vLLM --served-model-name), written into every record so that "
                                "lookups naming the model find this replica; unset: lookups naming a model "
                                "skip this replica", flag="--model")
    keep_token_ids: bool = reuse(Settings, "keep_token_ids", flag="--keep-token-ids")

    @property
    def engine_label(self) -> str:
        """Value of EventBatch.engine to start with: the forced engine, else vllm. With ``engine="auto"``
        the bridge relabels its stream once a payload shows which engine sent it
        (:func:`kvbus.producers.engines.detect_engine`: e.g. an SGLang map stream becomes "sglang")."""
        return self.engine if self.engine in ("vllm", "sglang") else "vllm"


class Sink(Protocol):
    """Where the bridge's records go (RawProducer, or a test double)."""

    def produce_batch(self, batch: EventBatch) -> None: ...
    def produce_dead_letter(self, dl: DeadLetter) -> None: ...
    def service(self) -> None: ...
    def accepting(self) -> bool: ...
    def update_gauges(self) -> None: ...
    def close(self, timeout: float = 30.0) -> int: ...
    def failure(self) -> str | None: ...


class Bridge:
    """Runs one stream. ``resume``: the last position produced before (from
    :func:`kvbus.producers.recovery.find_last_produced`), None for a first start. ``poller``: where
    its sockets are registered (several bridges of one process share one, and ``sink`` and
    ``metrics``: :class:`~kvbus.producers.bridge_group.BridgeGroup`); default its own."""

    def __init__(
        self,
        cfg: BridgeConfig,
        sink: Sink,
        metrics: BridgeMetrics | None = None,
        *,
        resume: Resume | None = None,
        ctx: zmq.Context | None = None,
        poller: zmq.Poller | None = None,
    ) -> None:
        self.cfg = cfg
        self.engine_label = cfg.engine_label
        """EventBatch.engine of the records produced (``cfg.engine_label``; with "auto", as detected)."""
        self._sniff = cfg.engine == "auto"
        self._sniffed = 0
        self.sink: Sink = sink
        self.metrics = metrics or BridgeMetrics()
        self.ctx = ctx or zmq.Context.instance()
        self.sequencer = Sequencer(
            replay=cfg.replay_endpoint is not None,
            epoch=resume.epoch if resume else None,
            last_seq=resume.last_seq if resume else None,
            max_held=cfg.max_held,
            is_last=self._same_as_resumed if resume is not None else None,
            fingerprint=_payload_fingerprint,
        )
        self._resume = resume
        self._resume_tail: EventBatch | None = None
        """Events of the resumed batch the last run did not produce (it stopped between parts)."""
        self.replay = ReplayClient(self.ctx, cfg.replay_endpoint, cfg.replay_timeout) if cfg.replay_endpoint else None
        self.sub: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        """Connection events of the SUB socket (ZMQ's socket monitor)."""
        self.engine_connected = False
        """Whether the SUB socket has a connection to the engine's PUB socket now."""
        self._poller = poller or zmq.Poller()
        self._polled_replay: zmq.Socket | None = None
        self._dp_rank = resume.record.dp_rank if resume else cfg.dp_rank
        self._topic = resume.record.topic if resume else cfg.topic
        self._stop = threading.Event()
        self._last_gauges = 0.0
        self._shed = False
        """Live batches were shed since the sink last accepted (a catch-up replay is due)."""
        self._seq_seen = SequencerStats()
        """The sequencer's counters as last added to the metrics (:meth:`BridgeMetrics.sync_sequencer`)."""

    def _same_as_resumed(self, item: Any) -> bool:
        """Whether a replayed batch is the one this bridge produced last before its restart.

        The last record may be one part of a split batch (``first_index``): it is compared with
        its slice of the engine's batch. If the engine's batch has events after that slice, the
        last run stopped between parts; the rest is kept in ``_resume_tail`` and produced next,
        before anything newer (:meth:`_on_reply`)."""
        assert self._resume is not None
        try:
            d = decode_batch(item[1], self.cfg.engine, skip_unknown=True, keep_tokens=self.cfg.keep_token_ids)
        except DecodeError:
            return True  # cannot tell: assume the engine kept running
        rec = self._resume.record
        end = rec.first_index + len(rec.events)
        # compared without the prompt's tokens: a last record written by a bridge that kept them (or not)
        same = d.ts == rec.ts and list(map(without_tokens, d.events[rec.first_index:end])) == list(
            map(without_tokens, rec.events))
        if not same:
            log.warning("replayed seq %d differs from the last record produced (ts %s vs %s): the engine "
                        "restarted while the bridge was down", rec.seq, d.ts, rec.ts)
        elif len(d.events) > end:
            self._resume_tail = msgspec.structs.replace(rec, events=d.events[end:], first_index=end)
        return same

    def _produce_resume_tail(self) -> None:
        """Produce the parts of the resumed batch the last run did not (see :meth:`_same_as_resumed`)."""
        tail, self._resume_tail = self._resume_tail, None
        if tail is None:
            return
        log.warning("%s#%d worker %d: the last run stopped inside split batch epoch %d seq %d; producing its "
                    "events %d..%d now", tail.replica, tail.dp_rank, tail.worker_rank, tail.epoch, tail.seq,
                    tail.first_index, tail.first_index + len(tail.events) - 1)
        self.metrics.events_in.inc(len(tail.events))
        self.sink.produce_batch(tail)

    # -- lifecycle --------------------------------------------------------------
    def open(self) -> None:
        """Connect the SUB socket and issue the start-up replay (resume or slow-joiner fill)."""
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self.cfg.rcvhwm)
        sub.setsockopt(zmq.SUBSCRIBE, self.cfg.topic.encode("utf-8"))
        self._monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._poller.register(self._monitor, zmq.POLLIN)
        sub.connect(self.cfg.endpoint)
        self.sub = sub
        self._poller.register(sub, zmq.POLLIN)
        log.info("bridge %s worker %d/%d: SUB %s topic %r, replay %s, epoch %s last seq %s, model %s",
                 self.cfg.replica, self.cfg.worker_rank, self.cfg.workers, self.cfg.endpoint, self.cfg.topic,
                 self.cfg.replay_endpoint or "off", self.sequencer.epoch, self.sequencer.last,
                 self.cfg.model or "not named (--model)")
        self._apply(self.sequencer.start())

    def stop(self) -> None:
        """Ask :meth:`run` to return (thread-safe)."""
        self._stop.set()

    def run(self, stop: Callable[[], bool] | None = None, poll_ms: int = 50) -> None:
        """Loop until :meth:`stop` (or ``stop()`` returns True)."""
        if self.sub is None:
            self.open()
        should_stop = stop or (lambda: False)
        while not self._stop.is_set() and not should_stop():
            self.step(poll_ms)

    def close(self, flush_timeout: float = 30.0) -> int:
        """Flush the sink and close sockets; returns records left undelivered."""
        left = self.sink.close(flush_timeout)
        self.close_sockets()
        return left

    def close_sockets(self) -> None:
        """Close this stream's sockets (not the sink, which a group's streams share)."""
        if self.replay is not None:
            self.replay.close()
        if self.sub is not None:
            self.sub.disable_monitor()
            self.sub.close(linger=0)
            self.sub = None
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None
        self.sync_metrics()

    def sync_metrics(self) -> None:
        """Add the sequencer's counters' growth to the metrics."""
        self.metrics.sync_sequencer(self.sequencer.stats, self._seq_seen)

    def not_ready(self) -> str | None:
        """Why this bridge is not ready (its ``/readyz``), None when it is: the engine socket is not
        connected, or the producer is failing (:meth:`Sink.failure`). Read from the probe thread."""
        if self.sub is None:
            return "the engine socket is not open yet"
        if not self.engine_connected:
            return f"the engine socket is not connected to {self.cfg.endpoint}"
        failure = self.sink.failure()
        return f"the producer is failing: {failure}" if failure else None

    # -- one pass -----------------------------------------------------------------
    def step(self, poll_ms: int = 50, max_live: int = 5000) -> None:
        """Serve the sink, then handle whatever the sockets have (waits up to ``poll_ms``)."""
        self.sink.service()
        self.sync_poller()
        self.handle(dict(self._poller.poll(poll_ms)), max_live)
        now = time.monotonic()
        if now - self._last_gauges > 0.5:
            self._last_gauges = now
            self.sync_metrics()
            self.metrics.held.set(self.sequencer.held)
            self.sink.update_gauges()

    def handle(self, ready: dict, max_live: int = 5000) -> int:
        """Handle what this stream's sockets have (``ready``: the poller's answer, socket -> events),
        reading at most ``max_live`` live batches; returns the engine batches read (live and replayed)."""
        read = 0
        if self._monitor is not None and self._monitor in ready:
            self._on_monitor()
        replay = self.replay
        if replay is not None and replay.socket is not None and replay.socket in ready:
            for reply in replay.read():
                read += 1
                self._on_reply(reply)
        if self.sub in ready:
            sub = self.sub
            for _ in range(max_live):
                try:
                    frames = sub.recv_multipart(zmq.NOBLOCK, copy=True)
                except zmq.Again:
                    break
                read += 1
                self._on_live(frames)
        self._catch_up_after_shedding()
        if replay is not None and replay.expired():
            log.warning("replay from %s seq>=%s timed out", replay.endpoint, replay.start_seq)
            replay.cancel()
            self._apply(self.sequencer.on_replay_end(complete=False))
        return read

    def _on_monitor(self) -> None:
        """Follow the SUB socket's connection to the engine (ZMQ reconnects on its own)."""
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            connected = event["event"] == zmq.EVENT_CONNECTED
            if connected != self.engine_connected:
                log.log(logging.INFO if connected else logging.WARNING, "engine %s %s", self.cfg.endpoint,
                        "connected" if connected else "disconnected: waiting for it to come back")
            self.engine_connected = connected

    def sync_poller(self) -> None:
        """Register the replay socket of the moment with the poller (a replay opens and closes one)."""
        sock = self.replay.socket if self.replay is not None else None
        if sock is not self._polled_replay:
            if self._polled_replay is not None:
                try:
                    self._poller.unregister(self._polled_replay)
                except KeyError:
                    pass
            if sock is not None:
                self._poller.register(sock, zmq.POLLIN)
            self._polled_replay = sock

    def _catch_up_after_shedding(self) -> None:
        """Once the sink accepts again after shedding live batches, ask the engine for what
        followed the last batch produced: the next live batch would reveal the gap, but an
        engine that went quiet sends none."""
        if self._shed and self.sink.accepting():
            self._shed = False
            actions = self.sequencer.catch_up()
            if actions.replay_from is not None:
                log.info("shed batches after seq %s: asking the engine to replay them", self.sequencer.last)
            self._apply(actions)

    # -- inputs ---------------------------------------------------------------------
    def _on_live(self, frames: list[bytes]) -> None:
        self.metrics.batches_in.inc()
        try:
            topic, seq, payload = parse_frames(frames)
        except DecodeError as exc:
            self._dead(frames, exc, self.cfg.endpoint)
            return
        if not self.sink.accepting():
            # backlog full: drop it now; the gap it leaves is replayed (see _catch_up_after_shedding) or reset
            self.metrics.shed.inc()
            self._shed = True
            return
        self._apply(self.sequencer.on_live(seq, (topic, payload, frames, self.cfg.endpoint)))

    def _on_reply(self, reply: Any) -> None:
        if isinstance(reply, Replayed):
            self.metrics.batches_in.inc()
            actions = self.sequencer.on_replayed(reply.seq, (reply.topic, reply.payload, reply.frames,
                                                             self.cfg.replay_endpoint))
            self._produce_resume_tail()  # only after the resume check, which produces nothing itself
            self._apply(actions)
        elif isinstance(reply, ReplayEnd):
            self._apply(self.sequencer.on_replay_end(complete=True))
        elif isinstance(reply, ReplayBad):
            self._dead(reply.frames, reply.error, self.cfg.replay_endpoint or "")

    # -- outputs ----------------------------------------------------------------------
    def _apply(self, actions: Actions) -> None:
        out = actions.out
        if out:
            if len(out) == 1 and type(out[0]) is Emit:
                batch = self._decode(out[0])
                if batch is not None:
                    self.sink.produce_batch(batch)
            else:
                self._produce_all(out)
        if self.replay is not None:
            if actions.replay_from is not None:
                self.replay.request(actions.replay_from)
            elif self.replay.active and not self.sequencer.replay_pending:
                self.replay.cancel()  # the sequencer gave up on it (too many held batches)

    def _produce_all(self, out: list) -> None:
        decoded: list[EventBatch | None] = [self._decode(o) if type(o) is Emit else None for o in out]
        for i, o in enumerate(out):
            if type(o) is ResetMarker:
                nxt = next((b for b in decoded[i + 1:] if b is not None), None)
                self.sink.produce_batch(self._marker(o, nxt.dp_rank if nxt is not None else self._dp_rank))
                log.warning("%s#%d worker %d: reset %s (missing %s..%s), new epoch %d", self.cfg.replica,
                            self._dp_rank, self.cfg.worker_rank, o.reason, o.missing_from, o.missing_to, o.epoch)
            elif decoded[i] is not None:
                self.sink.produce_batch(decoded[i])  # type: ignore[arg-type]

    def _decode(self, e: Emit) -> EventBatch | None:
        topic, payload, frames, source = e.item
        try:
            d = decode_batch(payload, self.cfg.engine, skip_unknown=True,
                             keep_tokens=self.cfg.keep_token_ids)
        except DecodeError as exc:
            self._dead(frames, exc, source)
            return None
        dp = d.dp_rank if d.dp_rank is not None else self.cfg.dp_rank
        self._dp_rank = dp
        self._topic = topic
        if d.unknown_events:
            self.metrics.unknown_events.inc(d.unknown_events)
            self._dead(frames, DecodeError(f"{d.unknown_events} event(s) of unknown type skipped at seq {e.seq}"),
                       source)
        self.metrics.events_in.inc(len(d.events))
        if self._sniff and d.events:
            self._detect(payload)
        cfg = self.cfg
        return EventBatch(
            replica=cfg.replica, seq=e.seq, ts=d.ts, events=d.events, dp_rank=dp,
            worker_rank=cfg.worker_rank, workers=cfg.workers, engine=self.engine_label,
            epoch=e.epoch, topic=topic, model=cfg.model,
        )

    def _marker(self, m: ResetMarker, dp_rank: int) -> EventBatch:
        cfg = self.cfg
        return EventBatch(
            replica=cfg.replica, seq=-1, ts=time.time(),
            events=[Reset(reason=m.reason, missing_from=m.missing_from, missing_to=m.missing_to)],
            dp_rank=dp_rank, worker_rank=cfg.worker_rank, workers=cfg.workers, engine=self.engine_label,
            epoch=m.epoch, topic=self._topic, model=cfg.model,
        )

    def _detect(self, payload: bytes) -> None:
        """``engine="auto"``: label the stream by the first payload that tells its engine; give up
        after :data:`DETECT_BATCHES` batches with events that fit every engine (label stays vllm)."""
        label = detect_engine(payload)
        self._sniffed += 1
        if label is not None:
            if label != self.engine_label:
                log.info("%s: stream detected as %s", self.cfg.replica, label)
            self.engine_label = label
            self._sniff = False
        elif self._sniffed >= DETECT_BATCHES:
            self._sniff = False

    def _dead(self, frames: list[bytes], exc: Exception, source: str) -> None:
        log.warning("dead letter from %s: %s: %s", source, type(exc).__name__, exc)
        self.metrics.dlq.inc()
        # the frames are kept up to DLQ_PAYLOAD_BYTES in all: a rejected ~1 MB payload (e.g. 1,000,001
        # hashes) would make a DeadLetter larger than a record may be, and it would be lost
        reason = f"{type(exc).__name__}: {exc}"
        self.sink.produce_dead_letter(dead_letter("bridge", source, reason, frames, time.time()))
