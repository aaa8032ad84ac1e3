"""Who may do what on the secured stack (``kvbus.infra.secure_plan``) follows the settings it is derived
from, and docs/security.md's table is what the plan says (no stack needed)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from kvbus.infra.secure_plan import ANALYTICS, BRIDGE, ROUTER, SINK, STREAMS, kafka_grants, redis_rules, table
from kvbus.schemas.topics import Topics
from kvbus.sinks.config import SinkConfig
from kvbus.streams.options import StreamsOptions

README = Path(__file__).resolve().parent.parent / "docs" / "security.md"


def names(grants, resource: str, op: str) -> set[str]:
    return {g.name + ("*" if g.prefixed else "") for g in grants if g.resource == resource and op in g.operations}


def test_acls_follow_the_topic_names_app_id_and_sink_group():
    t = Topics(raw="a.raw", blocks="a.blocks", incomplete="a.inc", dlq="a.dlq", snapshots="a.snap")
    g = kafka_grants(t, replace(StreamsOptions(), app_id="wk"), replace(SinkConfig(), group="sg"))
    assert names(g[BRIDGE], "topic", "WRITE") == {"a.raw", "a.dlq"}
    assert names(g[STREAMS], "topic", "READ") == {"a.raw", "wk-*"}
    blocks = {"a.blocks-packed", "a.blocks-packed.*", "a.blocks", "a.blocks.*"}  # both block layouts
    assert names(g[STREAMS], "topic", "WRITE") == {*blocks, "a.inc", "a.dlq", "wk-*"}
    assert names(g[STREAMS], "topic", "CREATE") == {"a.blocks-packed.*", "a.blocks.*", "wk-*"}
    assert names(g[STREAMS], "group", "READ") == {"wk"}
    assert names(g[SINK], "topic", "READ") == {*blocks, "a.snap"}
    assert names(g[SINK], "topic", "DESCRIBE_CONFIGS") == blocks  # retention checks
    assert names(g[SINK], "topic", "WRITE") == {"a.dlq", "a.snap"}
    assert "sg" in names(g[SINK], "group", "READ")
    assert names(g[ANALYTICS], "topic", "WRITE") == set()
    assert names(g[ANALYTICS], "topic", "READ") == {"a.raw", *blocks, "a.inc", "a.dlq", "a.snap"}
    for packed in (True, False):  # the prefixed grants cover the tier topics of both layouts
        assert t.for_ownership("kvcr", packed=packed).startswith(t.tier_prefix(packed))
    assert t.for_ownership("kvcr", packed=True) == "a.blocks-packed.kvcr"


def test_redis_rules_confine_both_users_to_the_views_prefix():
    rules = redis_rules(replace(SinkConfig(), prefix="view7:"))
    assert "~view7:*" in rules[SINK].split() and "%R~view7:*" in rules[ROUTER].split()
    assert "+fcall_ro" in rules[ROUTER].split()
    # the router writes only its own keys: shared load and predicted entries, of the view and of its shards
    written = {w.removeprefix("%RW~") for w in rules[ROUTER].split() if w.startswith("%RW~")}
    assert written == {"view7:load", "view7:X:*", "view7:xh", "view7:{s*}:load", "view7:{s*}:X:*", "view7:{s*}:xh"}
    assert not any(w.startswith("~") for w in rules[ROUTER].split())





def test_the_readme_table_is_the_plan():
    assert table(Topics(), StreamsOptions(), SinkConfig()) in README.read_text()
