/* ------------------------------------------------------------------------- */
/* One decode layer's local step, bound once (mpitree/_kernel.py BoundLayer). */
/* The kernel's arguments and the addresses of K, V (the cache's buffers,    */
/* which grow in place), the merge's records and the scratch stay the same   */
/* step after step; a step sets only q, the shard length and the step's      */
/* visibility, then one call runs the kernel into the records and, after the */
/* merge, one call writes the output in transformers' (B, Sq, Hq, D) layout. */
/* ------------------------------------------------------------------------- */
#include <stddef.h>

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
