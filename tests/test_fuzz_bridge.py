"""Bad input at scale, bridge stage (issue 9, part 4).

10,000 engine messages (``tests/hostile.py``, fixed seed), about a third good batches, the rest
hostile: random bytes, truncated msgpack, wrong field types, absurd numbers (ints beyond the Avro
ranges, NaN/inf where an int belongs, negative sizes and ranks), length headers claiming 4 G
elements, 1,000,001 hashes / events (one above the limits), nesting 1,500-50,000 levels deep,
unknown event types, bad hashes (empty, 65 bytes, str, float, mixed int/bytes), bad frame sets, seqs
beyond int64, and seqs that go backwards. The full 10,000 run in the integration test.

Designed outcomes, asserted exactly:

* rejected (REJECT, FRAMES): one DeadLetter each in the DLQ topic, payload = the frames received,
  reason ``DecodeError: ...``; an undecodable payload still consumes its seq (no gap);
* PARTIAL (a good event next to one of unknown type): the good event is produced, and the frames
  are dead-lettered once (``... of unknown type skipped``);
* ACCEPT, legitimately: a NaN/inf/negative ``ts`` (the engine's clock is informational: the sink
  measures staleness by Kafka arrival time), a negative int parent hash (SGLang and vLLM's builtin
  hash are signed), ``lora_id`` = int64 min: produced unchanged, nothing dead-lettered;
* BACKWARD (a good batch whose seq goes back by 1-40): an engine restart by design, not a dead
  letter: ``Reset(engine-restart)`` in a new epoch, the batch, and then, since the engine's next seq
  is ahead of the restarted run, ``Reset(gap-unrecoverable)`` (no replay endpoint in this test);
* the raw topic holds exactly the good events (each carries its own block hash), once each;
* the bridge process is alive at the end and exits 0 on SIGTERM; its RSS grows by < 150 MiB.

Found and fixed here (``producers/decode.py``): nesting deeper than the recursion limit raised
``RecursionError`` out of ``decode_batch`` and killed the bridge; a live seq frame >= 2^63 was
written to kvbus.raw as an Avro long no reader decodes back (now a dead letter). And in
``producers/bridge.py``: the dead letter of a ~1 MB payload was larger than a Kafka record and
refused by the producer, i.e. lost; its frames are now kept up to their first 64 KiB (as for an
oversized event), which the reason says.
"""
from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbus.producers.decode import DecodeError, decode_batch, parse_frames
from kvbus.runtime.settings import Settings
from kvbus.schemas.events import DLQ_PAYLOAD_BYTES, EventBatch, Reset, without_tokens
from kvbus.schemas.serde import RecordSerde, registry_client
from kvbus.simulator.fleet import Fleet, FleetConfig
from tests.hostile import (
    ACCEPT,
    BACKWARD,
    FRAMES,
    PARTIAL,
    REJECT,
    TopicReader,
    engine_inputs,
    good_payload,
    marker_hash,
    rss_mib,
)

SEED = 20240904
N = 10_000
REPLICA = "fuzz-0"
PROBE = 900_000
"""Good-event numbers of the slow-joiner probes (not part of the 10,000)."""


