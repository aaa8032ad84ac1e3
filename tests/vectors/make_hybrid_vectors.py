"""Make tests/vectors/vllm_hybrid_hits.json by running vLLM's own hybrid prefix-cache lookup from its PyPI wheel.

    python tests/vectors/make_hybrid_vectors.py [--work DIR] [--out tests/vectors/vllm_hybrid_hits.json]

Not run by the tests (it downloads vLLM's wheel, about 340 MB). ``pip download vllm==0.33.0 --no-deps``
into ``DIR`` (default: a temporary directory, outside the repository), the wheel's sha256 noted, the
files in :data:`WHEEL_FILES` unpacked, the wheel deleted. Those modules are imported for real (KV cache
specs, block pool, the single-type managers, the coordinator), everything else of vllm and torch as
stub modules (tests/vectors/make_vllm_vectors.py's). For each model shape of :data:`MODELS` and each
random pattern of cached blocks, vLLM's ``resolve_kv_cache_block_sizes`` gives the hash and scheduler
block sizes, a real ``HybridKVCacheCoordinator`` is built over a real ``BlockPool`` whose prefix cache
holds exactly the pattern (``_insert_block_hash`` per group and hash), and its
``find_longest_cache_hit`` and ``find_longest_cache_hit_per_group`` answer. What events would tell
kvbus of each group (``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``) comes from vLLM's own
``get_kv_cache_spec_kind`` / ``get_kv_cache_spec_sliding_window``. Needs only the kvbus venv.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import random
import sys
import tempfile
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))
from tests.vectors.make_vllm_vectors import Finder, StubModule, unpack_release  # noqa: E402

RELEASE = "0.33.0"
ROOT = Path(tempfile.gettempdir()) / "kvbus-vllm-hybrid"
WHEEL_FILES = {
    "vllm.utils.math_utils": "vllm/utils/math_utils.py",
    "vllm.v1.kv_cache_interface": "vllm/v1/kv_cache_interface.py",
    "vllm.v1.kv_cache_spec_registry": "vllm/v1/kv_cache_spec_registry.py",
    "vllm.v1.core.kv_cache_utils": "vllm/v1/core/kv_cache_utils.py",
    "vllm.v1.core.block_pool": "vllm/v1/core/block_pool.py",
    "vllm.v1.core.single_type_kv_cache_manager": "vllm/v1/core/single_type_kv_cache_manager.py",
    "vllm.v1.core.kv_cache_coordinator": "vllm/v1/core/kv_cache_coordinator.py",
}

# Model shapes: KV cache groups as (spec class, block size, window or chunk size). Every shape has a
# full-attention group of the hash block size first, like the models named (gpt-oss and Gemma 2/3:
# full + sliding window; Llama 4: full + chunked local; Jamba, Granite 4, Nemotron-H, Qwen3-Next:
# full + Mamba). "prefix_match_unit" sets vLLM's cache_config.prefix_match_unit (None: the default).
MODELS = {
    "full+sliding": [("full", 16, None), ("sliding", 16, 48)],
    "full+sliding-window-of-one-block": [("full", 16, None), ("sliding", 16, 16)],
    "full+3-sliding-groups": [("full", 16, None), ("sliding", 16, 64), ("sliding", 16, 64), ("sliding", 16, 64)],
    "full+two-windows": [("full", 16, None), ("sliding", 16, 64), ("sliding", 16, 32)],
    "full+sliding-of-larger-blocks": [("full", 16, None), ("sliding", 32, 96)],
    "full+mamba": [("full", 16, None), ("mamba", 16, None)],
    "full+mamba-of-larger-blocks": [("full", 16, None), ("mamba", 64, None)],
    "full+sliding+mamba": [("full", 16, None), ("sliding", 16, 48), ("mamba", 16, None)],
    "full+chunked-local": [("full", 16, None), ("chunked", 16, 512)],
    "full+chunked-local-of-short-chunks": [("full", 16, None), ("chunked", 16, 64)],
    "two-full": [("full", 16, None), ("mla", 16, None)],
}
CASES_PER_MODEL = 40


# ------------------------------------------------------------------ loading vLLM's modules

class _Logger:
    """What vllm.logger.init_logger returns, with vLLM's *_once methods."""

    def __init__(self, name: str):
        self._log = logging.getLogger(name)

    def __getattr__(self, name: str):
        return getattr(self._log, name.removesuffix("_once"))


