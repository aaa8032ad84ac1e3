"""Who may do what on the secured stack (``infra/stack up --secure``): one principal per kvbus stage,
its Kafka ACLs, its Redis ACL rules and its registry role. Pure data, derived from the kvbus
settings (topic names: :mod:`kvbus.schemas.topics`; the Faust app id and the sink group: the stages'
option objects); :mod:`kvbus.infra.secure` applies it, docs/security.md tabulates it.

Principals: the same user name in Kafka, Redis and the registry; :func:`table` renders who may
do what (docs/security.md's principals table is its output, checked by tests/test_secure_plan.py).

The registry's own Kafka client (KafkaSQL storage) is the principal :data:`REGISTRY_KAFKA_USER`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbus.schemas import view_keys
from kvbus.schemas.topics import REBUILD_GROUP_PREFIX, RECOVERY_GROUP_PREFIX, REPORT_GROUP_PREFIX, Topics
from kvbus.sinks.config import SinkConfig  # the sink's public options (its group, its key prefix)
from kvbus.streams.options import StreamsOptions  # the worker's public options (the Faust app id)

ADMIN = "admin"
BRIDGE = "bridge"
STREAMS = "streams"
SINK = "sink"
ROUTER = "router"
ANALYTICS = "analytics"
PRINCIPALS: tuple[str, ...] = (ADMIN, BRIDGE, STREAMS, SINK, ROUTER, ANALYTICS)
"""Every principal that gets an env file (``<secure state>/env/<principal>.env``)."""

RUNS: dict[str, str] = {
    ADMIN: "infra itself (topics, users, ACLs), operators",
    BRIDGE: "`kvbus bridge`, the in-process publisher",
    STREAMS: "`kvbus worker`",
    SINK: "`kvbus sink`",
    ROUTER: "`kvbus lookup`, routers",
    ANALYTICS: "`kvbus report`, other readers",
}
"""What runs as each principal."""

REGISTRY_KAFKA_USER = "registry"
"""Kafka principal of the registry's KafkaSQL storage (infra-internal; no env file)."""
KAFKASQL_TOPIC_PREFIX = "kvbus-registry-"
"""Prefix of the registry's journal and snapshot topics and of its consumer groups on the secured
Kafka (set by :mod:`kvbus.infra.secure` as ``apicurio.kafkasql.*``), so one prefixed ACL covers them."""

# Consumer groups the stages make up per run (uuid suffix): schemas/topics.py names their prefixes.
BRIDGE_RECOVERY_GROUPS = RECOVERY_GROUP_PREFIX
SINK_REBUILD_GROUPS = REBUILD_GROUP_PREFIX
ANALYTICS_GROUPS = REPORT_GROUP_PREFIX

KAFKA_USERS: tuple[str, ...] = (ADMIN, BRIDGE, STREAMS, SINK, ANALYTICS)
"""Principals with a SCRAM user (the router has no Kafka rights, so no Kafka user)."""
REGISTRY_ROLES: dict[str, str] = {ADMIN: "sr-admin", BRIDGE: "sr-developer", STREAMS: "sr-developer",
                                  SINK: "sr-developer", ANALYTICS: "sr-readonly"}
"""Registry role of each principal with a registry user (Apicurio's role names). Producers
register their schemas on first use (developer); reads are open to anyone (docs/security.md)."""


@dataclass(frozen=True)
class Grant:
    """One Kafka ACL (allow) of a principal."""

    resource: str
    """``topic`` or ``group``."""
    name: str
    """Resource name, or its prefix when ``prefixed``."""
    prefixed: bool
    """A PREFIXED pattern (every resource whose name starts with ``name``) rather than LITERAL."""
    operations: tuple[str, ...]
    """Kafka operations (``READ``, ``WRITE``, ``CREATE``, ``DESCRIBE``, ``DESCRIBE_CONFIGS``, ``ALL``);
    READ and WRITE imply DESCRIBE, WRITE on a topic implies IDEMPOTENT_WRITE on the cluster."""
    why: str
    """What the stage does with it."""

    def describe(self) -> str:
        """``READ topic kvbus.raw`` / ``WRITE, CREATE topic kvbus.blocks-packed.*`` (the table form of
        docs/security.md)."""
        return f"{', '.join(self.operations)} {self.resource} {self.name}{'*' if self.prefixed else ''}"


def _topic(name: str, *ops: str, why: str, prefixed: bool = False) -> Grant:
    return Grant("topic", name, prefixed, ops, why)


def _group(name: str, *ops: str, why: str, prefixed: bool = False) -> Grant:
    return Grant("group", name, prefixed, ops, why)


BLOCK_LAYOUTS: tuple[tuple[bool, str], ...] = ((True, "block layout 2"), (False, "block layout 1"))
"""(``packed``, name) of each block layout (schemas/topics.py, "Block layouts"): the worker writes layout 2
by default and layout 1 when run with ``--block-layout events``; the sink and readers read both."""


def _block_grants(topics: Topics, ops: tuple[str, ...], tier_ops: tuple[str, ...], why: str,
                  tier_why: str) -> list[Grant]:
    """``ops`` on each block layout's framework topic and ``tier_ops`` on its tier topics (a prefixed ACL:
    :meth:`Topics.tier_prefix`)."""
    return [g for packed, layout in BLOCK_LAYOUTS for g in (
        _topic(topics.for_ownership(None, packed=packed), *ops, why=f"{why} ({layout})"),
        _topic(topics.tier_prefix(packed), *tier_ops, prefixed=True, why=f"{tier_why} ({layout})"))]


