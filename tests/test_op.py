"""The (m, d, n) combine as an MPI op: the numpy fallback op's pair, at real ranks and alone."""

import numpy as np
import pytest
from mpi4py import MPI
from test_merge_definition import assert_same_bits, records

from mpitree import _op
from mpitree._state import combine_records


@pytest.mark.parallel(2)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("dim", [1, 7, 64])
def test_numpy_op_merges_as_the_definition_on_two_ranks(dim, dtype):
    """An all-reduce with the numpy op's own pair gives combine_records' bits on each rank."""
    comm = MPI.COMM_WORLD
    mine = records(3, dim, dtype, comm.rank)
    rec, op = _op.python_op(dtype, dim + 2)
    try:
        with np.errstate(all="ignore"):
            comm.Allreduce(MPI.IN_PLACE, [mine, len(mine), rec], op)
            want = combine_records(records(3, dim, dtype, 0), records(3, dim, dtype, 1))
    finally:
        op.Free()
        rec.Free()
    assert_same_bits(mine, want)


def reduce_local(op, theirs, ours, datatype, count):
    """Run ``op`` as MPI runs it inside a reduction: ``ours = theirs (op) ours``."""
    op.Reduce_local([theirs, count, datatype], [ours, count, datatype])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numpy_op_never_raises(dtype):
    """Any count, another record width or a foreign datatype: no exception leaves the op.

    The width comes from the datatype MPI hands the op; what is not whole records of the
    op's dtype is written as NaN (so a flagged merge reports it), never raised (an
    exception in a user function aborts the job).
    """
    width = 6
    rec, op = _op.python_op(dtype, width)
    wide = (MPI.FLOAT if dtype == np.float32 else MPI.DOUBLE).Create_contiguous(9).Commit()
    old = np.seterr(all="raise")  # a user's setting: the op's arithmetic must not raise
    try:
        for count in (0, 1, 5):
            a, b = records(1, width - 2, dtype, 0)[:count], records(1, width - 2, dtype, 1)[:count]
            ours = b.copy()
            reduce_local(op, a, ours, rec, count)
            with np.errstate(all="ignore"):
                assert_same_bits(ours, combine_records(a, b))
        flat = np.ones(12, dtype)
        reduce_local(op, flat.copy(), flat, MPI.FLOAT if dtype == np.float32 else MPI.DOUBLE, 12)
        assert np.isnan(flat).all()  # one value is not a record: poisoned, not raised
        nine = records(2, 7, dtype, 0)[:3]
        ours = records(2, 7, dtype, 1)[:3].copy()
        reduce_local(op, nine, ours, wide, 3)  # the width of the datatype given, not the op's
        with np.errstate(all="ignore"):
            assert_same_bits(ours, combine_records(nine, records(2, 7, dtype, 1)[:3]))
        half = np.ones(8, np.float32 if dtype == np.float64 else np.float64)
        reduce_local(op, half.copy(), half, MPI.FLOAT if dtype == np.float64 else MPI.DOUBLE, 8)
    finally:
        np.seterr(**old)
        wide.Free()
        op.Free()
        rec.Free()


def test_record_op_pairs_its_datatype():
    """``record_op`` hands out a datatype of the width asked, with its op, once per key."""
    rec, op = _op.record_op(np.float32, 10)
    assert rec.Get_size() == 40 and _op.record_op(np.float32, 10) == (rec, op)