def load(base: Path):
    """vLLM's KV cache modules from ``base`` (where the wheel was unpacked), freshly imported."""
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, Finder)]
    sys.meta_path.insert(0, Finder({m: base / p for m, p in WHEEL_FILES.items()}))
    sys.modules.setdefault("torch", StubModule("torch"))
    logger = StubModule("vllm.logger")
    logger.init_logger = _Logger
    sys.modules["vllm.logger"] = logger
    import vllm.v1.core.kv_cache_coordinator as kcc
    import vllm.v1.core.kv_cache_utils as kcu
    import vllm.v1.kv_cache_interface as kci
    return kci, kcu, kcc


def make_spec(kci, kind: str, bs: int, size: int | None):
    common = {"block_size": bs, "num_kv_heads": 1, "head_size": 8, "dtype": "float16"}
    if kind == "full":
        return kci.FullAttentionSpec(**common)
    if kind == "mla":
        return kci.MLAAttentionSpec(**common)
    if kind == "sliding":
        return kci.SlidingWindowSpec(**common, sliding_window=size)
    if kind == "chunked":
        return kci.ChunkedLocalAttentionSpec(**common, attention_chunk_size=size)
    if kind == "mamba":
        return kci.MambaSpec(block_size=bs, shapes=((1,),), dtypes=("float16",), mamba_cache_mode="align")
    raise ValueError(kind)


def block_sizes(kcu, cfg, bs: int, prefix_match_unit: int | None) -> tuple[int, int]:
    """vLLM's (scheduler_block_size, hash_block_size) for the groups of ``cfg``."""
    vllm_config = types.SimpleNamespace(
        cache_config=types.SimpleNamespace(block_size=bs, enable_prefix_caching=True,
                                           prefix_match_unit=prefix_match_unit),
        parallel_config=types.SimpleNamespace(decode_context_parallel_size=1), kv_transfer_config=None)
    return kcu.resolve_kv_cache_block_sizes(cfg, vllm_config)


# ------------------------------------------------------------------ patterns of cached blocks

def pattern(rng: random.Random, kind: str, s: int, n: int, fine: bool) -> list[int]:
    """Chain positions (0-based, hash block units) a group caches, for a chain of ``n`` hashes; a group of
    blocks ``s`` hash blocks long caches only positions ending its blocks, a Mamba group in fine-grained
    mode (partial entries) any position."""
    nb = n // s
    if kind in ("full", "mla"):
        run = rng.choice([nb, nb, rng.randint(0, nb)])
        blocks = set(range(run)) | {k for k in range(run + 1, nb) if rng.random() < 0.2}
    elif kind == "mamba":
        p = rng.choice([0.1, 0.3, 0.6])
        if fine:
            return sorted(j for j in range(n) if rng.random() < p / s)
        blocks = {k for k in range(nb) if rng.random() < p}
    else:  # sliding, chunked: runs with gaps (evicted blocks)
        blocks, on = set(), rng.random() < 0.5
        for k in range(nb):
            if rng.random() < 0.25:
                on = not on
            if on:
                blocks.add(k)
    return sorted((k + 1) * s - 1 for k in blocks)


