"""Ports handed to child processes (``kvbus.children.free_port`` / ``free_port_block``): bindable,
outside the ephemeral range that outgoing connections draw from, and never handed out twice while
the children may still be starting."""
from __future__ import annotations

import socket

from kvbus.children import free_port, free_port_block

EPHEMERAL = range(32768, 61000)


def test_free_ports_are_distinct_bindable_and_not_ephemeral():
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports), sorted(p for p in ports if ports.count(p) > 1)
    assert not [p for p in ports if p in EPHEMERAL], "a port an outgoing connection may take meanwhile"
    for p in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_blocks_do_not_overlap_ports_handed_out():
    single = {free_port() for _ in range(50)}
    blocks = [free_port_block(8) for _ in range(50)]
    taken = [p for b in blocks for p in range(b, b + 8)]
    assert len(set(taken)) == len(taken), "two blocks overlap"
    assert not single.intersection(taken), "a block holds a port handed out before"
    assert max(taken) < EPHEMERAL.start
