"""A Ray Serve request router that routes by kvbus's view (``pip install 'kvbus[ray]'``; docs/client.md).

Ray Serve asks a deployment's request router, for every request, which of the deployment's replicas to
try (``RequestRouter.choose_replicas``: ranks of replicas, best first; within a rank Ray sends the
request to the replica with the shortest queue that accepts it). :class:`KvbusRequestRouter` answers:

1. the replicas holding the longest prefix of the request's prompt (the view's lookup among the
   candidates, :class:`~kvbus.client.routing.PrefixRule`), then every other candidate;
2. Ray's default otherwise (power of two choices: :class:`PowerOfTwoChoicesRequestRouter`): when no
   candidate holds ``min_matched_blocks`` blocks, when the request carries no token ids, when the view
   is rebuilding or missing, or when it cannot be read. Ray keeps routing whatever Redis does.

Which kvbus replica a Ray replica is (:func:`replica_name`): the name the replica reports in its routing
stats under :data:`REPLICA_STAT` (a deployment's ``record_routing_stats`` returning
``{"kvbus_replica": name}``), else its Ray replica id (``replica_id.unique_id``; inside the replica:
``serve.get_replica_context().replica_id.unique_id``), the name its engine's bridge or publisher
publishes under (``--replica``).

The prompt's token ids (:func:`request_tokens`): the call's ``request_token_ids`` keyword (Ray Serve
LLM's name for them) or ``prompt_token_ids``, else the ``prompt`` of its first argument that has one (an
OpenAI completions body as a dict or an object with a ``prompt`` attribute) when that is a list of
token ids.

Configured through Ray's ``RequestRouterConfig(request_router_class=KvbusRequestRouter,
request_router_kwargs={...})``: the keywords of :meth:`KvbusRequestRouter.initialize_state`.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Optional, Sequence

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica

from kvbus.client.routing import PREFIX, PrefixRule, prompt_tokens, token_list
from kvbus.schemas.lookup import DEFAULT_PREFIX
from kvbus.sinks.view.reader import ViewClient, WeightsLike

log = logging.getLogger("kvbus.client.ray_serve")

REPLICA_STAT = "kvbus_replica"
"""The routing-stats key under which a Ray replica may name the kvbus replica it is."""
TOKEN_KWARGS = ("request_token_ids", "prompt_token_ids")
"""Keyword arguments of a call read as the prompt's token ids, in this order."""


def replica_name(replica: RunningReplica) -> str:
    """The kvbus replica name of a Ray replica: its routing stats' :data:`REPLICA_STAT`, else its Ray
    replica id (``replica_id.unique_id``)."""
    named = (replica.routing_stats or {}).get(REPLICA_STAT)
    return named if isinstance(named, str) and named else replica.replica_id.unique_id


def request_tokens(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[int] | None:
    """The prompt's token ids of a call with ``args`` and ``kwargs`` (the module's rule), or None."""
    for name in TOKEN_KWARGS:
        tokens = token_list(kwargs.get(name))
        if tokens is not None:
            return tokens
    for arg in args:
        if isinstance(arg, Mapping):
            if "prompt" in arg:
                return prompt_tokens(arg)
        elif hasattr(arg, "prompt"):
            return prompt_tokens({"prompt": getattr(arg, "prompt")})
    return None


class KvbusRequestRouter(PowerOfTwoChoicesRequestRouter):
    """Ray Serve's request router by longest prefix through kvbus's view (the module's rules)."""

    rule: PrefixRule
    """The longest-prefix rule over the view; :attr:`PrefixRule.decisions` counts requests per reason."""
    model: Optional[str] = None

    def initialize_state(self, view_url: str | None = None, prefix: str = DEFAULT_PREFIX, block_size: int = 16,
                         algo: str = "sha256", hash_seed: str | None = None, engine_version: str | None = None,
                         model: str | None = None, min_matched_blocks: int = 1, weights: WeightsLike | None = None,
                         status_every: float = 1.0, socket_timeout: float = 0.05, **kwargs: Any) -> None:
        """Ray calls this once per router with ``request_router_kwargs``. ``view_url``: the view's Redis
        (``redis://`` or ``redis+cluster://``; default ``$KVBUS_REDIS_URL``, else the local one), ``prefix``
        its key prefix; ``socket_timeout``: seconds a lookup may take before the request goes Ray's way.
        ``model``: the served model name the engines' bridges publish (None: any). The hashing and
        ranking keywords are :class:`~kvbus.client.routing.PrefixRule`'s; any other keyword is Ray's."""
        super().initialize_state(**kwargs)
        url = view_url or os.environ.get("KVBUS_REDIS_URL") or "redis://127.0.0.1:6379/0"
        view = ViewClient(url, prefix, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout)
        self.rule = PrefixRule(view, block_size=block_size, algo=algo, hash_seed=hash_seed,
                               engine_version=engine_version, min_matched_blocks=min_matched_blocks, weights=weights,
                               status_every=status_every, logger=log)
        self.model = model

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> list[list[RunningReplica]]:
        """The holders of the longest prefix first, then the other candidates; Ray's power of two choices
        when the view cannot say."""
        tokens = request_tokens(pending_request.args, pending_request.kwargs) if pending_request else None
        by_name: dict[str, RunningReplica] = {}
        for replica in candidate_replicas:
            by_name.setdefault(replica_name(replica), replica)
        verdict = self.rule.judge(tokens, list(by_name), model=self.model)
        if verdict.reason != PREFIX:
            return await super().choose_replicas(candidate_replicas, pending_request)
        best = [by_name[m.replica] for m in verdict.best]
        rest = [r for r in candidate_replicas if all(r is not b for b in best)]
        return [best, rest] if rest else [best]