def run_case(kci, kcu, kcc, model: list, held: list[list[int]], n: int, pmu: int | None):
    specs = [make_spec(kci, kind, bs, size) for kind, bs, size in model]
    groups = [kci.KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)]
    cfg = kci.KVCacheConfig(num_blocks=4096, kv_cache_tensors=[], kv_cache_groups=groups)
    scheduler_bs, hash_bs = block_sizes(kcu, cfg, model[0][1], pmu)
    co = kcc.HybridKVCacheCoordinator(cfg, 1 << 16, 1 << 16, False, True, False, 1, 1, scheduler_bs, hash_bs)
    pool = co.block_pool
    hashes = [kcu.BlockHash(hashlib.sha256(str(j).encode()).digest()) for j in range(n)]
    free = iter(range(1, pool.num_gpu_blocks))
    for gid, positions in enumerate(held):
        for j in positions:
            blk = pool.blocks[next(free)]
            pool._insert_block_hash(kcu.make_block_hash_with_group_id(hashes[j], gid), blk,
                                    num_tokens=(j + 1) * hash_bs)
    walked = 0  # the leading run of positions some group caches: what a kvbus lookup walks
    every = set().union(*map(set, held))
    while walked < n and walked in every:
        walked += 1
    _, hit, _ = co.find_longest_cache_hit(hashes, n * hash_bs)
    _, hit_walked, _ = co.find_longest_cache_hit(hashes, walked * hash_bs)
    _, per_group = co.find_longest_cache_hit_per_group(hashes, walked * hash_bs)
    events = [{"kv_cache_spec_kind": kci.get_kv_cache_spec_kind(spec).value,
               "kv_cache_spec_sliding_window": kci.get_kv_cache_spec_sliding_window(spec),
               "block_size": co.single_type_managers[i].block_size} for i, spec in enumerate(specs)]
    return {"hash_block_size": hash_bs, "scheduler_block_size": scheduler_bs,
            "cache_hit_alignment_tokens": co._cache_hit_alignment_tokens, "groups": events, "held": held,
            "n": n, "walked": walked, "hit_tokens": hit, "hit_tokens_walked": hit_walked,
            "per_group_tokens_walked": list(per_group)}


def unpack(work: Path) -> dict[str, str]:
    """vLLM's wheel unpacked into ``work`` (:data:`WHEEL_FILES` only): its name and sha256."""
    return unpack_release(RELEASE, work, tuple(WHEEL_FILES.values()))


def main(work: Path, out_path: str) -> None:
    source = unpack(work)
    kci, kcu, kcc = load(work)
    rng = random.Random(20)
    vectors = []
    for name, model in MODELS.items():
        unit = math.gcd(*(bs for _, bs, _ in model))
        fine = any(kind == "mamba" and bs > unit for kind, bs, _ in model)
        for case in range(CASES_PER_MODEL):
            n = rng.randint(1, 20) if case % 4 else rng.randint(20, 48)
            held = [pattern(rng, kind, bs // unit, n, fine) for kind, bs, _ in model]
            res = run_case(kci, kcu, kcc, model, held, n, None)
            assert res["hash_block_size"] == unit, (name, res["hash_block_size"])
            vectors.append({"model": name, **res})
    doc = {
        "about": (
            "Hybrid-model prefix-cache hits made by running vLLM " + RELEASE + "'s own code, from the PyPI wheel "
            "named in 'source', outside this repository (tests/vectors/make_hybrid_vectors.py): its KV cache specs, "
            "BlockPool, single-type managers and HybridKVCacheCoordinator imported for real, other vllm modules and "
            "torch as stubs. Per vector: the model's KV cache groups, each as the BlockStored events of vLLM would "
            "describe it (kv_cache_spec_kind and kv_cache_spec_sliding_window from get_kv_cache_spec_kind and "
            "get_kv_cache_spec_sliding_window, block_size the group manager's); hash_block_size and "
            "scheduler_block_size from resolve_kv_cache_block_sizes (prefix caching on, no prefix_match_unit); "
            "cache_hit_alignment_tokens from the coordinator; held: per group, the positions (0-based, in hash "
            "blocks) of the request's block hashes its prefix cache holds (what that group's BlockStored events "
            "published); n: hash blocks in the request; walked: the leading positions some group holds. "
            "hit_tokens: find_longest_cache_hit(block_hashes, n * hash_block_size)'s hit length; "
            "hit_tokens_walked: the same with max_cache_hit_length walked * hash_block_size; "
            "per_group_tokens_walked: find_longest_cache_hit_per_group(block_hashes, walked * hash_block_size)'s "
            "per-group hit lengths. No EAGLE, no DCP/PCP, no connector."),
        "vllm": RELEASE,
        "source": source,
        "models": {k: [list(g) for g in v] for k, v in MODELS.items()},
        "vectors": vectors,
    }
    Path(out_path).write_text(json.dumps(doc, indent=None, separators=(",", ":")) + "\n")
    print(f"{len(vectors)} vectors -> {out_path}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=ROOT, help=f"where the wheel is unpacked (default {ROOT})")
    ap.add_argument("--out", default=str(HERE / "vllm_hybrid_hits.json"))
    a = ap.parse_args()
    main(a.work, a.out)
