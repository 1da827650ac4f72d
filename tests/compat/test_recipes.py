"""The reference's recipes (what users copy to start), from its downloaded wheel, run unchanged through
the alias (tests/compat/reference_programs.py says how)."""

from __future__ import annotations

import pytest

from tests.compat.reference_programs import RECIPES, alias_pythonpath, run_unchanged, wheel_dir

__all__ = ["alias_pythonpath", "wheel_dir"]  # fixtures, used by name


@pytest.mark.slow  # Ray workers and the recipes' own sleeps: 2-4 minutes apiece here
@pytest.mark.parametrize("recipe", RECIPES)
def test_reference_recipe_runs_unchanged(recipe, wheel_dir, alias_pythonpath, tmp_path):
    run_unchanged(wheel_dir / "recipe" / recipe, alias_pythonpath, tmp_path, 600)
