"""deploy/kubernetes, offline: the example overlay renders with ``kubectl kustomize``; the built-in kinds
validate against the Kubernetes API schemas (PyPI's kubernetes-validate); every kvbus container's
arguments parse with kvbus's own CLI parser and every variable it gets is a setting kvbus reads (and
its settings load); the probes, the bridges' sidecars per data-parallel rank, the worker's volume
and the sink's static membership are wired as documented; the Strimzi topics and users equal the
topic declarations and the access plan; the generated files are current."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvbus import __version__
from kvbus.cli import build_parser
from kvbus.infra import manifests, prometheus_rule, strimzi
from kvbus.infra.secure_plan import ADMIN, BRIDGE, KAFKA_USERS, SINK, STREAMS, kafka_grants
from kvbus.runtime.logs import log_format
from kvbus.runtime.settings import Settings
from kvbus.schemas.topics import Topics
from kvbus.sinks.config import SinkConfig
from kvbus.streams.cli import options_from_args
from kvbus.streams.options import StreamsOptions

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = ROOT / "deploy/kubernetes"
OVERLAY = KUBERNETES / "overlays/example"
KUBE_VERSIONS = ("1.29", kubernetes_validate.latest_version())
"""The oldest Kubernetes with native sidecars on by default, and the newest the schemas know."""
CUSTOM_KINDS = {"KafkaTopic", "KafkaUser", "ServiceMonitor", "PodMonitor", "PrometheusRule"}
"""Kinds of operators' CRDs (Strimzi, Prometheus Operator): no built-in schema; checked below instead."""
SETTINGS_READERS = (Settings.from_env, StreamsOptions.from_env, SinkConfig.from_env, log_format)
"""Where the stages read their ``KVBUS_*`` variables (every one takes the environment as a mapping)."""
STAGE_PRINCIPAL = {"bridge": BRIDGE, "worker": STREAMS, "sink": SINK}
"""The access plan's principal each kvbus subcommand runs as."""
SAMPLE_POD = "vllm-0"
"""What ``metadata.name`` resolves to when a container's variables are resolved here."""


# ---------------------------------------------------------------------------------------------- rendering


def kustomize(path: Path) -> list[dict[str, Any]]:
    """The documents ``kubectl kustomize path`` prints."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is missing: the tests render the manifests with `kubectl kustomize`"
    out = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, f"kubectl kustomize {path.relative_to(ROOT)} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@cache
def _rendered() -> tuple[dict[str, Any], ...]:
    return tuple(kustomize(OVERLAY))


@pytest.fixture
def rendered() -> list[dict[str, Any]]:
    """The example overlay's documents (a fresh copy for each test: tests may change them)."""
    return json.loads(json.dumps(_rendered()))


def objects(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    """The documents of ``kind`` by name."""
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = objects(docs, kind)
    assert name in found, f"no {kind} {name} in the rendered overlay; {kind}s: {sorted(found)}"
    return found[name]


def settings_data(docs: list[dict[str, Any]]) -> dict[str, str]:
    """The data of the ``kvbus-settings`` ConfigMap (Kustomize adds a hash to its name)."""
    found = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("kvbus-settings-")]
    assert len(found) == 1, f"expected one kvbus-settings ConfigMap, found {[d['metadata']['name'] for d in found]}"
    return found[0]["data"]


