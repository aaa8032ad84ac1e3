"""The secured stack: ``infra/stack up --secure | down --secure | status --secure``.

Runs next to the open dev stack, with its own state directory and ports (:class:`SecureLayout`;
default ``$KVBUS_STATE_DIR/secure`` and ports from ``$KVBUS_SECURE_PORT_BASE``, 9190), sharing only
the downloaded Kafka jars and registry. Who may do what: :mod:`kvbus.infra.secure_plan`.

* **Kafka** 4.x KRaft, one node: clients on a ``SASL_SSL`` listener (SCRAM-SHA-512, no anonymous
  access), ``StandardAuthorizer`` with ``allow.everyone.if.no.acl.found=false``. The controller
  listener and the inter-broker listener are ``SSL`` with client certificates required: the broker
  authenticates with its certificate (principal ``User:CN=kvbus-broker``, a super user), so
  the broker's properties hold no password and nothing without a certificate from the local CA
  gets in (a PLAINTEXT controller listener would make ``User:ANONYMOUS`` a super user). ``admin``
  (the other super user) is bootstrapped with ``kafka-storage format --add-scram``; the stage users
  and ACLs are made with confluent-kafka's AdminClient on every ``up`` (idempotent).
* **Redis** (Debian's 7.0 build has TLS): TLS port only (``--port 0``), no client certificates,
  users from an ACL file (``user default off``; SHA-256 password hashes, no plain secret).
* **Registry** (Apicurio 3.3.3): HTTPS only; HTTP basic authentication against Quarkus' embedded
  users (no OIDC provider needed), role-based authorization, reads open to anonymous clients.
  Its KafkaSQL storage is on the secured Kafka as the principal ``registry``. Its secrets are in
  ``<data>/apicurio/config/application.properties`` (mode 0600; Quarkus reads it from the working
  directory), never on its command line.

Files under the secure state directory: ``pki/`` (CA, certificates, keys: :mod:`kvbus.infra.pki`),
``secrets/<principal>.password`` (0600), ``env/<principal>.env`` (``KVBUS_*`` lines; secrets by file
path only), ``redis/users.acl``, and ``run/``, ``logs/``, ``data/`` as the open stack has.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import ssl
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbus.sinks.config import SinkConfig  # the stages' public options (group, key prefix, app id)
from kvbus.streams.options import StreamsOptions

from . import dev_topics, kafka_broker, pki, redis_server, registry_server
from .procs import ServiceError, alive_record, port_open, start_process, stop_process, wait_until
from .secure_plan import (
    ADMIN,
    KAFKA_USERS,
    KAFKASQL_TOPIC_PREFIX,
    PRINCIPALS,
    REGISTRY_KAFKA_USER,
    REGISTRY_ROLES,
    Grant,
    kafka_grants,
    redis_rules,
    registry_grants,
)
from .stack_env import LOOPBACK, SECURE_PORT_BASE, Paths, RedisSettings, RegistrySettings, kvbus_settings, state_dir

log = logging.getLogger("infra")

SCRAM_MECHANISM = "SCRAM-SHA-512"
BROKER_CN = "kvbus-broker"
"""Subject CN of the broker's certificate: its principal on the SSL listeners is ``User:CN=kvbus-broker``."""
KAFKA_TIMEOUT = 120.0
REDIS_TIMEOUT = 20.0
REGISTRY_TIMEOUT = 240.0


@dataclass(frozen=True)
class SecurePorts:
    """Loopback ports of the secured stack."""

    kafka: int
    """Kafka's SASL_SSL client listener (the bootstrap)."""
    controller: int
    """Kafka's KRaft controller listener (SSL, broker certificate required)."""
    internal: int
    """Kafka's inter-broker listener (SSL, broker certificate required)."""
    registry: int
    """The registry's HTTPS port."""
    registry_management: int
    """The registry's management (health) port, plain HTTP."""
    redis: int
    """Redis' TLS port (no plaintext port)."""

    @classmethod
    def from_base(cls, base: int) -> SecurePorts:
        """Six consecutive ports from ``base``."""
        return cls(base, base + 1, base + 2, base + 3, base + 4, base + 5)


