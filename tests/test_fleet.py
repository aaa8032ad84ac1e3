"""The synthetic engine fleet: content, ground truth, ports, replay protocol, workers, CLI."""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time

import pytest
import zmq

from kvbus.producers.decode import decode_batch, parse_frames, parse_replay_reply
from kvbus.schemas.events import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored
from kvbus.schemas.hashing import block_hashes
from kvbus.schemas.topics import Topics
from kvbus.simulator.engine_wire import project
from kvbus.simulator.fleet import (
    CacheModel,
    Fleet,
    FleetConfig,
    ModelConfig,
    Residency,
    ScriptBatch,
    parse_schedule,
    stream_index,
)
from tests.memory_store import InMemoryStore

pytestmark = pytest.mark.timeout(60)


def model(fmt: str = "vllm-0.33", seed: int = 1, **kw) -> CacheModel:
    return CacheModel(random.Random(seed), ModelConfig(**kw), fmt)


def test_same_seed_same_events():
    a, b = model(seed=9), model(seed=9)
    assert [a.step() for _ in range(30)] == [b.step() for _ in range(30)]
    assert [model(seed=10).step() for _ in range(3)] != [model(seed=9).step() for _ in range(3)]


def test_stored_chains_use_vllm_hashes_so_prompts_can_be_looked_up():
    m = model(gpu_blocks=100_000, cpu_rate=0, kvcr_rate=0, clear_rate=0)
    for _ in range(20):
        m.step()
    gpu = m.truth.tiers[("GPU", None)]
    for toks in m.prompts:  # nothing evicted: every served prompt is resident, block by block
        hs = block_hashes(toks, 16)
        assert hs and all(h in gpu for h in hs)
    manifest = m.manifest()
    assert all(p["resident"] and p["resident_blocks"] == p["blocks"] for p in manifest["prompts"])


def test_parent_hash_links_each_store_to_the_cached_prefix():
    m = model(cpu_rate=0, kvcr_rate=0, clear_rate=0)
    seen: set[bytes] = set()
    for _ in range(40):
        for e in m.step():
            if isinstance(e, BlockStored):
                assert e.parent_block_hash is None or e.parent_block_hash in seen
                assert len(e.token_ids) == 16 * len(e.block_hashes) and e.block_size == 16
                seen.update(e.block_hashes)


def test_lru_eviction_one_hash_per_event_and_capacity_respected():
    m = model(gpu_blocks=64, cpu_rate=0, kvcr_rate=0, clear_rate=0)
    removed = 0
    for _ in range(50):
        for e in m.step():
            if isinstance(e, BlockRemoved):
                assert len(e.block_hashes) == 1 and e.medium == "GPU"
                removed += 1
        assert len(m.truth.tiers[("GPU", None)]) <= 64
    assert removed > 0


def test_ground_truth_equals_replaying_the_events():
    m = model(gpu_blocks=128, cpu_blocks=64, kvcr_blocks=32, cpu_rate=0.5, kvcr_rate=0.3, clear_rate=0.02)
    events = [e for _ in range(200) for e in m.step()]
    replayed = Residency().apply_all(project("vllm-0.33", e) for e in events)
    assert replayed.snapshot() == m.truth.snapshot()
    tiers = {(type(e).__name__, e.medium, e.ownership) for e in events if not isinstance(e, AllBlocksCleared)}
    assert {("BlockStored", "GPU", None), ("BlockStored", "CPU", None), ("BlockStored", "CPU", "kvcr"),
            ("BlockRemoved", "GPU", None)} <= tiers
    assert any(isinstance(e, AllBlocksCleared) for e in events)


def test_formats_without_medium_or_ownership_get_no_offload_events():
    m = model("vllm-0.9.2", cpu_rate=1.0, kvcr_rate=1.0)
    events = [e for _ in range(10) for e in m.step()]
    assert {getattr(e, "medium", None) for e in events} == {None}
    m = model("vllm-0.26", cpu_rate=1.0, kvcr_rate=1.0)
    events = [e for _ in range(10) for e in m.step()]
    assert {getattr(e, "ownership", None) for e in events} == {None}
    assert "CPU" in {getattr(e, "medium", None) for e in events}