def kafka_grants(topics: Topics, streams: StreamsOptions, sink: SinkConfig) -> dict[str, list[Grant]]:
    """The ACLs of each principal (``admin`` is a super user and has none; the router none)."""
    app = streams.app_id
    return {
        BRIDGE: [
            _topic(topics.raw, "WRITE", why="produce engine batches"),
            _topic(topics.dlq, "WRITE", why="dead letters (oversized events)"),
            _topic(topics.raw, "READ", why="on start, read the tail of its partition to resume its sequence"),
            _group(BRIDGE_RECOVERY_GROUPS, "READ", prefixed=True, why="the start-up reader's throw-away group"),
        ],
        STREAMS: [
            _topic(topics.raw, "READ", why="consume engine batches"),
            _group(app, "READ", why="the Faust consumer group (app id)"),
            *_block_grants(topics, ("WRITE",), ("WRITE", "CREATE"), why="consolidated framework-owned events",
                           tier_why="tier topics, created on first event of a tier"),
            _topic(topics.incomplete, "WRITE", why="incomplete events"),
            _topic(topics.dlq, "WRITE", why="dead letters"),
            _topic(app + "-", "READ", "WRITE", "CREATE", "DESCRIBE_CONFIGS", prefixed=True,
                   why="Faust's own topics: the table changelog, the assignor's leader topic"),
        ],
        SINK: [
            *_block_grants(topics, ("READ", "DESCRIBE_CONFIGS"), ("READ", "DESCRIBE_CONFIGS"),
                           why="consume consolidated events; its retention is checked against the snapshot interval",
                           tier_why="consume the tier topics (regex subscription); their retention is checked too"),
            _group(sink.group, "READ", why="the sinks' consumer group"),
            _topic(topics.dlq, "WRITE", why="dead letters"),
            _topic(topics.snapshots, "READ", "WRITE", "CREATE",
                   why="snapshots of the view (created compacted if missing)"),
            _group(SINK_REBUILD_GROUPS, "READ", prefixed=True, why="the snapshot reader's throw-away group"),
        ],
        ANALYTICS: [
            _topic(topics.raw, "READ", why="read records"),
            *_block_grants(topics, ("READ",), ("READ",), why="read records", tier_why="read the tier topics"),
            *[_topic(t, "READ", why="read records") for t in (topics.incomplete, topics.dlq, topics.snapshots)],
            _group(ANALYTICS_GROUPS, "READ", prefixed=True, why="kvbus report's throw-away groups"),
        ],
    }


def registry_grants() -> list[Grant]:
    """ACLs of the registry's own Kafka principal (its KafkaSQL journal, snapshots and groups)."""
    return [
        _topic(KAFKASQL_TOPIC_PREFIX, "ALL", prefixed=True, why="the registry's journal and snapshot topics"),
        _group(KAFKASQL_TOPIC_PREFIX, "ALL", prefixed=True, why="the registry's journal consumer"),
    ]


def router_keys(prefix: str) -> list[str]:
    """The key patterns routers write: ``P load`` (shared load, on shard 0 of a cluster) and the predicted
    entries ``P X:<hid>``, ``P xh`` of the view and of each shard (:mod:`kvbus.schemas.view_keys`)."""
    return [pattern for p in (prefix, prefix + "{s*}:")
            for pattern in (view_keys.LOAD(p), p + view_keys.PREDICTED.name + "*", view_keys.PREDICTED_HOLDERS(p))]


def redis_rules(sink: SinkConfig) -> dict[str, str]:
    """Redis ACL rules (``ACL SETUSER`` syntax, after ``on`` and the password) of each principal with
    a Redis user; keys are limited to the view's prefix (``KVBUS_SINK_PREFIX``)."""
    keys = sink.prefix + "*"
    return {
        ADMIN: "~* &* +@all",
        # the view's keys; reads, writes, MULTI, FUNCTION LOAD / FCALL; nothing @dangerous (FLUSHALL,
        # KEYS, CONFIG, ...) except INFO (the sink reads the server version, run id, maxmemory-policy and
        # evicted_keys), and no FUNCTION FLUSH / DELETE / RESTORE (not @dangerous in Redis 7.0, but they
        # drop libraries)
        SINK: f"resetchannels ~{keys} -@all +@read +@write +@keyspace +@transaction +@connection +@scripting "
              "-@dangerous +info -function|flush -function|delete -function|restore",
        # read-only key access (%R~) to the view, and writes (+@write, FCALL kvbus_predict) to the routers'
        # own keys only (%RW~): their shared load and their predicted entries (the view's and each shard's);
        # a write function called on any other key (kvbus_apply, kvbus_drop, ...) is refused NOPERM; TIME: predictions
        # expire by the server's clock; no FUNCTION (LOAD, DELETE, ...: @write)
        ROUTER: f"resetchannels %R~{keys} " + " ".join(f"%RW~{k}" for k in router_keys(sink.prefix))
                + " -@all +@read +@write +@connection +fcall_ro +fcall +time -@dangerous -function +info",
    }


def table(topics: Topics, streams: StreamsOptions, sink: SinkConfig) -> str:
    """The Markdown table of every principal's rights (Kafka ACLs, Redis ACL rules, registry role)."""
    grants = kafka_grants(topics, streams, sink)
    redis = redis_rules(sink)
    rows = ["| principal | runs | Kafka | Redis | registry |", "|---|---|---|---|---|"]
    for p in PRINCIPALS:
        if p == ADMIN:
            kafka = "super user"
        elif p not in KAFKA_USERS:
            kafka = "no user"
        else:
            kafka = "<br>".join(f"`{g.describe()}`" for g in grants.get(p, []))
        rule = f"`{redis[p]}`".replace("|", "\\|") if p in redis else "no user"  # a | ends a table cell
        rows.append(f"| `{p}` | {RUNS[p]} | {kafka} | {rule} | "
                    f"{REGISTRY_ROLES.get(p, 'no user')} |")
    return "\n".join(rows) + "\n"
