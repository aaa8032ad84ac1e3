"""A routing logic for vLLM production-stack's router that routes by kvbus's view (docs/client.md).

production-stack's router (the ``vllm_router`` package of the vllm-project/production-stack
repository, installed from that repository; PyPI's ``vllm-router`` is another project, a Rust
router with the same import name) asks its routing logic for every request::

    url = router.route_request(endpoints, engine_stats, request_stats, request)

``endpoints`` are the engines serving the request's model (``EndpointInfo``: ``url``, ``pod_name``,
``model_info``, ...), ``engine_stats`` and ``request_stats`` its two load dicts keyed by endpoint
URL (``EngineStats``: ``num_running_requests``, ``num_queuing_requests``, scraped from the engines;
``RequestStats``: ``in_prefill_requests``, ``in_decoding_requests``, ``qps``, counted by the router
itself), ``request`` the incoming Starlette request. :class:`KvbusRouter` answers:

1. the endpoint whose engine holds the longest prefix of the prompt, by the view's lookup among the
   given endpoints' replicas (:func:`endpoint_replica` maps each endpoint to the name its bridges
   publish under), tied holders least loaded first;
2. the least-loaded endpoint (:func:`endpoint_load`; equal loads in a random order) when no
   endpoint holds ``min_matched_blocks`` blocks of it, when the request carries no token ids and no
   tokenizer was given, when the view is not ready (a sink is rebuilding it, or it is missing), or
   when the view cannot be read. The router keeps routing whatever Redis does.

production-stack's types are imported only if it is installed: then :class:`KvbusRouter` is a
``RoutingInterface`` (and, as its routing logics are, one instance per process: its metaclass
keeps the first one made); without it the class has the same methods, for tests and other routers
of the same shape.
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence
from urllib.parse import urlsplit

from kvbus.client.routing import (  # noqa: F401  (the reasons and VIEW_ERRORS: this module's API since it had them)
    COLD,
    NO_TOKENS,
    NOT_READY,
    PREFIX,
    UNHASHABLE,
    VIEW_ERROR,
    VIEW_ERRORS,
    PrefixRule,
    Verdict,
    choose,
    prompt_tokens,
    token_list,
)
from kvbus.schemas.hashing import LoRA
from kvbus.sinks.view.reader import ViewClient, WeightsLike
from kvbus.sinks.view.ties import ByLoad

try:  # production-stack's router, when installed (not PyPI's vllm-router, which has no vllm_router.routers)
    from vllm_router.routers.routing_logic import RoutingInterface as _RoutingBase
except ImportError:
    _RoutingBase = object

if TYPE_CHECKING:
    from vllm_router.service_discovery import EndpointInfo
    from vllm_router.stats.engine_stats import EngineStats
    from vllm_router.stats.request_stats import RequestStats

log = logging.getLogger("kvbus.client.production_stack")

PRODUCTION_STACK = _RoutingBase is not object
"""Whether production-stack's router is installed (then :class:`KvbusRouter` is its ``RoutingInterface``)."""

Load = Callable[[str, Mapping[str, Any], Mapping[str, Any]], Any]
"""A load function: ``(endpoint url, engine_stats, request_stats)`` -> a sortable value, less is
less loaded (:func:`endpoint_load` by default)."""


# ----------------------------------------------------------------------------- endpoints


def endpoint_load(url: str, engine_stats: Mapping[str, Any], request_stats: Mapping[str, Any]) -> tuple:
    """An endpoint's load, compared as a tuple (less is less loaded):

    1. the requests this router has in flight to it (``RequestStats.in_prefill_requests +
       in_decoding_requests``: counted per request, so always current);
    2. the requests its engine runs and queues (``EngineStats.num_running_requests +
       num_queuing_requests``: scraped every few seconds, so they include other routers' traffic);
    3. its queries per second over the router's window (``RequestStats.qps``, the load
       production-stack's own logics fall back to).

    A value missing from the stats counts 0, as production-stack counts an endpoint without stats
    as idle."""
    rs, es = request_stats.get(url), engine_stats.get(url)
    in_flight = (getattr(rs, "in_prefill_requests", 0) or 0) + (getattr(rs, "in_decoding_requests", 0) or 0)
    engine = (getattr(es, "num_running_requests", 0) or 0) + (getattr(es, "num_queuing_requests", 0) or 0)
    return (in_flight, engine, getattr(rs, "qps", 0.0) or 0.0)