def test_all_blocks_cleared_empties_the_frameworks_tiers_of_the_truth():
    m = model(clear_rate=1.0, kvcr_rate=0.5)
    for _ in range(5):
        m.step()
    kvcr_before = m.truth.snapshot()[("CPU", "kvcr")]
    events = m.step()
    assert isinstance(events[0], AllBlocksCleared)
    truth = m.truth.snapshot()
    assert set(truth) <= {("GPU", None), ("CPU", None), ("CPU", "kvcr")}
    # after the clear only this step's stores are resident in the framework's tiers
    stored = {h for e in events if isinstance(e, BlockStored) for h in e.block_hashes}
    assert truth.get(("GPU", None), set()) | truth.get(("CPU", None), set()) <= stored
    # the secondary tier is its connector's: the clear leaves it
    assert kvcr_before <= truth[("CPU", "kvcr")] | stored | removed_from(events, ("CPU", "kvcr"))


def removed_from(events: list, tier: tuple) -> set[bytes]:
    return {h for e in events if isinstance(e, BlockRemoved) and (e.medium, e.ownership) == tier
            for h in e.block_hashes}


def test_the_views_rules_over_the_fleets_events_give_its_truth():
    """The fleet's ground truth follows the view's documented rules (AllBlocksCleared drops the
    framework's tiers, ownership tiers stay): the sink's model store, fed the fleet's events on
    their topics, ends where the truth does."""
    m = model(gpu_blocks=128, cpu_blocks=64, kvcr_blocks=32, cpu_rate=0.5, kvcr_rate=0.3, clear_rate=0.05)
    topics = Topics()
    records = []
    for seq in range(300):
        for i, e in enumerate(m.step()):
            ev = project("vllm-0.33", e)
            owner = getattr(ev, "ownership", None)
            records.append((topics.for_ownership(owner) if owner else topics.blocks,
                            BlockEvent(replica="r", epoch=1, seq=seq, index=i, ts=float(seq), event=ev)))
    view = InMemoryStore()
    view.apply(records)
    labels = {(medium, owner): medium if owner is None else f"{medium}@{owner}"
              for medium, owner in m.truth.snapshot()}
    assert view.summary() == {"r": {labels[t]: len(hs) for t, hs in m.truth.snapshot().items()}}
    assert any(isinstance(e, AllBlocksCleared) for _, r in records for e in [r.event])


def test_port_mapping_of_replicas_dp_ranks_and_workers():
    cfg = FleetConfig(replicas=2, dp_ranks=2, workers=2, base_port=6000)
    fleet = Fleet(cfg)
    streams = {(s.replica, s.dp_rank, s.worker_rank): s for s in fleet.streams()}
    assert len(streams) == 8
    for (name, d, w), s in streams.items():
        k = stream_index(cfg, int(name.rsplit("-", 1)[1]), d, w)
        assert s.endpoint == f"tcp://127.0.0.1:{6000 + 2 * k}"
        assert s.replay_endpoint == f"tcp://127.0.0.1:{6000 + 2 * k + 1}"
    assert streams[("replica-1", 0, 0)].endpoint == "tcp://127.0.0.1:6008"
    assert FleetConfig().base_port == 5557 and Fleet(FleetConfig(replicas=1)).streams()[0].endpoint.endswith(":5557")


