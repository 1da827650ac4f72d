"""The operator's commands start fast: ``tq-redis status`` (and the exporter and dashboard, which
read the same snapshot) never import torch or tensordict, whose import alone takes seconds here."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import free_port

PROBE = """
import sys
from tq_redis.cli.main import main
code = main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "tensordict") if m in sys.modules)
print("imported:", ",".join(heavy) or "-")
sys.exit(code)
"""


def test_status_reads_without_importing_torch():
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens: the command fails fast, typed
    for command in (["status"], ["status", "--json"]):
        out = subprocess.run([sys.executable, "-c", PROBE, *command, "--redis", url, "--namespace", "x"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 1 and "cannot reach Redis" in out.stderr, out.stderr[-2000:]
        assert "imported: -" in out.stdout, f"{command} imported {out.stdout.strip()}"
