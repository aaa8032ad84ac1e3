"""The security settings every process reads (runtime/security.py): each client library's
configuration from ``KVBUS_*`` variables, secrets from files and never in a repr or a child's
environment when they came from a file, and clear errors naming the variable to fix."""
from __future__ import annotations

import ssl

import faust
import pytest

from kvbus.runtime.env import SettingError
from kvbus.runtime.security import KafkaSecurity, Security, redact_url
from kvbus.runtime.settings import KAFKA_LOGGER, Settings


@pytest.fixture
def secrets(tmp_path):
    pw = tmp_path / "kafka.pw"
    pw.write_text("s3cret-kafka\n")
    props = tmp_path / "client.properties"
    props.write_text("# extra librdkafka settings\nsocket.keepalive.enable=true\n\nsasl.mechanism = SCRAM-SHA-256\n")
    ca = tmp_path / "ca.pem"
    ca.write_text("not parsed here")
    return {"pw": str(pw), "props": str(props), "ca": str(ca)}


def test_an_open_deployment_adds_nothing(monkeypatch):
    for k in list(__import__("os").environ):
        if k.startswith("KVBUS_"):
            monkeypatch.delenv(k)
    s = Settings.from_env()
    assert s.kafka() == {"bootstrap.servers": "127.0.0.1:9092", "logger": KAFKA_LOGGER}
    assert s.kafka(**{"group.id": "g"}) == {"bootstrap.servers": "127.0.0.1:9092", "logger": KAFKA_LOGGER,
                                            "group.id": "g"}
    assert s.redis_kwargs() == {} and s.security.registry.client_conf() == {}
    assert s.security.kafka.faust_credentials() is None
    assert s.security.to_env() == {}


def test_sasl_ssl_with_a_password_file(secrets):
    env = {"KVBUS_KAFKA_SECURITY_PROTOCOL": "sasl_ssl", "KVBUS_KAFKA_SASL_USERNAME": "sink",
           "KVBUS_KAFKA_SASL_PASSWORD_FILE": secrets["pw"], "KVBUS_KAFKA_SSL_CA": secrets["ca"],
           "KVBUS_KAFKA_PROPERTIES": secrets["props"]}
    sec = Security.from_env(env)
    assert sec.kafka.librdkafka() == {
        "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-256",  # the properties file has the last word
        "sasl.username": "sink", "sasl.password": "s3cret-kafka", "ssl.ca.location": secrets["ca"],
        "socket.keepalive.enable": "true"}
    assert "s3cret" not in repr(sec) and "s3cret" not in repr(Settings(security=sec))
    child = sec.to_env()
    assert child["KVBUS_KAFKA_SASL_PASSWORD_FILE"] == secrets["pw"]
    assert "s3cret-kafka" not in child.values(), "a secret read from a file travels as its path"
    assert Security.from_env(child) == sec


def test_faust_gets_the_same_credentials(secrets, tmp_path):
    import subprocess

    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=kvbus-test"], check=True, capture_output=True)
    sasl = KafkaSecurity.from_env({"KVBUS_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KVBUS_KAFKA_SASL_USERNAME": "streams",
                                   "KVBUS_KAFKA_SASL_PASSWORD": "pw", "KVBUS_KAFKA_SSL_CA": str(cert)})
    creds = sasl.faust_credentials()
    assert isinstance(creds, faust.SASLCredentials)
    assert (creds.username, creds.password, creds.mechanism.value, creds.protocol.value) == \
        ("streams", "pw", "SCRAM-SHA-512", "SASL_SSL")
    assert isinstance(creds.ssl_context, ssl.SSLContext)
    plain = KafkaSecurity.from_env({"KVBUS_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "KVBUS_KAFKA_SASL_USERNAME": "u",
                                    "KVBUS_KAFKA_SASL_PASSWORD": "p"}).faust_credentials()
    assert plain.protocol.value == "SASL_PLAINTEXT" and plain.ssl_context is None
    mtls = KafkaSecurity.from_env({"KVBUS_KAFKA_SECURITY_PROTOCOL": "SSL", "KVBUS_KAFKA_SSL_CA": str(cert),
                                   "KVBUS_KAFKA_SSL_CERT": str(cert), "KVBUS_KAFKA_SSL_KEY": str(key)})
    assert isinstance(mtls.faust_credentials(), faust.SSLCredentials)
    assert mtls.librdkafka()["ssl.certificate.location"] == str(cert)


