"""The routing policy (:func:`choose`: prefix reuse against load) and the routing rule the router
adapters share (production-stack's :mod:`kvbus.client.production_stack`,
Ray Serve's :mod:`kvbus.client.ray_serve`): which candidate replicas hold the longest prefix of a
prompt, or why the view cannot say (then the adapter routes by load).

:class:`PrefixRule` hashes a prompt's token ids as the engines do, asks the view among the candidates
(tied holders ordered by the caller's tie-break), and answers a :class:`Verdict`: :data:`PREFIX` when
the best holder holds at least ``min_matched_blocks`` leading blocks, else the reason the request goes
by load. A view that is rebuilding, missing, unreachable or of another layout never raises here: the
router keeps routing whatever Redis does, and the rule logs once when it stops and starts answering.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import redis
from redis.exceptions import RedisClusterException

from kvbus.schemas.hashing import LoRA
from kvbus.schemas.lookup import HolderMatch, LayoutMismatch, ViewStatus
from kvbus.sinks.view.reader import FunctionsMissing, ViewClient, WeightsLike, as_weights, chain_of
from kvbus.sinks.view.ties import Shuffle, TieBreak

log = logging.getLogger("kvbus.client.routing")

PREFIX, COLD, NO_TOKENS, UNHASHABLE, NOT_READY, VIEW_ERROR = (
    "prefix", "cold", "no_tokens", "unhashable", "not_ready", "view_error")
"""Why a request went where it went (:attr:`Verdict.reason`): ``prefix``, to the holder of the
longest prefix; else by load because ``cold``, no candidate holds ``min_matched_blocks`` blocks;
``no_tokens``, the request has no token ids and no tokenizer gave any; ``unhashable``, its token ids
cannot be hashed as the engines do (a LoRA adapter whose path is unknown, a malformed cache salt);
``not_ready``, the view is rebuilding or missing; ``view_error``, the view could not be read (Redis
unreachable or timing out, functions not loaded, another layout)."""

DEFAULT_BETA = 0.5
"""The weight of load against reuse in :func:`choose` (docs/routing.md says how it was chosen)."""


def score(matched: int, prompt_blocks: int, load: float, max_load: float, beta: float = DEFAULT_BETA) -> float:
    """A replica's score for a request: the share of the prompt's blocks it holds, less ``beta`` times its
    relative load (its load over the most loaded candidate's; 0 when none is loaded):
    ``matched / prompt_blocks - beta * load / max_load``, as production-stack's KV-aware router weighs them."""
    reuse = matched / prompt_blocks if prompt_blocks > 0 else 0.0
    return reuse - beta * (load / max_load if max_load > 0 else 0.0)


def choose(prompt_blocks: int, matched: Mapping[str, int], load: Mapping[str, float], order: Sequence[str],
           beta: float = DEFAULT_BETA) -> str:
    """The replica for a request among ``order`` (the candidates, in the tie-break's order): the best
    :func:`score`, then the longer prefix, then the lower load, then the first in ``order``.
    ``prompt_blocks``: the prompt's full blocks; ``matched``: replica -> leading blocks it holds (absent: 0);
    ``load``: replica -> its load (in-flight requests, or prompt tokens; absent: 0)."""
    if not order:
        raise ValueError("choose needs at least one candidate")
    top = max((load.get(n, 0.0) for n in order), default=0.0)
    rank = {n: i for i, n in enumerate(order)}
    return max(order, key=lambda n: (score(matched.get(n, 0), prompt_blocks, load.get(n, 0.0), top, beta),
                                     matched.get(n, 0), -load.get(n, 0.0), -rank[n]))


VIEW_ERRORS = (redis.RedisError, RedisClusterException, FunctionsMissing, LayoutMismatch)
"""What a failed read of the view raises; the router routes by load instead."""


def token_list(value: Any) -> list[int] | None:
    """``value`` if it is a non-empty list of token ids (ints, not bools), else None."""
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    return None


def prompt_tokens(body: Mapping[str, Any]) -> list[int] | None:
    """The token ids a request names itself: its ``prompt`` when that is a list of token ids (the
    OpenAI completions API's token form), or a list holding one such list. None otherwise (text
    prompts, chat messages: a tokenizer's job)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    return token_list(prompt)


@dataclass(frozen=True)
class Verdict:
    """What the view says of one request among its candidates."""

    reason: str
    """:data:`PREFIX` when :attr:`matches` starts with a holder of at least ``min_matched_blocks``
    blocks; else why the request goes by load (:data:`COLD`, :data:`NO_TOKENS`, ...)."""
    matches: list[HolderMatch] = field(default_factory=list)
    """The candidates holding a prefix of the prompt, best first (empty unless the view answered)."""
    blocks: int = 0
    """The prompt's full blocks (0 when it could not be hashed): what :func:`choose` weighs matches against."""

    @property
    def best(self) -> list[HolderMatch]:
        """The holders tied for the longest prefix (by :attr:`HolderMatch.score`), in the tie-break's
        order; empty unless :attr:`reason` is :data:`PREFIX`."""
        if self.reason != PREFIX:
            return []
        return [m for m in self.matches if m.score == self.matches[0].score]


class PrefixRule:
    """The longest-prefix rule over kvbus's view, as the router adapters use it.

    ``view``: a :class:`~kvbus.client.ViewClient` (give it a short ``socket_timeout``: a lookup is one
    Redis round trip on the router's event loop, and a timeout routes by load). How the engines hash
    prompts: ``block_size`` (their ``--block-size``), ``algo`` (``--prefix-caching-hash-algo``),
    ``hash_seed`` (their ``PYTHONHASHSEED``; None: this process's, else vLLM's default),
    ``engine_version`` (their vLLM release where it hashes differently); all checked here
    (ValueError or :class:`~kvbus.schemas.hashing.UnmatchableSeed`). ``min_matched_blocks``: the
    fewest leading blocks a holder must hold to be routed to by prefix. ``weights``: the lookup's tier
    weights. ``status_every``: seconds a read of the view's status is trusted (0: read it for every
    request). ``tie_seed``: seeds :attr:`shuffle` (None: from the OS). ``logger``: where the rule says
when routing by prefix stops and starts again (the adapter's own).

    :attr:`decisions` counts the verdicts per reason.
    """

    def __init__(self, view: ViewClient, *, block_size: int = 16, algo: str = "sha256", hash_seed: str | None = None,
                 engine_version: str | None = None, min_matched_blocks: int = 1, weights: WeightsLike | None = None,
                 status_every: float = 1.0, tie_seed: int | str | None = None, logger: logging.Logger = log):
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if min_matched_blocks < 1:
            raise ValueError(f"min_matched_blocks must be at least 1, got {min_matched_blocks}")
        chain_of([0] * block_size, None, block_size, algo, hash_seed, engine_version=engine_version)
        self.view = view
        self.block_size, self.algo, self.hash_seed, self.engine_version = block_size, algo, hash_seed, engine_version
        self.min_matched_blocks = min_matched_blocks
        self.weights = as_weights(weights)
        self.status_every = status_every
        self.shuffle = Shuffle(tie_seed)
        """Random order for equal loads and tied holders."""
        self.decisions: Counter[str] = Counter()
        self._status: ViewStatus | None = None
        self._status_at = float("-inf")
        self._degraded: str | None = None
        self._log = logger

    def judge(self, tokens: Sequence[int] | None, candidates: Sequence[str], *, lora: LoRA | None = None,
              cache_salt: str | None = None, model: str | None = None, tie_break: TieBreak | None = None) -> Verdict:
        """What the view says of a prompt of ``tokens`` (None: the request has none) among the replicas
        named ``candidates``; ``tie_break`` orders tied holders (default: :attr:`shuffle`)."""
        if tokens is None:
            return self._note(Verdict(NO_TOKENS))
        try:
            chain = chain_of(tokens, None, self.block_size, self.algo, self.hash_seed, lora=lora,
                             cache_salt=cache_salt if cache_salt != "" else None, engine_version=self.engine_version)
        except ValueError as e:
            self._log.debug("request not hashable as the engines hash it (%s): routing by load", e)
            return self._note(Verdict(UNHASHABLE))
        if len(chain) < self.min_matched_blocks:
            return self._note(Verdict(COLD, blocks=len(chain)))
        try:
            if not self._ready():
                return self._note(Verdict(NOT_READY, blocks=len(chain)))
            matches = self.view.lookup(hashes=chain, weights=self.weights, candidates=list(candidates), model=model,
                                       tie_break=tie_break or self.shuffle)
        except VIEW_ERRORS as e:
            self._degrade(VIEW_ERROR, f"the view could not be read ({type(e).__name__}: {e})")
            return self._note(Verdict(VIEW_ERROR, blocks=len(chain)))
        self._recover()
        if matches and matches[0].matched >= self.min_matched_blocks:
            return self._note(Verdict(PREFIX, matches, len(chain)))
        return self._note(Verdict(COLD, matches, len(chain)))

    def _note(self, verdict: Verdict) -> Verdict:
        self.decisions[verdict.reason] += 1
        return verdict

    def _ready(self) -> bool:
        """Whether the view's answers are complete, from a status read at most ``status_every`` s ago."""
        now = time.monotonic()
        if self._status is None or now - self._status_at >= self.status_every:
            self._status, self._status_at = self.view.status(), now
        if not self._status.ready:
            self._degrade(NOT_READY, f"the view is {self._status.state}")
        return self._status.ready

    def _degrade(self, reason: str, why: str) -> None:
        """Log once when routing by prefix stops, and why."""
        if self._degraded != reason:
            self._log.warning("%s: routing by load until it is back", why)
            self._degraded = reason

    def _recover(self) -> None:
        if self._degraded is not None:
            self._log.info("the view answers again: routing by prefix")
            self._degraded = None
