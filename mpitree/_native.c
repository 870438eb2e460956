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
 * Empty states (m == -inf) are the identity and never produce NaN.  The merge is
 * bitwise commutative: combine(a, b) == combine(b, a).
 */
#include <math.h>
#include <string.h>

#define MPITREE_NSLOTS 64

static int slot_dim_f32[MPITREE_NSLOTS];
static int slot_dim_f64[MPITREE_NSLOTS];

#define DEFINE_COMBINE(T, SUF, EXP)                                              \
    static void combine_##SUF(const T *in, T *io, int count, int dim)           \
    {                                                                            \
        const int w = dim + 2;                                                   \
        for (int r = 0; r < count; ++r, in += w, io += w) {                      \
            const T ma = in[0], mb = io[0];                                      \
            if (ma == -INFINITY)                                                 \
                continue;                                                        \
            if (mb == -INFINITY) {                                               \
                memcpy(io, in, (size_t)w * sizeof(T));                           \
                continue;                                                        \
            }                                                                    \
            if (ma <= mb) {                                                      \
                const T s = EXP(ma - mb);                                        \
                for (int j = 1; j < w; ++j)                                      \
                    io[j] += s * in[j];                                          \
            } else {                                                             \
                const T s = EXP(mb - ma);                                        \
                io[0] = ma;                                                      \
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

/* ------------------------------------------------------------------------- */
/* Local decode attention on one shard, float32, for the CPU path.           */
/*                                                                           */
/* For each (batch b, kv head h) the R = G * Sq query rows of its GQA group  */
/* are processed together: one pass over K writes the R scores of each key   */
/* into a small buffer, one pass over that buffer turns scores into weights  */
/* (max, exp, sum), and one pass over V accumulates the numerators. K and V  */
/* are each read exactly once; all arithmetic is float32.                     */
/* ------------------------------------------------------------------------- */
#include <stdint.h>
#include <stdlib.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MPITREE_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define MPITREE_CLONES
#endif

typedef struct {
    int64_t batch, q_heads, kv_heads, q_len, head_dim;
    int64_t k_strides[3]; /* elements between batches, heads, keys of K (D is unit) */
    int64_t v_strides[3];
    const int64_t *lens;   /* (B,) keys used per batch row, or NULL for all T */
    int64_t t;             /* shard length T */
    const uint8_t *vis;    /* (B, Hm, Sq, T) visibility, or NULL */
    int64_t vis_heads;     /* Hm: 1 or Hq */
    float scale;
} mpitree_attn_args;

MPITREE_CLONES
static void group_scores(const float *q, const float *k, int64_t kstride, int64_t n,
                         int64_t rows, int64_t dim, float *s)
{
    for (int64_t j = 0; j < n; ++j) {
        const float *kj = k + j * kstride;
        for (int64_t r = 0; r < rows; ++r) {
            const float *qr = q + r * dim;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t x = 0; x < dim; ++x)
                acc += qr[x] * kj[x];
            s[j * rows + r] = acc;
        }
    }
}

MPITREE_CLONES
static void group_values(const float *p, const float *v, int64_t vstride, int64_t n,
                         int64_t rows, int64_t dim, float *acc)
{
    for (int64_t j = 0; j < n; ++j) {
        const float *vj = v + j * vstride;
        for (int64_t r = 0; r < rows; ++r) {
            const float w = p[j * rows + r];
            float *ar = acc + r * dim;
#pragma omp simd
            for (int64_t x = 0; x < dim; ++x)
                ar[x] += w * vj[x];
        }
    }
}

/* q: (B, Hq, Sq, D) float32 contiguous; out: (B, Hq, Sq, D + 2) float32 records.
 * Returns 0, or -1 if scratch memory could not be allocated. */
int mpitree_attend_f32(const mpitree_attn_args *a, const float *q, const float *k,
                       const float *v, float *out)
{
    const int64_t dim = a->head_dim, sq = a->q_len, g = a->q_heads / a->kv_heads;
    const int64_t rows = g * sq, w = dim + 2;
    float *qs = malloc(sizeof(float) * (size_t)(rows * dim + rows * dim));
    float *s = malloc(sizeof(float) * (size_t)(a->t > 0 ? a->t * rows : 1));
    if (!qs || !s) {
        free(qs);
        free(s);
        return -1;
    }
    float *acc = qs + rows * dim;
    float mx[rows > 0 ? rows : 1], den[rows > 0 ? rows : 1];
    for (int64_t b = 0; b < a->batch; ++b) {
        const int64_t n = a->lens ? a->lens[b] : a->t;
        for (int64_t h = 0; h < a->kv_heads; ++h) {
            /* rows r = gi * Sq + i of query head h * g + gi */
            const float *qh = q + ((b * a->q_heads + h * g) * sq) * dim;
            for (int64_t x = 0; x < rows * dim; ++x)
                qs[x] = qh[x] * a->scale;
            const float *kh = k + b * a->k_strides[0] + h * a->k_strides[1];
            const float *vh = v + b * a->v_strides[0] + h * a->v_strides[1];
            group_scores(qs, kh, a->k_strides[2], n, rows, dim, s);
            for (int64_t r = 0; r < rows; ++r) {
                mx[r] = -INFINITY;
                den[r] = 0.0f;
            }
            if (a->vis) {
                for (int64_t r = 0; r < rows; ++r) {
                    const int64_t hq = a->vis_heads > 1 ? h * g + r / sq : 0;
                    const uint8_t *vr = a->vis + ((b * a->vis_heads + hq) * sq + r % sq) * a->t;
                    for (int64_t j = 0; j < n; ++j)
                        if (!vr[j])
                            s[j * rows + r] = -INFINITY;
                }
            }
            for (int64_t j = 0; j < n; ++j)
                for (int64_t r = 0; r < rows; ++r)
                    mx[r] = s[j * rows + r] > mx[r] ? s[j * rows + r] : mx[r];
            for (int64_t r = 0; r < rows; ++r)
                if (mx[r] == -INFINITY)
                    mx[r] = 0.0f; /* every weight is exp(-inf) = 0 */
            for (int64_t j = 0; j < n; ++j)
                for (int64_t r = 0; r < rows; ++r) {
                    const float e = expf(s[j * rows + r] - mx[r]);
                    s[j * rows + r] = e;
                    den[r] += e;
                }
            memset(acc, 0, sizeof(float) * (size_t)(rows * dim));
            group_values(s, vh, a->v_strides[2], n, rows, dim, acc);
            for (int64_t r = 0; r < rows; ++r) {
                float *rec = out + ((b * a->q_heads + h * g) * sq + r) * w;
                rec[0] = den[r] > 0.0f ? mx[r] : -INFINITY;
                rec[1] = den[r];
                memcpy(rec + 2, acc + r * dim, sizeof(float) * (size_t)dim);
            }
        }
    }
    free(qs);
    free(s);
    return 0;
}

/* Stream-read n floats (the bandwidth floor a decode kernel cannot beat). */
MPITREE_CLONES
float mpitree_read_f32(const float *x, int64_t n)
{
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; ++i)
        acc += x[i];
    return acc;
}
