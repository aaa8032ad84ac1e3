"""A snapshot (:mod:`kvbus.top.collect`) as rich renderables: one panel per source.

Every panel shows its source's ``error`` ("unreachable: ...") in place of its table when the source
could not be read; ``-`` in a cell means "not known yet" (a rate before the second sample, a
latency with no observation in the interval).
"""
from __future__ import annotations

import datetime as dt
from typing import Callable

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text


def fmt(v: float | int | None, digits: int = 0) -> str:
    """A number for a cell: thousands separated, ``-`` for None."""
    if v is None:
        return "-"
    return f"{v:,.{digits}f}"


def _unreachable(title: str, error: str) -> Panel:
    return Panel(Text(error, style="bold red"), title=title, title_align="left", border_style="red")


def _table(*columns: str, right_from: int = 1) -> Table:
    t = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    for i, c in enumerate(columns):
        t.add_column(c, justify="right" if i >= right_from else "left", no_wrap=True)
    return t


def flow_panel(snap: dict) -> Panel:
    """events/s and totals: in (bridges, acknowledged by Kafka), consolidated (workers), applied (sinks)."""
    t = _table("stage", "events/s", "total")
    for key, label in (("in", "in (bridges, acked)"), ("consolidated", "consolidated (workers)"),
                       ("applied", "applied (sinks)")):
        f = snap["flow"][key]
        t.add_row(label, fmt(f["per_s"], 1), fmt(f["total"]))
    return Panel(t, title="flow", title_align="left")


def lag_panel(snap: dict) -> Panel:
    """Consumer lag of each hop (lag, end and committed offsets, records/s in and committed) and,
    per topic, of each partition (``p<n> <lag>``, lagging ones highlighted), from Kafka."""
    k = snap["kafka"]
    if k.get("error"):
        return _unreachable("consumer lag (Kafka)", k["error"])
    lines = []
    for hop in k["hops"]:
        head = Text(f"{hop['hop']} ({hop['group']}): lag ", style="bold")
        head.append(fmt(hop["lag"]), style="bold yellow" if hop["lag"] else "bold green")
        lines.append(head)
        lines.append(Text(f"  end {fmt(hop['end'])}, committed {fmt(hop['committed'])}; "
                          f"in {fmt(hop['produced_per_s'], 1)} rec/s, committed {fmt(hop['consumed_per_s'], 1)} rec/s"))
        topics: dict[str, list[dict]] = {}
        for p in hop["partitions"]:
            topics.setdefault(p["topic"], []).append(p)
        for topic, parts in topics.items():
            line = Text(f"  {topic} lag by partition:")
            for p in parts:
                line.append(f" p{p['partition']} ")
                line.append(fmt(p["lag"]), style="yellow" if p["lag"] else "")
            lines.append(line)
    return Panel(Group(*lines), title=f"consumer lag (Kafka {k['bootstrap']})", title_align="left")


def freshness_panel(snap: dict) -> Panel:
    """Latency per hop over the interval, from the processes' histograms."""
    t = _table("hop", "p50 ms", "p99 ms", "batches")
    for row in snap["freshness"]:
        t.add_row(row["hop"], fmt(row["p50_ms"], 2), fmt(row["p99_ms"], 2), fmt(row["observations"]))
    return Panel(t, title="freshness (per-hop latency over the interval)", title_align="left")


def _state(e: dict) -> Text:
    return Text("up", style="green") if e["up"] else Text("DOWN", style="bold red")


def _per_s(e: dict, field: str) -> str:
    return fmt(e["counters"][field]["per_s"], 1)


def _total(e: dict, field: str) -> str:
    return fmt(e["counters"][field]["total"])


def _processes_panel(title: str, entries: list[dict], columns: tuple[str, ...],
                     cells: Callable[[dict], list[RenderableType]], *notes: Text) -> Panel:
    """One row per process endpoint: its name, up/DOWN, then ``cells(entry)`` of a process that
    answered; under the table ``notes``, then each unreachable endpoint's error."""
    t = _table(columns[0], "state", *columns[1:])
    errors = []
    for e in entries:
        if e["up"]:
            t.add_row(e["endpoint"], _state(e), *cells(e))
        else:
            t.add_row(e["endpoint"], _state(e), *[""] * (len(columns) - 1))
            errors.append(Text(e["error"], style="red"))
    return Panel(Group(t, *notes, *errors), title=title, title_align="left", border_style="red" if errors else "white")


def _bridge_cells(e: dict) -> list[RenderableType]:
    return [_per_s(e, "events_in"), _per_s(e, "events_acked"), _total(e, "gaps"), _total(e, "replays"),
            _total(e, "resets"), _total(e, "engine_restarts"), _total(e, "dead_letters"), fmt(e["gauges"]["backlog"])]