@dataclass
class SecurePaths(Paths):
    """:class:`kvbus.infra.stack_env.Paths` of the secured stack: its own run, logs, data and configs, the
    open stack's Kafka jars and registry distribution (``shared``)."""

    shared: Paths = field(default_factory=Paths)

    @property
    def kafka_libs(self) -> Path:
        return self.shared.kafka_libs

    @property
    def apicurio(self) -> Path:
        return self.shared.apicurio

    @property
    def apicurio_app(self) -> Path:
        return self.shared.apicurio_app


@dataclass(frozen=True)
class SecureLayout:
    """Where one secured stack lives: its state directory and ports."""

    root: Path
    ports: SecurePorts

    @classmethod
    def default(cls) -> SecureLayout:
        """``$KVBUS_STATE_DIR/secure`` and ports from ``$KVBUS_SECURE_PORT_BASE`` (default 9190:
        Kafka 9190, controller 9191, inter-broker 9192, registry 9193, its health 9194, Redis 9195)."""
        return cls(state_dir() / "secure", SecurePorts.from_base(SECURE_PORT_BASE.read(os.environ)))

    @property
    def paths(self) -> SecurePaths:
        return SecurePaths(self.root)

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def secrets(self) -> Path:
        return self.root / "secrets"

    @property
    def env_dir(self) -> Path:
        return self.root / "env"

    @property
    def ca(self) -> Path:
        """The CA certificate clients trust."""
        return self.pki / "ca.pem"

    @property
    def redis_acl(self) -> Path:
        return self.root / "redis" / "users.acl"

    @property
    def registry_config(self) -> Path:
        """Quarkus reads ``config/application.properties`` from the registry's working directory."""
        return self.paths.data / "apicurio" / "config" / "application.properties"

    @property
    def state_file(self) -> Path:
        return self.paths.run / "secure.json"

    @property
    def bootstrap(self) -> str:
        return f"{LOOPBACK}:{self.ports.kafka}"

    @property
    def redis_url(self) -> str:
        return f"rediss://{LOOPBACK}:{self.ports.redis}/0"

    @property
    def registry(self) -> RegistrySettings:
        return RegistrySettings(url=f"https://{LOOPBACK}:{self.ports.registry}/apis/ccompat/v7", host=LOOPBACK,
                                port=self.ports.registry, management_port=self.ports.registry_management)

    def password_file(self, principal: str) -> Path:
        """The file holding ``principal``'s password (Kafka, Redis and registry alike)."""
        return self.secrets / f"{principal}.password"

    def env_file(self, principal: str) -> Path:
        return self.env_dir / f"{principal}.env"


# ---------------------------------------------------------------------------- files


