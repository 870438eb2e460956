/* ------------------------------------------------------------------------- */
/* The one compiled step (mpitree_step, bound once): every fast path runs    */
/* it, bound by mpitree/_steps.py Bound. A decode layer binds the kernel's   */
/* arguments and the addresses of K, V (the cache's buffers, which grow in   */
/* place), the merge's records and the scratch, and sets only q, the shard   */
/* length and the step's visibility each step; a DecodePlan binds its kernel */
/* and records (with kv_len, its kernel slot's int64 lengths buffer, filled  */
/* each step) and sets q, K, V and the shard length. A recurring one-shot    */
/* call also binds the agreement: the MIN all-reduce of four int64 that      */
/* mpitree/_guard.py agree sends for that call, made first, and the rest     */
/* only if every rank sent that vector. Then: this rank's records (the       */
/* kernel over the shard, or a state's records copied in), this rank's flag  */
/* (clear: nothing here fails), the merge's persistent all-reduce (none for  */
/* one rank), and the output (a layer's (B, Sq, Hq, D), a plan's or a        */
/* one-shot call's (B, Hq, Sq, D), or the merged records). MPI_Allreduce     */
/* takes handles by value, whose C type differs between MPIs: int in MPICH,  */
/* a pointer in Open MPI and the MPI ABI; handle_bytes says which, and the   */
/* call goes through the matching function type. The others (MPI_Finalized,  */
/* MPI_Start, MPI_Wait) take pointers only: no mpi.h.                        */
/* ------------------------------------------------------------------------- */
#define _POSIX_C_SOURCE 199309L /* clock_gettime */

#include <math.h>
#include <stddef.h>
#include <string.h>
#include <time.h>

#include "_native.h"

typedef int (*allreduce_int_handles)(const void *, void *, int, int, int, int);
typedef int (*allreduce_pointer_handles)(const void *, void *, int, void *, void *, void *);

/* This rank's records: the kernel over the bound shard with this call's q, T, lengths
 * and visibility, or (MPITREE_LOCAL_COPY) nbytes of source. */
void mpitree_step_local(mpitree_step *s)
{
    if (s->local == MPITREE_LOCAL_COPY) {
        memcpy(s->rec, s->source, (size_t)s->nbytes);
        return;
    }
    s->args.t = s->t;
    s->args.vis = s->vis;
    s->args.vis_heads = s->vis_heads;
    s->args.lens = s->lens;
    mpitree_attend_f32(&s->args, s->q, s->k, s->v, s->rec, s->scratch);
}

/* The merged records' output into out, in the bound output's layout. */
void mpitree_step_output(const mpitree_step *s, void *out)
{
    const mpitree_attn_args *a = &s->args;
    if (s->output == MPITREE_OUTPUT_LAYER)
        mpitree_finish_f32(s->rec, a->batch, a->q_heads, a->q_len, a->head_dim, out);
    else if (s->output == MPITREE_OUTPUT_HEADS)
        mpitree_finish_f32(s->rec, 1, a->batch * a->q_heads * a->q_len, 1, a->head_dim, out);
    else
        memcpy(out, s->rec, (size_t)s->nbytes);
}

/* Monotonic nanoseconds (for phase_times only). */
static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* The agreement (allreduce not NULL): got = MIN over ranks of sent. */
static int agree(mpitree_step *s)
{
    int err;
    if (s->handle_bytes == 4)
        err = ((allreduce_int_handles)s->allreduce)(
            s->sent, s->got, 4, (int)s->int64_type, (int)s->min_op, (int)s->comm);
    else
        err = ((allreduce_pointer_handles)s->allreduce)(
            s->sent, s->got, 4, (void *)(intptr_t)s->int64_type, (void *)(intptr_t)s->min_op,
            (void *)(intptr_t)s->comm);
    if (err != 0) {
        s->mpi_error = err;
        return MPITREE_AGREE_ERROR;
    }
    return memcmp(s->sent, s->got, sizeof s->sent) != 0 ? MPITREE_DISAGREED : MPITREE_OK;
}

/*
 * The whole step, in order: MPI_Finalized (after MPI_Finalize no other MPI call may
 * run, and the caller may not have asked: a step's later layer runs in its entry
 * point's lane, mpitree/_guard.py, before the guard), the agreement where one is
 * bound, this rank's records, its flag, the merge, then the output into out unless
 * some rank failed. Returns an enum mpitree_code (_native.h says what each means).
 */
/* The structs' sizes as this library was built, which the loader compares with its
 * ctypes mirrors (mpitree/_library.py): a library built from other sources is refused. */
int64_t mpitree_struct_size(int which)
{
    return which == 0 ? (int64_t)sizeof(mpitree_step) : (int64_t)sizeof(mpitree_attn_args);
}

int mpitree_step_run(mpitree_step *s, void *out)
{
    int err = 0, done = 1;
    int64_t t0, t1;
    if (s->flag == NULL || s->finalized == NULL)
        return MPITREE_UNBOUND;
    err = s->finalized(&done);
    if (err != 0) {
        s->mpi_error = err;
        return MPITREE_AGREE_ERROR;
    }
    if (done)
        return MPITREE_FINALIZED;
    if (s->allreduce != NULL) {
        err = agree(s);
        if (err != 0)
            return err;
    }
    t0 = s->timed ? now_ns() : 0;
    mpitree_step_local(s);
    t1 = s->timed ? now_ns() : 0;
    *s->flag = MPITREE_FLAG_CLEAR;
    if (s->start != NULL) {
        err = s->start(s->request);
        if (err == 0)
            err = s->wait(s->request, s->status);
    }
    if (s->timed) {
        s->kernel_ns = t1 - t0;
        s->collective_ns = now_ns() - t1;
    }
    if (err != 0) {
        s->mpi_error = err;
        return MPITREE_MERGE_ERROR;
    }
    if (*s->flag != MPITREE_FLAG_CLEAR)
        return MPITREE_FLAGGED;
    mpitree_step_output(s, out);
    return MPITREE_OK;
}
