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
 * wherever no NaN is involved (but for the sign of m when one side's is 0 and the
 * other's -0: the weights, d and n do not depend on it).
 *
 * The exponential is mpitree's own (merge_exp below), not the C library's: libm's
 * exp and expf differ between C libraries, and glibc picks its variant by whether
 * the CPU has FMA, so ranks on different machines could round a merge apart. Plain
 * IEEE double arithmetic (the build passes -ffp-contract=off) gives the same bits
 * on every compiler, C library and CPU. It is the one exponential of the merge: the
 * compiled kernel's exp8/exp1 (_native_kernel.c) are another algorithm (float
 * Cephes-style, fused or not by build), for the weights of its own online softmax
 * within a shard, whose bits the kernel's golden hashes pin (tests/test_kernel.py).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "_native.h"

/* 2**k as a double, for -1022 <= k <= 1023 (a normal number: exact). */
static double pow2(int k)
{
    const uint64_t bits = (uint64_t)(k + 1023) << 52;
    double x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* exp(x) in double within 1 ulp (0.97 at most over 3M random points); exp(0) = 1,
 * exp(-inf) = 0, NaN stays NaN. x = k ln2 + r with |r| <= ln2 / 2 (Cody and Waite:
 * k * LN2_HI is exact), exp(r) = 1 + (r + r^2 q(r)) with q the Taylor series' tail
 * to r**11 / 13! (truncation below 4e-18): the sum that rounds last is 1 plus a small
 * term. Then times 2**k in one rounding (a subnormal result rounds once, from a
 * normal product). */
static double merge_exp(double x)
{
    static const double LN2_HI = 6.93147180369123816490e-01; /* 0x3fe62e42fee00000 */
    static const double LN2_LO = 1.90821492927058770002e-10; /* 0x3dea39ef35793c76 */
    static const double INV_LN2 = 1.44269504088896338700e+00;
    static const double INV_FACT[11] = {
        1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0,
        1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0,
        1.0 / 2.0}; /* 1/12! .. 1/2! */
    if (x != x)
        return x + x; /* NaN */
    if (x > 709.782712893384)
        return INFINITY;
    if (x < -745.2)
        return 0.0; /* -inf included */
    const double t = x * INV_LN2;
    const int k = (int)(t < 0 ? t - 0.5 : t + 0.5);
    const double r = (x - k * LN2_HI) - k * LN2_LO;
    double q = 1.0 / 6227020800.0; /* 1 / 13! */
    for (int i = 0; i < 11; ++i)
        q = q * r + INV_FACT[i];
    const double p = 1.0 + (r + (r * r) * q);
    if (k > 1023)
        return p * pow2(1023) * 2.0;
    if (k < -1022)
        return p * pow2(k + 600) * pow2(-600);
    return p * pow2(k);
}

/* expf(x): merge_exp in double, rounded once to float. */
static float merge_expf(float x) { return (float)merge_exp((double)x); }

#define MPITREE_NSLOTS 64

static int slot_dim_f32[MPITREE_NSLOTS];
static int slot_dim_f64[MPITREE_NSLOTS];

#define DEFINE_COMBINE(T, SUF, EXP)                                              \
    static void combine_##SUF(const T *in, T *io, int count, int dim)           \
    {                                                                            \
        const int w = MPITREE_REC_WIDTH(dim);                                    \
        for (int r = 0; r < count; ++r, in += w, io += w) {                      \
            const T ma = in[MPITREE_REC_M], mb = io[MPITREE_REC_M];              \
            if (ma <= mb) { /* no NaN; both empty: scale exp(-inf) = 0 */        \
                const T s = EXP(ma - (mb == -INFINITY ? 0 : mb));                \
                for (int j = MPITREE_REC_D; j < w; ++j) /* d, then n */          \
                    io[j] += s * in[j];                                          \
            } else { /* ma > mb, or a NaN: then s and m are NaN */              \
                const T s = EXP(mb - ma);                                        \
                io[MPITREE_REC_M] = ma > mb ? ma : (T)NAN;                       \
                for (int j = MPITREE_REC_D; j < w; ++j)                          \
                    io[j] = in[j] + s * io[j];                                   \
            }                                                                    \
        }                                                                        \
    }

DEFINE_COMBINE(float, f32, merge_expf)
DEFINE_COMBINE(double, f64, merge_exp)

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

/* y[i] = the merge's exp(x[i]) for i < n, float32 (bits 32) or float64 (bits 64). */
void mpitree_merge_exp(int bits, const void *x, void *y, int64_t n)
{
    for (int64_t i = 0; i < n; ++i) {
        if (bits == 32)
            ((float *)y)[i] = merge_expf(((const float *)x)[i]);
        else
            ((double *)y)[i] = merge_exp(((const double *)x)[i]);
    }
}

/* Merge `count` records of `in` into `io` (the same code MPI runs). */
void mpitree_combine(int bits, const void *in, void *io, int count, int dim)
{
    if (bits == 32)
        combine_f32((const float *)in, (float *)io, count, dim);
    else
        combine_f64((const double *)in, (double *)io, count, dim);
}