def _sub(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s


def _recv_all(sock: zmq.Socket, timeout_ms: int = 300) -> list[list[bytes]]:
    out = []
    while sock.poll(timeout_ms):
        out.append(sock.recv_multipart())
    return out


@pytest.mark.parametrize("fmt, with_topic", [("vllm-0.24", False), ("vllm-0.26", True), ("sglang-0.5.23", True)])
def test_live_frames_and_replay_protocol(fmt, with_topic):
    ctx = zmq.Context.instance()
    with Fleet(FleetConfig(replicas=1, base_port=0, format=fmt, topic="kv", buffer_steps=5)) as fleet:
        stream = fleet.streams()[0]
        sub = _sub(ctx, stream.endpoint)
        time.sleep(0.2)
        for _ in range(8):
            fleet.publish_step()
        frames = _recv_all(sub)
        assert [parse_frames(f)[:2] for f in frames] == [("kv", i) for i in range(8)]
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(stream.replay_endpoint)
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])  # 1..2 were evicted (buffer 5)
        replies = []
        while dealer.poll(2000):
            msg = dealer.recv_multipart()
            replies.append(msg)
            if parse_replay_reply(msg) is None:
                break
        assert all(len(r) == (4 if with_topic else 3) for r in replies)
        parsed = [parse_replay_reply(r) for r in replies]
        assert parsed[-1] is None
        assert [p[1] for p in parsed[:-1]] == [3, 4, 5, 6, 7]
        assert [p[2] for p in parsed[:-1]] == [f[2] for f in frames[3:]]
        assert all(p[0] == ("kv" if with_topic else "") for p in parsed[:-1])
        dealer.send_multipart([b"garbage"])  # malformed requests are ignored
        assert not dealer.poll(300)
        sub.close()
        dealer.close()


def test_workers_report_the_same_events_with_drops_and_duplicates():
    ctx = zmq.Context.instance()
    cfg = FleetConfig(replicas=1, workers=2, base_port=0, drop_rate=0.1, dup_rate=0.1, seed=4)
    with Fleet(cfg) as fleet:
        subs = {s.worker_rank: _sub(ctx, s.endpoint) for s in fleet.streams()}
        time.sleep(0.2)
        model = fleet.models[("replica-0", 0)]
        sent = []
        for _ in range(20):
            evs = model.step()
            fleet.publish_events("replica-0", evs)
            sent.append(evs)
        got = {w: [decode_batch(parse_frames(f)[2]).events for f in _recv_all(s)] for w, s in subs.items()}
        for s in subs.values():
            s.close()
    assert len(got[0]) == len(got[1]) == 20
    assert fleet.worker_drops > 0 and fleet.worker_dups > 0
    total_reports = sum(len(b) for w in got for b in got[w])
    assert total_reports == 2 * sum(map(len, sent)) - fleet.worker_drops + fleet.worker_dups
    for w in got:  # each worker's batch = the step's events in order, some missing, some twice
        for evs, batch in zip(sent, got[w]):
            expected = [project("vllm-0.33", e) for e in evs]
            j = 0
            for x in batch:
                if j and x == expected[j - 1]:
                    continue  # a duplicated report
                while expected[j] != x:
                    j += 1  # reports dropped in between
                j += 1


def test_script_mode_publishes_explicit_batches_and_tracks_truth():
    ctx = zmq.Context.instance()
    h = [i.to_bytes(8, "big") for i in range(4)]
    with Fleet(FleetConfig(replicas=2, base_port=0)) as fleet:
        sub = _sub(ctx, fleet.publisher("replica-1").pub_endpoint)
        time.sleep(0.2)
        seqs = fleet.play([
            ScriptBatch("replica-1", [BlockStored(block_hashes=h[:2], token_ids=list(range(32)), block_size=16,
                                                  medium="GPU")], ts=10.0),
            ScriptBatch("replica-1", [BlockRemoved(block_hashes=[h[1]], medium="GPU")], ts=11.0, send_live=False),
            ScriptBatch("replica-1", [BlockStored(block_hashes=[h[2]], parent_block_hash=h[0],
                                                  token_ids=list(range(16)), block_size=16, medium="CPU")], ts=12.0),
        ])
        frames = _recv_all(sub)
        sub.close()
    assert seqs == [[0], [1], [2]]
    assert [parse_frames(f)[1] for f in frames] == [0, 2]  # seq 1 only in the replay buffer
    assert fleet.truth("replica-1").snapshot() == {("GPU", None): {h[0]}, ("CPU", None): {h[2]}}
    assert fleet.truth("replica-0").snapshot() == {}


