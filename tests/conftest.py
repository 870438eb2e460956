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


def _cuda_device():
    """Return whether a CUDA device is usable from torch or CuPy, whichever is installed."""
    try:
        import torch

        if torch.cuda.is_available():
            return True
    except ImportError:
        pass
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, or CuPy without a driver
        return False


def pytest_collection_modifyitems(config, items):
    """Tag ``cuda``-marked tests for the runner; skip them where no CUDA device is usable."""
    cuda_items = [item for item in items if item.get_closest_marker("cuda")]
    if not cuda_items:
        return
    skip = None if _cuda_device() else pytest.mark.skip(reason="cuda-marked: no CUDA device")
    for item in cuda_items:
        item.user_properties.append(("marker", "cuda"))
        if skip is not None:
            item.add_marker(skip)