@pytest.mark.parametrize("env, names", [
    ({"KVBUS_KAFKA_SECURITY_PROTOCOL": "TLS"}, "KVBUS_KAFKA_SECURITY_PROTOCOL"),
    ({"KVBUS_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KVBUS_KAFKA_SASL_USERNAME": "u"}, "KVBUS_KAFKA_SASL_PASSWORD"),
    ({"KVBUS_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KVBUS_KAFKA_SASL_USERNAME": "u", "KVBUS_KAFKA_SASL_PASSWORD": "p",
      "KVBUS_KAFKA_SASL_MECHANISM": "GSSAPI"}, "KVBUS_KAFKA_SASL_MECHANISM"),
    ({"KVBUS_KAFKA_SASL_PASSWORD_FILE": "/nonexistent/pw"}, "KVBUS_KAFKA_SASL_PASSWORD_FILE"),
    ({"KVBUS_KAFKA_SSL_CA": "/nonexistent/ca.pem"}, "KVBUS_KAFKA_SSL_CA"),
    ({"KVBUS_REGISTRY_USERNAME": "reader"}, "KVBUS_REGISTRY_PASSWORD"),
])
def test_a_bad_setting_is_refused_naming_the_variable(env, names):
    with pytest.raises(SettingError, match=names):
        Security.from_env(env)


def test_redis_and_registry_credentials(secrets):
    env = {"KVBUS_REDIS_USERNAME": "router", "KVBUS_REDIS_PASSWORD": "r-pw", "KVBUS_REDIS_SSL_CA": secrets["ca"],
           "KVBUS_REGISTRY_USERNAME": "analytics", "KVBUS_REGISTRY_PASSWORD_FILE": secrets["pw"],
           "KVBUS_REGISTRY_SSL_CA": secrets["ca"]}
    sec = Security.from_env(env)
    assert sec.redis.client_kwargs("rediss://h:6380/0") == {"username": "router", "password": "r-pw",
                                                           "ssl_ca_certs": secrets["ca"]}
    assert "ssl_ca_certs" not in sec.redis.client_kwargs("redis://h:6379/0")
    assert sec.registry.client_conf() == {"basic.auth.user.info": "analytics:s3cret-kafka",
                                          "ssl.ca.location": secrets["ca"]}
    assert sec.registry.http_headers()["Authorization"].startswith("Basic ")
    assert "r-pw" not in repr(sec) and "s3cret" not in repr(sec)


def test_urls_are_redacted_for_logs():
    assert redact_url("redis://sink:pw@10.0.0.1:6379/0") == "redis://sink:***@10.0.0.1:6379/0"
    assert redact_url("redis+cluster://u:p@h1:7000,h2:7001/0") == "redis+cluster://u:***@h1:7000,h2:7001/0"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert redact_url("redis://user@h:1/0") == "redis://user@h:1/0"


def test_kafka_refusals_name_the_setting_to_fix():
    from confluent_kafka import KafkaError

    from kvbus.runtime.security import describe_kafka_error, kafka_security_hint

    sasl = KafkaSecurity(protocol="SASL_SSL", mechanism="SCRAM-SHA-512", username="bridge", password=__import__(
        "kvbus.runtime.security", fromlist=["Secret"]).Secret("pw"))
    assert "KVBUS_KAFKA_SASL_PASSWORD" in kafka_security_hint(KafkaError(KafkaError._AUTHENTICATION), sasl)
    denied = describe_kafka_error(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED), sasl.librdkafka())
    assert "user 'bridge'" in denied and "KVBUS_KAFKA_SASL_USERNAME" in denied and "pw" not in denied.split("--")[1]
    assert "KVBUS_KAFKA_SSL_CA" in kafka_security_hint(KafkaError(KafkaError._SSL), sasl)
    wrong = KafkaError(KafkaError._TRANSPORT,
                       "Disconnected while requesting ApiVersion: might be caused by "
                       "incorrect security.protocol configuration (connecting to a SSL listener?)")
    assert "KVBUS_KAFKA_SECURITY_PROTOCOL (now PLAINTEXT)" in kafka_security_hint(wrong, KafkaSecurity())
    assert kafka_security_hint(KafkaError(KafkaError._MSG_TIMED_OUT), sasl) is None


def test_registry_and_plaintext_refusals_name_the_setting():
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    from kvbus.runtime.security import RegistrySecurity, Secret, kafka_security_hint, registry_security_hint

    ro = RegistrySecurity("analytics", Secret("pw"))
    assert "KVBUS_REGISTRY_USERNAME" in registry_security_hint(SchemaRegistryError(403, 40301, "not authorized"), ro)
    assert "KVBUS_REGISTRY_PASSWORD" in registry_security_hint(SchemaRegistryError(401, 40101, "unauthorized"), ro)
    assert registry_security_hint(SchemaRegistryError(409, 409, "incompatible"), ro) is None
    hung_up = ("FAIL [rdkafka#producer-2] 127.0.0.1:9190/bootstrap: Disconnected: connection closed by peer: "
               "receive 0 after POLLIN (after 0ms in state APIVERSION_QUERY)")
    assert "KVBUS_KAFKA_SECURITY_PROTOCOL (now PLAINTEXT)" in kafka_security_hint(hung_up, KafkaSecurity())
    sasl = KafkaSecurity(protocol="SASL_SSL", mechanism="SCRAM-SHA-512", username="u", password=Secret("p"))
    assert kafka_security_hint(hung_up, sasl) is None, "a SASL_SSL client hung up on is not a protocol mismatch"