def test_admit_reports_the_reused_prefix_and_updates_the_truth():
    m = model(gpu_blocks=8, cpu_rate=0, kvcr_rate=0, clear_rate=0)
    system = list(range(1, 3 * 16 + 1))  # 3 full blocks
    first = system + [7] * 20  # 4 full blocks, then 4 tokens
    reused, events = m.admit(first)
    assert reused == 0 and [type(e) for e in events] == [BlockStored]
    assert events[0].block_hashes == block_hashes(first, 16)
    assert m.truth.snapshot() == {("GPU", None): set(block_hashes(first, 16))}
    second = system + [9] * 16  # shares the 3 system blocks
    reused, events = m.admit(second)
    assert reused == 3 and [len(e.block_hashes) for e in events] == [1]  # only the new block stored
    assert m.resident_prefix(block_hashes(second, 16)) == 4
    reused, events = m.admit([5] * 80)  # 5 blocks and 5 new: 10 > 8, the 2 least recently used leave
    assert reused == 0 and [type(e) for e in events] == [BlockRemoved] * 2 + [BlockStored]
    assert [e.block_hashes for e in events[:2]] == [block_hashes(first, 16)[3:], block_hashes(system, 16)[2:]]
    assert m.resident_prefix(block_hashes(first, 16)) == 2 and len(m.truth.tiers[("GPU", None)]) == 8


def test_serve_publishes_what_the_chosen_replica_cached_and_clear_caches_resets_every_replica():
    with Fleet(FleetConfig(replicas=2, base_port=0, model=ModelConfig(cpu_rate=0, kvcr_rate=0))) as fleet:
        tokens = list(range(1, 40))  # 2 full blocks
        assert fleet.serve("replica-1", tokens) == (0, 1)
        assert fleet.serve("replica-1", tokens) == (2, 0)  # all cached: nothing new, no batch
        assert fleet.publisher("replica-0").next_seq == 0 and fleet.publisher("replica-1").next_seq == 1
        _, payload = fleet.publisher("replica-1").buffer[0]
        (stored,) = decode_batch(payload).events
        assert stored.block_hashes == block_hashes(tokens, 16) and stored.medium == "GPU"
        assert fleet.truth("replica-1").snapshot() == {("GPU", None): set(stored.block_hashes)}
        fleet.clear_caches()
        for name in ("replica-0", "replica-1"):
            pub = fleet.publisher(name)
            assert [type(e) for e in decode_batch(pub.buffer[-1][1]).events] == [AllBlocksCleared]
            assert fleet.truth(name).snapshot() == {}
        assert fleet.serve("replica-1", tokens) == (0, 1)  # the cache really is empty
        assert fleet.events == 2


def test_cli_runs_for_a_duration_and_writes_the_manifest(tmp_path):
    manifest = tmp_path / "fleet.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvbus.simulator.fleet", "--replicas", "2", "--base-port", "0", "--rate", "50",
         "--duration", "1", "--seed", "3", "--manifest", str(manifest), "--format", "vllm-0.29"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(manifest.read_text())
    assert data["format"] == "vllm-0.29" and data["block_size"] == 16 and data["hash_algo"] == "sha256"
    assert set(data["replicas"]) == {"replica-0#0", "replica-1#0"}
    r0 = data["replicas"]["replica-0#0"]
    assert r0["steps"] > 10 and r0["prompts"] and "GPU/None" in r0["tiers"]
    p = r0["prompts"][-1]
    assert p["resident_blocks"] <= p["blocks"] == len(p["tokens"]) // 16
    assert len(data["streams"]) == 2 and all(s["endpoint"].startswith("tcp://127.0.0.1:") for s in data["streams"])


