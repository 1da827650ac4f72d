"""Sphinx configuration of the tq-redis documentation (build: see getting-started.md)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # autodoc reads the package of this checkout, installed or not

import tq_redis  # noqa: E402

project = "tq-redis"
release = tq_redis.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]

# pages are Markdown (MyST); ``{doc}`` links and headings as link targets
myst_enable_extensions = ["deflist"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # a class's Attributes: section as fields, not a second entry beside its properties

html_theme = "furo"
html_title = f"tq-redis {release}"
