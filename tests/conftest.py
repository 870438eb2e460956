"""Test configuration: under mpiexec with MPITREE_QUIET=1, only rank 0 prints."""

import os

import pytest
from mpi4py import MPI


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cluster: tests on an emulated cluster (they skip without root and ip netns)"
    )
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


if not _cuda_device():
    # CPU tensors run the Triton kernels under Triton's interpreter. Set before any test
    # module imports triton: importing transformers imports it, and triton fixes its mode then.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _cluster_host():
    """Return why an emulated cluster cannot be made here (not root, no ``ip netns``), or ""."""
    from mpitree.cluster import ClusterError, check_host

    try:
        check_host()
    except ClusterError as exc:
        return str(exc)
    return ""


def pytest_collection_modifyitems(config, items):
    """Tag ``cuda``- and ``cluster``-marked tests for the runner; skip them where they cannot run.

    ``cuda``: where no CUDA device is usable; ``cluster``: where network
    namespaces cannot be made (not root, no ``ip netns``), with the reason.
    """
    for marker, why in (("cuda", _cuda_device), ("cluster", _cluster_host)):
        marked = [item for item in items if item.get_closest_marker(marker)]
        if not marked:
            continue
        found = why()
        if marker == "cuda":
            reason = "" if found else "cuda-marked: no CUDA device"
        else:
            reason = found and f"cluster-marked: {found}"
        for item in marked:
            item.user_properties.append(("marker", marker))
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