def test_probes_reach_every_worker_stream_and_the_truth_and_are_logged(tmp_path):
    ctx = zmq.Context.instance()
    log_path = tmp_path / "probes.jsonl"
    cfg = FleetConfig(replicas=2, workers=2, base_port=0, schedule=((0.0, 0.3),), probe_every=0.05,
                      probe_log=str(log_path))
    with Fleet(cfg) as fleet:
        subs = {(s.replica, s.worker_rank): _sub(ctx, s.endpoint) for s in fleet.streams()}
        time.sleep(0.2)
        fleet.run()
        records = [json.loads(line) for line in log_path.read_text().splitlines()]
        probes = [r for r in records if "probe" in r]
        assert records[0]["rung"] == 0 and records[-1]["end"] is True
        assert len(probes) >= 4 and {p["holder"] for p in probes} == {"replica-0#0", "replica-1#0"}
        assert all(a["t"] <= b["t"] for a, b in zip(records, records[1:]))
        for (replica, _w), sub in subs.items():  # every worker of the probed replica sends the probe
            sent = [e for f in _recv_all(sub) for e in decode_batch(parse_frames(f)[2], "vllm").events]
            want = [bytes.fromhex(p["probe"]) for p in probes if p["holder"] == f"{replica}#0"]
            assert [e.block_hashes for e in sent] == [[h] for h in want]
            assert all(fleet.truth(replica).holds(h) for h in want)
            sub.close()


def test_schedule_paces_steps_by_the_events_they_publish():
    cfg = FleetConfig(replicas=2, base_port=0, schedule=((3000.0, 1.0), (0.0, 0.5)))
    with Fleet(cfg) as fleet:
        fleet.run()
        steps_after_load = fleet.steps
    # 1 s at 3,000 events/s, then 0.5 s at rate 0 (no steps); a step publishes 1-60 events
    assert 2000 <= fleet.events <= 3100
    assert fleet.steps == steps_after_load > 20


def test_schedule_option_parses_rungs_and_rejects_bad_ones():
    assert parse_schedule("2000:10, 0:2.5") == ((2000.0, 10.0), (0.0, 2.5))
    for bad in ("2000", "x:1", "100:0", "-1:3"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_schedule(bad)


def test_pregenerated_steps_play_the_events_and_truth_of_live_ones_restamped():
    """``pregenerate``: the same seed plays the same batches and ends with the same ground truth as
    steps generated while playing; each payload's ts is the time it was sent, not generated; a probe
    published after them is in the ground truth."""
    live_fleet = Fleet(FleetConfig(replicas=3, base_port=0, seed=4))
    pre_fleet = Fleet(FleetConfig(replicas=3, base_port=0, seed=4))
    with live_fleet as live, pre_fleet as pre:
        generated = time.time()
        steps = pre.pregenerate(400)
        assert steps > 1 and pre.events == 0 and pre.truth("replica-0").snapshot() == {}  # nothing published yet
        time.sleep(0.01)
        sent = time.time()
        for _ in range(steps):
            assert live.publish_step() == pre.publish_step() > 0
        for name in live.names:
            a = [decode_batch(p, "auto") for _, p in live.publisher(name).buffer]
            b = [decode_batch(p, "auto") for _, p in pre.publisher(name).buffer]
            assert [x.events for x in a] == [y.events for y in b] and a
            assert all(y.ts >= sent > generated for y in b)
            assert pre.truth(name).snapshot() == live.truth(name).snapshot()
            assert pre.publisher(name).published() == live.publisher(name).published()
        h, holder = pre.publish_probe()
        assert pre.truth(holder[:-2]).holds(h)


def test_restamp_replaces_only_an_envelopes_leading_float_ts():
    import msgspec

    from kvbus.simulator.engine_wire import encode_batch
    from kvbus.simulator.fleet import restamp, restamp_prefix

    payload = encode_batch("vllm-0.33", 1.5, [BlockStored(block_hashes=[b"\0" * 7 + b"\1"], token_ids=[1] * 16,
                                                         block_size=16, medium="GPU")])
    again = restamp(payload, restamp_prefix(2.25))
    assert msgspec.msgpack.decode(again)[0] == 2.25 and msgspec.msgpack.decode(again)[1:] == \
        msgspec.msgpack.decode(payload)[1:]
    assert restamp(b"\x93\xc0\x90\x00", restamp_prefix(2.0)) == b"\x93\xc0\x90\x00"  # not a float ts: unchanged
