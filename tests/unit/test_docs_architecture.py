"""The docs' architecture page draws the package as it is, so it cannot drift from the code.

``docs/architecture.md`` lists the layers in a fenced block after the marker
``<!-- layers: ...`` and describes every subpackage by its dotted name. These tests compare that
list with the ``layers`` contract of ``[tool.importlinter]`` in pyproject.toml (the one
``lint-imports`` enforces) and check that no subpackage or layered module goes unnamed.
"""

from __future__ import annotations

import pkgutil
import re
import sys
from pathlib import Path

import pytest

import tq_redis

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"
MARKER = "<!-- layers:"


def contract_layers() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "layers"]
    return list(contract["layers"])


def page_layers(text: str) -> list[str]:
    """The lines of the first fenced block after the layers marker."""
    assert MARKER in text, f"{PAGE} lost its {MARKER} ... --> marker before the list of layers"
    after = text.split(MARKER, 1)[1]
    block = re.search(r"^```[^\n]*\n(.*?)^```", after, re.S | re.M)
    assert block, f"no fenced block follows the {MARKER} marker in {PAGE}"
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def subpackages() -> list[str]:
    return sorted(
        info.name for info in pkgutil.walk_packages(tq_redis.__path__, "tq_redis.") if info.ispkg
    )


def test_the_page_lists_the_layers_of_the_import_contract_in_its_order():
    assert page_layers(PAGE.read_text()) == contract_layers()


def test_the_page_names_every_subpackage_and_every_layered_module():
    text = PAGE.read_text()
    layered = [f"tq_redis.{name.strip()}" for layer in contract_layers() for name in layer.split("|")]
    missing = [name for name in subpackages() + layered if f"`{name}`" not in text]
    assert not missing, f"{PAGE.name} does not describe {missing}"


def test_the_subpackage_walk_finds_the_nested_ones():
    # the check above must see packages below the top level too (the DRAM store, the Lua helpers' parent)
    found = subpackages()
    assert "tq_redis.backends.dram" in found and "tq_redis.lua" in found and "tq_redis.ops" in found


def test_a_page_whose_layers_drifted_is_told_apart():
    text = PAGE.read_text()
    layers = contract_layers()
    swapped = text.replace(f"\n{layers[0]}\n{layers[1]}\n", f"\n{layers[1]}\n{layers[0]}\n", 1)
    assert swapped != text and page_layers(swapped) != layers
