"""The reference's six tutorials, from its downloaded wheel, run unchanged through the alias
(tests/compat/reference_programs.py says how)."""

from __future__ import annotations

import pytest

from tests.compat.reference_programs import TUTORIALS, alias_pythonpath, run_unchanged, tutorial_dir, wheel_dir

__all__ = ["alias_pythonpath", "tutorial_dir", "wheel_dir"]  # fixtures, used by name


@pytest.mark.slow  # each starts Ray: ~20 s apiece, so CI runs them beside the soak tests
@pytest.mark.parametrize("tutorial", TUTORIALS)
def test_reference_tutorial_runs_unchanged(tutorial, tutorial_dir, alias_pythonpath, tmp_path):
    run_unchanged(tutorial_dir / tutorial, alias_pythonpath, tmp_path, 300)
