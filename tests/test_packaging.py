"""The installable package: the wheel built from a fresh clone, and each role installed from it into a
fresh venv (pip's cache and PyPI), run from outside the repository with only what that role's extra
brings.

* the wheel's only top-level package is ``kvbus``; it carries the Avro schemas, the Redis function
  library and every module of the stage folders, and no tests or benchmarks;
* ``[client]``: ``kvbus lookup --json`` against a view written by the sink's store code on a real
  Redis answers exactly as the development venv's does, with no faust, polars or confluent-kafka there;
* ``[publisher]``: the in-process publisher writes to the real Kafka + registry and the batches are read
  back from the raw topic, with no faust, polars or redis there;
* both with the newest releases in range and with every library at its lower bound;
* ``[bridge]``, ``[streams]``, ``[sink]``, ``[top]``, ``[analytics]``: every module of the role's stage imports and its
  subcommands answer ``--help``, without the other roles' libraries;
* the image's install script (deploy/image/install.sh, what the Dockerfile runs) into a fresh prefix:
  ``kvbus --version`` and ``kvbus worker --help`` run from it.

Slow (venvs: about 2 minutes in all here): marked ``packaging`` (``-m packaging`` selects them, ``-m "not
packaging"`` leaves them out); they run in the default ``./dev test``.
"""
from __future__ import annotations

import email.parser
import json
import re
import sys
import time
import tomllib
import uuid
import zipfile
from pathlib import Path
from typing import Iterator

import pytest
from confluent_kafka import Consumer
from packaging.requirements import Requirement
from packaging.version import Version

import kvbus
from kvbus.infra.scratch_redis import RedisServer
from kvbus.producers.sequencer import REASON_ENGINE_RESTART
from kvbus.runtime.settings import Settings
from kvbus.schemas.events import BlockEvent, BlockRemoved, BlockStored, EventBatch, Reset, canonical_hash
from kvbus.schemas.hashing import block_hashes
from kvbus.schemas.serde import RecordSerde, registry_client
from kvbus.sinks.view.redis_store import RedisStore
from tests.venvs import BASE_PYTHON, ROOT, Venv, build_wheel, fresh_clone, lowest_versions

pytestmark = [pytest.mark.packaging, pytest.mark.timeout(600)]

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
STAGE_DIRS: dict[str, str] = {pkg: folder for pkg, folder in PYPROJECT["tool"]["setuptools"]["package-dir"].items()}
"""Import package -> repository folder (pyproject.toml's package-dir)."""

DEV = Venv(Path(sys.prefix))
"""The venv running these tests (./dev's, with every extra and the checkout installed editable)."""
NOT_FOR_ROUTERS = ("faust", "polars", "confluent_kafka", "fastavro", "prometheus_client", "zmq", "matplotlib")
NOT_FOR_ENGINES = ("faust", "polars", "redis", "zmq", "matplotlib", "rich")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This checkout as a fresh clone has it."""
    return fresh_clone(tmp_path_factory.mktemp("clone") / "kvbus")


@pytest.fixture(scope="module")
def wheel(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from :func:`source` (one per module: every role installs this one)."""
    return build_wheel(source, tmp_path_factory.mktemp("wheel"))


def role_venv(wheel: Path, role: str, path: Path, versions: str = "newest") -> Venv:
    """A fresh venv with the wheel and ``role``'s extra: the newest releases pip finds in range, or with
    ``versions="lowest"`` each library at the lower bound pyproject.toml gives it."""
    pins = lowest_versions(PYPROJECT, role) if versions == "lowest" else []
    venv = Venv.create(path)
    venv.install(f"{wheel}[{role}]", *pins)
    wanted = {Requirement(p).name: Version(str(Requirement(p).specifier).removeprefix("==")) for p in pins}
    assert {n: Version(v) for n, v in venv.versions(wanted).items()} == wanted
    return venv


# ------------------------------------------------------------------------------------------ the wheel


