"""How every kvbus process authenticates to Kafka, Redis and the schema registry.

One place for the security settings, read from the environment like :mod:`kvbus.runtime.settings`, and
for turning them into each client library's configuration: librdkafka properties (confluent-kafka:
bridge, publisher, sink, the worker's output producer, admin clients), Faust's
``broker_credentials`` (aiokafka: the worker's consumer and changelog), redis-py keyword arguments
and the registry client's configuration.

Each setting is declared once here (:data:`SETTINGS`; every one with its meaning: docs/configuration.md):
``KVBUS_KAFKA_*`` (protocol, SASL, TLS, a librdkafka properties file), ``KVBUS_REDIS_*`` (ACL user, TLS
CA) and ``KVBUS_REGISTRY_*`` (basic auth, TLS CA).

Secrets: a ``*_FILE`` variable names a file whose content (stripped) is the secret, as Docker and
Kubernetes secrets are mounted; it is preferred to the plain variable. Secrets are never part of
a ``repr``, a log line, a ``--help`` text or a dead letter; a child process gets the file's path,
not the secret, when the secret came from a file (:meth:`Security.to_env`).
"""
from __future__ import annotations

import os
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Mapping

from kvbus.runtime.env import FILE, TEXT, Setting, SettingError, one_of

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
"""Kafka security protocols (``security.protocol``)."""
MECHANISMS = ("SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN")
"""SASL mechanisms kvbus configures for both client libraries (librdkafka and aiokafka)."""


class SecurityConfigError(SettingError):
    """A security setting is missing or malformed; the message names the ``KVBUS_*`` variable."""


KAFKA_PROTOCOL = Setting("KVBUS_KAFKA_SECURITY_PROTOCOL", one_of(*PROTOCOLS), "PLAINTEXT",
                         f"Kafka security protocol: {', '.join(PROTOCOLS)}")
KAFKA_MECHANISM = Setting("KVBUS_KAFKA_SASL_MECHANISM", one_of(*MECHANISMS), "",
                          f"SASL mechanism with a SASL protocol: {', '.join(MECHANISMS)}",
                          shown=f"{MECHANISMS[0]} with SASL")
KAFKA_USERNAME = Setting("KVBUS_KAFKA_SASL_USERNAME", TEXT, "", "SASL user (required with a SASL protocol)")
KAFKA_PASSWORD = Setting("KVBUS_KAFKA_SASL_PASSWORD", TEXT, "", "the SASL user's password", secret=True)
KAFKA_CA = Setting("KVBUS_KAFKA_SSL_CA", FILE, "", "CA certificate (PEM file) the brokers' certificates are checked "
                   "against (with an SSL protocol)")
KAFKA_CERT = Setting("KVBUS_KAFKA_SSL_CERT", FILE, "", "client certificate (PEM file; mutual TLS, with "
                     "KVBUS_KAFKA_SSL_KEY)")
KAFKA_KEY = Setting("KVBUS_KAFKA_SSL_KEY", FILE, "", "the client certificate's key (PEM file)")
KAFKA_PROPERTIES = Setting("KVBUS_KAFKA_PROPERTIES", FILE, "", "a file of extra librdkafka key=value lines for "
                           "every confluent-kafka client (applied last)")


def credential_settings(prefix: str, service: str, user: str, ca: str) -> tuple[Setting, Setting, Setting]:
    """The user, password and CA settings of a service: ``<prefix>_USERNAME``, ``<prefix>_PASSWORD``
    (or ``..._FILE``) and ``<prefix>_SSL_CA``; ``user``: what the user is, ``ca``: when the CA is used."""
    return (Setting(f"{prefix}_USERNAME", TEXT, "", f"{service} {user}"),
            Setting(f"{prefix}_PASSWORD", TEXT, "", f"the {service} user's password", secret=True),
            Setting(f"{prefix}_SSL_CA", FILE, "", f"CA certificate (PEM file) {ca}"))


@dataclass(frozen=True)
class Secret:
    """A secret value and where it came from: ``file`` (a path; the value was read from it) or the
    variable itself. Its ``repr`` never shows the value."""

    value: str = field(default="", repr=False)
    file: str = ""

    def __bool__(self) -> bool:
        return bool(self.value)

    def __repr__(self) -> str:
        return f"Secret(file={self.file!r})" if self.file else ("Secret(***)" if self.value else "Secret()")


