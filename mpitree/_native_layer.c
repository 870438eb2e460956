/* ------------------------------------------------------------------------- */
/* One decode layer's local step, bound once (mpitree/_kernel.py BoundLayer). */
/* The kernel's arguments and the addresses of K, V (the cache's buffers,    */
/* which grow in place), the merge's records and the scratch stay the same   */
/* step after step; a step sets only q, the shard length and the step's      */
/* visibility, then one call runs the kernel into the records and, after the */
/* merge, one call writes the output in transformers' (B, Sq, Hq, D) layout. */
/* Where the merge is one persistent all-reduce, mpitree_layer_step_f32 does */
/* all three in one call: the merge's own Python (mpitree/_merger.py         */
/* Merger.merge_layer) only counts the bytes and reads the verdict.          */
/* ------------------------------------------------------------------------- */
#define _POSIX_C_SOURCE 199309L /* clock_gettime */

#include <math.h>
#include <stddef.h>
#include <time.h>

#include "_native.h"

/* The step's records of q over the shard: mpitree_attend_f32 on the bound arguments. */
void mpitree_layer_attend_f32(mpitree_layer *l)
{
    l->args.t = l->t;
    l->args.vis = l->vis;
    l->args.vis_heads = l->vis_heads;
    l->args.lens = NULL;
    mpitree_attend_f32(&l->args, l->q, l->k, l->v, l->rec, l->scratch);
}

/* The merged records' output into out (B, Sq, Hq, D), C order: mpitree_finish_f32. */
void mpitree_layer_finish_f32(const mpitree_layer *l, float *out)
{
    const mpitree_attn_args *a = &l->args;
    mpitree_finish_f32(l->rec, a->batch, a->q_heads, a->q_len, a->head_dim, out);
}

/* Monotonic nanoseconds (for phase_times only). */
static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/*
 * The whole step: the kernel into the records, this rank's flag (no failure: nothing
 * here fails), the bound all-reduce, then the output into out unless some rank failed.
 * MPI_Finalized comes first: after MPI_Finalize no other MPI call may run, and the
 * caller may not have asked (a step's later layer runs in its entry point's lane,
 * mpitree/_guard.py, before the guard). Returns 0 (out written), 1 (a rank's
 * flag says it failed: out untouched), 2 (an MPI call returned the error code left in
 * l->mpi_error), 3 (no merge is bound: nothing ran) or 4 (MPI is finalized: nothing ran).
 */
int mpitree_layer_step_f32(mpitree_layer *l, float *out)
{
    int err = 0, done = 1;
    int64_t t0, t1;
    if (l->flag == NULL || l->finalized == NULL)
        return 3;
    if (l->finalized(&done) != 0 || done)
        return 4;
    t0 = l->timed ? now_ns() : 0;
    mpitree_layer_attend_f32(l);
    t1 = l->timed ? now_ns() : 0;
    *l->flag = MPITREE_FLAG_CLEAR;
    if (l->start != NULL) {
        err = l->start(l->request);
        if (err == 0)
            err = l->wait(l->request, l->status);
    }
    if (l->timed) {
        l->kernel_ns = t1 - t0;
        l->collective_ns = now_ns() - t1;
    }
    if (err != 0) {
        l->mpi_error = err;
        return 2;
    }
    if (*l->flag != MPITREE_FLAG_CLEAR)
        return 1;
    mpitree_layer_finish_f32(l, out);
    return 0;
}
