"""Governance of kvbus's schemas in a Confluent-compatible registry (Apicurio's ccompat API).

Subjects follow TopicNameStrategy: ``<topic>-value``. :func:`check` asks the
registry whether the schemas in ``schemas/avro`` are compatible with what it
holds (with the registry's reasons when not); :func:`register` registers them.
"""
from __future__ import annotations

import http.client
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

from kvbus.runtime.security import RegistrySecurity
from kvbus.schemas.avro import schema_str
from kvbus.schemas.topics import Topics


@dataclass
class CheckResult:
    """Outcome of one subject's compatibility check."""

    subject: str
    """Registry subject, ``<topic>-value``."""
    record: str
    """kvbus record kind whose schema was checked (EventBatch, BlockEvent, BlockEvents, Incomplete, DeadLetter)."""
    status: str
    """compatible, incompatible, new (subject not registered yet), or error."""
    messages: list[str] = field(default_factory=list)
    """The registry's reasons when incompatible, or the error."""


def subjects(topics: Topics, ownerships: list[str] | tuple[str, ...] = ()) -> dict[str, str]:
    """Subject -> record kind for every kvbus topic (tier topics for the given ownership values)."""
    out = {
        f"{topics.raw}-value": "EventBatch",
        f"{topics.blocks}-value": "BlockEvent",
        f"{topics.packed}-value": "BlockEvents",
        f"{topics.incomplete}-value": "Incomplete",
        f"{topics.dlq}-value": "DeadLetter",
        f"{topics.snapshots}-value": "ViewSnapshot",
    }
    for o in ownerships:
        out[f"{topics.for_ownership(o)}-value"] = "BlockEvent"
        out[f"{topics.for_ownership(o, packed=True)}-value"] = "BlockEvents"
    return out


#: Tries of one registry request before its transport error is raised: Apicurio now and then closes a
#: connection without an answer (docs/reading-topics.md), and answers its first writes after a start slowly.
REQUEST_TRIES = 3
#: Seconds one registry request may take before it is tried again.
REQUEST_TIMEOUT_S = 10.0
#: Seconds between tries of a registry request (doubling after each).
RETRY_WAIT_S = 0.5

_TRANSIENT = (http.client.RemoteDisconnected, ConnectionError, TimeoutError, urllib.error.URLError)
"""Transport errors after which a request is tried again: closed unanswered, reset, refused, timed out."""


def _request(url: str, method: str = "GET", body: dict | None = None,
             content_type: str = "application/vnd.schemaregistry.v1+json",
             security: RegistrySecurity | None = None) -> tuple[int, dict | list]:
    """One registry request, authenticated as ``security`` says (basic auth, TLS CA:
    ``kvbus.runtime.security``; None: the process's ``KVBUS_REGISTRY_*`` settings); (status, JSON body).

    Tried up to :data:`REQUEST_TRIES` times when the connection fails or closes unanswered. Every
    request this module makes may be repeated: reads, the compatibility setting, and registrations,
    which return the same id for the same schema. Hand-written on urllib rather than confluent's
    ``SchemaRegistryClient`` because :func:`check_schema` needs the reasons of the verbose
    compatibility check (that client returns only the verdict) and Apicurio's native dry run."""
    sec = security if security is not None else RegistrySecurity.from_env(os.environ)
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url, data=data, method=method,
        headers={"Content-Type": content_type, **sec.http_headers()},
    )
    for attempt in range(1, REQUEST_TRIES):
        try:
            return _send(req, security=sec)
        except _TRANSIENT:
            time.sleep(RETRY_WAIT_S * 2 ** (attempt - 1))
    return _send(req, security=sec)


def _send(req: urllib.request.Request, security: RegistrySecurity) -> tuple[int, dict | list]:
    """Send ``req`` once; (status, JSON body), the registry's error statuses included."""
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S, context=security.ssl_context()) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"message": raw.decode(errors="replace")}