def test_the_wheel_holds_one_package_kvbus_with_its_data_and_no_tests(wheel: Path, source: Path):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        top_level = {n.split("/")[0] for n in names} - {dist_info}
        meta = email.parser.Parser().parsestr(z.read(f"{dist_info}/METADATA").decode())
        entry_points = z.read(f"{dist_info}/entry_points.txt").decode()
        top_level_txt = z.read(f"{dist_info}/top_level.txt").decode().split()
    assert top_level == {"kvbus"} and top_level_txt == ["kvbus"]
    # every module and data file of the stage folders, under kvbus.<stage>
    expected = set()
    for pkg, folder in STAGE_DIRS.items():
        for f in (source / folder).rglob("*"):
            if f.is_file() and f.suffix in (".py", ".avsc", ".lua"):
                expected.add(pkg.replace(".", "/") + "/" + f.relative_to(source / folder).as_posix())
    assert expected - set(names) == set()
    assert {n for n in names if n.endswith(".avsc")} == {f"kvbus/schemas/avro/{f.name}"
                                                         for f in (source / "schemas" / "avro").glob("*.avsc")}
    assert "kvbus/sinks/view/lua/kvbus.lua" in names
    assert [n for n in names if re.search(r"(^|/)(tests|benchmarks)/|__pycache__|\.pyc$", n)] == []
    assert any(n.endswith("/licenses/LICENSE") for n in names)
    assert meta["Name"] == "kvbus" and meta["Version"] == kvbus.__version__
    assert meta["License-Expression"] == "Apache-2.0"
    assert set(meta.get_all("Provides-Extra")) == set(PYPROJECT["project"]["optional-dependencies"])
    assert re.search(r"^kvbus = kvbus\.cli:main$", entry_points, re.M)


# ------------------------------------------------------------------------------------------ [client]

TOKENS = ",".join(str(t) for t in range(1, 65))
"""Four blocks of 16 tokens."""


@pytest.fixture(scope="module")
def view() -> Iterator[tuple[RedisServer, str, list[bytes]]]:
    """A real Redis with a view written by the sink's store code, (server, key prefix, chain): a (dp 0)
    holds the whole 4-block chain in GPU, b#1 three blocks in CPU, b#0 two blocks in CPU and block 0
    in GPU too."""
    chain = block_hashes(range(1, 65), 16)
    with RedisServer() as srv:
        prefix = f"pkg{uuid.uuid4().hex[:8]}:"

        def ev(replica: str, dp: int, seq: int, hashes: list[bytes], medium: str) -> tuple[str, BlockEvent]:
            return ("kvbus.blocks", BlockEvent(replica=replica, dp_rank=dp, epoch=1, seq=seq, index=0, ts=time.time(),
                                               event=BlockStored(block_hashes=hashes, medium=medium)))

        RedisStore(srv.client(), prefix).apply([ev("a", 0, 0, chain, "GPU"), ev("b", 1, 0, chain[:3], "CPU"),
                                                ev("b", 0, 0, chain[:2], "CPU"), ev("b", 0, 1, chain[:1], "GPU")])
        yield srv, prefix, chain


LOOKUPS = [
    # (query, expected {holder: matched} best first, b#0 holds 2 blocks in CPU, block 0 in GPU too)
    (["--tokens", TOKENS], {"a": 4, "b#1": 3, "b#0": 2}),
    (["--hashes", ",".join("0x" + h.hex() for h in block_hashes(range(1, 65), 16))],
     {"a": 4, "b#1": 3, "b#0": 2}),
    (["--tokens", TOKENS, "--replicas", "b", "--weights", "CPU=0.1"], {"b#0": 2, "b#1": 3}),
]
"""Lookups of the view and their answers (vLLM's sha256 token hashing; hex hashes; candidates and weights)."""


@pytest.mark.parametrize("versions", ["newest", "lowest"])
def test_client_install_looks_up_the_view_without_kafka_or_faust(wheel: Path, view, versions: str, tmp_path: Path):
    srv, prefix, _chain = view
    venv = role_venv(wheel, "client", tmp_path / "client", versions)
    assert venv.importable(NOT_FOR_ROUTERS) == []
    env = {"KVBUS_REDIS_URL": srv.url}
    for query, matched in LOOKUPS:
        argv = ["kvbus", "lookup", *query, "--prefix", prefix, "--json"]
        done = venv.run(argv, env)
        assert done.returncode == 0 and done.stderr == "", f"{argv}: exit {done.returncode}\n{done.stderr}"
        answer = json.loads(done.stdout)
        assert [(name, m["matched"]) for name, m in answer.items()] == list(matched.items())
        assert answer["b#0"]["tiers"] == {"CPU": 2, "GPU": 1} and answer["b#1"]["dp_rank"] == 1
        # the test venv's `kvbus lookup` (the repository's code with every extra) answers the same
        assert answer == json.loads(DEV.check(argv, env))


