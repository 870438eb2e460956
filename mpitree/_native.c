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

/* 8 floats; GCC lowers it to two SSE registers where AVX is unavailable. */
typedef float v8f __attribute__((vector_size(32)));

static inline v8f load8(const float *p)
{
    v8f r;
    memcpy(&r, p, sizeof r);
    return r;
}

static inline void store8(float *p, v8f x) { memcpy(p, &x, sizeof x); }

static inline float hsum8(v8f a)
{
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f select8(v8i mask, v8f a, v8f b) /* mask ? a : b, lane-wise */
{
    return (v8f)(((v8i)a & mask) | ((v8i)b & ~mask));
}

/* exp(x) for 8 lanes, Cephes-style: ~1 ulp for x in [-87, 88]; exactly 0 below
 * -87.3 (so exp(-inf) = 0, as masked keys need), +inf above 88.7. */
static inline v8f exp8(v8f x)
{
    const v8f zero = {0}, lo = zero - 87.3365f, hi = zero + 88.7228f;
    const v8i under = x < lo, over = x > hi;
    x = select8(under, lo, select8(over, hi, x));
    const v8f magic = zero + 12582912.0f; /* 1.5 * 2^23: round to nearest integer */
    const v8f n = (x * 1.44269504088896341f + magic) - magic;
    const v8f r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    v8f p = zero + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
    const v8f y = p * (v8f)e;
    return select8(under, zero, select8(over, zero + INFINITY, y));
}

#define KEYS 16 /* keys per block in the value pass (8 KB of V at D = 128) */

static inline v8f bcast8(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

#if defined(__clang__)
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

/* Lane i of the result is the sum of the lanes of x_i (an 8x8 transpose-add). */
static inline v8f hsum8x8(v8f x0, v8f x1, v8f x2, v8f x3, v8f x4, v8f x5, v8f x6, v8f x7)
{
#define PAIRS(a, b) (SHUF(a, b, 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(a, b, 1, 9, 3, 11, 5, 13, 7, 15))
#define QUADS(a, b) (SHUF(a, b, 0, 1, 8, 9, 4, 5, 12, 13) + SHUF(a, b, 2, 3, 10, 11, 6, 7, 14, 15))
    const v8f u0 = QUADS(PAIRS(x0, x1), PAIRS(x2, x3));
    const v8f u1 = QUADS(PAIRS(x4, x5), PAIRS(x6, x7));
#undef PAIRS
#undef QUADS
    return SHUF(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* Dot product of a and b: vector body, scalar tail. */
static inline float dot(const float *a, const float *b, int64_t dim)
{
    const int64_t d8 = dim & ~(int64_t)7;
    v8f acc = {0};
    for (int64_t x = 0; x < d8; x += 8)
        acc += load8(a + x) * load8(b + x);
    float sum = hsum8(acc);
    for (int64_t x = d8; x < dim; ++x)
        sum += a[x] * b[x];
    return sum;
}

/* s[r * n + j] = q_r . k_j for r < rows, j < n. Blocks of 8 keys x 1 row: 8 vector
 * accumulators, reduced by one transpose-add into the 8 contiguous scores. The
 * 8 key rows (4 KB at D = 128) stay in L1 across the rows of the group; the block
 * four ahead is prefetched (prefetches never fault, even past the end). */
MPITREE_CLONES
static void group_scores(const float *q, const float *k, int64_t kstride, int64_t n,
                         int64_t rows, int64_t dim, float *s)
{
    const int64_t n8 = n & ~(int64_t)7, d8 = dim & ~(int64_t)7;
    const v8f zero = {0};
    for (int64_t j = 0; j < n8; j += 8) {
        const float *k0 = k + j * kstride;
        for (int64_t i = 32; i < 40; ++i) /* the key block 4 ahead: hide memory latency */
            for (int64_t x = 0; x < dim; x += 16)
                __builtin_prefetch(k0 + i * kstride + x);
        for (int64_t r = 0; r < rows; ++r) {
            const float *qr = q + r * dim;
            v8f a0 = zero, a1 = zero, a2 = zero, a3 = zero;
            v8f a4 = zero, a5 = zero, a6 = zero, a7 = zero;
            for (int64_t x = 0; x < d8; x += 8) {
                const v8f qv = load8(qr + x);
                const float *kx = k0 + x;
                a0 += qv * load8(kx);
                a1 += qv * load8(kx + kstride);
                a2 += qv * load8(kx + 2 * kstride);
                a3 += qv * load8(kx + 3 * kstride);
                a4 += qv * load8(kx + 4 * kstride);
                a5 += qv * load8(kx + 5 * kstride);
                a6 += qv * load8(kx + 6 * kstride);
                a7 += qv * load8(kx + 7 * kstride);
            }
            v8f sv = hsum8x8(a0, a1, a2, a3, a4, a5, a6, a7);
            for (int64_t x = d8; x < dim; ++x)
                for (int i = 0; i < 8; ++i)
                    sv[i] += qr[x] * k0[i * kstride + x];
            store8(s + r * n + j, sv);
        }
    }
    for (int64_t j = n8; j < n; ++j)
        for (int64_t r = 0; r < rows; ++r)
            s[r * n + j] = dot(q + r * dim, k + j * kstride, dim);
}

/* w * v, or exactly 0 where the weight w is 0 when `masked` (0 * NaN would be NaN). */
static inline v8f wv8(v8f w, v8f v, int masked)
{
    const v8f p = w * v;
    if (!masked)
        return p;
    const v8f zero = {0};
    return select8(w != zero, p, zero);
}

/* acc_r += sum_j p[r * n + j] v_j for r < rows. Blocks of KEYS keys x 16 columns x
 * 4 rows with 8 register accumulators (leftover rows one at a time); while the
 * first row block runs, each line of the key block two ahead is prefetched.
 * `masked`: the chunk has excluded keys (weight exactly 0), whose values may be
 * garbage (a cache's unused slots): they are selected out, never multiplied. */
MPITREE_CLONES
static void group_values(const float *p, const float *v, int64_t vstride, int64_t n,
                         int64_t rows, int64_t dim, float *acc, int masked)
{
    const int64_t d16 = dim & ~(int64_t)15, r4 = rows & ~(int64_t)3;
    for (int64_t j0 = 0; j0 < n; j0 += KEYS) {
        const int64_t jn = j0 + KEYS < n ? j0 + KEYS : n;
        for (int64_t r0 = 0; r0 < r4; r0 += 4) {
            const float *p0 = p + r0 * n, *p1 = p0 + n, *p2 = p1 + n, *p3 = p2 + n;
            float *c0 = acc + r0 * dim, *c1 = c0 + dim, *c2 = c1 + dim, *c3 = c2 + dim;
            for (int64_t x = 0; x < d16; x += 16) {
                v8f a00 = load8(c0 + x), a01 = load8(c0 + x + 8);
                v8f a10 = load8(c1 + x), a11 = load8(c1 + x + 8);
                v8f a20 = load8(c2 + x), a21 = load8(c2 + x + 8);
                v8f a30 = load8(c3 + x), a31 = load8(c3 + x + 8);
                for (int64_t j = j0; j < jn; ++j) {
                    const float *vj = v + j * vstride + x;
                    if (r0 == 0)
                        __builtin_prefetch(vj + 2 * KEYS * vstride);
                    const v8f v0 = load8(vj), v1 = load8(vj + 8);
                    const v8f w0 = bcast8(p0[j]), w1 = bcast8(p1[j]);
                    const v8f w2 = bcast8(p2[j]), w3 = bcast8(p3[j]);
                    a00 += wv8(w0, v0, masked);
                    a01 += wv8(w0, v1, masked);
                    a10 += wv8(w1, v0, masked);
                    a11 += wv8(w1, v1, masked);
                    a20 += wv8(w2, v0, masked);
                    a21 += wv8(w2, v1, masked);
                    a30 += wv8(w3, v0, masked);
                    a31 += wv8(w3, v1, masked);
                }
                store8(c0 + x, a00);
                store8(c0 + x + 8, a01);
                store8(c1 + x, a10);
                store8(c1 + x + 8, a11);
                store8(c2 + x, a20);
                store8(c2 + x + 8, a21);
                store8(c3 + x, a30);
                store8(c3 + x + 8, a31);
            }
        }
        for (int64_t r = r4; r < rows; ++r) {
            const float *pr = p + r * n;
            float *cr = acc + r * dim;
            for (int64_t x = 0; x < d16; x += 16) {
                v8f a0 = load8(cr + x), a1 = load8(cr + x + 8);
                for (int64_t j = j0; j < jn; ++j) {
                    const float *vj = v + j * vstride + x;
                    if (r == 0)
                        __builtin_prefetch(vj + 2 * KEYS * vstride);
                    const v8f w = bcast8(pr[j]);
                    a0 += wv8(w, load8(vj), masked);
                    a1 += wv8(w, load8(vj + 8), masked);
                }
                store8(cr + x, a0);
                store8(cr + x + 8, a1);
            }
        }
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = j0; j < jn; ++j) {
                const float w = p[r * n + j];
                if (masked && w == 0.0f)
                    continue;
                const float *vj = v + j * vstride;
                float *cr = acc + r * dim;
                for (int64_t x = d16; x < dim; ++x)
                    cr[x] += w * vj[x];
            }
    }
}

/* Fold one chunk of n scores into a row's running max *m and sum *den: in place,
 * s_j = exp(s_j - m_new). Returns the factor exp(m_old - m_new) by which the row's
 * earlier numerator must be scaled (0 while the row has seen no visible key). */
MPITREE_CLONES
static float row_weights(float *s, int64_t n, float *m, float *den)
{
    const int64_t n8 = n & ~(int64_t)7;
    v8f vm = bcast8(-INFINITY);
    for (int64_t j = 0; j < n8; j += 8) {
        const v8f x = load8(s + j);
        vm = select8(x > vm, x, vm);
    }
    float cm = -INFINITY;
    for (int i = 0; i < 8; ++i)
        cm = vm[i] > cm ? vm[i] : cm;
    for (int64_t j = n8; j < n; ++j)
        cm = s[j] > cm ? s[j] : cm;
    const float old = *m, fresh = cm > old ? cm : old;
    const float shift = fresh == -INFINITY ? 0.0f : fresh;
    v8f vs = {0};
    for (int64_t j = 0; j < n8; j += 8) {
        const v8f e = exp8(load8(s + j) - shift);
        store8(s + j, e);
        vs += e;
    }
    float sum = hsum8(vs);
    for (int64_t j = n8; j < n; ++j) {
        s[j] = expf(s[j] - shift);
        sum += s[j];
    }
    const float scale = old == -INFINITY ? 0.0f : expf(old - shift);
    *den = *den * scale + sum;
    *m = fresh;
    return scale;
}

#define CHUNK 2048 /* keys per chunk: scratch stays small whatever the shard length */

/* Scratch floats mpitree_attend_f32 needs (independent of the shard length). */
int64_t mpitree_attend_scratch(int64_t rows, int64_t dim)
{
    return 2 * rows * dim + 2 * rows + CHUNK * rows;
}

/* q: (B, Hq, Sq, D) float32 contiguous; out: (B, Hq, Sq, D + 2) float32 records;
 * scratch: mpitree_attend_scratch(G * Sq, D) floats (the caller owns it). Keys are
 * taken in chunks with a running max (online softmax), K and V read once each. */
void mpitree_attend_f32(const mpitree_attn_args *a, const float *q, const float *k,
                        const float *v, float *out, float *scratch)
{
    const int64_t dim = a->head_dim, sq = a->q_len, g = a->q_heads / a->kv_heads;
    const int64_t rows = g * sq, w = dim + 2;
    float *qs = scratch, *acc = qs + rows * dim, *mx = acc + rows * dim, *den = mx + rows;
    float *s = den + rows;
    for (int64_t b = 0; b < a->batch; ++b) {
        const int64_t n = a->lens ? a->lens[b] : a->t;
        for (int64_t h = 0; h < a->kv_heads; ++h) {
            /* row r = gi * Sq + i is query i of head h * g + gi */
            const float *qh = q + ((b * a->q_heads + h * g) * sq) * dim;
            for (int64_t x = 0; x < rows * dim; ++x)
                qs[x] = qh[x] * a->scale;
            const float *kh = k + b * a->k_strides[0] + h * a->k_strides[1];
            const float *vh = v + b * a->v_strides[0] + h * a->v_strides[1];
            memset(acc, 0, sizeof(float) * (size_t)(rows * dim));
            for (int64_t r = 0; r < rows; ++r) {
                mx[r] = -INFINITY;
                den[r] = 0.0f;
            }
            for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
                const int64_t cn = n - c0 < CHUNK ? n - c0 : CHUNK;
                group_scores(qs, kh + c0 * a->k_strides[2], a->k_strides[2], cn, rows, dim, s);
                int masked = 0; /* any key of this chunk excluded for some row */
                for (int64_t r = 0; r < rows; ++r) {
                    float *sr = s + r * cn;
                    if (a->vis) {
                        const int64_t hq = a->vis_heads > 1 ? h * g + r / sq : 0;
                        const uint8_t *vr =
                            a->vis + ((b * a->vis_heads + hq) * sq + r % sq) * a->t + c0;
                        for (int64_t j = 0; j < cn; ++j) {
                            masked |= !vr[j];
                            sr[j] = vr[j] ? sr[j] : -INFINITY; /* select: garbage k never leaks */
                        }
                    }
                    const float scale = row_weights(sr, cn, mx + r, den + r);
                    if (scale != 1.0f)
                        for (int64_t x = 0; x < dim; ++x)
                            acc[r * dim + x] *= scale;
                }
                group_values(s, vh + c0 * a->v_strides[2], a->v_strides[2], cn, rows, dim, acc,
                             masked);
            }
            for (int64_t r = 0; r < rows; ++r) {
                float *rec = out + ((b * a->q_heads + h * g) * sq + r) * w;
                rec[0] = mx[r];
                rec[1] = den[r];
                memcpy(rec + 2, acc + r * dim, sizeof(float) * (size_t)dim);
            }
        }
    }
}

/* Which build of the multiversioned kernels runs on this CPU. */
const char *mpitree_kernel_isa(void)
{
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("x86-64-v3") ? "x86-64-v3 (AVX2, FMA)" : "x86-64 (SSE2)";
#else
    return "portable C";
#endif
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
