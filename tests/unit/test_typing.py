"""What a type checker sees of the public API: mypy runs on typical user calls
(tests/typing/user_calls.py: no error) and on wrong ones (tests/typing/wrong_calls.py: exactly the
error each line's ``# expect: CODE`` names), and the package says it is typed (``py.typed``)."""

from __future__ import annotations

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
