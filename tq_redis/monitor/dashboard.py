"""``tq-redis dashboard``: a small live web page of one namespace, served by the same process.

``/`` is one static HTML page (no build step, no framework): its script fetches ``/api/snapshot``
every few seconds and redraws partitions (production per field, consumption per task, claimable,
leases, redeliveries, poison, waiters, and the event counters), storage nodes and their bytes, the server's memory and
recent errors. ``/api/snapshot`` is :func:`tq_redis.monitor.status.snapshot` as JSON, read from
Redis once per request. When Redis cannot be read (it stopped, the network is gone) the page says
"Redis unreachable" and keeps showing the last snapshot read, with the time it was taken (the
server keeps it, so a page opened afterwards shows it too). The server is read-only (GET and HEAD
only) and never sends the Redis URL or its credentials: the page and the JSON name the namespace,
never where Redis is.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tq_redis.redact import redact

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>tq-redis: __NS__</title>
<style>
body{font:14px system-ui,sans-serif;margin:1.2em;color:#222}
h1{font-size:1.3em;margin:0 0 .3em} h2{font-size:1.1em;margin:1.2em 0 .3em}
table{border-collapse:collapse;margin:.3em 0 .8em}
td,th{border:1px solid #ccc;padding:.2em .6em;text-align:right}
td:first-child,th:first-child{text-align:left} th{background:#f3f3f3}
.bar{display:inline-block;height:.7em;background:#4a8;vertical-align:middle;margin-right:.4em}
.muted{color:#777} .err{color:#b00}
</style></head>
<body>
<h1>tq-redis namespace <span id="ns">__NS__</span></h1>
<div id="reach" class="err" hidden></div>
<div id="server" class="muted">loading...</div>
<div id="counters" class="muted"></div>
<div id="updated" class="muted"></div>
<div id="partitions"></div>
<h2>Storage nodes</h2><div id="nodes"></div>
<h2>Recent errors</h2><div id="errors"></div>
<script>
"use strict";
const REFRESH_MS = __REFRESH_MS__;
function el(tag, text, cls) { const e = document.createElement(tag);
  if (text !== undefined) e.textContent = String(text);
  if (cls) e.className = cls; return e; }
function size(n) { if (n === null || n === undefined) return "?"; const u = ["B","KiB","MiB","GiB","TiB"]; let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; } return (i ? n.toFixed(1) : n) + " " + u[i]; }
function bar(pct) { const d = el("span"); const b = el("span", undefined, "bar"); b.style.width = (pct * 1.2) + "px";
  d.appendChild(b); d.appendChild(document.createTextNode(pct.toFixed(1) + "%")); return d; }
function table(head, rows, id) { const t = el("table"); if (id) t.id = id; const tr = el("tr");
  head.forEach(h => tr.appendChild(el("th", h))); t.appendChild(tr);
  rows.forEach(r => { const row = el("tr"); r.forEach(c => { const td = el("td");
    if (c instanceof Node) td.appendChild(c); else td.textContent = String(c); row.appendChild(td); });
    t.appendChild(row); });
  return t; }
function waiting(s) { if (!s.waiters) return "0"; const w = s.waiting_for;
  return s.waiters + (w && w.batch ? " (batch " + w.batch + " of " + w.fields.join(",") + ")" : " (any change)"); }
function leases(s) { if (!s.in_flight) return "0"; return s.in_flight + " (" + s.lapsed + " lapsed)"; }
function draw(snap) {
  const sv = snap.server;
  document.getElementById("server").textContent = (sv.refused ? "server: INFO refused (" + sv.refused + ")"
    : sv.product + " " + sv.version + ": memory " + size(sv.used_memory)
      + " used of " + (sv.maxmemory ? size(sv.maxmemory) : "no limit") + ", eviction policy " + sv.maxmemory_policy)
    + "; bytes " + size(snap.bytes.inline) + " inline in Redis, "
    + size(Object.values(snap.bytes.nodes).reduce((a, b) => a + b, 0))
    + " on storage nodes, " + size(snap.bytes.spilled) + " spilled";
  const c = (snap.counters || {}).total || {};
  document.getElementById("counters").textContent = "events counted (they never go down; cleared partitions "
    + "included): lease expiries " + (c.lease_expiries || 0) + ", redeliveries " + (c.redeliveries || 0)
    + ", poisoned " + (c.poisoned || 0);
  const parts = document.getElementById("partitions"); parts.replaceChildren();
  if (!snap.partitions.length) parts.appendChild(el("p", "no partitions", "muted"));
  snap.partitions.forEach(p => {
    const box = el("div"); box.className = "partition"; box.dataset.partition = p.id;
    box.appendChild(el("h2", "partition " + p.id + ": " + p.samples + " samples" + (p.sealed ? ", sealed" : "")
      + ", age " + (p.age_s === null ? "?" : p.age_s + " s") + ", inline " + p.inline.values + " values"));
    box.appendChild(table(["field", "produced", "progress"],
      Object.entries(p.fields).map(([f, s]) => [f, s.produced, bar(s.pct)])));
    box.appendChild(table(["task", "claimable", "consumed", "progress", "leases in flight", "redelivered",
      "poison", "waiters", "lease expiries", "redeliveries", "poisoned"],
      Object.entries(p.tasks).map(([t, s]) => [t, s.claimable, s.consumed, bar(s.pct), leases(s), s.redelivered,
        s.poison, waiting(s), s.lease_expiries || 0, s.redeliveries || 0, s.poisoned || 0])));
    parts.appendChild(box);
  });
  const nodes = document.getElementById("nodes"); nodes.replaceChildren();
  nodes.appendChild(table(["node", "used", "capacity", "spilled", "heartbeat"],
    snap.storage_nodes.map(n => [n.address && n.address !== n.id ? n.id + " at " + n.address : n.id,
      size(n.used || 0), size(n.capacity || 0),
      size(n.spilled_bytes || 0),
      n.heartbeat_age_s === undefined ? "?" : n.heartbeat_age_s + " s ago"]), "node-table"));
  const rep = snap.replica_repair;
  if (rep) {
    nodes.appendChild(el("p", "replica repair: " + rep.state + ", " + rep.repaired + " value(s) re-made in all" +
      (rep.state === "copying" ? "; dead node " + rep.dead + ": " + rep.values_done + " of " + rep.values_total +
        " re-made, " + rep.under_replicated + " under-replicated" : "") +
      (rep.waiting ? "; waiting: " + rep.waiting : ""), "replica-repair"));
  }
}
function drawErrors(errors) {
  const box = document.getElementById("errors"); box.replaceChildren();
  if (!errors.length) { box.appendChild(el("p", "none", "muted")); return; }
  errors.forEach(e => box.appendChild(el("div", new Date(e.time * 1000).toISOString() + " " + e.text, "err")));
}
function drawReach(body) {
  // Redis gone: say so, and keep the last snapshot on the page (the server sends it again)
  const reach = document.getElementById("reach");
  reach.hidden = body.live !== false;
  if (reach.hidden) return;
  const taken = body.as_of ? new Date(body.as_of * 1000).toISOString() : null;
  reach.textContent = body.problem + (taken ? "; showing the last snapshot, taken " + taken
    : "; no snapshot read yet");
  if (!body.snapshot) document.getElementById("server").textContent = body.problem;
}
async function refresh() {
  try {
    const resp = await fetch("api/snapshot", {cache: "no-store"});
    const body = await resp.json();
    if (body.snapshot) draw(body.snapshot);
    drawReach(body);
    drawErrors(body.errors);
    document.getElementById("updated").textContent = "updated " + new Date().toISOString() + " (every "
      + REFRESH_MS / 1000 + " s)";
    document.body.dataset.refreshed = String(Number(document.body.dataset.refreshed || 0) + 1);
  } catch (e) {
    drawErrors([{time: Date.now() / 1000, text: "the dashboard did not answer: " + e}]);
  }
}
refresh(); setInterval(refresh, REFRESH_MS);
</script></body></html>
"""


