"""``kvbus lookup``: a router's question asked from the command line, through :class:`kvbus.client.ViewClient`.

    kvbus lookup (--hashes H1,H2,... | --tokens 1,2,3,... [--block-size 16]
                  [--algo sha256|sha256_cbor|xxhash|xxhash_cbor] [--hash-seed S]
                  [--lora-name NAME [--lora-path PATH]] [--cache-salt SALT] [--engine-version V])
                 [--replicas a,b#1] [--model NAME] [--weights GPU=1,CPU=0.8,STORAGE=0.5] [--prefix kvbus:] [--json]

It runs in the ``[client]`` install (redis, hiredis, xxhash, cbor2): nothing of Kafka, Faust or the writer.
"""
from __future__ import annotations

import argparse
import json
import sys

from kvbus.runtime.settings import Settings
from kvbus.schemas.events import canonical_hash
from kvbus.schemas.hashing import HASH_ALGOS, HASH_RELEASES, LoRA, first_release
from kvbus.schemas.lookup import DEFAULT_PREFIX, LOOKUP_OPTIONS, LayoutMismatch
from kvbus.sinks.view.reader import FunctionsMissing, ViewClient
from kvbus.sinks.view.ties import BY_NAME

U64 = 1 << 64
I64_MIN = -(1 << 63)


def parse_hash(text: str) -> bytes:
    """One block hash as its canonical 8 bytes: decimal uint64 (vLLM), negative decimal int64
    (SGLang) or ``0x`` hex (at most 16 digits). Raises ValueError otherwise."""
    s = text.strip()
    try:
        if s.lower().startswith("0x"):
            value = int(s, 16)
            if not 0 <= value < U64:
                raise ValueError
        else:
            value = int(s, 10)
            if not I64_MIN <= value < U64:
                raise ValueError
    except ValueError:
        raise ValueError(f"not a 64-bit block hash: {text!r} (decimal uint64, negative int64 or 0x-hex)") from None
    return canonical_hash(value)


def parse_hashes(text: str) -> list[bytes]:
    """Comma-separated hashes (see :func:`parse_hash`), chain order."""
    return [parse_hash(p) for p in text.split(",") if p.strip()]


def parse_tokens(text: str) -> list[int]:
    """Comma-separated token ids."""
    try:
        return [int(p) for p in text.split(",") if p.strip()]
    except ValueError as e:
        raise ValueError(f"token ids must be integers: {e}") from None


def lora_of(name: str | None, path: str | None) -> LoRA | None:
    """The adapter of ``--lora-name`` / ``--lora-path`` (None without a name); ValueError for a path
    without a name."""
    if name is None:
        if path is not None:
            raise ValueError("--lora-path needs --lora-name")
        return None
    return LoRA(name, path or "")


def add_lookup_args(p: argparse.ArgumentParser) -> None:
    """Options of ``kvbus lookup``."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hashes", help="comma-separated block hashes, block 0 first "
                                      "(decimal uint64, negative int64 or 0x-hex)")
    src.add_argument("--tokens", help="comma-separated prompt token ids (hashed as vLLM does)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block with --tokens (default 16)")
    p.add_argument("--algo", default="sha256", choices=sorted(HASH_ALGOS),
                   help="vLLM --prefix-caching-hash-algo with --tokens (default sha256)")
    p.add_argument("--hash-seed", default=None,
                   help="the engines' PYTHONHASHSEED with --tokens (default: this process's PYTHONHASHSEED, "
                        "else vLLM's default seed; required for xxhash and xxhash_cbor, whose seed vLLM "
                        "otherwise draws at random per process)")
    p.add_argument("--lora-name", default=None,
                   help="with --tokens: the request's LoRA adapter (vLLM lora_name; default: the base model)")
    p.add_argument("--lora-path", default=None,
                   help="with --lora-name: the path the engines loaded the adapter from (--lora-modules NAME=PATH), "
                        f"which vLLM hashes from {first_release(lora_key='name_path')} on")
    p.add_argument("--cache-salt", default=None, help="with --tokens: the request's cache_salt (default none)")
    p.add_argument("--engine-version", default=None,
                   help="with --tokens: the engines' vLLM release, e.g. 0.30.0, where it hashes differently "
                        f"(default: {HASH_RELEASES[-1].release} and later)")
    p.add_argument("--replicas", help="only these candidates: replica names or <replica>#<dp_rank>, comma-separated")
    for option in LOOKUP_OPTIONS:  # every option of the lookup protocol, as declared there
        p.add_argument(f"--{option.name.replace('_', '-')}", default=None, help=option.meaning)
    p.add_argument("--weights", help="tier weights NAME=W over the defaults GPU=1,CPU=0.8,STORAGE=0.5,*=0.5 "
                                     "(NAME: a medium or an ownership)")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="Redis key prefix of the view (default kvbus:)")
    p.add_argument("--json", action="store_true", help='print {"<replica>": {"matched": N, ...}, ...}')


TOKEN_KEYS = ("lora_name", "lora_path", "cache_salt", "engine_version")
"""``kvbus lookup`` options that change how --tokens are hashed (refused with --hashes)."""


def lookup_answer(args: argparse.Namespace, settings: Settings) -> dict[str, dict]:
    """The ``--json`` answer of ``kvbus lookup``: holders by display name, best first (tied holders
    by name), asked through :class:`kvbus.client.ViewClient`."""
    if args.hashes is not None:
        given = [f"--{k.replace('_', '-')}" for k in TOKEN_KEYS if getattr(args, k) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} apply to --tokens: --hashes are hashed already")
        source: dict = {"hashes": parse_hashes(args.hashes)}
    else:
        source = {"tokens": parse_tokens(args.tokens), "block_size": args.block_size, "algo": args.algo,
                  "seed": args.hash_seed, "lora": lora_of(args.lora_name, args.lora_path),
                  "cache_salt": args.cache_salt, "engine_version": args.engine_version}
    candidates = [c.strip() for c in (args.replicas or "").split(",") if c.strip()] or None
    with ViewClient(settings.redis_url, args.prefix, tie_break=BY_NAME, **settings.redis_kwargs()) as view:
        options = {o.name: getattr(args, o.name) for o in LOOKUP_OPTIONS}
        found = view.lookup(**source, weights=args.weights, candidates=candidates, **options)
        status = view.status()
    if not status.ready:
        print(f"kvbus lookup: warning: the view is {status.state} since {status.fields.get('since', '?')} "
              f"({status.fields.get('phase', 'no view yet')}): the answer may miss blocks", file=sys.stderr)
    return {m.name: m.to_json() for m in found}


def run_lookup(args: argparse.Namespace, settings: Settings) -> int:
    """Print which holders hold the longest prefix of a chain."""
    try:
        answer = lookup_answer(args, settings)
    except (ValueError, FunctionsMissing, LayoutMismatch) as e:
        print(f"kvbus lookup: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(answer))
        return 0
    if not answer:
        print("no replica holds block 0 of this chain")
        return 0
    print(f"{'replica':<28} {'matched':>7} {'score':>9}  tiers")
    for name, m in answer.items():
        tiers = " ".join(f"{t}={n}" for t, n in m["tiers"].items())
        print(f"{name:<28} {m['matched']:>7} {m['score']:>9.3f}  {tiers}")
    return 0