def read_secret(env: Mapping[str, str], secret: Setting) -> Secret:
    """``secret``'s value: the content of the file named by ``<variable>_FILE`` if set, else the variable's
    (not stripped: a password may hold any character)."""
    name = secret.variable
    path = env.get(f"{name}_FILE", "").strip()
    if path:
        try:
            return Secret(Path(path).read_text().strip(), path)
        except OSError as e:
            raise SecurityConfigError(f"{name}_FILE={path}: cannot read the secret file ({e.strerror})") from None
    return Secret(env.get(name, ""))


def read_properties(path: str) -> dict[str, str]:
    """``key=value`` lines of a librdkafka properties file (``#`` comments and blank lines skipped)."""
    out: dict[str, str] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise SecurityConfigError(f"{KAFKA_PROPERTIES.variable}={path}, line {n}: expected key=value")
        out[key.strip()] = value.strip()
    return out


@dataclass(frozen=True)
class KafkaSecurity:
    """Kafka client security: ``protocol`` (:data:`PROTOCOLS`), SASL ``mechanism`` / ``username`` /
    ``password`` (with a SASL protocol), TLS ``ca`` / ``cert`` / ``key`` (PEM file paths; with an SSL
    protocol), and ``properties_file`` (extra librdkafka properties)."""

    protocol: str = "PLAINTEXT"
    mechanism: str = ""
    username: str = ""
    password: Secret = Secret()
    ca: str = ""
    cert: str = ""
    key: str = ""
    properties_file: str = ""

    @property
    def sasl(self) -> bool:
        return self.protocol.startswith("SASL_")

    @property
    def tls(self) -> bool:
        return self.protocol.endswith("SSL")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "KafkaSecurity":
        protocol = KAFKA_PROTOCOL.read(env)
        sec = cls(protocol=protocol, mechanism=KAFKA_MECHANISM.read(env), username=KAFKA_USERNAME.read(env),
                  password=read_secret(env, KAFKA_PASSWORD), ca=KAFKA_CA.read(env), cert=KAFKA_CERT.read(env),
                  key=KAFKA_KEY.read(env), properties_file=KAFKA_PROPERTIES.read(env))
        if sec.sasl:
            if not sec.mechanism:
                sec = cls(**{**sec.__dict__, "mechanism": MECHANISMS[0]})
            if not sec.username or not sec.password:
                raise SecurityConfigError(f"KVBUS_KAFKA_SECURITY_PROTOCOL={protocol} needs KVBUS_KAFKA_SASL_USERNAME "
                                          "and KVBUS_KAFKA_SASL_PASSWORD (or KVBUS_KAFKA_SASL_PASSWORD_FILE)")
        if bool(sec.cert) != bool(sec.key):
            raise SecurityConfigError("KVBUS_KAFKA_SSL_CERT and KVBUS_KAFKA_SSL_KEY go together (mutual TLS)")
        return sec

    def librdkafka(self) -> dict[str, str]:
        """librdkafka properties (confluent-kafka), the properties file's last (it may override)."""
        conf: dict[str, str] = {}
        if self.protocol != "PLAINTEXT":
            conf["security.protocol"] = self.protocol
        if self.sasl:
            conf.update({"sasl.mechanism": self.mechanism, "sasl.username": self.username,
                         "sasl.password": self.password.value})
        if self.tls:
            if self.ca:
                conf["ssl.ca.location"] = self.ca
            if self.cert:
                conf.update({"ssl.certificate.location": self.cert, "ssl.key.location": self.key})
        if self.properties_file:
            conf.update(read_properties(self.properties_file))
        return conf

    def ssl_context(self) -> ssl.SSLContext | None:
        """A client TLS context (the CA, the client certificate if any), None without TLS."""
        if not self.tls:
            return None
        ctx = ssl.create_default_context(cafile=self.ca or None)
        if self.cert:
            ctx.load_cert_chain(self.cert, self.key)
        return ctx

    def faust_credentials(self) -> Any:
        """Faust's ``broker_credentials`` (aiokafka): SASL (over TLS with SASL_SSL), TLS only, or None."""
        import faust

        if self.sasl:
            return faust.SASLCredentials(username=self.username, password=self.password.value,
                                         ssl_context=self.ssl_context(), mechanism=self.mechanism)
        if self.tls:
            return faust.SSLCredentials(self.ssl_context())
        return None

    def to_env(self) -> dict[str, str]:
        return _env({KAFKA_PROTOCOL.variable: self.protocol if self.protocol != "PLAINTEXT" else "",
                     KAFKA_MECHANISM.variable: self.mechanism, KAFKA_USERNAME.variable: self.username,
                     KAFKA_CA.variable: self.ca, KAFKA_CERT.variable: self.cert, KAFKA_KEY.variable: self.key,
                     KAFKA_PROPERTIES.variable: self.properties_file}, KAFKA_PASSWORD, self.password)