class Dashboard:
    """The state behind the page: a Redis client of one namespace and the errors it met lately."""

    def __init__(self, redis_url: str, namespace: str, *, refresh_s: float = 2.0, keep_errors: int = 20) -> None:
        from tq_redis.server import connections

        self.namespace = namespace
        self.refresh_s = refresh_s
        self._url = redis_url
        # one try per read: the page's next refresh is the retry, so a Redis that is gone is reported
        # at once instead of after the reconnect backoff (seconds per request)
        self._redis = connections.sync_client(redis_url, reconnect=False, socket_connect_timeout=3, socket_timeout=5)
        self._lock = threading.Lock()
        self.errors: deque[dict[str, Any]] = deque(maxlen=keep_errors)
        self._last: dict[str, Any] | None = None  # the last snapshot read, and when
        self._last_at: float | None = None

    def page(self) -> bytes:
        from html import escape

        return (_PAGE.replace("__NS__", escape(self.namespace))
                .replace("__REFRESH_MS__", str(int(self.refresh_s * 1000))).encode())

    def snapshot_json(self) -> bytes:
        """``{"snapshot", "as_of", "live", "problem", "errors"}``: the namespace now, or -- when the read
        fails -- the last snapshot read (None before the first) with ``live`` false and ``problem``
        saying what is wrong ("Redis unreachable" when it cannot be reached); a failed read also adds one
        line to ``errors`` (the URL redacted)."""
        from tq_redis.monitor.status import snapshot

        problem = None
        with self._lock:  # one reader of the client at a time
            try:
                self._last, self._last_at = snapshot(self._redis, self.namespace), time.time()
            except Exception as exc:  # the page says what failed; the server keeps serving
                problem = "Redis unreachable" if _unreachable(exc) else "reading Redis failed"
                text = " ".join(f"{type(exc).__name__}: {exc}".split()).replace(self._url, redact(self._url))
                self.errors.append({"time": time.time(), "text": f"reading namespace {self.namespace!r}: {text}"})
            return json.dumps({"snapshot": self._last, "as_of": self._last_at, "live": problem is None,
                               "problem": problem, "errors": list(self.errors)}).encode()

    def close(self) -> None:
        self._redis.close()


