"""Make tests/vectors/vllm_block_hashes.json by running vLLM's own block hashing from its PyPI wheels.

    python tests/vectors/make_vllm_vectors.py [--work DIR] [--out tests/vectors/vllm_block_hashes.json]

Not run by the tests (it downloads one wheel of about 340 MB per release in :data:`RELEASES`). For each
release: ``pip download vllm==V --no-deps`` into ``DIR/V`` (default: a temporary directory, outside the
repository), the wheel's sha256 noted, the few files it needs unpacked, the wheel deleted. Then vLLM's
``kv_cache_utils.py`` is imported with stub modules for its other vllm imports (see the JSON's "about"),
and each case runs vLLM's ``init_none_hash`` and ``get_request_block_hasher`` on a request stub. Needs
cbor2, xxhash and msgspec (the kvbus venv has them).
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path

ROOT = Path(tempfile.gettempdir()) / "kvbus-vllm-wheels"
HERE = Path(__file__).resolve().parent
RELEASES = ["0.10.2", "0.11.0", "0.11.1", "0.12.0", "0.13.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0",
            "0.32.0", "0.33.0"]
NEWEST = "0.33.0"

PROMPTS = {
    "A": list(range(1, 33)),
    "B": [(i * 7919 + 13) % 32000 for i in range(50)],
}


def fresh(text: str) -> str:
    """``text`` as a string object of its own, as an engine's parsed names and salts are (pickle refers
    back to a string object it met before in the same tuple; CPython shares only 1-character strings)."""
    return "".join(list(text))


LORAS = {
    "sql-v1": ("sql-adapter", "/adapters/sql-adapter/v1"),
    "sql-v2": ("sql-adapter", "/adapters/sql-adapter/v2"),   # the same name re-pointed at another path
    "long": ("Ünïcode-адаптер-" + "x" * 40, "/mnt/loras/" + "p" * 300),  # non-ASCII, > 255 UTF-8 bytes
    "tag-like": (fresh("lora"), fresh("cache_salt")),          # equal to the tags, not the same objects
    "one-char": ("a", "/"),                                      # shared objects: pickle refers back
}
SALTS = {"tenant-a": "tenant-a", "unicode": "tenant-ü-🙂", "long": "s" * 256, "tag-like": fresh("lora"),
         "one-char": "a"}


# ------------------------------------------------------------------ permissive stubs for vllm's other modules

class _StubMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub_class(name)

    def __or__(cls, other):
        return cls

    def __ror__(cls, other):
        return cls

    def __getitem__(cls, item):
        return cls

    def __iter__(cls):
        return iter(())


class _Stub(metaclass=_StubMeta):
    def __init__(self, *a, **k):
        pass

    def __call__(self, *a, **k):
        return a[0] if len(a) == 1 and callable(a[0]) and not k else _Stub()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub()


def _stub_class(name):
    return _StubMeta(name, (_Stub,), {})


class StubModule(types.ModuleType):
    def __init__(self, name):
        super().__init__(name)
        self.__path__ = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "init_logger":
            return logging.getLogger
        return _stub_class(name)


class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, real: dict[str, Path]):
        self.real = real

    def find_spec(self, name, path=None, target=None):
        if name != "vllm" and not name.startswith("vllm."):
            return None
        if name in self.real:
            return importlib.util.spec_from_file_location(name, self.real[name])
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        return StubModule(spec.name)

    def exec_module(self, module):
        pass


def extract_functions(path: Path, names: set[str]) -> dict:
    """vLLM's own functions ``names`` from a module too heavy to import (vllm/utils/__init__.py before
    vllm/utils/hashing.py existed), executed with the stdlib and cbor2."""
    tree = ast.parse(path.read_text())
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {n.name for n in body} == names, (path, names)
    ns: dict = {}
    exec("import hashlib, pickle, cbor2\nfrom typing import Any, Callable\n", ns)
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), ns)
    return ns


def load_release(version: str):
    """vLLM ``version``'s kv_cache_utils and hashing functions, freshly imported."""
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, Finder)]
    base = ROOT / version / "vllm"
    real = {"vllm.v1.core.kv_cache_utils": base / "v1/core/kv_cache_utils.py"}
    if (base / "utils/hashing.py").exists():
        real["vllm.utils.hashing"] = base / "utils/hashing.py"
    finder = Finder(real)
    sys.meta_path.insert(0, finder)
    import vllm  # a stub package
    envs = StubModule("vllm.envs")
    envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES = True
    sys.modules["vllm.envs"] = vllm.envs = envs
    utils = StubModule("vllm.utils")
    if "vllm.utils.hashing" not in real:
        names = {"sha256", "sha256_cbor", "get_hash_fn_by_name"}
        for k, v in extract_functions(base / "utils/__init__.py", names).items():
            setattr(utils, k, v)
    sys.modules["vllm.utils"] = vllm.utils = utils
    if "vllm.utils.hashing" in real:
        import vllm.utils.hashing as hashing  # noqa: PLR0402 (the stub package would answer a from-import)
        utils.hashing = hashing
        get_hash_fn_by_name = hashing.get_hash_fn_by_name
    else:
        get_hash_fn_by_name = utils.get_hash_fn_by_name
    import vllm.v1.core.kv_cache_utils as kcu
    probe = get_hash_fn_by_name("sha256")("probe")  # a stub in its place would answer anything
    assert isinstance(probe, bytes) and len(probe) == 32, f"vLLM {version}'s sha256 is not loaded: {probe!r}"
    return kcu, get_hash_fn_by_name


