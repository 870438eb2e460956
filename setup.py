"""Build script: the packages are found, never listed by hand (metadata: setup.cfg).

``adapters/`` installs as ``mpitree.adapters`` (``package_dir`` in setup.cfg): a
top-level ``adapters`` package would clash with an unrelated PyPI package.
"""

from setuptools import find_packages, setup


def packages():
    """Every package under ``mpitree/``, and ``adapters/``'s under ``mpitree.adapters``."""
    adapters = [f"mpitree.adapters.{name}" for name in find_packages("adapters")]
    return [*find_packages(include=["mpitree", "mpitree.*"]), "mpitree.adapters", *adapters]


if __name__ == "__main__":
    setup(packages=packages())