def _private_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` with mode 0600 (created so: never readable by others)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    tmp.replace(path)


def password(layout: SecureLayout, principal: str) -> str:
    """``principal``'s password, made (random, 32 characters) on first use."""
    path = layout.password_file(principal)
    if not path.is_file():
        layout.secrets.mkdir(parents=True, exist_ok=True)
        layout.secrets.chmod(0o700)
        _private_write(path, secrets.token_urlsafe(24) + "\n")
    return path.read_text().strip()


def env_lines(layout: SecureLayout, principal: str) -> dict[str, str]:
    """The ``KVBUS_*`` settings of ``principal``: where every service of the secured stack is (so no
    process started with them reaches another stack by default) and credentials (by file) for the
    services it has rights on. Without a Kafka user no SASL settings (a client then speaks PLAINTEXT
    to the SASL_SSL listener and is dropped); without a Redis or registry user none (Redis refuses
    the disabled default user; registry reads are open, writes answered 401)."""
    pw = str(layout.password_file(principal))
    ca = str(layout.ca)
    out = {"KVBUS_BOOTSTRAP": layout.bootstrap, "KVBUS_REGISTRY_URL": layout.registry.url, "KVBUS_REGISTRY_SSL_CA": ca,
           "KVBUS_REDIS_URL": layout.redis_url, "KVBUS_REDIS_SSL_CA": ca}
    if principal in KAFKA_USERS:
        out |= {"KVBUS_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KVBUS_KAFKA_SASL_MECHANISM": SCRAM_MECHANISM,
                "KVBUS_KAFKA_SASL_USERNAME": principal, "KVBUS_KAFKA_SASL_PASSWORD_FILE": pw, "KVBUS_KAFKA_SSL_CA": ca}
    if principal in REGISTRY_ROLES:
        out |= {"KVBUS_REGISTRY_USERNAME": principal, "KVBUS_REGISTRY_PASSWORD_FILE": pw}
    if principal in redis_rules(SinkConfig.from_env()):
        out |= {"KVBUS_REDIS_USERNAME": principal, "KVBUS_REDIS_PASSWORD_FILE": pw}
    return out


def prepare(layout: SecureLayout) -> pki.CertFiles:
    """Make what the services need before they start (each file only when missing, except the
    generated configs): the CA and the broker's certificate, every password, the env files, Redis'
    ACL file and the registry's secret config. Returns the server certificate."""
    layout.paths.ensure()
    cert = pki.ensure_cert(layout.pki, BROKER_CN)
    for p in (*PRINCIPALS, REGISTRY_KAFKA_USER):
        password(layout, p)
    layout.env_dir.mkdir(parents=True, exist_ok=True)
    for p in PRINCIPALS:
        body = "".join(f"{k}={v}\n" for k, v in env_lines(layout, p).items())
        _private_write(layout.env_file(p), f"# kvbus settings of the principal '{p}' on the secured stack "
                                           f"(infra/stack up --secure); secrets are in the *_FILE paths\n{body}")
    rules = redis_rules(SinkConfig.from_env())
    acl = ["user default off"] + [
        f"user {p} on #{hashlib.sha256(password(layout, p).encode()).hexdigest()} {r}" for p, r in rules.items()]
    _private_write(layout.redis_acl, "\n".join(acl) + "\n")
    users = [f"quarkus.security.users.embedded.users.{p}={password(layout, p)}\n"
             f"quarkus.security.users.embedded.roles.{p}={role}\n" for p, role in REGISTRY_ROLES.items()]
    jaas = (f'org.apache.kafka.common.security.scram.ScramLoginModule required username="{REGISTRY_KAFKA_USER}" '
            f'password="{password(layout, REGISTRY_KAFKA_USER)}";')
    _private_write(layout.registry_config, "# generated by infra/secure.py: the registry's secrets\n"
                   "quarkus.security.users.embedded.plain-text=true\n" + "".join(users)
                   + f"apicurio.kafka.common.sasl.jaas.config={jaas}\n")
    return cert


# ---------------------------------------------------------------------------- kafka


def admin_conf(layout: SecureLayout, principal: str = ADMIN) -> dict[str, Any]:
    """librdkafka properties of ``principal`` on the SASL_SSL listener (bootstrap excluded)."""
    return {"security.protocol": "SASL_SSL", "sasl.mechanism": SCRAM_MECHANISM, "sasl.username": principal,
            "sasl.password": password(layout, principal), "ssl.ca.location": str(layout.ca)}


def kafka_node(layout: SecureLayout) -> kafka_broker.Node:
    """The one Kafka node of the secured stack."""
    return kafka_broker.Node(1, layout.ports.kafka, layout.ports.controller, 1, layout.paths)


def kafka_overrides(layout: SecureLayout, cert: pki.CertFiles) -> dict[str, str | None]:
    """Broker properties laid over :func:`kvbus.infra.kafka_broker.node_properties` (no secret in them)."""
    p = layout.ports
    return {
        "listeners": f"SASL_SSL://{LOOPBACK}:{p.kafka},CONTROLLER://{LOOPBACK}:{p.controller},INTERNAL://{LOOPBACK}:{p.internal}",
        "advertised.listeners": f"SASL_SSL://{LOOPBACK}:{p.kafka},INTERNAL://{LOOPBACK}:{p.internal}",
        "listener.security.protocol.map": "CONTROLLER:SSL,INTERNAL:SSL,SASL_SSL:SASL_SSL",
        "inter.broker.listener.name": "INTERNAL",
        "sasl.enabled.mechanisms": SCRAM_MECHANISM,
        "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config":
            "org.apache.kafka.common.security.scram.ScramLoginModule required;",
        "listener.name.controller.ssl.client.auth": "required",
        "listener.name.internal.ssl.client.auth": "required",
        "ssl.keystore.type": "PEM",
        "ssl.keystore.location": str(cert.keystore),
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(cert.ca),
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "allow.everyone.if.no.acl.found": "false",
        "super.users": f"User:{ADMIN};User:CN={BROKER_CN}",
        "auto.create.topics.enable": "false",
    }


def _acl_bindings(principal: str, grants: list[Grant]) -> list[Any]:
    from confluent_kafka.admin import AclBinding, AclOperation, AclPermissionType, ResourcePatternType, ResourceType

    return [AclBinding(ResourceType[g.resource.upper()], g.name,
                       ResourcePatternType.PREFIXED if g.prefixed else ResourcePatternType.LITERAL,
                       f"User:{principal}", "*", AclOperation[op], AclPermissionType.ALLOW)
            for g in grants for op in g.operations]


def apply_kafka_security(layout: SecureLayout, timeout: float = 30.0) -> dict[str, int]:
    """Create or update every SCRAM user (but admin's, set at format) and create every ACL of
    :mod:`kvbus.infra.secure_plan` as ``admin``. Returns ``{principal: number of ACLs}``."""
    from confluent_kafka.admin import ScramCredentialInfo, ScramMechanism, UserScramCredentialUpsertion

    client = dev_topics.admin_client(layout.bootstrap, **admin_conf(layout))
    users = [u for u in (*KAFKA_USERS, REGISTRY_KAFKA_USER) if u != ADMIN]
    info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 8192)
    ups = [UserScramCredentialUpsertion(u, info, password(layout, u).encode()) for u in users]
    for fut in client.alter_user_scram_credentials(ups, request_timeout=timeout).values():
        fut.result(timeout)
    plan = kafka_grants(kvbus_settings().topics, StreamsOptions.from_env(), SinkConfig.from_env())
    plan[REGISTRY_KAFKA_USER] = registry_grants()
    bindings = [b for p, g in plan.items() for b in _acl_bindings(p, g)]
    for fut in client.create_acls(bindings, request_timeout=timeout).values():
        fut.result(timeout)
    return {p: sum(len(g.operations) for g in gs) for p, gs in plan.items()}


# ---------------------------------------------------------------------------- redis


def redis_settings(layout: SecureLayout) -> RedisSettings:
    return RedisSettings(url=layout.redis_url, host=LOOPBACK, port=layout.ports.redis)


def redis_argv(layout: SecureLayout, cert: pki.CertFiles) -> list[str]:
    """redis-server on the TLS port only, users from the ACL file."""
    data = layout.paths.data / "redis"
    return [*redis_server.server_argv(redis_settings(layout), data),
            "--port", "0", "--tls-port", str(layout.ports.redis),
            "--tls-cert-file", str(cert.cert), "--tls-key-file", str(cert.key), "--tls-ca-cert-file", str(cert.ca),
            "--tls-auth-clients", "no", "--aclfile", str(layout.redis_acl)]


def redis_client(layout: SecureLayout, principal: str = ADMIN, **kw: Any) -> Any:
    """A redis-py client of ``principal`` over TLS (short timeouts, no retries: a refusal is final)."""
    redis = redis_server.require_client()
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis(host=LOOPBACK, port=layout.ports.redis, ssl=True, ssl_ca_certs=str(layout.ca),
                       username=principal, password=password(layout, principal),
                       **{"socket_connect_timeout": 5, "socket_timeout": 5, "retry": Retry(NoBackoff(), 0), **kw})


def _redis_pid(layout: SecureLayout) -> Path:
    return layout.paths.run / "redis.pid"


def _redis_ping(layout: SecureLayout) -> bool:
    with redis_client(layout) as r:
        return bool(r.ping())


# ---------------------------------------------------------------------------- registry


def registry_props(layout: SecureLayout, cert: pki.CertFiles) -> dict[str, str | None]:
    """Registry system properties laid over :func:`kvbus.infra.registry_server.argv` (no secret in them)."""
    return {
        "quarkus.http.port": str(layout.ports.registry),
        "quarkus.http.ssl-port": str(layout.ports.registry),
        "quarkus.http.insecure-requests": "disabled",
        "quarkus.http.ssl.certificate.files": str(cert.cert),
        "quarkus.http.ssl.certificate.key-files": str(cert.key),
        "quarkus.http.auth.basic": "true",
        "apicurio.authn.mechanism.priority": "basic",
        "apicurio.auth.role-based-authorization": "true",
        "apicurio.auth.role-source": "token",
        "apicurio.auth.anonymous-read-access.enabled": "true",
        "apicurio.kafkasql.topic": KAFKASQL_TOPIC_PREFIX + "journal",
        "apicurio.kafkasql.snapshots.topic": KAFKASQL_TOPIC_PREFIX + "snapshots",
        "apicurio.kafkasql.consumer.group-prefix": KAFKASQL_TOPIC_PREFIX,
        "apicurio.events.kafka.topic": KAFKASQL_TOPIC_PREFIX + "events",
        "apicurio.kafka.common.security.protocol": "SASL_SSL",
        "apicurio.kafka.common.sasl.mechanism": SCRAM_MECHANISM,
        "apicurio.kafka.common.ssl.truststore.type": "PEM",
        "apicurio.kafka.common.ssl.truststore.location": str(cert.ca),
    }


def ssl_context(layout: SecureLayout) -> ssl.SSLContext:
    """A client TLS context trusting the local CA."""
    return ssl.create_default_context(cafile=str(layout.ca))


def registry_ready(layout: SecureLayout) -> bool:
    """Health UP on the management port and ``GET /subjects`` answered 200 over HTTPS (anonymously)."""
    reg = layout.registry
    try:
        with urllib.request.urlopen(reg.health_url, timeout=2) as resp:
            if resp.status != 200:
                return False
        with urllib.request.urlopen(reg.subjects_url, timeout=2, context=ssl_context(layout)) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError):
        return False


# ---------------------------------------------------------------------------- up / down / status


def up(layout: SecureLayout | None = None, *, timeout: float | None = None) -> dict[str, Any]:
    """Start (or confirm) the secured Redis, Kafka and registry of ``layout`` (default:
    :meth:`SecureLayout.default`), its users, ACLs and topics. Idempotent.

    Returns ``{"bootstrap", "registry_url", "redis_url", "env_dir", "env", "acls", "state_dir", "timings"}``
    (``env``: the admin's settings).
    """
    layout = layout or SecureLayout.default()
    shared = layout.paths.shared.ensure()
    t_all = time.monotonic()
    timings: dict[str, float] = {}
    t = time.monotonic()
    dev_topics.require_client()
    kafka_broker.ensure_libs(shared)
    registry_server.ensure_app(shared)
    redis_server.binary()
    cert = prepare(layout)
    timings["prepare"] = time.monotonic() - t

    t = time.monotonic()
    rec = alive_record(_redis_pid(layout))
    if rec is None:
        if port_open(LOOPBACK, layout.ports.redis):
            raise ServiceError(f"redis (secure): port {layout.ports.redis} is in use "
                               "by a process this stack did not start")
        (layout.paths.data / "redis").mkdir(parents=True, exist_ok=True)
        rec = start_process("redis", redis_argv(layout, cert), pid_path=_redis_pid(layout),
                            log_path=layout.paths.logs / "redis.log", marker=f"{LOOPBACK}:{layout.ports.redis}",
                            cwd=layout.paths.data / "redis")
    else:  # running: take the ACL file as written now (rules may have changed)
        with redis_client(layout) as r:
            r.acl_load()
    wait_until("redis (secure)", lambda: _redis_ping(layout), timeout=timeout or REDIS_TIMEOUT,
               records=[rec], interval=0.1)
    timings["redis"] = time.monotonic() - t

    t = time.monotonic()
    node = kafka_node(layout)
    scram = f"{SCRAM_MECHANISM}=[name={ADMIN},password={password(layout, ADMIN)}]"
    new = kafka_broker.start(layout.paths, [node], overrides=kafka_overrides(layout, cert),
                             format_args=["--add-scram", scram])
    live = kafka_broker.running([node])
    wait_until("kafka (secure)", kafka_broker.Readiness([node], admin_conf(layout)), timeout=timeout or KAFKA_TIMEOUT,
               records=new or list(live.values()), log=node.log_path)
    acls = apply_kafka_security(layout)
    dev_topics.ensure_kvbus_topics(layout.bootstrap, 1, client_conf=admin_conf(layout))
    timings["kafka"] = time.monotonic() - t

    t = time.monotonic()
    reg = layout.registry
    rrec = registry_server.start(layout.paths, reg, layout.bootstrap, 1, registry_props(layout, cert))
    recs = [rrec] if rrec is not None else [r for r in [registry_server.running(layout.paths)] if r is not None]
    wait_until("registry (secure)", lambda: registry_ready(layout), timeout=timeout or REGISTRY_TIMEOUT, records=recs,
               log=registry_server.log_path(layout.paths))
    timings["registry"] = time.monotonic() - t
    timings["total"] = time.monotonic() - t_all

    state = {"bootstrap": layout.bootstrap, "registry_url": reg.url, "redis_url": layout.redis_url,
             "env_dir": str(layout.env_dir), "state_dir": str(layout.root), "ca": str(layout.ca),
             "ports": layout.ports.__dict__, "kafka_version": kafka_broker.KAFKA_VERSION,
             "apicurio_version": registry_server.version()}
    layout.state_file.write_text(json.dumps(state, indent=1, sort_keys=True))
    return {**state, "env": env_lines(layout, ADMIN), "acls": acls,
            "timings": {k: round(v, 2) for k, v in timings.items()}}


def down(layout: SecureLayout | None = None, timeout: float = 30.0) -> dict[str, str]:
    """Stop the secured stack's processes (registry, Kafka, Redis; by their pid files only).
    Keys, passwords and data stay (the next ``up`` reuses them). Returns ``{name: outcome}``."""
    layout = layout or SecureLayout.default()
    run = layout.paths.run
    out: dict[str, str] = {}
    pid_files = [registry_server.pid_path(layout.paths), kafka_node(layout).pid_path, _redis_pid(layout)]
    pid_files += [p for p in sorted(run.glob("*.pid")) if p not in pid_files] if run.is_dir() else []
    for pf in pid_files:
        rec = alive_record(pf)
        if rec is not None:
            out[f"{rec.name} (secure)"] = stop_process(rec, pid_path=pf, timeout=timeout)
    layout.state_file.unlink(missing_ok=True)
    return out


def status(layout: SecureLayout | None = None) -> dict[str, Any]:
    """Per-service pid/running/ready of the secured stack; ``ready`` if all are."""
    layout = layout or SecureLayout.default()
    node = kafka_node(layout)

    def probe(check: Any) -> bool:
        try:
            return bool(check())
        except Exception:  # noqa: BLE001 - unreachable or refusing: not ready
            return False

    recs = {"kafka": alive_record(node.pid_path), "registry": registry_server.running(layout.paths),
            "redis": alive_record(_redis_pid(layout))}
    ready = {"kafka": lambda: kafka_broker.Readiness([node], admin_conf(layout))(),
             "registry": lambda: registry_ready(layout), "redis": lambda: _redis_ping(layout)}
    address = {"kafka": layout.bootstrap, "registry": layout.registry.url, "redis": layout.redis_url}
    services = {name: {"pid": rec.pid if rec else None, "running": rec is not None, "address": address[name],
                       "ready": rec is not None and layout.ca.is_file() and probe(ready[name])}
                for name, rec in recs.items()}
    return {"ready": all(s["ready"] for s in services.values()), "services": services, "bootstrap": layout.bootstrap,
            "state_dir": str(layout.root), "env_dir": str(layout.env_dir)}
