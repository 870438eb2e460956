/* ------------------------------------------------------------------------- */
/* A recurring allreduce_state in one call (mpitree/_oneshot_lane.py): the   */
/* agreement's all-reduce (MIN of four int64, the same collective and the    */
/* same vector as mpitree/_guard.py agree sends for this call), then, if     */
/* every rank sent that vector, the records into the merger's buffer and its */
/* persistent all-reduce, then the merged records out. MPI_Allreduce takes   */
/* handles by value, whose C type differs between MPIs: int in MPICH, a      */
/* pointer in Open MPI and the MPI ABI; mpitree_oneshot.handle_bytes says    */
/* which, and the call goes through the matching function type.              */
/* ------------------------------------------------------------------------- */
#include <math.h>
#include <stddef.h>
#include <string.h>

#include "_native.h"

typedef int (*allreduce_int_handles)(const void *, void *, int, int, int, int);
typedef int (*allreduce_pointer_handles)(const void *, void *, int, void *, void *, void *);

/* The agreement: got = MIN over ranks of sent (four int64). Returns the MPI error code. */
static int agree(mpitree_oneshot *o)
{
    if (o->handle_bytes == 4)
        return ((allreduce_int_handles)o->allreduce)(
            o->sent, o->got, 4, (int)o->int64_type, (int)o->min_op, (int)o->comm);
    return ((allreduce_pointer_handles)o->allreduce)(
        o->sent, o->got, 4, (void *)(intptr_t)o->int64_type, (void *)(intptr_t)o->min_op,
        (void *)(intptr_t)o->comm);
}

/*
 * MPI_Finalized first (nothing else may run after MPI_Finalize); then the agreement
 * (skipped when allreduce is NULL: one rank); then, if every rank sent this rank's
 * vector, nbytes of in into the records, this rank's flag clear, the persistent
 * all-reduce (skipped when start is NULL: one rank), and the records into out unless
 * some rank's flag is set. Returns 0 (out written), 1 (a rank's flag is set: out
 * untouched), 2 (an MPI call returned the error code left in mpi_error), 4 (MPI is
 * finalized: nothing ran) or 5 (the agreement's result, in got, differs from sent:
 * nothing else ran; the caller reads got as agree does).
 */
int mpitree_oneshot_merge_f32(mpitree_oneshot *o, const void *in, void *out)
{
    int err = 0, done = 1;
    if (o->finalized(&done) != 0 || done)
        return 4;
    if (o->allreduce != NULL) {
        err = agree(o);
        if (err != 0) {
            o->mpi_error = err;
            return 2;
        }
        if (memcmp(o->sent, o->got, sizeof o->sent) != 0)
            return 5;
    }
    memcpy(o->records, in, (size_t)o->nbytes);
    *o->flag = -INFINITY;
    if (o->start != NULL) {
        err = o->start(o->request);
        if (err == 0)
            err = o->wait(o->request, o->status);
    }
    if (err != 0) {
        o->mpi_error = err;
        return 2;
    }
    if (*o->flag != -INFINITY)
        return 1;
    memcpy(out, o->records, (size_t)o->nbytes);
    return 0;
}
