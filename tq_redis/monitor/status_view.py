"""How ``tq-redis status`` draws a snapshot: tables with ``rich`` on a terminal where it is
installed (the ``monitor`` and ``demo`` extras), else (piped, ``--plain``, no rich) the plain text
of :func:`tq_redis.monitor.status.render`.

The core install does not pull ``rich``; both renderings hold the same numbers.
"""

from __future__ import annotations

import sys
from typing import Any

from tq_redis.monitor.status import (
    COUNTER_KINDS,
    age_text,
    counters_line,
    lease_text,
    node_label,
    rate_limit_lines,
    render,
    replica_repair_text,
    server_line,
    waiting_text,
)
from tq_redis.units import format_size


def have_rich() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def _rate(value: float | None) -> str:
    return f"{value:+.1f}/s" if value is not None else ""


def rich_renderables(snap: dict[str, Any], rate: dict[str, Any] | None = None) -> list[Any]:
    """The snapshot as rich renderables: a header, a fields and a tasks table per partition, the nodes."""
    from rich.table import Table
    from rich.text import Text

    rate = rate or {}
    out: list[Any] = [
        Text(f"namespace {snap['namespace']!r}: {len(snap['partitions'])} partition(s)", style="bold"),
        Text(server_line(snap)),
    ]
    if "counters" in snap:
        out.append(Text(counters_line(snap)))
    for p in snap["partitions"]:
        r = rate.get(p["id"], {})
        sealed = ", sealed" if p["sealed"] else ""
        title = (f"partition {p['id']!r}: {p['samples']} samples {_rate(r.get('samples'))}{sealed}, "
                 f"age {age_text(p['age_s'])}, inline {p['inline']['values']} values "
                 f"({'?' if p['inline']['bytes'] is None else format_size(p['inline']['bytes'])})")
        fields = Table(title=title, title_justify="left")
        for col in ("field", "produced", "%", "rate"):
            fields.add_column(col, justify="left" if col == "field" else "right")
        for f, s in p["fields"].items():
            fields.add_row(f, str(s["produced"]), f"{s['pct']:.1f}", _rate(r.get("fields", {}).get(f)))
        out.append(fields)
        tasks = Table()
        for col in ("task", "claimable", "consumed", "%", "rate", "leases", "redelivered", "poison", "waiters",
                    "expiries", "redeliveries", "poisoned"):
            tasks.add_column(col, justify="left" if col in ("task", "leases", "waiters") else "right")
        for t, s in p["tasks"].items():
            tasks.add_row(t, str(s["claimable"]), str(s["consumed"]), f"{s['pct']:.1f}",
                          _rate(r.get("tasks", {}).get(t)), lease_text(s), str(s["redelivered"]),
                          str(s["poison"]), waiting_text(s), *(str(s.get(k, 0)) for k in COUNTER_KINDS.values()))
        if p["tasks"]:
            out.append(tasks)
        out.extend(Text(line.strip()) for line in rate_limit_lines(p))
    b = snap["bytes"]
    inline_size = "?" if b["inline"] is None else format_size(b["inline"])
    nodes = Table(title=f"bytes: {inline_size} inline in Redis ({b['inline_values']} values), "
                        f"{format_size(sum(b['nodes'].values()))} on {len(snap['storage_nodes'])} storage node(s), "
                        f"{format_size(b['spilled'])} spilled", title_justify="left")
    for col in ("node", "used", "capacity", "spilled", "heartbeat"):
        nodes.add_column(col, justify="left" if col == "node" else "right")
    for n in snap["storage_nodes"]:
        age = n.get("heartbeat_age_s")
        nodes.add_row(node_label(n), format_size(n.get("used", 0)),
                      format_size(n.get("capacity", 0)), format_size(n.get("spilled_bytes") or 0),
                      f"{age:.1f}s ago" if age is not None else "?")
    out.append(nodes)
    if snap.get("replica_repair"):
        out.append(Text(replica_repair_text(snap["replica_repair"])))
    for partition, count in snap.get("pending_deletes", {}).items():
        out.append(Text(f"partition {partition!r}: the bytes of {count} cleared sample(s) are not deleted yet "
                        f"(a store was unreachable); clear_partition({partition!r}) deletes them"))
    return out


def show(snap: dict[str, Any], rate: dict[str, Any] | None = None, *, clear: bool = False,
         plain: bool = False) -> None:
    """Print a snapshot on stdout (``clear``: redraw the screen first, for ``--watch``)."""
    if plain or not sys.stdout.isatty() or not have_rich():  # piped: text a script can grep
        if clear:
            print("\033[2J\033[H", end="")
        print(render(snap, rate), flush=True)
        return
    from rich.console import Console

    console = Console()
    if clear:
        console.clear()
    for item in rich_renderables(snap, rate):
        console.print(item)
