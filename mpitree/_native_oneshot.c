/* ------------------------------------------------------------------------- */
/* A recurring one-shot call in one call (mpitree/_oneshot_lane.py): the     */
/* agreement's all-reduce (MIN of four int64, the same collective and the    */
/* same vector as mpitree/_guard.py agree sends for this call), then, if     */
/* every rank sent that vector, this rank's records into the merger's buffer */
/* (allreduce_state's records, or tree_decode's kernel over the shard), the  */
/* merger's persistent all-reduce, and the merged records or their output    */
/* out. MPI_Allreduce takes handles by value, whose C type differs between   */
/* MPIs: int in MPICH, a pointer in Open MPI and the MPI ABI;                */
/* mpitree_oneshot.handle_bytes says which, and the call goes through the    */
/* matching function type.                                                   */
/* ------------------------------------------------------------------------- */
#include <math.h>
#include <stddef.h>
#include <string.h>

#include "_native.h"

typedef int (*allreduce_int_handles)(const void *, void *, int, int, int, int);
typedef int (*allreduce_pointer_handles)(const void *, void *, int, void *, void *, void *);

/*
 * MPI_Finalized first (nothing else may run after MPI_Finalize), then the agreement
 * (skipped when allreduce is NULL: one rank): got = MIN over ranks of sent. Returns 0
 * (every rank sent this rank's vector), 4 (MPI is finalized: nothing ran), 5 (got
 * differs from sent) or 6 (MPI_Finalized or the agreement returned the error code
 * left in mpi_error).
 */
static int agree(mpitree_oneshot *o)
{
    int err, done = 1;
    err = o->finalized(&done);
    if (err != 0) {
        o->mpi_error = err;
        return 6;
    }
    if (done)
        return 4;
    if (o->allreduce == NULL)
        return 0;
    if (o->handle_bytes == 4)
        err = ((allreduce_int_handles)o->allreduce)(
            o->sent, o->got, 4, (int)o->int64_type, (int)o->min_op, (int)o->comm);
    else
        err = ((allreduce_pointer_handles)o->allreduce)(
            o->sent, o->got, 4, (void *)(intptr_t)o->int64_type, (void *)(intptr_t)o->min_op,
            (void *)(intptr_t)o->comm);
    if (err != 0) {
        o->mpi_error = err;
        return 6;
    }
    return memcmp(o->sent, o->got, sizeof o->sent) != 0 ? 5 : 0;
}

/*
 * This rank's flag clear, then the persistent all-reduce of the records and the flag
 * (skipped when start is NULL: one rank). Returns 0, 1 (a rank's flag is set) or 2.
 */
static int merge(mpitree_oneshot *o)
{
    int err = 0;
    *o->flag = MPITREE_FLAG_CLEAR;
    if (o->start != NULL) {
        err = o->start(o->request);
        if (err == 0)
            err = o->wait(o->request, o->status);
    }
    if (err != 0) {
        o->mpi_error = err;
        return 2;
    }
    return *o->flag != MPITREE_FLAG_CLEAR;
}

/*
 * allreduce_state: the agreement, then nbytes of in into the records, the merge, and
 * the merged records into out. Returns 0 (out written), 1 (a rank's flag is set: out
 * untouched), 2 (the merge's MPI error, in mpi_error), 4 (MPI is finalized: nothing
 * ran), 5 (the agreement's result, in got, is not sent: nothing else ran; the caller
 * reads got as agree does) or 6 (the agreement's MPI error, in mpi_error: nothing
 * else ran). Codes 0 to 2: every rank agreed and the merge ran.
 */
int mpitree_oneshot_merge_f32(mpitree_oneshot *o, const void *in, void *out)
{
    int code = agree(o);
    if (code != 0)
        return code;
    memcpy(o->records, in, (size_t)o->nbytes);
    code = merge(o);
    if (code == 0)
        memcpy(out, o->records, (size_t)o->nbytes);
    return code;
}

/*
 * tree_decode: the agreement, then the kernel (the bound arguments, shard length t)
 * into the records, the merge, and the output n / d (B, Hq, Sq, D) into out. Returns
 * as mpitree_oneshot_merge_f32.
 */
int mpitree_oneshot_decode_f32(mpitree_oneshot *o, const float *q, const float *k,
                               const float *v, int64_t t, float *out)
{
    mpitree_attn_args *a = &o->kernel;
    int code = agree(o);
    if (code != 0)
        return code;
    a->t = t;
    mpitree_attend_f32(a, q, k, v, o->records, o->scratch);
    code = merge(o);
    if (code == 0)
        mpitree_finish_f32(o->records, 1, a->batch * a->q_heads * a->q_len, 1, a->head_dim, out);
    return code;
}