def _unreachable(exc: BaseException) -> bool:
    """Whether a failed read means Redis cannot be reached (down, unreachable, timing out)."""
    import redis

    from tq_redis.errors import ConnectionFailed

    return isinstance(exc, redis.ConnectionError | redis.TimeoutError | OSError | ConnectionFailed)


def _handler(dashboard: Dashboard) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "tq-redis-dashboard"

        def _send(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if path in ("/", "/index.html"):
                self._send(200, dashboard.page(), "text/html; charset=utf-8")
            elif path == "/api/snapshot":
                self._send(200, dashboard.snapshot_json(), "application/json")
            else:
                self._send(404, b"not found\n", "text/plain")

        do_HEAD = do_GET  # noqa: N815

        def _read_only(self) -> None:
            self._send(405, b"read-only\n", "text/plain")

        do_POST = do_PUT = do_DELETE = do_PATCH = _read_only  # noqa: N815

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass  # no access log on stderr

    return Handler


def serve(redis_url: str, namespace: str, port: int = 0, host: str = "127.0.0.1", *,
          refresh_s: float = 2.0) -> tuple[ThreadingHTTPServer, str, Dashboard]:
    """Start the dashboard in a background thread; returns ``(server, url, dashboard)``."""
    dashboard = Dashboard(redis_url, namespace, refresh_s=refresh_s)
    server = ThreadingHTTPServer((host, port), _handler(dashboard))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="tq-dashboard", daemon=True).start()
    return server, f"http://{host}:{server.server_address[1]}/", dashboard