def pod_specs(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(workload name, pod spec) of every workload."""
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield d["metadata"]["name"], d["spec"]["template"]["spec"]


def kvbus_image(docs: list[dict[str, Any]]) -> str:
    """The kvbus image the overlay deploys (the worker's)."""
    return one(docs, "StatefulSet", "kvbus-worker")["spec"]["template"]["spec"]["containers"][0]["image"]


def kvbus_containers(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(pod spec, container) of every container, init containers included, that runs the kvbus image."""
    image = kvbus_image(docs)
    for _, spec in pod_specs(docs):
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            if c["image"] == image:
                yield spec, c


def env_of(docs: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """The variables a container gets: its ConfigMaps (``envFrom``), then its ``env``; a ``fieldRef`` to
    ``metadata.name`` resolves to :data:`SAMPLE_POD`."""
    configmaps = objects(docs, "ConfigMap")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        assert set(source) == {"configMapRef"}, f"{container['name']}: unexpected envFrom {source}"
        env.update(configmaps[source["configMapRef"]["name"]]["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            assert var["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}, \
                f"{container['name']}: {var['name']} comes from {var['valueFrom']}, not the pod name"
            env[var["name"]] = SAMPLE_POD
    return env


def args_of(docs: list[dict[str, Any]], container: dict[str, Any]) -> list[str]:
    """The container's arguments with ``$(VAR)`` resolved the way the kubelet does."""
    env = env_of(docs, container)

    def resolve(arg: str) -> str:
        for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
            assert ref in env, f"{container['name']}: argument {arg!r} refers to ${ref}, which it does not define"
            arg = arg.replace(f"$({ref})", env[ref])
        return arg

    return [resolve(a) for a in container["args"]]


def parsed(docs: list[dict[str, Any]], container: dict[str, Any]) -> Any:
    """The container's arguments parsed by ``kvbus``'s own parser (the image's entry point is ``kvbus``)."""
    args = args_of(docs, container)
    try:
        return build_parser(args[0]).parse_args(args)
    except SystemExit as e:
        pytest.fail(f"{container['name']}: `kvbus {' '.join(args)}` does not parse (exit {e.code})")


def container_port(container: dict[str, Any], port: int | str) -> int:
    """A probe's or Service's port (a number or the name of one of the container's ports) as a number."""
    if isinstance(port, int):
        return port
    numbers = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    assert port in numbers, f"{container['name']} has no port named {port!r} (ports: {numbers})"
    return numbers[port]


def mounted_files(spec: dict[str, Any], container: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Files the container sees from Secret volumes: path -> (Secret name, key)."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    files = {}
    for mount in container.get("volumeMounts", []):
        secret = volumes.get(mount["name"], {}).get("secret")
        if secret is None:
            continue
        assert "items" in secret, f"{container['name']}: Secret volume {mount['name']} mounts no named items"
        for item in secret["items"]:
            files[f"{mount['mountPath']}/{item['path']}"] = (secret["secretName"], item["key"])
    return files


class Recorder(dict):
    """A mapping that records every name looked up in it."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)


def load_settings(env: Mapping[str, str]) -> set[str]:
    """Load every settings reader from ``env`` (each must accept it); the names they looked up."""
    recorder = Recorder(env)
    for read in SETTINGS_READERS:
        read(recorder)
    return recorder.read


def stage_env(docs: list[dict[str, Any]], spec: dict[str, Any], container: dict[str, Any],
              tmp_path: Path) -> dict[str, str]:
    """The container's variables with each file it mounts from a Secret made under ``tmp_path`` (and the
    variables naming it pointed there); a variable naming a file under /etc that is not mounted fails."""
    env = env_of(docs, container)
    files = mounted_files(spec, container)
    for path in files:
        local = tmp_path / container["name"] / path.lstrip("/")
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_text("secret\n")
    for name, value in env.items():
        if value.startswith("/etc/"):
            assert value in files, \
                f"{container['name']}: {name}={value} is no file it mounts (mounted: {sorted(files)})"
            env[name] = str(tmp_path / container["name"] / value.lstrip("/"))
    return env


def stage_containers(docs: list[dict[str, Any]], command: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    found = [(s, c) for s, c in kvbus_containers(docs) if c["args"][0] == command]
    assert found, f"no container runs `kvbus {command}`"
    return found


# ---------------------------------------------------------------------------------------------- rendering


def test_overlay_renders_every_part(rendered: list[dict[str, Any]]) -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for d in rendered}
    for expected in [("Namespace", "kvbus"), ("StatefulSet", "kvbus-worker"), ("Deployment", "kvbus-sink"),
                     ("StatefulSet", "vllm"), ("PodDisruptionBudget", "kvbus-worker"),
                     ("PodDisruptionBudget", "kvbus-sink"), ("ServiceMonitor", "kvbus"), ("PodMonitor", "vllm"),
                     ("PrometheusRule", "kvbus")]:
        assert expected in kinds, f"{expected} missing from the overlay; it renders {sorted(kinds)}"
    assert {d["metadata"].get("namespace") for d in rendered if d["kind"] != "Namespace"} == {"kvbus"}
    settings_data(rendered)
    assert kustomize(KUBERNETES / "base"), "the base renders nothing"


def test_builtin_kinds_validate_against_the_kubernetes_schemas(rendered: list[dict[str, Any]]) -> None:
    custom = set()
    for version in KUBE_VERSIONS:
        for d in rendered:
            name = f"{d['kind']} {d['metadata']['name']}"
            try:
                kubernetes_validate.validate(d, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                assert d["kind"] in CUSTOM_KINDS, f"{name}: no schema in Kubernetes {version}, and not a known CRD kind"
                custom.add(d["kind"])
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{name} is invalid in Kubernetes {version}: {e.message} at {list(e.path)}")
    assert custom == CUSTOM_KINDS


def test_the_overlay_deploys_this_version_of_the_kvbus_image(rendered: list[dict[str, Any]]) -> None:
    image = kvbus_image(rendered)
    assert image.rpartition(":")[2] == __version__, f"the overlay deploys {image}, kvbus is {__version__}"
    for _, c in kvbus_containers(rendered):
        assert "command" not in c, f"{c['name']}: the image's entry point is `kvbus`; set args only"


# ---------------------------------------------------------------------------------------------- containers


def test_every_kvbus_container_parses_with_the_kvbus_cli(rendered: list[dict[str, Any]]) -> None:
    commands = []
    for _, c in kvbus_containers(rendered):
        args = parsed(rendered, c)
        commands.append(args.command)
    assert sorted(commands) == ["bridge", "bridge", "sink", "worker"]


def test_every_variable_is_a_kvbus_setting_and_the_settings_load(rendered: list[dict[str, Any]],
                                                                tmp_path: Path) -> None:
    for spec, c in kvbus_containers(rendered):
        env = stage_env(rendered, spec, c, tmp_path)
        read = load_settings(env) | load_settings({})
        referenced = {ref for a in c["args"] for ref in re.findall(r"\$\((\w+)\)", a)}
        for name in env:
            if name.startswith("KVBUS_"):
                assert name in read, f"{c['name']}: {name} is no setting kvbus reads"
            else:
                assert name in referenced, f"{c['name']}: {name} is neither a kvbus setting nor used by its arguments"


def test_each_stage_authenticates_as_its_own_kafka_user(rendered: list[dict[str, Any]], tmp_path: Path) -> None:
    for spec, c in kvbus_containers(rendered):
        principal = STAGE_PRINCIPAL[c["args"][0]]
        env = env_of(rendered, c)
        user = strimzi.user_name(principal)
        assert env.get("KVBUS_KAFKA_SASL_USERNAME") == user, f"{c['name']} runs as {principal}: user {user}"
        files = mounted_files(spec, c)
        password = env.get("KVBUS_KAFKA_SASL_PASSWORD_FILE", "")
        assert files.get(password) == (user, "password"), \
            f"{c['name']}: its password file {password!r} is not key `password` of Secret {user} ({files})"
        security = Settings.from_env(stage_env(rendered, spec, c, tmp_path)).security.kafka
        assert (security.protocol, security.mechanism) == ("SASL_SSL", "SCRAM-SHA-512")
        assert security.password.value == "secret", "the password was not read from its file"


def test_probes_use_the_health_endpoints_on_the_metrics_port(rendered: list[dict[str, Any]]) -> None:
    for spec, c in kvbus_containers(rendered):
        port = parsed(rendered, c).metrics_port
        assert port, f"{c['name']} serves no metrics port"
        live = c.get("livenessProbe", {}).get("httpGet")
        assert live and live["path"] == "/healthz" and container_port(c, live["port"]) == port, \
            f"{c['name']}: livenessProbe {c.get('livenessProbe')} is not /healthz on its metrics port {port}"
        sidecar = c.get("restartPolicy") == "Always"
        if sidecar:  # a sidecar's readiness is the engine pod's: kvbus never takes the engine out of service
            assert "readinessProbe" not in c and "startupProbe" not in c, \
                f"{c['name']}: a bridge sidecar's readiness or start-up would hold its engine back"
        else:
            ready = c.get("readinessProbe", {}).get("httpGet")
            assert ready and ready["path"] == "/readyz" and container_port(c, ready["port"]) == port, \
                f"{c['name']}: readinessProbe {c.get('readinessProbe')} is not /readyz on its metrics port {port}"


def test_services_and_the_service_monitor_reach_the_metrics_ports(rendered: list[dict[str, Any]]) -> None:
    monitor = one(rendered, "ServiceMonitor", "kvbus")["spec"]
    monitored = [s for s in objects(rendered, "Service").values()
                 if monitor["selector"]["matchLabels"].items() <= s["metadata"].get("labels", {}).items()]
    assert sorted(s["metadata"]["name"] for s in monitored) == ["kvbus-sink", "kvbus-worker"]
    workloads = {**objects(rendered, "StatefulSet"), **objects(rendered, "Deployment")}
    for service in monitored:
        name = service["metadata"]["name"]
        pod = workloads[name]["spec"]["template"]
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items(), f"{name} selects no pod"
        ports = {p["name"]: p for p in service["spec"]["ports"]}
        port = ports[monitor["endpoints"][0]["port"]]
        container = pod["spec"]["containers"][0]
        assert container_port(container, port["targetPort"]) == parsed(rendered, container).metrics_port


def test_resources_are_requested(rendered: list[dict[str, Any]]) -> None:
    for _, c in kvbus_containers(rendered):
        res = c.get("resources", {})
        assert {"cpu", "memory"} <= set(res.get("requests", {})), f"{c['name']}: no CPU and memory requests"
        assert "memory" in res.get("limits", {}), f"{c['name']}: no memory limit"


# ---------------------------------------------------------------------------------------------- stages


def offset_port(endpoint: str, rank: int) -> str:
    """vLLM's endpoint of data-parallel rank ``rank``: the port + rank."""
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


def option(args: list[str], name: str) -> str:
    assert name in args, f"{name} missing from {args}"
    return args[args.index(name) + 1]


def loopback(endpoint: str) -> str:
    """The address a bridge connects to for an engine's ``endpoint`` (the engine binds all addresses: ``*``)."""
    return endpoint.replace("*", "127.0.0.1")


def test_one_bridge_sidecar_per_data_parallel_rank_of_the_engine(rendered: list[dict[str, Any]]) -> None:
    spec = one(rendered, "StatefulSet", "vllm")["spec"]["template"]["spec"]
    engine = next(c for c in spec["containers"] if c["name"] == "vllm")
    config = json.loads(option(engine["args"], "--kv-events-config"))
    assert config["enable_kv_cache_events"] is True and config["publisher"] == "zmq"
    ranks = int(option(engine["args"], "--data-parallel-size"))
    bridges = [c for c in spec.get("initContainers", []) if c["args"][0] == "bridge"]
    assert all(c.get("restartPolicy") == "Always" for c in bridges), "a bridge must be a native sidecar"
    by_rank = {parsed(rendered, c).dp_rank: c for c in bridges}
    assert sorted(by_rank) == list(range(ranks)), f"bridges for ranks {sorted(by_rank)}, the engine has {ranks}"
    metrics = set()
    for rank, c in by_rank.items():
        args = parsed(rendered, c)
        assert args.endpoint == loopback(offset_port(config["endpoint"], rank)), f"rank {rank}: {args.endpoint}"
        assert args.replay_endpoint == loopback(offset_port(config["replay_endpoint"], rank))
        assert args.topic == config["topic"]
        assert "$(POD_NAME)" in c["args"] and args.replica == SAMPLE_POD, \
            f"{c['name']}: --replica must be the pod name (the name the router knows the endpoint by)"
        served = option(engine["args"], "--served-model-name") if "--served-model-name" in engine["args"] else \
            engine["args"][0]
        assert args.model == served, f"{c['name']}: --model {args.model!r} is not the model vLLM serves ({served!r})"
        metrics.add(next(p["name"] for p in c["ports"] if p["containerPort"] == args.metrics_port))
    ports = {offset_port(config[e], r) for r in range(ranks) for e in ("endpoint", "replay_endpoint")}
    assert len(ports) == 2 * ranks, "the ranks' PUB and replay ports overlap"
    monitor = one(rendered, "PodMonitor", "vllm")["spec"]
    scraped = {e["port"]: e for e in monitor["podMetricsEndpoints"]}
    for port in metrics:
        assert port in scraped, f"the PodMonitor does not scrape bridge port {port}"
        relabel = scraped[port]["relabelings"]
        assert {"sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "replica"} in relabel, \
            f"{port}: its series need replica = the pod name, the bridges' --replica"


def test_worker_keeps_its_rocksdb_state_on_its_volume(rendered: list[dict[str, Any]]) -> None:
    worker = one(rendered, "StatefulSet", "kvbus-worker")["spec"]
    container = worker["template"]["spec"]["containers"][0]
    options = options_from_args(parsed(rendered, container))
    assert options.store.startswith("rocksdb:"), f"the worker's store is {options.store}"
    claims = {t["metadata"]["name"] for t in worker["volumeClaimTemplates"]}
    mounts = [m for m in container["volumeMounts"] if m["name"] in claims]
    assert any(options.data_dir.is_relative_to(m["mountPath"]) for m in mounts), \
        f"the data directory {options.data_dir} is on none of the claimed volumes {mounts}"


def test_sink_uses_static_membership_from_the_pod_name(rendered: list[dict[str, Any]]) -> None:
    [(_, sink)] = stage_containers(rendered, "sink")
    assert "$(POD_NAME)" in sink["args"] and parsed(rendered, sink).instance_id == SAMPLE_POD


def test_disruption_budgets_cover_the_worker_and_the_sink(rendered: list[dict[str, Any]]) -> None:
    workloads = {**objects(rendered, "StatefulSet"), **objects(rendered, "Deployment")}
    for name in ("kvbus-worker", "kvbus-sink"):
        pdb = one(rendered, "PodDisruptionBudget", name)["spec"]
        labels = workloads[name]["spec"]["template"]["metadata"]["labels"]
        assert pdb["selector"]["matchLabels"].items() <= labels.items(), f"the {name} budget selects no pod"
        assert pdb.get("maxUnavailable") == 1


# ---------------------------------------------------------------------------------------------- Strimzi


def test_kafka_topics_equal_the_topic_declarations(rendered: list[dict[str, Any]]) -> None:
    env = settings_data(rendered)
    found = {t["spec"]["topicName"]: t["spec"] for t in objects(rendered, "KafkaTopic").values()}
    want = {s.name: {"topicName": s.name, "partitions": s.partitions, "replicas": s.replicas, "config": dict(s.config)}
            for s in strimzi.specs(env)}
    assert found == want
    topics = Topics.from_env(env)
    assert found[topics.snapshots]["config"]["cleanup.policy"] == "compact"
    snapshot_every = SinkConfig.from_env(env).snapshot_every
    for name in (topics.raw, topics.packed, topics.blocks):
        assert int(found[name]["config"]["retention.ms"]) > 1000 * snapshot_every, \
            f"{name} must retain more than the snapshot period ({snapshot_every} s)"


def flat_acls(users: Mapping[str, list[dict[str, Any]]]) -> set[tuple[str, ...]]:
    """(user, resource type, name, pattern type, operation) of every ACL."""
    return {(u, a["resource"]["type"], a["resource"]["name"], a["resource"]["patternType"], op)
            for u, acls in users.items() for a in acls for op in a["operations"]}


def test_kafka_users_and_acls_equal_the_access_plan(rendered: list[dict[str, Any]]) -> None:
    env = settings_data(rendered)
    users = {name: u["spec"] for name, u in objects(rendered, "KafkaUser").items()}
    assert set(users) == {strimzi.user_name(p) for p in KAFKA_USERS if p != ADMIN}
    assert {u["authentication"]["type"] for u in users.values()} == {"scram-sha-512"}
    plan = kafka_grants(Topics.from_env(env), StreamsOptions.from_env(env), SinkConfig.from_env(env))
    want = {(strimzi.user_name(p), g.resource, g.name, "prefix" if g.prefixed else "literal",
             strimzi.strimzi_operation(op)) for p, grants in plan.items() for g in grants for op in g.operations}
    assert flat_acls({name: u["authorization"]["acls"] for name, u in users.items()}) == want


def test_generated_files_are_current() -> None:
    stale = [str(p.relative_to(ROOT)) for p in manifests.stale()]
    assert not stale, f"stale generated files {stale}: run {manifests.COMMAND}"


def test_prometheus_rule_is_the_rule_files(rendered: list[dict[str, Any]], tmp_path: Path) -> None:
    rule = one(rendered, "PrometheusRule", "kvbus")["spec"]
    assert rule["groups"] == prometheus_rule.rule_groups(ROOT / "ops/prometheus/rules")
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: ./dev setup installs Debian's prometheus package"
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": rule["groups"]}))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stdout + out.stderr