def check_schema(registry_url: str, subject: str, schema: str,
                 security: RegistrySecurity | None = None) -> tuple[str, list[str]]:
    """Is ``schema`` (Avro JSON) compatible with the latest version of ``subject``?

    Returns (status, messages): ``compatible``, ``incompatible`` with the registry's
    reasons, ``new`` when the subject does not exist, or ``error``.
    """
    base = registry_url.rstrip("/")
    q = urllib.parse.quote(subject, safe="")
    # Apicurio answers "compatible" for a subject it does not have: ask for it first.
    status, _ = _request(f"{base}/subjects/{q}/versions", security=security)
    if status == 404:
        return "new", []
    status, body = _request(
        f"{base}/compatibility/subjects/{q}/versions/latest?verbose=true",
        "POST", {"schema": schema, "schemaType": "AVRO"}, security=security,
    )
    if status == 404:
        return "new", []
    if status != 200 or not isinstance(body, dict):
        return "error", [f"HTTP {status}: {body}"]
    if body.get("is_compatible"):
        return "compatible", []
    reasons = [str(m) for m in body.get("messages", [])] or _apicurio_reasons(registry_url, subject, schema, security)
    return "incompatible", reasons or ["(the registry gave no reason)"]


def _apicurio_reasons(registry_url: str, subject: str, schema: str,
                      security: RegistrySecurity | None = None) -> list[str]:
    """Apicurio's ccompat check gives no reasons; its native API's dry-run registration does."""
    base, sep, _ = registry_url.rstrip("/").rpartition("/apis/ccompat/")
    if not sep:
        return []
    q = urllib.parse.quote(subject, safe="")
    status, body = _request(
        f"{base}/apis/registry/v3/groups/default/artifacts/{q}/versions?dryRun=true", "POST",
        {"content": {"content": schema, "contentType": "application/json"}}, "application/json", security,
    )
    if status in (200, 201) or not isinstance(body, dict):
        return []
    return [body.get("title") or body.get("detail") or str(body)]


def register_schema(registry_url: str, subject: str, schema: str, security: RegistrySecurity | None = None) -> int:
    """Register ``schema`` under ``subject``; returns its id. Raises ValueError with the
    registry's message when it refuses (e.g. 409 incompatible)."""
    base = registry_url.rstrip("/")
    q = urllib.parse.quote(subject, safe="")
    status, body = _request(f"{base}/subjects/{q}/versions", "POST", {"schema": schema, "schemaType": "AVRO"},
                            security=security)
    if status != 200 or not isinstance(body, dict):
        raise ValueError(f"registry refused {subject} (HTTP {status}): {body}")
    return int(body["id"])


def check(registry_url: str, topics: Topics, ownerships: tuple[str, ...] = (),
          security: RegistrySecurity | None = None) -> list[CheckResult]:
    """Check every kvbus subject against the registry."""
    results = []
    for subject, record in subjects(topics, ownerships).items():
        status, messages = check_schema(registry_url, subject, schema_str(record), security)
        results.append(CheckResult(subject, record, status, messages))
    return results


#: Compatibility kvbus asks for on its own subjects: new and old readers must read
#: records of every registered version (fields are only added, with defaults).
KVBUS_COMPATIBILITY = "FULL_TRANSITIVE"


def set_compatibility(registry_url: str, subject: str, level: str = KVBUS_COMPATIBILITY,
                      security: RegistrySecurity | None = None) -> None:
    """Set ``subject``'s compatibility level (PUT /config/<subject>)."""
    base = registry_url.rstrip("/")
    q = urllib.parse.quote(subject, safe="")
    status, body = _request(f"{base}/config/{q}", "PUT", {"compatibility": level}, security=security)
    if status != 200:
        raise ValueError(f"registry refused compatibility {level} for {subject} (HTTP {status}): {body}")


def register(registry_url: str, topics: Topics, ownerships: tuple[str, ...] = (),
             security: RegistrySecurity | None = None) -> dict[str, int]:
    """Set every kvbus subject to FULL_TRANSITIVE and register its schema; returns subject -> id.
    ``security``: the registry credentials (None: the process's ``KVBUS_REGISTRY_*``)."""
    ids = {}
    for subject, record in subjects(topics, ownerships).items():
        set_compatibility(registry_url, subject, security=security)
        ids[subject] = register_schema(registry_url, subject, schema_str(record), security)
    return ids
