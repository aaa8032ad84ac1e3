"""The query API's requests and answers: the shape of Mooncake's conductor indexer API, which Dynamo's
standalone indexer follows, over :class:`kvbus.client.ViewClient` (docs/serve.md).

A request is decoded and checked here (:func:`parse`: a :class:`BadRequest` names the field), asked
of the view through one function (:func:`ask`), and its holders are folded into the answer
(:func:`answer`): keyed by tenant, then instance (kvbus's replica), each with ``longest_matched`` in
tokens, one count per medium (:func:`medium`), and ``DP`` (rank -> tokens).
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Mapping, Sequence

import msgspec
from msgspec import Meta

from kvbus.client import HolderMatch, Load, ViewClient
from kvbus.client.load import DEFAULT_LEASE
from kvbus.client.routing import DEFAULT_BETA, choose
from kvbus.schemas.hashing import LoRA, hash_rules
from kvbus.schemas.tiers import medium_of

DEFAULT_TENANT = "default"
"""The tenant of a request that names none (Mooncake's default)."""

MEDIA: dict[str, str] = {
    "GPU": "GPU",
    "CPU": "CPU",
    "CPU_PINNED": "CPU",
    "DISK": "DISK",
    "STORAGE": "DISK",
    "FS": "DISK",
}
"""kvbus medium (an event's ``medium``, upper-cased) -> the answer's medium: Mooncake's device pool
(``GPU``), host pool (``CPU``) and disk pool (``DISK``). Any other medium (``OBJ``, ``EXTERNAL``, an
engine's own) is answered under its own name."""
ANSWER_MEDIA = ("GPU", "CPU", "DISK")
"""Media every instance's answer lists, 0 when nothing is held there (more when held)."""

U64 = 1 << 64


@functools.cache
def medium(tier_label: str) -> str:
    """The answer's medium of a kvbus tier label (``GPU``, ``CPU@kvcr``, ``GPU/g1``, ``STORAGE``):
    :data:`MEDIA` of its medium, else the medium itself."""
    m = medium_of(tier_label)
    return MEDIA.get(m, m)


# ------------------------------------------------------------------------------------------ requests

Token = Annotated[int, Meta(ge=0)]
Hash = Annotated[int, Meta(ge=-(1 << 63))]  # and < 2**64, checked in parse (msgspec bounds stop at int64)


class _Common(msgspec.Struct, forbid_unknown_fields=True):
    """Fields of both endpoints (Mooncake's names; ``model_name`` is Dynamo's name of ``model``)."""

    model: str | None = None
    model_name: str | None = None
    lora_name: str | None = None
    tenant_id: str | None = None
    instance_id: str | None = None
    block_size: Annotated[int, Meta(ge=1)] | None = None
    cache_salt: str | None = None
    predicted: Annotated[float, Meta(ge=0)] | None = None


class TokensBody(_Common, forbid_unknown_fields=True):
    """``POST /query``."""

    token_ids: list[Token] | None = None


class PredictBody(_Common, forbid_unknown_fields=True):
    """``POST /predict``: a prompt (``token_ids`` or ``seq_hashes``) just routed to ``instance_id``, and the
    prediction's ``ttl`` in seconds."""

    token_ids: list[Token] | None = None
    seq_hashes: list[Hash] | None = None
    ttl: Annotated[float, Meta(gt=0)] | None = None


class RouteBody(_Common, forbid_unknown_fields=True):
    """``POST /route``: a prompt (``token_ids`` or ``seq_hashes``), the ``instances`` it may go to, and the
    routing policy's ``beta``."""

    token_ids: list[Token] | None = None
    seq_hashes: list[Hash] | None = None
    instances: list[str] | None = None
    beta: Annotated[float, Meta(ge=0)] | None = None


class HashesBody(_Common, forbid_unknown_fields=True):
    """``POST /query_by_hash``: ``seq_hashes``, or ``block_hash`` (Mooncake's earlier name) or
    ``block_hashes`` (Dynamo's)."""

    seq_hashes: list[Hash] | None = None
    block_hash: list[Hash] | None = None
    block_hashes: list[Hash] | None = None


class BadRequest(ValueError):
    """A request the API cannot answer (HTTP 400): ``field`` names the request field at fault (None:
    the body as a whole)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field

    def to_json(self) -> dict[str, Any]:
        """The 400 answer's body: ``{"error": message, "field": name or null}``."""
        return {"error": str(self), "field": self.field}


@dataclass(frozen=True)
class Hashing:
    """How the server hashes ``token_ids``: the engines' settings (``kvbus serve`` flags)."""

    algo: str = "sha256"
    """The engines' ``--prefix-caching-hash-algo``."""
    seed: str | None = None
    """Their ``PYTHONHASHSEED`` (None: this process's, else vLLM's default)."""
    engine_version: str | None = None
    """Their vLLM release where it hashes differently (None: the newest rules)."""
    lora_modules: Mapping[str, str] = field(default_factory=dict)
    """Adapter name -> the path the engines loaded it from (vLLM's ``--lora-modules NAME=PATH``)."""

    def lora(self, name: str | None) -> LoRA | None:
        """The adapter a request's ``lora_name`` names (None or "": the base model). BadRequest for a
        name the server was not given a path for, where the engines' release hashes the path."""
        if not name:
            return None
        rules = hash_rules(self.engine_version)
        if rules.lora_key == "int_id":
            raise BadRequest(f"vLLM {rules.release} hashes an adapter's blocks with the lora_int_id each engine "
                             "assigns itself, which no router can compute", "lora_name")
        path = self.lora_modules.get(name)
        if path is None:
            if rules.lora_key == "name":
                return LoRA(name)
            known = ", ".join(sorted(self.lora_modules)) or "none"
            raise BadRequest(f"unknown LoRA adapter {name!r}: the engines hash its path, and this server knows "
                             f"the paths of {known} (kvbus serve --lora-module NAME=PATH)", "lora_name")
        return LoRA(name, path)


@dataclass(frozen=True)
class Query:
    """A checked request: what is asked of the view and how the answer is keyed."""

    model: str
    """The model the request names."""
    tenant: str
    """The answer's top-level key."""
    block_size: int
    """Tokens per block: the hashing of ``tokens`` and the unit of every count in the answer."""
    tokens: list[int] | None = None
    """``/query``: the prompt's token ids (hashed by the client as the engines do)."""
    hashes: list[int] | None = None
    """``/query_by_hash``: the prompt's block hashes (rolling: each covers the prefix up to its block)."""
    lora: LoRA | None = None
    """The adapter (``/query``: hashed in; ``/query_by_hash``: checked only, the hashes carry it)."""
    cache_salt: str | None = None
    """The salt (``/query``: hashed in; ``/query_by_hash``: the hashes carry it)."""
    instance: str | None = None
    """Only this instance (a replica, or ``replica#rank``), None: all."""
    predicted: float | None = None
    """Count the view's predicted entries with this weight (None: not at all; docs/routing.md)."""


_AT = re.compile(r"at `\$\.([A-Za-z_]\w*)")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")
_DECODERS = {kind: msgspec.json.Decoder(kind) for kind in (TokensBody, HashesBody, PredictBody, RouteBody)}


def _decode(body: bytes, kind: type) -> Any:
    try:
        return _DECODERS[kind].decode(body)
    except msgspec.ValidationError as e:
        text = str(e)
        at = _UNKNOWN.search(text) or _AT.search(text)
        if _UNKNOWN.search(text):
            text += f" (this endpoint takes {', '.join(kind.__struct_fields__)})"
        raise BadRequest(text, at.group(1) if at else None) from None
    except msgspec.DecodeError as e:
        raise BadRequest(f"the body is not JSON: {e}") from None


def _one_of(body: Any, names: Sequence[str], required: bool = True) -> tuple[str | None, Any]:
    """The value of whichever of the alias fields ``names`` the body gives; BadRequest when several
    are given, or none while ``required``."""
    given = [n for n in names if getattr(body, n) is not None]
    if len(given) > 1:
        raise BadRequest(f"{' and '.join(given)} name the same thing: give one", given[1])
    if not given:
        if required:
            raise BadRequest(f"{names[0]} is required", names[0])
        return None, None
    return given[0], getattr(body, given[0])


def parse(body: bytes, by_hash: bool, hashing: Hashing) -> Query:
    """The :class:`Query` of a request body (JSON) to ``/query`` (``by_hash`` False) or
    ``/query_by_hash``; :class:`BadRequest` naming the field otherwise."""
    b = _decode(body, HashesBody if by_hash else TokensBody)
    _, model = _one_of(b, ("model", "model_name"))
    if not model:
        raise BadRequest("model must name the model", "model")
    if b.block_size is None:
        raise BadRequest("block_size is required", "block_size")
    if b.instance_id is not None and not b.instance_id:
        raise BadRequest("instance_id must name an instance, or be left out for all", "instance_id")
    common = dict(model=model, tenant=b.tenant_id if b.tenant_id is not None else DEFAULT_TENANT,
                  block_size=b.block_size, lora=hashing.lora(b.lora_name), cache_salt=b.cache_salt,
                  instance=b.instance_id, predicted=b.predicted)
    if not by_hash:
        _, tokens = _one_of(b, ("token_ids",))
        return Query(tokens=tokens, **common)
    name, hashes = _one_of(b, ("seq_hashes", "block_hash", "block_hashes"))
    if hashes and max(hashes) >= U64:
        i, h = next((i, h) for i, h in enumerate(hashes) if h >= U64)
        raise BadRequest(f"{name}[{i}] = {h} is not a 64-bit hash (at most 2**64 - 1)", name)
    return Query(hashes=hashes, **common)


# ------------------------------------------------------------------------------------------ the lookup

def ask(view: ViewClient, q: Query, hashing: Hashing) -> list[HolderMatch]:
    """The view's holders for ``q``, best first: the one call every request's lookup goes through.

    ``q.model`` reaches the view here, as ``lookup(model=...)``: only the holders whose bridges name
    that model answer (docs/client.md, "Models"). ValueError (the client's) for what cannot be hashed."""
    candidates = None if q.instance is None else [q.instance]
    if q.hashes is not None:
        return view.lookup(hashes=q.hashes, candidates=candidates, model=q.model, predicted=q.predicted)
    return view.lookup(tokens=q.tokens, block_size=q.block_size, algo=hashing.algo, seed=hashing.seed,
                       lora=q.lora, cache_salt=q.cache_salt, engine_version=hashing.engine_version,
                       candidates=candidates, model=q.model, predicted=q.predicted)


def predict(view: ViewClient, body: bytes, hashing: Hashing) -> int:
    """``POST /predict``: record the prompt's blocks as predicted on ``instance_id`` (a replica: its rank
    0, or ``replica#rank``) for ``ttl`` seconds (default the client's), for the request's model; the
    blocks recorded (0: the view does not know that holder yet). BadRequest naming the field otherwise."""
    b = _decode(body, PredictBody)
    _, model = _one_of(b, ("model", "model_name"))
    if not b.instance_id:
        raise BadRequest("instance_id must name the instance the request was routed to", "instance_id")
    name, prompt = _one_of(b, ("token_ids", "seq_hashes"))
    kw: dict[str, Any] = {"model": model or None}
    if b.ttl is not None:
        kw["ttl"] = b.ttl
    if name == "seq_hashes":
        if prompt and max(prompt) >= U64:
            raise BadRequest("seq_hashes holds a value that is not a 64-bit hash", name)
        return view.predict(b.instance_id, hashes=prompt, **kw)
    if b.block_size is None:
        raise BadRequest("block_size is required with token_ids", "block_size")
    return view.predict(b.instance_id, tokens=prompt, block_size=b.block_size, algo=hashing.algo, seed=hashing.seed,
                        lora=hashing.lora(b.lora_name), cache_salt=b.cache_salt,
                        engine_version=hashing.engine_version, **kw)


# ------------------------------------------------------------------------------------------ answers


def instance_answer(holders: Sequence[HolderMatch], block_size: int) -> dict[str, Any]:
    """One instance's answer from its holders (one per data-parallel rank), every count in tokens:
    ``longest_matched`` (the longest prefix any rank holds, on any medium), each medium's longest
    prefix held there by any rank (never more than that rank's ``matched``), and ``DP``: rank ->
    the prefix that rank holds."""
    blocks = dict.fromkeys(ANSWER_MEDIA, 0)
    for m in holders:
        for tier, n in m.tiers.items():
            name = medium(tier)
            n = min(n, m.matched)
            if n > blocks.get(name, 0):
                blocks[name] = n
    if len(blocks) > len(ANSWER_MEDIA):  # other media after the three, by name
        blocks = {k: blocks[k] for k in (*ANSWER_MEDIA, *sorted(blocks.keys() - set(ANSWER_MEDIA)))}
    out = {"longest_matched": max(m.matched for m in holders) * block_size}
    for name, n in blocks.items():
        out[name] = n * block_size
    ranks = holders if len(holders) == 1 else sorted(holders, key=_dp_rank)
    out["DP"] = {str(m.dp_rank): m.matched * block_size for m in ranks}
    return out


def _dp_rank(m: HolderMatch) -> int:
    return m.dp_rank


def answer(q: Query, holders: Sequence[HolderMatch]) -> dict[str, dict[str, dict[str, Any]]]:
    """``{tenant: {instance: instance_answer}}``; instances in the order of their best holder (the
    lookup's ranking: longest and best-scored first, ties by the client's tie-break); instances that
    hold no block of the prompt are left out."""
    by_instance: dict[str, list[HolderMatch]] = {}
    for m in holders:
        by_instance.setdefault(m.replica, []).append(m)
    return {q.tenant: {name: instance_answer(hs, q.block_size) for name, hs in by_instance.items()}}


def route(view: ViewClient, body: bytes, hashing: Hashing) -> dict[str, Any]:
    """``POST /route``: where the routing policy (:func:`kvbus.client.routing.choose`) sends the prompt among
    ``instances``, from one :meth:`~kvbus.client.ViewClient.lookup_with_load` (the prefix each instance
    holds, and every router's shared load): ``{"instance", "matched" (tokens), "prompt_blocks", "load":
    {instance: requests in flight}}``. BadRequest naming the field for anything else."""
    b = _decode(body, RouteBody)
    _, model = _one_of(b, ("model", "model_name"))
    if not b.instances or not all(b.instances):
        raise BadRequest("instances must name the instances the request may go to", "instances")
    if b.block_size is None:
        raise BadRequest("block_size is required", "block_size")
    name, prompt = _one_of(b, ("token_ids", "seq_hashes"))
    kw: dict[str, Any] = {"candidates": b.instances, "model": model or None, "predicted": b.predicted}
    if name == "seq_hashes":
        if prompt and max(prompt) >= U64:
            raise BadRequest("seq_hashes holds a value that is not a 64-bit hash", name)
        holders, loads = view.lookup_with_load(hashes=prompt, **kw)
        blocks = len(prompt)
    else:
        holders, loads = view.lookup_with_load(
            tokens=prompt, block_size=b.block_size, algo=hashing.algo, seed=hashing.seed,
            lora=hashing.lora(b.lora_name), cache_salt=b.cache_salt, engine_version=hashing.engine_version, **kw)
        blocks = len(prompt) // b.block_size
    matched: dict[str, int] = {}
    for m in holders:
        matched[m.replica] = max(matched.get(m.replica, 0), m.matched)
    load = {i: loads[i].requests if i in loads else 0 for i in b.instances}
    beta = DEFAULT_BETA if b.beta is None else b.beta
    chosen = choose(blocks, matched, load, b.instances, beta)
    return {"instance": chosen, "matched": matched.get(chosen, 0) * b.block_size, "prompt_blocks": blocks,
            "load": load}


def parse_report(body: bytes) -> tuple[str, dict[str, Load], float]:
    """``POST /load``'s body: (router, replica -> :class:`~kvbus.schemas.lookup.Load`, lease seconds, default
    :data:`kvbus.client.load.DEFAULT_LEASE`). :class:`BadRequest` for anything else."""
    try:
        doc = msgspec.json.decode(body or b"null")
    except msgspec.DecodeError as e:
        raise BadRequest(f"the body is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise BadRequest("the body must be a JSON object")
    router, lease, raw = doc.get("router"), doc.get("lease", DEFAULT_LEASE), doc.get("load", {})
    if not isinstance(router, str) or not router or "\0" in router:
        raise BadRequest("router must be a non-empty string without NUL", "router")
    if isinstance(lease, bool) or not isinstance(lease, (int, float)) or lease <= 0:
        raise BadRequest("lease must be a positive number of seconds", "lease")
    if not isinstance(raw, dict):
        raise BadRequest('load must be {"<replica>": {"requests": n, "tokens": t}}', "load")
    loads = {}
    for replica, x in raw.items():
        counts = [x.get(k, 0) if isinstance(x, dict) else None for k in ("requests", "tokens")]
        if not replica or "\0" in replica or not all(type(n) is int and n >= 0 for n in counts):
            raise BadRequest(f"load of {replica!r}: requests and tokens must be integers >= 0", "load")
        loads[replica] = Load(*counts)
    return router, loads, float(lease)