def endpoint_replica(endpoint: Any, names: Mapping[str, str] | None = None) -> str:
    """The replica name kvbus knows ``endpoint``'s engine by (its bridges' ``--replica``), by the first
    rule that gives one:

    1. ``names[url]``: a configured mapping (URLs without a trailing ``/``);
    2. the endpoint's ``pod_name``, which production-stack's Kubernetes service discovery sets (the
       example deployment starts its bridges with ``--replica $(POD_NAME)``);
    3. the URL's ``host:port`` (``http://10.0.0.5:8000`` -> ``10.0.0.5:8000``; the port defaults to
       80 or 443 by scheme): static service discovery's backends."""
    url = endpoint.url.rstrip("/")
    if names and url in names:
        return names[url]
    pod = getattr(endpoint, "pod_name", None)
    if pod:
        return pod
    parts = urlsplit(url)
    if not parts.hostname:
        raise ValueError(f"endpoint URL {endpoint.url!r} has no host: give its replica name in replica_urls")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{port}"


# ----------------------------------------------------------------------------- requests


def json_body(request: Any) -> dict:
    """The JSON body of a request: ``request`` itself if it is a dict, else the body a Starlette
    request holds once read (a Starlette request is a mapping too: of its ASGI scope).
    production-stack's request service awaits ``request.body()`` before it routes and calls
    ``route_request`` without the parsed body; Starlette keeps what it read in ``request._body``,
    the only place a synchronous routing logic can get it (read on purpose). A body that is not a
    JSON object (a multipart upload, nothing read yet) gives ``{}``."""
    if isinstance(request, dict):
        return request
    body = getattr(request, "_body", None)
    if not body:
        return {}
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


def request_lora(body: Mapping[str, Any], endpoints: Sequence[Any], paths: Mapping[str, str]) -> LoRA | None:
    """The LoRA adapter a request asks for, or None for a base model. ``body["model"]`` names an
    adapter when ``paths`` has it (adapter name -> the path the engines loaded it from), or when an
    endpoint's ``model_info`` (production-stack reads the engines' ``/v1/models``) lists it with a
    ``parent``: vLLM reports an adapter's path as its ``root`` (None then when it does not)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return None
    if model in paths:
        return LoRA(model, paths[model])
    for ep in endpoints:
        info = (getattr(ep, "model_info", None) or {}).get(model)
        if info is not None and getattr(info, "parent", None):
            return LoRA(model, getattr(info, "root", None) or "")
    return None


# ----------------------------------------------------------------------------- the routing logic


@dataclass(frozen=True)
class Decision:
    """Where one request goes and why."""

    url: str
    """The endpoint URL returned to production-stack."""
    reason: str
    """:data:`PREFIX` or why not (:data:`COLD`, :data:`NO_TOKENS`, :data:`UNHASHABLE`,
    :data:`NOT_READY`, :data:`VIEW_ERROR`)."""
    replica: str
    """The endpoint's replica name (:func:`endpoint_replica`)."""
    matched: int = 0
    """Leading blocks of the prompt the chosen replica holds (0 unless routed by prefix)."""


