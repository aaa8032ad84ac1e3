"""A fresh virtual environment with only ``kvbus[client]`` (pip install from this checkout: redis,
hiredis, xxhash, cbor2, msgspec) answers lookups equal to ``kvbus lookup --json`` of the full
installation, through :class:`kvbus.client.ViewClient` and through its own ``kvbus lookup``, on a
single Redis and on a Redis Cluster; the pipeline's libraries are not there to import."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kvbus.infra.scratch_cluster import RedisClusterServer
from kvbus.infra.scratch_redis import RedisServer
from kvbus.sinks.view.redis_store import RedisStore
from kvbus.sinks.view.sharded_store import ShardedRedisStore
from tests.test_client import _client_kwargs, _kvbus_lookup_json
from tests.test_lookup_protocol import CASES, EMPTY_CASES, _records

ROOT = Path(__file__).resolve().parent.parent
PIPELINE_MODULES = ("confluent_kafka", "fastavro", "prometheus_client", "faust", "aiokafka", "zmq", "polars")

SCRIPT = """
import json, sys
from kvbus.client import BY_NAME, ViewClient
url, prefix, cases = sys.argv[1], sys.argv[2], json.loads(sys.stdin.read())
with ViewClient(url, prefix, tie_break=BY_NAME) as view:
    for kw in cases:
        print(json.dumps({m.name: m.to_json() for m in view.lookup(**kw)}))
"""


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory) -> Path:
    """``python -m venv`` + ``pip install '<checkout>[client]'`` (~20 s with pip's cache warm), from a
    copy of the checkout (pip builds in the source tree: its build/ would outlive deleted modules)."""
    tmp = tmp_path_factory.mktemp("client-venv")
    src, venv = tmp / "src", tmp / "venv"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", ".infra", "build", "*.egg-info",
                                                             "__pycache__", ".pytest_cache", ".hypothesis"))
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", f"{src}[client]"], check=True,
                   timeout=600, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    return venv


def _run(venv: Path, args: list[str], **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVBUS_", "PYTHON"))}
    return subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=venv, env={**env, **kw.pop("env", {})},
                          **kw)


def test_only_the_client_dependencies_are_installed(client_venv):
    py = str(client_venv / "bin" / "python")
    for mod in PIPELINE_MODULES:
        r = _run(client_venv, [py, "-c", f"import {mod}"])
        assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr, f"{mod} is importable in the client venv"
    r = _run(client_venv, [py, "-c", "import kvbus.client, kvbus.schemas.lookup; print(kvbus.client.__file__)"])
    assert r.returncode == 0, r.stderr
    assert str(client_venv) in r.stdout, "kvbus comes from the venv, not from the checkout"
    r = _run(client_venv, [py, "-c", "from kvbus.client import production_stack as ps; print(ps.PRODUCTION_STACK)"])
    assert (r.returncode, r.stdout) == (0, "False\n"), "the production-stack adapter imports without it: " + r.stderr


@pytest.mark.parametrize("where", ["single", "cluster"])
def test_a_client_only_venv_answers_as_kvbus_lookup(client_venv, capsys, where):
    ctx = RedisClusterServer(3) if where == "cluster" else RedisServer()
    with ctx as srv:
        prefix = f"v{uuid.uuid4().hex[:8]}:"
        store = ShardedRedisStore(srv.url, prefix) if where == "cluster" else RedisStore(srv.client(), prefix)
        store.apply(_records())
        cases = sorted(CASES)
        want = [_kvbus_lookup_json(srv.url, prefix, CASES[c], capsys) for c in cases]
        assert [c for c, w in zip(cases, want) if not json.loads(w)] == sorted(EMPTY_CASES), "the cases find holders"
        py = str(client_venv / "bin" / "python")
        r = _run(client_venv, [py, "-c", SCRIPT, srv.url, prefix],
                 input=json.dumps([_client_kwargs(CASES[c]) for c in cases]))
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines(keepends=True) == want
        for c, w in zip(cases, want):
            r = _run(client_venv, [str(client_venv / "bin" / "kvbus"), "lookup", *CASES[c], "--prefix", prefix,
                                   "--json"], env={"KVBUS_REDIS_URL": srv.url})
            assert (r.returncode, r.stdout) == (0, w), (c, r.stderr)