def lora_request(version: str, name: str, path: str):
    """vLLM's own LoRARequest where it imports (msgspec only), else an object with its attributes."""
    src = ROOT / version / "vllm/lora/request.py"
    try:
        spec = importlib.util.spec_from_file_location(f"_lora_{version}", src)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.LoRARequest(lora_name=name, lora_int_id=1, lora_path=path), "vllm.lora.request.LoRARequest"
    except Exception as e:  # noqa: BLE001
        return types.SimpleNamespace(lora_name=name, lora_int_id=1, lora_path=path), f"namespace ({e!r})"


def request(tokens, lora, salt):
    return types.SimpleNamespace(
        request_id="r", block_hashes=[], num_tokens=len(tokens), all_token_ids=list(tokens),
        prompt_token_ids=list(tokens), mm_features=[], mm_positions=[], mm_hashes=[], mm_inputs=[],
        lora_request=lora, cache_salt=salt, prompt_embeds=None, _prompt_embeds_per_block_hashes={},
        num_computed_tokens=0)


def jsonable(x):
    if isinstance(x, (tuple, list)):
        return [jsonable(v) for v in x]
    if isinstance(x, bytes):
        return {"bytes": x.hex()}
    return x


def run_case(kcu, get_hash_fn_by_name, algo, seed, tokens, bs, lora, salt):
    if seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = seed
    fn = get_hash_fn_by_name(algo)
    kcu.init_none_hash(fn)
    nh1 = kcu.NONE_HASH
    kcu.init_none_hash(fn)
    nh = kcu.NONE_HASH
    if nh1 != nh:
        return {"random_seed": True}
    seen = []
    real = kcu.generate_block_hash_extra_keys

    def recording(*a, **k):
        out = real(*a, **k)
        seen.append(out[0])
        return out

    kcu.generate_block_hash_extra_keys = recording
    try:
        digests = kcu.get_request_block_hasher(bs, fn)(request(tokens, lora, salt))
    finally:
        kcu.generate_block_hash_extra_keys = real
    out = {"random_seed": False, "none_hash": bytes(nh).hex(), "extra_keys": jsonable(seen),
           "digests": [bytes(d).hex() for d in digests],
           "hashes": [int.from_bytes(d, "big") & (2**64 - 1) for d in digests]}
    if hasattr(kcu, "to_event_extra_keys"):
        out["event_extra_keys"] = jsonable(kcu.to_event_extra_keys(seen))
    return out


WHEEL_FILES = ("vllm/v1/core/kv_cache_utils.py", "vllm/utils/hashing.py", "vllm/utils/__init__.py",
               "vllm/lora/request.py")


def unpack_release(version: str, d: Path | None = None, files: "tuple[str, ...] | None" = None) -> dict[str, str]:
    """Download vLLM ``version``'s wheel into ``d`` (default ROOT/version), unpack ``files`` (default
    WHEEL_FILES; a name the wheel lacks is skipped), delete the wheel; its name and sha256 (kept in
    ``d``/source.json, so a second run downloads nothing)."""
    d = d if d is not None else ROOT / version
    note = d / "source.json"
    if note.exists():
        return json.loads(note.read_text())
    d.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(d), f"vllm=={version}"],
                   check=True)
    (wheel,) = d.glob("vllm-*.whl")
    digest = hashlib.sha256()
    with wheel.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    with zipfile.ZipFile(wheel) as z:
        for name in files if files is not None else WHEEL_FILES:
            if name in z.namelist():
                z.extract(name, d)
    source = {"wheel": wheel.name, "sha256": digest.hexdigest()}
    wheel.unlink()
    note.write_text(json.dumps(source))
    return source