def test_client_install_imports_from_the_checkouts_root(wheel: Path, source: Path, view, tmp_path: Path):
    """Run from a checkout's root (where ``python -m`` and ``python -c`` put the current directory first on
    the path), the installed wheel is what ``import kvbus`` finds: no folder there shadows it."""
    srv, prefix, _chain = view
    venv = role_venv(wheel, "client", tmp_path / "client")
    code = ("import json, kvbus, kvbus.client\n"
            "print(json.dumps([kvbus.__file__, kvbus.client.__file__]))")
    done = venv.run(["python", "-c", code], cwd=source)
    assert done.returncode == 0, f"import kvbus.client from {source}: exit {done.returncode}\n{done.stderr}"
    files = json.loads(done.stdout)
    assert all(Path(f).is_relative_to(venv.path) for f in files), f"imported from outside the venv: {files}"
    query, matched = LOOKUPS[0]
    done = venv.run(["python", "-m", "kvbus", "lookup", *query, "--prefix", prefix, "--json"],
                    {"KVBUS_REDIS_URL": srv.url}, cwd=source)
    assert done.returncode == 0 and done.stderr == "", f"python -m kvbus lookup from {source}:\n{done.stderr}"
    assert {name: m["matched"] for name, m in json.loads(done.stdout).items()} == matched


# ------------------------------------------------------------------------------------------ [publisher]

PUBLISH = """
import json, sys
from types import SimpleNamespace
from kvbus.producers.publisher import create_publisher
from kvbus.schemas.events import BlockRemoved, BlockStored, canonical_hash

h = [canonical_hash(i) for i in (11, 12, 13)]
pub = create_publisher("kafka", replica="engine-pkg", data_parallel_rank=1, topic="kv@engine-pkg@m")
pub.publish(SimpleNamespace(ts=1.5, events=[BlockStored(block_hashes=h, token_ids=list(range(48)), block_size=16,
                                                        medium="GPU")]))
pub.publish(SimpleNamespace(ts=2.5, events=[BlockRemoved(block_hashes=h[2:], medium="GPU")]))
pub.shutdown()
print(json.dumps({"epoch": pub.epoch, "acked": pub.acked, "failed": pub.failed, "dropped": pub.dropped,
                  "kafka": "confluent_kafka" in sys.modules, "redis": "redis" in sys.modules}))
"""
"""What an engine embedding the publisher does: two batches, then shutdown (which delivers them)."""


def read_batches(settings: Settings, topic: str, count: int, timeout: float = 60.0) -> list[tuple[bytes, EventBatch]]:
    """The first ``count`` records of ``topic`` as (key, EventBatch), read with kvbus's serde; fails
    with what it read if fewer arrive within ``timeout`` seconds."""
    serde = RecordSerde(registry_client(settings), "EventBatch")
    consumer = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": f"pkg-{uuid.uuid4().hex}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    consumer.subscribe([topic])
    got: list[tuple[bytes, EventBatch]] = []
    deadline = time.monotonic() + timeout
    try:
        while len(got) < count and time.monotonic() < deadline:
            for msg in consumer.consume(100, timeout=0.5):
                assert msg.error() is None, msg.error()
                got.append((msg.key(), serde.loads(msg.value(), topic)))
    finally:
        consumer.close()
    assert len(got) >= count, f"waited {timeout:.0f}s for {count} records on {topic}; read {got}"
    return got


