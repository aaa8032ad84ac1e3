"""``kvbus report``: analytics over the block topics for a time range.

Reads the block topics of both layouts (``kvbus.blocks``, ``kvbus.blocks-packed`` and their tier topics;
each event of a packed record counts as one), ``kvbus.incomplete`` and ``kvbus.dlq`` (``--raw``: also
``kvbus.raw``) from ``--since`` to ``--until`` (default: everything), prints a summary, writes
``report.html`` (charts, one file, offline) and Parquet files (``events``, ``series``, ``lives``,
``sharing``, ``tiers``, ``holders``, ``prefixes``, ``offload``, ``incomplete``, ``dead_letters``,
``clocks``, ``raw``) into ``--out``. Everything is timed by the Kafka record time; the engines' ``ts``
is a column, and the summary counts the events whose ``ts`` lies more than ``--clock-skew`` seconds
from it. ``--sample N`` prints N records of each event kind of each topic instead. Services and
topic names come from the ``KVBUS_*`` settings (kvbus.runtime.settings). The records of the range are
held in memory while the tables are built (327 MB RSS for a 25 s demo run's 50,617 block events).
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from kvbus.analytics import html_report, sample, summary
from kvbus.analytics.metrics import CLOCK_SKEW_S, Report, compute
from kvbus.analytics.progress import ReadProgress
from kvbus.analytics.reader import Record, block_topics, read
from kvbus.analytics.tables import block_events, dead_letter_table, incomplete_table, raw_table
from kvbus.analytics.timerange import TimeRange, parse_time
from kvbus.runtime.settings import Settings


def add_report_args(p: argparse.ArgumentParser) -> None:
    """Options of ``kvbus report``."""
    p.add_argument("--since", type=parse_time, default=None,
                   help="first record time: ISO 8601 (UTC unless it says), epoch seconds, or an age like 15m, 2h "
                        "(default: the beginning of the topics)")
    p.add_argument("--until", type=parse_time, default=None,
                   help="records before this time (same forms; default: the end of the topics when reading starts)")
    p.add_argument("--raw", action="store_true", help="also read kvbus.raw (per-worker reports)")
    p.add_argument("--out", type=Path, default=Path("kvbus-report"),
                   help="directory for report.html and the Parquet files (default ./kvbus-report)")
    p.add_argument("--no-html", action="store_true", help="do not write report.html")
    p.add_argument("--no-parquet", action="store_true", help="do not write Parquet files")
    p.add_argument("--top", type=int, default=10, help="shared prefixes listed (default 10)")
    p.add_argument("--clock-skew", type=float, default=CLOCK_SKEW_S, metavar="SECONDS",
                   help="count an event's engine clock as off when its ts lies more than this from its Kafka "
                        f"record time (default {CLOCK_SKEW_S:g})")
    p.add_argument("--sample", type=int, nargs="?", const=2, default=None, metavar="N",
                   help="print N records of each event kind of every topic read as JSON (default 2) and stop")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show reading progress on stderr (default: when stderr is a terminal)")


def topics_to_read(settings: Settings, raw: bool) -> list[str]:
    """The block topics of both layouts that exist, the incomplete and dead-letter topics, and (``raw``) the
    raw topic."""
    t = settings.topics
    return block_topics(settings) + [t.incomplete, t.dlq] + ([t.raw] if raw else [])


def build_report(settings: Settings, records: list[Record], raw: bool, top: int = 10,
                 clock_skew_s: float = CLOCK_SKEW_S) -> Report:
    """All tables of a report from the records read."""
    t = settings.topics
    by_topic: dict[str, list[Record]] = {}
    for r in records:
        by_topic.setdefault(r.topic, []).append(r)
    block_recs = [r for name, rs in by_topic.items() if name not in (t.incomplete, t.dlq, t.raw) for r in rs]
    return compute(
        block_events(block_recs, t), t.blocks, incomplete_table(by_topic.get(t.incomplete, [])),
        dead_letter_table(by_topic.get(t.dlq, [])),
        raw_table(by_topic.get(t.raw, [])) if raw else None, top_prefixes=top, clock_skew_s=clock_skew_s,
    )


def write_parquet(report: Report, out: Path) -> list[Path]:
    """One Parquet file per table into ``out``; returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    tables = {"events": report.blocks, "series": report.series, "lives": report.lives, "sharing": report.sharing,
              "tiers": report.tiers, "holders": report.holders, "prefixes": report.prefixes, "offload": report.offload,
              "incomplete": report.incomplete, "dead_letters": report.dead_letters, "clocks": report.clocks}
    if report.raw is not None:
        tables["raw"] = report.raw
    paths = []
    for name, df in tables.items():
        path = out / f"{name}.parquet"
        df.write_parquet(path)
        paths.append(path)
    return paths


def run_report(args: argparse.Namespace, settings: Settings) -> int:
    """Run ``kvbus report``; 0 when it wrote what was asked, 1 when the range held no block events."""
    span = TimeRange(args.since, args.until)
    topics = topics_to_read(settings, args.raw)
    with ReadProgress(enabled=args.progress) as progress:
        stream = read(settings, topics, span, on_plan=progress.planned, on_record=progress.advance)
        if args.sample is not None:
            samples = sample.pick(stream, args.sample, lambda: {r.topic for r in progress.ranges if r.records})
            progress.finish()
        else:
            records = list(stream)
            progress.finish()
    if args.sample is not None:
        print(sample.render(samples))
        return 0
    undecodable = sum(1 for r in records if r.value is None)
    report = build_report(settings, records, args.raw, args.top, args.clock_skew)
    print(summary.render(report, span.describe()))
    if undecodable:
        print(f"== {undecodable} records could not be decoded (left out)")
    argv = sys.argv[1:]
    command = "kvbus " + shlex.join(argv[argv.index("report"):] if "report" in argv else ["report"])
    if not args.no_html:
        path = html_report.write(report, args.out / "report.html", f"kvbus report: {span.describe()}", command)
        print(f"== wrote {path}")
    if not args.no_parquet:
        paths = write_parquet(report, args.out)
        print(f"== wrote {len(paths)} Parquet files to {args.out}/ ({', '.join(p.stem for p in paths)})")
    return 0 if not report.blocks.is_empty() else 1