def main(out_path: str) -> None:
    sources = {v: unpack_release(v) for v in RELEASES}
    vectors = []
    facts = {}
    for version in RELEASES:
        kcu, get_hash_fn_by_name = load_release(version)
        algos = [a for a in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor") if _has(get_hash_fn_by_name, a)]
        lora_by_int_id = "lora_int_id" in (ROOT / version / "vllm/v1/core/kv_cache_utils.py").read_text().split(
            "def _gen_lora_extra_hash_keys")[1].split("\ndef ")[0]
        facts[version] = {"algos": algos, "lora_keyed_by_int_id": lora_by_int_id}
        cases = []  # (algo, seed, prompt, bs, lora id, salt id)
        for algo in algos:
            cases.append((algo, None, "A", 16, None, None))
            cases.append((algo, "0", "B", 16, None, None))
            cases.append((algo, "0", "B", 16, None, "tenant-a"))
            if not lora_by_int_id:
                cases += [(algo, "0", "B", 16, "sql-v1", None), (algo, "0", "B", 16, "sql-v2", None),
                          (algo, "0", "B", 16, "sql-v1", "tenant-a")]
            if version == NEWEST:
                cases.append((algo, None, "B", 16, None, None))
                for seed in ("0", "12345", ""):
                    cases += [(algo, seed, "A", 16, None, None), (algo, seed, "B", 8, None, None)]
                cases += [(algo, "12345", "B", 16, None, None), (algo, "12345", "B", 16, "sql-v2", "tenant-a"),
                          (algo, "0", "A", 16, None, "tenant-a"), (algo, "0", "B", 8, "sql-v1", "tenant-a"),
                          (algo, "0", "A", 16, "long", "unicode"), (algo, "0", "A", 16, None, "long"),
                          (algo, "0", "A", 16, "tag-like", "tag-like"), (algo, "0", "A", 16, "one-char", "one-char"),
                          (algo, None, "B", 16, "sql-v1", "tenant-a")]
        seen_cases = set()
        for algo, seed, prompt, bs, lora_id, salt_id in cases:
            if (algo, seed, prompt, bs, lora_id, salt_id) in seen_cases:
                continue
            seen_cases.add((algo, seed, prompt, bs, lora_id, salt_id))
            lora = None
            lora_json = None
            if lora_id:
                name, path = LORAS[lora_id]
                lora, facts[version]["lora_request"] = lora_request(version, name, path)
                lora_json = {"name": name, "path": path}
            salt = SALTS[salt_id] if salt_id else None
            res = run_case(kcu, get_hash_fn_by_name, algo, seed, PROMPTS[prompt], bs, lora, salt)
            vectors.append({"vllm": version, "algo": algo, "pythonhashseed": seed, "prompt": prompt,
                            "block_size": bs, "lora": lora_json, "cache_salt": salt, **res})
    import cbor2
    import xxhash
    doc = {
        "about": (
            "Block-hash vectors made by running vLLM's own hashing code, from the PyPI wheels named in "
            "'sources', outside this repository: each release's vllm/v1/core/kv_cache_utils.py (and "
            "vllm/utils/hashing.py, or for releases without it the sha256/sha256_cbor/get_hash_fn_by_name "
            "functions of vllm/utils/__init__.py) imported with stub modules for its other vllm imports "
            "(vllm.envs with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, a logger, empty config and KV-spec "
            "classes), and vLLM's own LoRARequest (vllm/lora/request.py) where it imports with msgspec "
            "alone. Per vector: PYTHONHASHSEED set as given (null: unset), init_none_hash(get_hash_fn_by_name"
            "(algo)) called twice (random_seed: the two NONE_HASHes differed, so no digests), then "
            "get_request_block_hasher(block_size, fn) run on a request stub (the prompt's tokens, no "
            "multimodal features, no prompt embeds, lora_request and cache_salt as given). extra_keys: what "
            "generate_block_hash_extra_keys returned per block (tuples as arrays); event_extra_keys: "
            "to_event_extra_keys of them (what KV events carry), where the release has it; digests: the "
            "block hashes (hex); hashes: the published ints (last 8 bytes of each digest, "
            "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)."),
        "made_with": {"python": sys.version.split()[0], "cbor2": cbor2.__version__ if hasattr(cbor2, "__version__")
                      else _dist_version("cbor2"), "xxhash": xxhash.VERSION},
        "sources": sources,
        "releases": facts,
        "prompts": PROMPTS,
        "vectors": vectors,
    }
    Path(out_path).write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"{len(vectors)} vectors from {len(RELEASES)} releases -> {out_path}")


def _dist_version(name):
    from importlib.metadata import version
    return version(name)


def _has(get_hash_fn_by_name, algo):
    try:
        get_hash_fn_by_name(algo)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=ROOT, help=f"where wheels are unpacked (default {ROOT})")
    ap.add_argument("--out", default=str(HERE / "vllm_block_hashes.json"))
    a = ap.parse_args()
    ROOT = a.work
    main(a.out)
