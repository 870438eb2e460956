"""Sphinx configuration for mpitree's documentation (built with -W in CI)."""

import importlib.metadata

project = "mpitree"
author = "mpitree developers"
release = importlib.metadata.version("mpitree")
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.intersphinx",
    "numpydoc",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 4
myst_enable_extensions = ["dollarmath"]

# Optional GPU frameworks are absent on the docs machine; their adapters import them lazily.
autodoc_mock_imports = ["cupy", "flash_attn"]
autodoc_member_order = "bysource"
autodoc_typehints = "none"
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

intersphinx_mapping = {}
html_theme = "furo"
html_title = f"mpitree {release}"
