"""What a type checker sees of the public API: mypy runs on typical user calls
(tests/typing/user_calls.py: no error) and on wrong ones (tests/typing/wrong_calls.py: exactly the
error each line's ``# expect: CODE`` names), and the package says it is typed (``py.typed``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TYPING = ROOT / "tests" / "typing"
_ERROR = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+): error: (?P<message>.*?)\s+\[(?P<code>[a-z-]+)\]$")


def _expected(path: Path) -> set[tuple[str, int, str]]:
    found = set()
    for number, line in enumerate(path.read_text().splitlines(), 1):
        mark = re.search(r"# expect: ([a-z-]+)$", line)
        if mark:
            found.add((path.name, number, mark.group(1)))
    return found


def test_mypy_sees_every_public_signature(tmp_path: Path) -> None:
    good, wrong = TYPING / "user_calls.py", TYPING / "wrong_calls.py"
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(TYPING / "mypy.ini"), "--cache-dir", str(tmp_path),
         "--no-error-summary", str(good), str(wrong)],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr  # 2: mypy itself failed
    errors = [_ERROR.match(line) for line in proc.stdout.splitlines() if ": error: " in line]
    assert all(errors), proc.stdout
    seen = {(Path(e["file"]).name, int(e["line"]), e["code"]) for e in errors if e}
    expected = _expected(wrong)
    assert len(expected) >= 5  # the marks were read
    assert seen == expected, proc.stdout
    messages = "\n".join(e["message"] for e in errors if e)
    assert '"tiemout"' in messages and '"task_nme"' in messages and '"kv_putt"' in messages


def test_the_package_ships_py_typed() -> None:
    assert resources.files("tq_redis").joinpath("py.typed").is_file()
    package_data = re.search(r'^"tq_redis" = \[(.*)\]$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert package_data and '"py.typed"' in package_data.group(1)  # in the wheel too


def test_mypy_in_the_projects_venv_finds_tq_redis_with_nothing_on_its_path(tmp_path: Path) -> None:
    """A user's checker, run with the project's own interpreter on a file outside the checkout, finds
    the package through the editable install's static path (scripts/setup-venv.sh installs with
    ``editable_mode=compat``), not through MYPYPATH or an import hook it cannot follow."""
    user_file = tmp_path / "wrong_calls.py"
    user_file.write_text((TYPING / "wrong_calls.py").read_text())
    config = tmp_path / "mypy.ini"
    config.write_text(
        "".join(line for line in (TYPING / "mypy.ini").read_text().splitlines(keepends=True)
                if not line.startswith("mypy_path"))
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(config), "--cache-dir", str(tmp_path / "cache"),
         "--no-error-summary", str(user_file)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600,
    )
    assert "Cannot find implementation or library stub" not in proc.stdout, proc.stdout
    seen = {(Path(m["file"]).name, int(m["line"]), m["code"])
            for m in (_ERROR.match(line) for line in proc.stdout.splitlines()) if m}
    assert seen == _expected(user_file), proc.stdout + proc.stderr
