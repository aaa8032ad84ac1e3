"""The record layouts the fast codec (:mod:`schemas.fast_encode`, :mod:`schemas.fast_decode`,
:mod:`schemas.event_scan`) is written for, checked against ``schemas/avro/*.avsc`` at import.

The hand-written encoders and decoders follow the field order and types below. If a ``.avsc``
file changes (a field added, moved, retyped; a union branch added), :func:`check_layout` raises
:class:`LayoutError` naming the record and the difference, so the codec fails loudly at import
instead of writing or reading garbage. Docs and defaults are not part of a layout (they do not
change the binary encoding).
"""
from __future__ import annotations

from typing import Any

from schemas.avro import parsed_schema

HASH = "fixed8"
EVENT = "kvbus.BlockStored|kvbus.BlockRemoved|kvbus.AllBlocksCleared|kvbus.Reset"
"""The event union; branch i is written as the long i (bytes 0, 2, 4, 6)."""

LAYOUT: dict[str, tuple[tuple[str, str], ...]] = {
    "kvbus.BlockStored": (
        ("block_hashes", f"array<{HASH}>"), ("parent_block_hash", f"null|{HASH}"), ("token_ids", "array<long>"),
        ("block_size", "int"), ("lora_id", "null|long"), ("medium", "null|string"), ("lora_name", "null|string"),
        ("extra_keys", "null|bytes"), ("group_idx", "null|int"), ("kv_cache_spec_kind", "null|string"),
        ("kv_cache_spec_sliding_window", "null|int"), ("locality", "null|string"), ("ownership", "null|string"),
        ("session_id", "null|string"), ("lookahead_token_ids", "null|array<array<long>>"),
        ("cache_salt", "null|string"), ("token_id_pairs", "null|array<array<long>>"),
        ("block_digests", "null|array<bytes>"), ("parent_block_digest", "null|bytes"),
    ),
    "kvbus.BlockRemoved": (
        ("block_hashes", f"array<{HASH}>"), ("medium", "null|string"), ("group_idx", "null|int"),
        ("locality", "null|string"), ("ownership", "null|string"), ("block_digests", "null|array<bytes>"),
    ),
    "kvbus.AllBlocksCleared": (),
    "kvbus.Reset": (("reason", "string"), ("missing_from", "null|long"), ("missing_to", "null|long")),
    "kvbus.EventBatch": (
        ("replica", "string"), ("dp_rank", "int"), ("worker_rank", "int"), ("workers", "int"), ("engine", "string"),
        ("epoch", "long"), ("seq", "long"), ("ts", "double"), ("topic", "string"), ("events", f"array<{EVENT}>"),
        ("first_index", "int"),
    ),
    "kvbus.BlockEvent": (
        ("replica", "string"), ("dp_rank", "int"), ("epoch", "long"), ("seq", "long"), ("index", "int"),
        ("ts", "double"), ("event", EVENT),
    ),
    "kvbus.Incomplete": (
        ("replica", "string"), ("dp_rank", "int"), ("epoch", "long"), ("seq", "long"), ("index", "int"),
        ("workers", "int"), ("reported", "array<int>"), ("missing", "array<int>"), ("event", EVENT),
    ),
    "kvbus.DeadLetter": (
        ("stage", "string"), ("source", "string"), ("reason", "string"), ("payload", "array<bytes>"),
        ("ts", "double"),
    ),
}
"""Record name -> (field name, type signature) in schema order."""


class LayoutError(RuntimeError):
    """``schemas/avro`` no longer matches what the fast codec writes and reads."""


def _signature(node: Any, named: dict[str, Any], records: dict[str, Any]) -> str:
    """Compact type signature: primitives by name, ``fixed<size>``, record names, ``array<T>``, ``A|B``."""
    if isinstance(node, list):
        return "|".join(_signature(b, named, records) for b in node)
    if isinstance(node, str):
        ref = named.get(node)
        if ref is None:
            return node  # a primitive
        return node if ref["type"] == "record" else _signature(ref, named, records)
    kind = node["type"]
    if kind == "array":
        return f"array<{_signature(node['items'], named, records)}>"
    if kind == "fixed":
        named[node["name"]] = node
        return f"fixed{node['size']}"
    if kind == "record":
        named[node["name"]] = records[node["name"]] = node
        for f in node["fields"]:
            _signature(f["type"], named, records)  # registers nested named types
        return node["name"]
    return _signature(kind, named, records)


def layouts(record: str) -> dict[str, tuple[tuple[str, str], ...]]:
    """Layouts of ``kvbus.<record>`` and of every record nested in it, from the ``.avsc`` files."""
    named: dict[str, Any] = {}
    records: dict[str, Any] = {}
    _signature(parsed_schema(record), named, records)
    out = {}
    for name, node in records.items():
        out[name] = tuple((f["name"], _signature(f["type"], named, {})) for f in node["fields"])
    return out


def check_layout() -> None:
    """Raise :class:`LayoutError` if any kvbus record differs from :data:`LAYOUT`."""
    for record in ("EventBatch", "BlockEvent", "Incomplete", "DeadLetter"):
        for name, got in layouts(record).items():
            want = LAYOUT.get(name)
            if got != want:
                raise LayoutError(
                    f"{name} in schemas/avro changed; update schemas/avro_layout.py and the fast codec "
                    f"(schemas/fast_encode.py, fast_decode.py, event_scan.py).\n  codec: {want}\n  .avsc: {got}")


check_layout()
