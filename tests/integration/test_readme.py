"""The README's usage snippet runs as printed, in a process of its own (``tq.init()``: an embedded
Valkey and two DRAM nodes), and says the truth about the output layout: a tensor field comes back
as a nested tensor (``torch.equal`` raises on it), and ``.to_padded_tensor(0)`` makes it dense."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).parents[2] / "README.md"

CHECKS = """
assert data["prompt"].is_nested and not data["reward"].is_nested
assert prompts.shape == (4, 16) and not prompts.is_nested
try:
    torch.equal(data["prompt"], prompts)
except Exception:  # what the README warns of
    pass
else:
    raise AssertionError("torch.equal on a nested tensor no longer raises: the README's warning is stale")
print("readme snippet ok")
"""


def _usage_snippet() -> str:
    text = README.read_text()
    section = text[text.index("\n## Usage\n"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_usage_snippet_runs_and_its_layout_note_is_right(tmp_path):
    script = tmp_path / "usage.py"
    script.write_text(_usage_snippet() + CHECKS)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "readme snippet ok" in out.stdout