@pytest.mark.integration
@pytest.mark.parametrize("versions", ["newest", "lowest"])
def test_publisher_install_publishes_to_the_raw_topic_without_redis_or_faust(wheel: Path, test_settings: Settings,
                                                                             versions: str, tmp_path: Path):
    venv = role_venv(wheel, "publisher", tmp_path / "publisher", versions)
    assert venv.importable(NOT_FOR_ENGINES) == []
    out = json.loads(venv.check(["python", "-I", "-c", PUBLISH], test_settings.to_env()).strip().splitlines()[-1])
    assert out["acked"] == 3 and out["failed"] == out["dropped"] == 0 and out["kafka"] and not out["redis"]
    records = read_batches(test_settings, test_settings.topics.raw, 3)
    assert len(records) == 3 and {key for key, _ in records} == {b"engine-pkg#1"}
    start, stored, removed = (b for _, b in records)
    h = [canonical_hash(i) for i in (11, 12, 13)]
    assert start.seq == -1 and start.events == [Reset(reason=REASON_ENGINE_RESTART)]
    assert [(b.replica, b.dp_rank, b.engine, b.epoch, b.seq, b.ts, b.topic) for b in (stored, removed)] == [
        ("engine-pkg", 1, "kvbus", out["epoch"], 0, 1.5, "kv@engine-pkg@m"),
        ("engine-pkg", 1, "kvbus", out["epoch"], 1, 2.5, "kv@engine-pkg@m"),
    ]
    assert stored.events == [BlockStored(block_hashes=h, block_size=16, medium="GPU")]
    assert removed.events == [BlockRemoved(block_hashes=h[2:], medium="GPU")]


# ------------------------------------------------------------------------------------------ the other roles

ROLES = {
    # role: (its stage packages, its subcommands, libraries of other roles it must not bring)
    "bridge": (["kvbus.producers"], ["bridge", "schemas"], ["faust", "redis", "polars", "matplotlib"]),
    "streams": (["kvbus.streams"], ["worker"], ["redis", "zmq", "polars", "matplotlib"]),
    "sink": (["kvbus.sinks"], ["sink", "lookup"], ["faust", "zmq", "polars", "matplotlib"]),
    "top": (["kvbus.top"], ["top"], ["faust", "zmq", "polars", "matplotlib"]),
    "serve": (["kvbus.serve"], ["serve"], ["faust", "zmq", "confluent_kafka", "polars", "matplotlib"]),
    "analytics": (["kvbus.analytics"], ["report"], ["faust", "redis", "zmq", "pyarrow"]),
}


@pytest.mark.parametrize("role", sorted(ROLES))
def test_each_role_install_imports_its_stage_and_nothing_of_the_others(wheel: Path, role: str, tmp_path: Path):
    packages, commands, others = ROLES[role]
    venv = role_venv(wheel, role, tmp_path / role)
    assert venv.importable(others) == []
    assert venv.import_all(packages) == {}
    for command in commands:
        assert f"usage: kvbus {command}" in venv.check(["kvbus", command, "--help"])


# ------------------------------------------------------------------------------------------ the image

IMAGE_STAGES = ("kvbus.producers", "kvbus.streams", "kvbus.sinks", "kvbus.top", "kvbus.serve")


def test_the_dockerfile_runs_the_install_script_as_a_non_root_kvbus_entrypoint():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.findall(r"^FROM (\S+)", dockerfile, re.M) == ["python:${PYTHON_VERSION}-slim"] * 2  # build, final
    assert re.search(r"^ARG PYTHON_VERSION=3\.1[1-9]$", dockerfile, re.M)
    assert re.search(r"^RUN /src/deploy/image/install\.sh /src /opt/kvbus ", dockerfile, re.M)
    user = re.findall(r"^USER (\S+)", dockerfile, re.M)
    assert user and user[-1].split(":")[0] not in ("0", "root")
    assert re.findall(r"^ENTRYPOINT (.+)$", dockerfile, re.M) == ['["kvbus"]']


def test_the_image_install_script_into_a_fresh_prefix_runs_every_stage(source: Path, tmp_path: Path):
    prefix = tmp_path / "opt-kvbus"
    done = Venv(tmp_path).run([str(source / "deploy" / "image" / "install.sh"), str(source), str(prefix)],
                              {"PYTHON": str(BASE_PYTHON)}, timeout=600)
    assert done.returncode == 0, f"install.sh exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    image = Venv(prefix)
    assert image.check(["kvbus", "--version"]).strip() == f"kvbus {kvbus.__version__}"
    assert "usage: kvbus worker" in image.check(["kvbus", "worker", "--help"])
    assert image.import_all(IMAGE_STAGES) == {}
    assert image.importable(["polars", "matplotlib"]) == []  # kvbus report is not in the default image