def bridges_panel(snap: dict) -> Panel:
    """One row per bridge endpoint: up/down, events/s, gaps, replays, resets, restarts, dead letters."""
    up = sum(e["up"] for e in snap["bridges"])
    return _processes_panel(f"bridges: {up} up, {len(snap['bridges']) - up} down", snap["bridges"],
                            ("bridge", "in/s", "acked/s", "gaps", "replays", "resets", "restarts", "dlq", "backlog"),
                            _bridge_cells)


def _worker_cells(e: dict) -> list[RenderableType]:
    cons = [e["counters"][f]["per_s"] for f in ("consolidated", "passthrough")]
    return [fmt(None if None in cons else sum(cons), 1), fmt(e["gauges"]["pending_aggregates"]),
            fmt(e["gauges"]["holders"]), fmt(sum(e["labelled_gauges"]["partition_lag"].values()))]


def workers_panel(snap: dict) -> Panel:
    """Faust workers: pending aggregates, holders, incompletes per reason and their share."""
    inc = snap["incomplete"]
    reasons = ", ".join(f"{r}={fmt(v['total'])}" for r, v in inc["reasons"].items()) or "none"
    share = "-" if inc["share"] is None else f"{100 * inc['share']:.2f} %"
    return _processes_panel("Faust workers", snap["workers"],
                            ("worker", "consolidated/s", "pending aggregates", "holders", "raw lag"), _worker_cells,
                            Text(f"incomplete: {reasons}; share of TP-consolidated now {share}"))


def _sink_cells(e: dict) -> list[RenderableType]:
    g = e["gauges"]
    return [_per_s(e, "events_applied"), fmt(g["view_entries"]), fmt(g["view_blocks"]), fmt(g["view_holders"]),
            Text(fmt(g["stale_holders"]), style="yellow" if g["stale_holders"] else ""),
            "yes" if g["view_rebuilding"] else "no"]


def sinks_panel(snap: dict) -> Panel:
    """Sinks: the view's size, holders and stale holders as each sink reports them."""
    return _processes_panel("sinks", snap["sinks"],
                            ("sink", "applied/s", "entries", "blocks", "holders", "stale holders", "rebuilding"),
                            _sink_cells)


def dead_letters_panel(snap: dict) -> Panel:
    """Dead letters per stage and reason (the processes' counters) and what the topic holds."""
    d = snap["dead_letters"]
    t = _table("stage", "reason", "total", "per s", right_from=2)
    for r in d["rows"]:
        t.add_row(r["stage"], r["reason"], Text(fmt(r["total"]), style="bold red" if r["total"] else ""),
                  fmt(r["per_s"], 2))
    topic = d["topic"]
    line = (Text(f"{topic['topic']} holds {fmt(topic['records'])} records") if topic
            else Text("dead-letter topic: unreachable (see the Kafka panel)", style="red"))
    return Panel(Group(t, line), title="dead letters", title_align="left")


def view_panel(snap: dict) -> Panel:
    """Blocks per replica and tier in the residency view, its state, size and stale holders."""
    v = snap["view"]
    title = f"residency view (Redis {v['url']}, prefix {v['prefix']})"
    if v.get("error"):
        return _unreachable(title, v["error"])
    t = _table("replica", *v["tiers"], "total")
    for holder, tiers in sorted(v["replicas"].items()):
        t.add_row(holder, *[fmt(tiers.get(x, 0)) for x in v["tiers"]], fmt(sum(tiers.values())))
    s = v["size"]
    stale = ", ".join(v["stale"]) or "none"
    head = Text(f"state {v['state']} | entries {fmt(s['entries'])} | blocks {fmt(s['blocks'])} | "
                f"live holders {fmt(s['holders'])} | stale holders: {stale}")
    return Panel(Group(head, t), title=title, title_align="left")


TWO_COLUMNS = 180
"""Terminal width from which the screen has two columns (each panel's table fits without cuts)."""


def render(snap: dict, width: int = 200) -> RenderableType:
    """The whole screen; two columns when ``width`` (the terminal's) allows, else one."""
    when = dt.datetime.fromtimestamp(snap["time"]).strftime("%H:%M:%S")
    header = Text(f"kvbus top  {when}  every {snap['interval_s']:g}s  (Ctrl-C quits)", style="bold")
    left = Group(flow_panel(snap), freshness_panel(snap), lag_panel(snap))
    right = Group(bridges_panel(snap), workers_panel(snap), sinks_panel(snap), dead_letters_panel(snap))
    if width >= TWO_COLUMNS:
        grid = Table.grid(expand=True)
        grid.add_column(ratio=4)
        grid.add_column(ratio=5)  # the process tables are the wider ones
        grid.add_row(left, right)
        body: RenderableType = grid
    else:
        body = Group(left, right)
    return Group(header, body, view_panel(snap))