@dataclass(frozen=True)
class Credentials:
    """A user, its password and the CA (PEM path) of the service's TLS certificate, read from the
    subclass's :attr:`SETTINGS` (``<PREFIX>_USERNAME``, ``<PREFIX>_PASSWORD`` or ``..._FILE``, ``<PREFIX>_SSL_CA``)."""

    SETTINGS: ClassVar[tuple[Setting, Setting, Setting]] = ()  # type: ignore[assignment]
    """The user, password and CA settings (:func:`credential_settings`)."""
    username: str = ""
    password: Secret = Secret()
    ca: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str]):
        user, password, ca = cls.SETTINGS
        return cls(user.read(env), read_secret(env, password), ca.read(env))

    def to_env(self) -> dict[str, str]:
        user, password, ca = self.SETTINGS
        return _env({user.variable: self.username, ca.variable: self.ca}, password, self.password)


@dataclass(frozen=True)
class RedisSecurity(Credentials):
    """Redis ACL ``username`` / ``password`` (override the URL's) and ``ca`` for ``rediss://``."""

    SETTINGS: ClassVar[tuple[Setting, Setting, Setting]] = credential_settings(
        "KVBUS_REDIS", "Redis", "ACL user (else the URL's user)", "for a rediss:// URL")

    def client_kwargs(self, url: str) -> dict[str, Any]:
        """redis-py keyword arguments (``Redis.from_url(url, **kw)`` / ``RedisCluster``) for ``url``."""
        kw: dict[str, Any] = {}
        if self.username:
            kw["username"] = self.username
        if self.password:
            kw["password"] = self.password.value
        if self.ca and url.split(":", 1)[0].startswith("rediss"):
            kw["ssl_ca_certs"] = self.ca
        return kw


@dataclass(frozen=True)
class RegistrySecurity(Credentials):
    """Registry basic-auth ``username`` / ``password`` and ``ca`` for an ``https://`` URL."""

    SETTINGS: ClassVar[tuple[Setting, Setting, Setting]] = credential_settings(
        "KVBUS_REGISTRY", "schema registry", "basic-auth user", "for an https:// registry URL")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "RegistrySecurity":
        sec = super().from_env(env)
        if bool(sec.username) != bool(sec.password):
            raise SecurityConfigError("KVBUS_REGISTRY_USERNAME and KVBUS_REGISTRY_PASSWORD (or ..._FILE) go together")
        return sec

    def client_conf(self) -> dict[str, str]:
        """confluent-kafka ``SchemaRegistryClient`` configuration entries (besides ``url``)."""
        conf: dict[str, str] = {}
        if self.username:
            conf["basic.auth.user.info"] = f"{self.username}:{self.password.value}"
        if self.ca:
            conf["ssl.ca.location"] = self.ca
        return conf

    def http_headers(self) -> dict[str, str]:
        """HTTP headers for a plain request to the registry (basic auth), for urllib callers."""
        import base64

        if not self.username:
            return {}
        token = base64.b64encode(f"{self.username}:{self.password.value}".encode()).decode()
        return {"Authorization": f"Basic {token}"}

    def ssl_context(self) -> ssl.SSLContext | None:
        return ssl.create_default_context(cafile=self.ca) if self.ca else None


