"""The core install is what a training rank needs: the demo's libraries and fsspec are extras.

The installed metadata is read (what ``pip install tq-redis`` pulls), and a subprocess in which
those libraries cannot be imported checks that the client, the CLI and a storage node work
without them and that what needs them names the extra to install.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXTRAS_ONLY = ("matplotlib", "rich", "fsspec")


def _requirements() -> tuple[set[str], dict[str, set[str]]]:
    """``(core, {extra: names})`` of the installed tq-redis, project names lower-cased."""
    core: set[str] = set()
    extras: dict[str, set[str]] = {}
    for requirement in importlib.metadata.requires("tq-redis") or []:
        name = re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0).lower().replace("_", "-")
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", requirement)
        if extra:
            extras.setdefault(extra.group(1), set()).add(name)
        else:
            core.add(name)
    return core, extras


def test_core_install_pulls_neither_the_demo_libraries_nor_fsspec() -> None:
    core, extras = _requirements()
    assert "torch" in core and "redis" in core  # the metadata was read
    assert not core & set(EXTRAS_ONLY), f"core dependencies name {sorted(core & set(EXTRAS_ONLY))}"
    assert {"rich", "matplotlib"} <= extras["demo"]
    assert extras["monitor"] == {"rich"}  # `tq-redis status` tables
    assert {"fsspec", "s3fs"} <= extras["s3"]
    assert "tq-redis" in extras["test"]  # [test] pulls [demo] and [s3]: the tests use both


# Runs with matplotlib, rich and fsspec unimportable; prints one JSON line of what it saw.
_WITHOUT_EXTRAS = """
import contextlib, io, json, sys
from pathlib import Path
for name in ("matplotlib", "rich", "fsspec"):
    sys.modules[name] = None
seen = {}
import tq_redis as tq
seen["client"] = tq.TransferQueueClient.__name__
import tq_redis.cli.main, tq_redis.dock.dock, tq_redis.channel.channel
import tq_redis.integrations.dataloader, tq_redis.monitor.status, tq_redis.monitor.status_view
seen["status_rich"] = tq_redis.monitor.status_view.have_rich()
stderr = io.StringIO()
with contextlib.redirect_stderr(stderr):
    seen["cli_demo"] = [tq_redis.cli.main.main(["demo", "--steps", "1", "--out", sys.argv[2]]), stderr.getvalue()]
seen["demo_out_made"] = Path(sys.argv[2]).exists()
import tq_redis.backends.dram.node, tq_redis.backends.dram.server  # a storage node without --spill
from tq_redis.storage.base import store_class
from tq_redis.backends.dram.spill import SpillTier
from tq_redis.demo.pipeline import run_demo
from tq_redis.errors import ConfigError
for what, call in (("fsspec_store", lambda: store_class("fsspec")),
                   ("spill", lambda: SpillTier(sys.argv[1], "node-0")),
                   ("demo", lambda: run_demo(steps=1))):
    try:
        call()
    except ConfigError as exc:
        seen[what] = [type(exc).__name__, str(exc)]
loaded = [name for name in ("matplotlib", "rich", "fsspec") if sys.modules.get(name) is not None]
seen["loaded"] = loaded
print(json.dumps(seen))
"""


def test_without_the_extras_the_package_works_and_the_rest_names_what_to_install(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_EXTRAS, str(tmp_path / "spill"), str(tmp_path / "demo-out")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["client"] == "TransferQueueClient"
    assert seen["loaded"] == []
    assert seen["status_rich"] is False  # `tq-redis status` prints plain text then
    for what, extra in (("fsspec_store", "[s3]"), ("spill", "[s3]"), ("demo", "[demo]")):
        kind, message = seen[what]
        assert kind == "BackendNotInstalled", (what, kind, message)
        assert f"pip install 'tq-redis{extra}'" in message, (what, message)
    assert "rich and matplotlib" in seen["demo"][1]
    # `tq-redis demo` says it in one line, and starts nothing
    assert seen["cli_demo"] == [1, "tq-redis demo FAILED: the demo needs rich and matplotlib, which the [demo] "
                                   "extra installs: pip install 'tq-redis[demo]'\n"]
    assert not seen["demo_out_made"]
