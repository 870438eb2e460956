"""Test configuration: under mpiexec with MPITREE_QUIET=1, only rank 0 prints."""

import os

import pytest
from mpi4py import MPI


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    if MPI.COMM_WORLD.size > 1 and MPI.COMM_WORLD.rank > 0 and os.environ.get("MPITREE_QUIET"):
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)