@dataclass(frozen=True)
class Security:
    """All of a process's security settings."""

    kafka: KafkaSecurity = KafkaSecurity()
    redis: RedisSecurity = RedisSecurity()
    registry: RegistrySecurity = RegistrySecurity()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Security":
        env = os.environ if env is None else env
        return cls(KafkaSecurity.from_env(env), RedisSecurity.from_env(env), RegistrySecurity.from_env(env))

    def to_env(self) -> dict[str, str]:
        """The ``KVBUS_*`` variables that give a child process these settings; a secret read from a
        file is passed as its ``*_FILE`` path."""
        return {**self.kafka.to_env(), **self.redis.to_env(), **self.registry.to_env()}


SETTINGS: tuple[Setting, ...] = (KAFKA_PROTOCOL, KAFKA_MECHANISM, KAFKA_USERNAME, KAFKA_PASSWORD, KAFKA_CA, KAFKA_CERT,
                                 KAFKA_KEY, KAFKA_PROPERTIES, *RedisSecurity.SETTINGS, *RegistrySecurity.SETTINGS)
"""Every security setting, in the order docs/configuration.md lists them."""


def _env(plain: dict[str, str], secret: Setting, value: Secret) -> dict[str, str]:
    out = {k: v for k, v in plain.items() if v}
    if value.file:
        out[f"{secret.variable}_FILE"] = value.file
    elif value.value:
        out[secret.variable] = value.value
    return out


def redact_url(url: str) -> str:
    """``url`` with any password in it replaced by ``***`` (``redis://user:***@host:6379/0``): what
    logs and screens may show. Works for URLs with several hosts (``redis+cluster://u:p@h1:1,h2:2``)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    userinfo, at, hosts = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{hosts}"


def kafka_security_hint(err: Any, client: "KafkaSecurity | Mapping[str, Any]") -> str | None:
    """What to fix when ``err`` (a confluent-kafka ``KafkaError``, or any error whose text it is) is
    Kafka refusing this process's credentials, rights or protocol: a sentence naming the
    ``KVBUS_KAFKA_*`` settings; None for any other error. ``client``: the process's Kafka security,
    or the librdkafka configuration it built from it."""
    from confluent_kafka import KafkaError

    if isinstance(client, KafkaSecurity):
        client = client.librdkafka()
    user, mechanism = client.get("sasl.username", ""), client.get("sasl.mechanism", "no SASL")
    protocol = client.get("security.protocol", "PLAINTEXT")
    code = err.code() if hasattr(err, "code") else None
    text = str(err)
    who = f"user {user!r}" if user else "this client (no SASL user: KVBUS_KAFKA_SASL_USERNAME unset)"
    if code in (KafkaError._AUTHENTICATION, KafkaError.SASL_AUTHENTICATION_FAILED) or "Authentication failed" in text:
        return (f"Kafka refused the credentials of {who} ({mechanism}): check "
                "KVBUS_KAFKA_SASL_USERNAME and KVBUS_KAFKA_SASL_PASSWORD / KVBUS_KAFKA_SASL_PASSWORD_FILE")
    if code in (KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.GROUP_AUTHORIZATION_FAILED,
                KafkaError.CLUSTER_AUTHORIZATION_FAILED, KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED) \
            or "Authorization failed" in text or "not authorized" in text.lower():
        return (f"Kafka's ACLs do not allow {who} this: run this stage as the principal that has the right "
                "(KVBUS_KAFKA_SASL_USERNAME; docs/security.md), or grant it")
    if code == KafkaError._SSL or "SSL handshake failed" in text or "certificate verify failed" in text:
        return ("the TLS handshake with Kafka failed: check KVBUS_KAFKA_SSL_CA (the CA that signed the brokers' "
                f"certificates) and KVBUS_KAFKA_SECURITY_PROTOCOL (now {protocol})")
    if "security.protocol" in text or "SSL listener" in text \
            or (protocol == "PLAINTEXT" and "in state APIVERSION_QUERY" in text):  # a TLS/SASL listener hangs up
        return f"the broker speaks another protocol: check KVBUS_KAFKA_SECURITY_PROTOCOL (now {protocol})"
    return None


def describe_kafka_error(err: Any, client: "KafkaSecurity | Mapping[str, Any]") -> str:
    """``err``'s text, followed by what to fix when it is a security refusal (:func:`kafka_security_hint`)."""
    return kafka_error_report(err, client)[1]


