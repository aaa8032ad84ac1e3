"""The benchmarks' prober reads the fleet's probe log: a holder's clear withdraws its probes not
seen yet (they left the truth before they could show), and nothing else."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from kvbus.schemas.events import BlockEvent, BlockStored
from tests.memory_store import InMemoryStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import pipeline  # noqa: E402  (benchmarks/pipeline.py)

sys.path.pop(0)


def test_a_clear_withdraws_the_holders_unseen_probes_only(tmp_path: Path) -> None:
    seen, cleared, other = bytes(8), b"\x01" * 8, b"\x02" * 8
    store = InMemoryStore()
    store.apply([("kvbus.blocks", BlockEvent(replica="r", epoch=1, seq=0, index=0, ts=1.0,
                                              event=BlockStored(block_hashes=[seen], medium="GPU")))])
    log = tmp_path / "probes.jsonl"
    lines = [{"probe": seen.hex(), "holder": "r#0"}, {"probe": cleared.hex(), "holder": "r#0"},
             {"probe": other.hex(), "holder": "s#0"}]
    log.write_text("".join(json.dumps({**x, "t": i, "wall": i}) + "\n" for i, x in enumerate(lines)))
    prober = pipeline.Prober(log, store)
    prober.poll()
    assert set(prober.seen) == {seen}
    with log.open("a") as f:
        f.write(json.dumps({"cleared": "r#0", "t": 5, "wall": 5}) + "\n")
    prober.poll()
    assert set(prober.published) == {seen, other}  # the seen probe keeps its figure
    assert prober.withdrawn == 1
