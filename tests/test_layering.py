"""Data flows one way and the stages share only the contract (``kvbus.schemas``) and the processes'
plumbing (``kvbus.runtime``): no stage imports another's modules.

Read from the source (every ``import kvbus.X`` / ``from kvbus.X import``, at any depth of the file).
The few crossings that exist are named here with why: the Flink job makes its PyFlink environment
with the stack's tools; the simulator encodes from the engines' release tables, the one source of
every engine format.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("producers", "streams", "sinks", "analytics", "simulator")
ALLOWED: dict[str, tuple[str, ...]] = {
    "producers": (),
    "streams": (),
    "sinks": (),
    "analytics": ("kvbus.infra.flink",),
    "simulator": ("kvbus.producers.engines",),
}


def kvbus_imports(path: Path) -> set[str]:
    """Every ``kvbus.*`` name the file imports (``from kvbus.a import b``: ``kvbus.a.b``, a module or a name in it)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("kvbus."))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvbus.") and not node.level:
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_imports_only_the_contract_and_itself(stage: str) -> None:
    own = f"kvbus.{stage}"
    allowed = ("kvbus.schemas", "kvbus.runtime", own) + ALLOWED[stage]
    crossings = sorted(
        f"{path.relative_to(ROOT)}: {mod}"
        for path in (ROOT / stage).rglob("*.py")
        for mod in kvbus_imports(path)
        if not any(mod == a or mod.startswith(a + ".") for a in allowed)
    )
    assert crossings == [], f"{stage} imports another stage's modules"


def test_the_check_sees_imports() -> None:
    """The reader finds a crossing where there is one (the rule above is not vacuous)."""
    assert "kvbus.sinks.config.SinkConfig" in kvbus_imports(ROOT / "infra" / "secure_plan.py")


READERS = ("clients/python", "commands/top", "commands/serve", "commands/demo.py")
"""The view's readers: the routers' client, ``kvbus top``, ``kvbus serve`` and the demo."""
READ_SIDE = ("kvbus.sinks.view.reader", "kvbus.sinks.view.ties")
"""What of the sink stage a reader may import: the view's reader and its tie-breaks."""
READER_ALLOWED = {"commands/top/top_config.py": ("kvbus.sinks.config", "kvbus.streams.options")}
"""``kvbus top`` watches the metrics endpoints the sink's and the worker's settings name by default."""


def _files(entry: str) -> list[Path]:
    path = ROOT / entry
    return [path] if path.is_file() else sorted(path.rglob("*.py"))


@pytest.mark.parametrize("entry", READERS)
def test_a_reader_imports_nothing_of_the_writer(entry: str) -> None:
    crossings = sorted(
        f"{path.relative_to(ROOT)}: {mod}"
        for path in _files(entry)
        for mod in kvbus_imports(path)
        if mod.startswith(("kvbus.sinks.", "kvbus.streams.", "kvbus.producers."))
        and not any(mod.startswith(a + ".") or mod == a
                    for a in READ_SIDE + READER_ALLOWED.get(str(path.relative_to(ROOT)), ()))
    )
    assert crossings == [], "a reader of the view imports the writer's (or another stage's) modules"


def test_the_reader_itself_imports_only_the_contract_and_the_servers_plumbing() -> None:
    """The reader and its tie-breaks need the contract (key layout, lookup protocol), the runtime and the
    cluster plumbing; never the writer's stores, protocol or function library."""
    allowed = ("kvbus.schemas", "kvbus.runtime", "kvbus.sinks.view.cluster") + READ_SIDE
    crossings = sorted(
        f"{path.relative_to(ROOT)}: {mod}"
        for path in (ROOT / "sinks/view/reader.py", ROOT / "sinks/view/ties.py", ROOT / "sinks/view/cluster.py")
        for mod in kvbus_imports(path)
        if not any(mod == a or mod.startswith(a + ".") for a in allowed)
    )
    assert crossings == []
