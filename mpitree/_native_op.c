/*
 * Native combine for mpitree's MPI user-defined reduction.
 *
 * A record is [m, d, n_0 .. n_{D-1}] (float32 or float64): running max of the
 * logits (natural-log scale), softmax denominator and numerator.  The functions
 * below have the MPI_User_function signature but need no mpi.h: the datatype
 * argument is never read.  MPI gives no user data to a reduction callback, so the
 * head dimension D comes from a slot table: slot i of each dtype is bound to one
 * D by mpitree_bind_slot() before its MPI_Op is created.
 *
 * One definition of the merge, shared with numpy's combine_records and the local
 * kernels: plain IEEE arithmetic, m = max(ma, mb) with NaN winning, each side
 * scaled by exp(m_side - m) (by exp(-inf) = 0 when both are empty, m == -inf).
 * Nothing is ever skipped, so a NaN anywhere in a record survives every merge
 * (0 * NaN = NaN), and the empty state (m = -inf, d = 0, n = 0) is the identity.
 * A record with m == NaN (a NaN score) is poisoned: every field of the result is
 * NaN. The merge is commutative: combine(a, b) == combine(b, a), bit for bit
 * wherever no NaN is involved.
 */
#include <math.h>
#include <stddef.h>

#include "_native.h"

#define MPITREE_NSLOTS 64

static int slot_dim_f32[MPITREE_NSLOTS];
static int slot_dim_f64[MPITREE_NSLOTS];

#define DEFINE_COMBINE(T, SUF, EXP)                                              \
    static void combine_##SUF(const T *in, T *io, int count, int dim)           \
    {                                                                            \
        const int w = dim + 2;                                                   \
        for (int r = 0; r < count; ++r, in += w, io += w) {                      \
            const T ma = in[0], mb = io[0];                                      \
            if (ma <= mb) { /* no NaN; both empty: scale exp(-inf) = 0 */        \
                const T s = EXP(ma - (mb == -INFINITY ? 0 : mb));                \
                for (int j = 1; j < w; ++j)                                      \
                    io[j] += s * in[j];                                          \
            } else { /* ma > mb, or a NaN: then s and m are NaN */              \
                const T s = EXP(mb - ma);                                        \
                io[0] = ma > mb ? ma : (T)NAN;                                   \
                for (int j = 1; j < w; ++j)                                      \
                    io[j] = in[j] + s * io[j];                                   \
            }                                                                    \
        }                                                                        \
    }

DEFINE_COMBINE(float, f32, expf)
DEFINE_COMBINE(double, f64, exp)

#define SLOT(SUF, T, B, I)                                                       \
    static void op_##SUF##_##B##_##I(void *in, void *io, int *len, void *dt)    \
    {                                                                            \
        (void)dt;                                                                \
        combine_##SUF((const T *)in, (T *)io, *len, slot_dim_##SUF[8 * B + I]); \
    }

#define SLOTS8(SUF, T, B)                                                        \
    SLOT(SUF, T, B, 0) SLOT(SUF, T, B, 1) SLOT(SUF, T, B, 2) SLOT(SUF, T, B, 3)  \
    SLOT(SUF, T, B, 4) SLOT(SUF, T, B, 5) SLOT(SUF, T, B, 6) SLOT(SUF, T, B, 7)

#define SLOTS64(SUF, T)                                                          \
    SLOTS8(SUF, T, 0) SLOTS8(SUF, T, 1) SLOTS8(SUF, T, 2) SLOTS8(SUF, T, 3)      \
    SLOTS8(SUF, T, 4) SLOTS8(SUF, T, 5) SLOTS8(SUF, T, 6) SLOTS8(SUF, T, 7)

SLOTS64(f32, float)
SLOTS64(f64, double)

#define P8(SUF, B)                                                               \
    op_##SUF##_##B##_0, op_##SUF##_##B##_1, op_##SUF##_##B##_2,                  \
    op_##SUF##_##B##_3, op_##SUF##_##B##_4, op_##SUF##_##B##_5,                  \
    op_##SUF##_##B##_6, op_##SUF##_##B##_7
#define P64(SUF) P8(SUF, 0), P8(SUF, 1), P8(SUF, 2), P8(SUF, 3), P8(SUF, 4),    \
                 P8(SUF, 5), P8(SUF, 6), P8(SUF, 7)

typedef void (*user_fn)(void *, void *, int *, void *);
static user_fn const table_f32[MPITREE_NSLOTS] = {P64(f32)};
static user_fn const table_f64[MPITREE_NSLOTS] = {P64(f64)};

int mpitree_nslots(void) { return MPITREE_NSLOTS; }

/* Bind slot `slot` of dtype `bits` (32 or 64) to head dim `dim`; return the
 * user function to hand to MPI_Op_create, or NULL on bad arguments. */
void *mpitree_bind_slot(int bits, int slot, int dim)
{
    if (slot < 0 || slot >= MPITREE_NSLOTS || dim < 1)
        return NULL;
    if (bits == 32) {
        slot_dim_f32[slot] = dim;
        return (void *)table_f32[slot];
    }
    if (bits == 64) {
        slot_dim_f64[slot] = dim;
        return (void *)table_f64[slot];
    }
    return NULL;
}

/* Merge `count` records of `in` into `io` (the same code MPI runs). */
void mpitree_combine(int bits, const void *in, void *io, int count, int dim)
{
    if (bits == 32)
        combine_f32((const float *)in, (float *)io, count, dim);
    else
        combine_f64((const double *)in, (double *)io, count, dim);
}