def test_decoder_classifies_every_hostile_payload():
    """Unit level, no stack: every generated payload decodes (GOOD/ACCEPT/PARTIAL/BACKWARD, to exactly
    its good event) or raises DecodeError (REJECT, FRAMES): never another exception."""
    seen = collections.Counter()
    for x in engine_inputs(SEED, N):
        seen[x.kind] += 1
        if x.frames is not None:
            with pytest.raises(DecodeError):
                parse_frames(x.frames)
            continue
        if x.kind == REJECT:
            with pytest.raises(DecodeError):
                decode_batch(x.payload, "auto", skip_unknown=True)
            try:  # without the tokens, a payload whose only fault is in them is read; nothing else escapes
                decode_batch(x.payload, "auto", skip_unknown=True, keep_tokens=False)
            except DecodeError:
                pass
            continue
        d = decode_batch(x.payload, "auto", skip_unknown=True)
        assert [e.block_hashes for e in d.events] == [[marker_hash(x.good)]], x.case
        assert d.unknown_events == (1 if x.kind == PARTIAL else 0), x.case
        tokenless = decode_batch(x.payload, "auto", skip_unknown=True, keep_tokens=False)
        assert tokenless.events == [without_tokens(e) for e in d.events], x.case
        assert tokenless.unknown_events == d.unknown_events, x.case
    assert sum(seen.values()) == N and all(seen[k] > 100 for k in (REJECT, FRAMES, PARTIAL, ACCEPT, BACKWARD))


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_bridge_survives_10000_hostile_messages(test_settings: Settings, tmp_path: Path):
    s = test_settings
    t = s.topics
    fleet = Fleet(FleetConfig(replicas=1, base_port=0, format="vllm-0.33", topic="", seed=1)).start()
    stream = fleet.streams()[0]
    pub = fleet.publisher("replica-0")
    env = {**os.environ, **s.to_env(), "PYTHONUNBUFFERED": "1"}
    log_path = tmp_path / "bridge.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "kvbus", "bridge", "--endpoint", stream.endpoint,
                             "--replica", REPLICA, "--no-recover", "--flush-timeout", "20",
                             "--keep-token-ids"],  # the strictest decoding: bad token ids are rejected
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    reg = registry_client(s.registry_url)
    serdes = {t.raw: RecordSerde(reg, "EventBatch"), t.dlq: RecordSerde(reg, "DeadLetter")}
    reader = TopicReader(s.bootstrap, [t.raw, t.dlq], lambda v, topic: serdes[topic].loads(v, topic))

    def alive() -> str | None:
        if proc.poll() is not None:
            return f"bridge exited with {proc.returncode}:\n{log_path.read_text(errors='replace')[-4000:]}"
        return None

    try:
        # slow joiner: probe with good batches until the subscription is live (no replay endpoint)
        probes = 0
        deadline = time.monotonic() + 60
        while not reader.values(t.raw):
            assert time.monotonic() < deadline, "bridge never produced a probe"
            assert alive() is None, alive()
            pub.publish_payload(good_payload(PROBE + probes))
            probes += 1
            reader.poll(0.2)
        rss_before = rss_mib(proc.pid)
        t0 = time.monotonic()

        expected_dead: collections.Counter = collections.Counter()
        dead_kind: dict[tuple, str] = {}
        good: collections.Counter = collections.Counter()
        kinds: collections.Counter = collections.Counter()
        for x in engine_inputs(SEED, N):
            kinds[x.kind] += 1
            if x.kind == BACKWARD:
                seq = max(0, pub.next_seq - 1 - x.seq_back)
                pub.send_raw([b"", seq.to_bytes(8, "big"), x.payload])
            elif x.frames is not None:
                pub.send_raw(x.frames)
                frames = tuple(x.frames)
            else:
                seq = pub.publish_payload(x.payload)
                frames = (b"", seq.to_bytes(8, "big"), x.payload)
            if x.kind in (REJECT, FRAMES, PARTIAL):
                frames = _kept(frames)
                expected_dead[frames] += 1
                dead_kind[frames] = x.kind
            if x.good is not None:
                good[marker_hash(x.good)] += 1
        n_dead = sum(expected_dead.values())

        probe_hashes = {marker_hash(PROBE + i) for i in range(probes)}

        def good_events() -> int:
            return sum(1 for b in reader.values(t.raw) if b.seq >= 0 for e in b.events
                       if e.block_hashes[0] not in probe_hashes)

        try:
            reader.until(lambda: len(reader.values(t.dlq)) >= n_dead and good_events() >= sum(good.values()),
                         90, f"{n_dead} dead letters and {len(good)} good events", alive)
        except AssertionError:
            have = collections.Counter(h for b in reader.values(t.raw) if b.seq >= 0 for e in b.events
                                       for h in e.block_hashes)
            missing = [(x.kind, x.case) for x in engine_inputs(SEED, N)
                       if x.good is not None and have[marker_hash(x.good)] == 0]
            raise AssertionError(f"missing {len(missing)}: {collections.Counter(missing)}; "
                                 f"dead {len(reader.values(t.dlq))}/{n_dead}")
        elapsed = time.monotonic() - t0
        rss_after = rss_mib(proc.pid)
        assert alive() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log_path.read_text(errors="replace")[-4000:]
        reader.to_end()
    finally:
        reader.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
        fleet.stop()

    letters = reader.values(t.dlq)
    got = collections.Counter(tuple(d.payload) for d in letters)
    assert got == expected_dead  # every rejected message exactly once, nothing else
    assert {d.stage for d in letters} == {"bridge"} and {d.source for d in letters} == {stream.endpoint}
    for d in letters:
        kind = dead_kind[tuple(d.payload)]
        assert d.reason.startswith("DecodeError: "), d.reason
        assert ("of unknown type skipped" in d.reason) == (kind == PARTIAL), d.reason
        assert ("payload truncated" in d.reason) == (sum(map(len, d.payload)) == DLQ_PAYLOAD_BYTES), d.reason
    reasons = collections.Counter(_reason_class(d.reason) for d in letters)

    batches: list[EventBatch] = reader.values(t.raw)
    events = collections.Counter(h for b in batches if b.seq >= 0 for e in b.events for h in e.block_hashes)
    assert collections.Counter({h: n for h, n in events.items() if h not in probe_hashes}) == good
    markers = collections.Counter(b.events[0].reason for b in batches if b.seq < 0)
    assert all(isinstance(b.events[0], Reset) and len(b.events) == 1 for b in batches if b.seq < 0)
    assert markers["engine-restart"] == kinds[BACKWARD] and markers["gap-unrecoverable"] == kinds[BACKWARD]
    assert markers["bridge-start"] <= 1 and sum(markers.values()) <= 2 * kinds[BACKWARD] + 1
    assert rss_after - rss_before < 150, (rss_before, rss_after)
    print(f"\nbridge fuzz: sent {N} ({dict(kinds)}), dead-lettered {len(letters)} {dict(reasons)}, "
          f"good events produced {sum(good.values())}, resets {dict(markers)}, crashes 0, "
          f"rss {rss_before:.0f} -> {rss_after:.0f} MiB, {elapsed:.1f} s")


def _kept(frames: tuple) -> tuple:
    """The frames as a dead letter keeps them: the first DLQ_PAYLOAD_BYTES bytes in all."""
    out, budget = [], DLQ_PAYLOAD_BYTES
    for f in frames:
        out.append(f[:budget])
        budget -= len(out[-1])
    return tuple(out)


def _reason_class(reason: str) -> str:
    """A short class of a dead letter's reason (for the summary line)."""
    r = reason.removeprefix("DecodeError: ")
    for key in ("unknown type", "nested too deeply", "truncated", "int64 range", "frames", "8 bytes", "UTF-8",
                "malformed", "envelope", "block_hashes", "Expected"):
        if key in r:
            return key
    return r.split(":")[0][:40]