def kafka_error_report(err: Any, client: "KafkaSecurity | Mapping[str, Any]") -> tuple[int, str]:
    """How a client-level Kafka error is logged: (``logging.ERROR`` for a security refusal, which no
    retry fixes, else ``logging.WARNING``; :func:`describe_kafka_error`'s text)."""
    import logging

    hint = kafka_security_hint(err, client)
    return (logging.ERROR, f"{err} -- {hint}") if hint else (logging.WARNING, str(err))


def redis_security_hint(err: BaseException, sec: RedisSecurity) -> str | None:
    """What to fix when ``err`` (a redis-py error) is Redis refusing this process's credentials,
    rights or protocol: a sentence naming the ``KVBUS_REDIS_*`` settings; None for other errors."""
    import redis

    who = f"user {sec.username!r}" if sec.username else "the URL's user (or 'default')"
    if isinstance(err, redis.AuthenticationError) or "WRONGPASS" in str(err) or "NOAUTH" in str(err):
        return (f"Redis refused the credentials of {who}: check KVBUS_REDIS_USERNAME and KVBUS_REDIS_PASSWORD / "
                "KVBUS_REDIS_PASSWORD_FILE (or the user:password in KVBUS_REDIS_URL)")
    if isinstance(err, redis.exceptions.NoPermissionError) or "NOPERM" in str(err):
        return (f"Redis's ACL does not allow {who} this: run this stage as the Redis user that has the right "
                "(KVBUS_REDIS_USERNAME; docs/security.md)")
    text = str(err)
    if isinstance(err, redis.ConnectionError) and ("SSL" in text or "ssl" in text or "Connection reset" in text
                                                  or "Connection closed by server" in text):
        return ("the connection to Redis failed at the TLS layer or was closed: a rediss:// URL for a TLS port, "
                "redis:// for a plain one (KVBUS_REDIS_URL), and KVBUS_REDIS_SSL_CA for the server's CA")
    return None


class SecurityRefused(RuntimeError):
    """A service refused this process's credentials, rights or protocol; the message says which
    ``KVBUS_*`` setting to fix. ``kvbus`` exits 2 with it."""


def registry_security_hint(err: BaseException, sec: RegistrySecurity) -> str | None:
    """What to fix when ``err`` (confluent-kafka's ``SchemaRegistryError`` or an HTTP error) is the
    registry refusing this process: 401 (credentials), 403 (rights); None for other errors."""
    status = getattr(err, "http_status_code", None) or getattr(err, "code", None)
    who = f"user {sec.username!r}" if sec.username else "anonymous requests (KVBUS_REGISTRY_USERNAME unset)"
    if status == 401:
        return (f"the schema registry refused the credentials of {who}: check KVBUS_REGISTRY_USERNAME and "
                "KVBUS_REGISTRY_PASSWORD / KVBUS_REGISTRY_PASSWORD_FILE")
    if status == 403:
        return (f"the schema registry does not let {who} register schemas (a write role is needed): run this "
                "stage as its own principal (KVBUS_REGISTRY_USERNAME; docs/security.md)")
    return None


def check_kafka_access(conf: Mapping[str, Any], timeout: float = 15.0) -> None:
    """Connect to Kafka with the client configuration ``conf`` (``Settings.kafka()``) and ask for
    the cluster's metadata; raises :class:`SecurityRefused` naming the setting to fix if Kafka
    refuses the credentials or the protocol. Other failures (Kafka down) are left to the caller's
    own retries. For a process whose client library would fail with a bare traceback (aiokafka)."""
    import logging

    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    refused: list[str] = []

    def note(err: Any) -> None:  # an error (error_cb) or a librdkafka log line (some refusals are only logged)
        hint = kafka_security_hint(err, conf)
        if hint and not refused:
            refused.append(f"{err} -- {hint}")

    class Capture(logging.Logger):
        def handle(self, record: logging.LogRecord) -> None:
            note(record.getMessage())

    admin = AdminClient({**conf, "error_cb": note, "logger": Capture("kvbus.kafka-check")})
    deadline = time.monotonic() + timeout
    while True:
        try:
            admin.list_topics(timeout=1.0)
            return
        except KafkaException:
            pass
        admin.poll(0.1)  # serves error_cb and the log lines
        if refused:
            raise SecurityRefused(refused[0])
        if time.monotonic() > deadline:
            return  # not a refusal we can name (Kafka down?): the caller's own retries report it