class KvbusRouter(_RoutingBase):
    """production-stack's ``RoutingInterface`` routing by longest prefix through kvbus's view.

    ``view``: a :class:`~kvbus.client.ViewClient` (give it a short ``socket_timeout``, e.g. 0.05 s:
    a lookup is one Redis round trip made on the router's event loop, and a timeout routes by
    load), or a URL to open one. How the engines hash prompts: ``block_size`` (their
    ``--block-size``), ``algo`` (``--prefix-caching-hash-algo``), ``hash_seed`` (their
    ``PYTHONHASHSEED``; None: this process's, else vLLM's default), ``engine_version`` (their vLLM
    release where it hashes differently). Every algorithm and seed is checked here: ValueError (or
    :class:`~kvbus.schemas.hashing.UnmatchableSeed`) for one the engines' hashes cannot be matched on.

    ``tokenizer``: called with a request's JSON body when it carries no token ids
    (:func:`prompt_tokens`), returns the token ids the engine will see (for chat requests, after
    the chat template) or None. ``replica_urls``: replica name -> endpoint URL, for endpoints whose
    name is not their pod name or host:port (:func:`endpoint_replica`). ``lora_paths``: adapter
    name -> the path the engines loaded it from, where the endpoints' ``model_info`` does not say
    (:func:`request_lora`). ``min_matched_blocks``: the fewest leading blocks a holder must hold to
    be routed to by prefix (else: by load). ``weights``: tier weights of the lookup
    (:data:`~kvbus.sinks.view.reader.WeightsLike`; checked here). ``load``: an endpoint's load (:data:`Load`; default
    :func:`endpoint_load`). ``status_every``: seconds a read of the view's status is trusted
    (0: read it for every request). ``tie_seed``: seeds the order of equal loads and tied holders
    (None: from the OS). ``beta``: weigh reuse against load with the routing policy
    (:func:`kvbus.client.routing.choose`: the share of the prompt a replica holds less ``beta`` times its
    relative load, the load being the first element of ``load``'s value: this router's requests in flight);
    None: the longest prefix first, load only among equal prefixes (docs/routing.md says when each fits).
    ``max_instance_failover_reroute_attempts``: production-stack's retries on
    other endpoints after a failed one (its request service reads this attribute).

    :attr:`decisions` counts the requests routed per reason (:data:`PREFIX`, ...).
    """

    def __init__(self, view: ViewClient | str, *, block_size: int = 16, algo: str = "sha256",
                 hash_seed: str | None = None, engine_version: str | None = None,
                 tokenizer: Callable[[dict], Sequence[int] | None] | None = None,
                 replica_urls: Mapping[str, str] | None = None, lora_paths: Mapping[str, str] | None = None,
                 min_matched_blocks: int = 1, weights: WeightsLike | None = None, load: Load | None = None,
                 status_every: float = 1.0, tie_seed: int | str | None = None, beta: float | None = None,
                 max_instance_failover_reroute_attempts: int = 0):
        if beta is not None and beta < 0:
            raise ValueError(f"beta must be at least 0, got {beta}")
        self.beta = beta
        self._owns_view = isinstance(view, str)
        self.rule = PrefixRule(ViewClient(view) if isinstance(view, str) else view, block_size=block_size, algo=algo,
                               hash_seed=hash_seed, engine_version=engine_version,
                               min_matched_blocks=min_matched_blocks, weights=weights, status_every=status_every,
                               tie_seed=tie_seed, logger=log)
        """The longest-prefix rule (:class:`~kvbus.client.routing.PrefixRule`): hashing, lookup, readiness."""
        self.view = self.rule.view
        self.tokenizer = tokenizer
        self._names = {url.rstrip("/"): name for name, url in (replica_urls or {}).items()}
        self.lora_paths = dict(lora_paths or {})
        self.load = load or endpoint_load
        self.max_instance_failover_reroute_attempts = max_instance_failover_reroute_attempts

    @property
    def decisions(self) -> Counter[str]:
        """Requests routed per reason (:data:`PREFIX`, ...)."""
        return self.rule.decisions

    @property
    def min_matched_blocks(self) -> int:
        """The fewest leading blocks a holder must hold to be routed to by prefix (settable)."""
        return self.rule.min_matched_blocks

    @min_matched_blocks.setter
    def min_matched_blocks(self, value: int) -> None:
        self.rule.min_matched_blocks = value

    @property
    def status_every(self) -> float:
        """Seconds a read of the view's status is trusted (settable)."""
        return self.rule.status_every

    @status_every.setter
    def status_every(self, value: float) -> None:
        self.rule.status_every = value

    # -- production-stack's interface --------------------------------------------

    def route_request(self, endpoints: list[EndpointInfo], engine_stats: dict[str, EngineStats],
                      request_stats: dict[str, RequestStats], request: Any,
                      request_json: Mapping[str, Any] | None = None) -> str:
        """The URL of the endpoint to send ``request`` to (:meth:`decide`). ``request``: the Starlette
        request whose body was read (:func:`json_body`), or the JSON body itself; ``request_json``:
        the parsed body, where the caller has it (production-stack passes it to its own asynchronous
        logics only)."""
        body = dict(request_json) if request_json is not None else json_body(request)
        return self.decide(endpoints, engine_stats, request_stats, body).url

    def extract_session_id(self, request: Any, request_json: Mapping[str, Any]) -> str | None:
        """None: this logic routes by prefix, not by session (production-stack logs what this returns)."""
        return None

    def close(self) -> None:
        """Close the view client if this router opened it (a URL was given)."""
        if self._owns_view:
            self.view.close()

    # -- the decision -------------------------------------------------------------

    def decide(self, endpoints: Sequence[Any], engine_stats: Mapping[str, Any], request_stats: Mapping[str, Any],
               body: Mapping[str, Any]) -> Decision:
        """Where a request with JSON ``body`` goes among ``endpoints`` (see the module's rules).
        ValueError when there is no endpoint, or two endpoints map to one replica name."""
        if not endpoints:
            raise ValueError("no endpoint to route to")
        urls: dict[str, str] = {}
        for ep in endpoints:
            name = endpoint_replica(ep, self._names)
            if name in urls and urls[name] != ep.url:
                raise ValueError(f"endpoints {urls[name]} and {ep.url} both map to replica {name!r}: "
                                 "give each its bridges' --replica name in replica_urls")
            urls[name] = ep.url
        loads = {url: self.load(url, engine_stats, request_stats) for url in urls.values()}
        tokens = prompt_tokens(body)
        if tokens is None and self.tokenizer is not None:
            tokens = token_list(list(self.tokenizer(dict(body)) or []))
        lora = request_lora(body, endpoints, self.lora_paths) if tokens is not None else None
        verdict = self.rule.judge(tokens, list(urls), lora=lora, cache_salt=body.get("cache_salt"),
                                  tie_break=ByLoad(lambda m: loads[urls[m.replica]], then=self.rule.shuffle))
        if self.beta is not None and verdict.reason in (PREFIX, COLD):
            return self._weigh(verdict, urls, loads)
        if verdict.reason == PREFIX:
            best = verdict.matches[0]
            return Decision(urls[best.replica], PREFIX, best.replica, best.matched)
        least = min(loads.values())
        name = self.rule.shuffle.rng.choice([n for n, u in urls.items() if loads[u] == least])
        return Decision(urls[name], verdict.reason, name)

    def _weigh(self, verdict: Verdict, urls: Mapping[str, str], loads: Mapping[str, Any]) -> Decision:
        """The replica :func:`~kvbus.client.routing.choose` picks with :attr:`beta`, candidates in a random order."""
        matched = {m.replica: m.matched for m in verdict.matches}
        numeric = {name: float(loads[u][0] if isinstance(loads[u], tuple) else loads[u]) for name, u in urls.items()}
        order = list(urls)
        self.rule.shuffle.rng.shuffle(order)
        name = choose(verdict.blocks, matched, numeric, order, self.beta)
        n = matched.get(name, 0)
        return Decision(urls[name], PREFIX if n >= self.rule.min_matched_blocks else verdict.reason, name, n)

    def __repr__(self) -> str:
        return f"KvbusRouter({self.view!r}, block_size={self.rule.block_size}, algo={self.rule.algo!r})"
