/* ------------------------------------------------------------------------- */
/* Local decode attention on one shard, float32, for the CPU path.           */
/*                                                                           */
/* For each (batch b, kv head h) the R = G * Sq query rows of its GQA group  */
/* share every key. Keys are taken in chunks (online softmax, running max);  */
/* per chunk and per block of up to 8 rows (4 in the baseline build), one   */
/* pass over K writes the block's scores (register-blocked: rows x keys      */
/* accumulators, so a K vector loaded once feeds every row of the block),    */
/* one pass turns them into weights (max, exp, sum), and one pass over V     */
/* accumulates the numerators                                                */
/* (rows x columns accumulators, a V vector loaded once feeds every row).    */
/* The v3 build runs a block of 8 rows as two register tiles of 4 over each  */
/* few keys in turn (the second finds them in L1): in its 16 registers, the  */
/* score pass loads fewer vectors per multiply-add, and the value pass       */
/* broadcasts fewer weights (4 per 8 multiply-adds, against 8).              */
/* K and V come from memory once (later row blocks hit the chunk in L2).     */
/* Lines a fixed distance ahead are prefetched into L2 (the passes read      */
/* several key rows side by side, an order the hardware prefetcher does not  */
/* follow). With one row per KV head (MHA, Sq = 1) and contiguous key rows,  */
/* both passes can instead read memory in address order and leave the       */
/* fetching to the hardware prefetcher: the same sums, and faster on some    */
/* machines, slower on others, so the process times both ways on its first  */
/* large calls and keeps the faster (see read_order). All arithmetic is      */
/* float32.                                                                  */
/*                                                                           */
/* The same code is compiled three times on x86-64 with GCC and picked at    */
/* run time: x86-64-v4 (AVX-512VL: 32 vector registers, wider blocking, for  */
/* 8 or more rows a KV head; fewer run the v3 build's code), x86-64-v3       */
/* (AVX2, FMA) and the baseline (SSE2). Every sum takes its terms in the    */
/* same order in the v3 and v4 builds, whatever their blocking.              */
/*                                                                           */
/* Which products fuse with their sums is spelled out (fma8, fma1), never    */
/* left to the compiler (the build passes -ffp-contract=off), and the        */
/* exponentials are the kernel's own (exp8, exp1), not libm's: the v3 and    */
/* v4 builds fuse every product into its sum, the baseline none. GCC's own   */
/* contraction differs between versions and between code paths of one      */
/* build: GCC 13.3's generic tuning left the address-order score loop's      */
/* multiply-adds unfused and fused the prefetching path's, so the two read   */
/* orders, chosen by timing, gave different bits. Now a build gives the     */
/* same bits on every compiler, C library and CPU, its paths the same bits   */
/* as each other, and the v3 and v4 builds the same bits for every head dim  */
/* (tests/test_kernel.py holds golden hashes).                               */
/* ------------------------------------------------------------------------- */
#define _POSIX_C_SOURCE 199309L /* clock_gettime */
#include <math.h>
#include <string.h>
#include <time.h>

#include "_native.h"

/* 8 floats; GCC lowers it to two SSE registers where AVX is unavailable. */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

MPITREE_INLINE v8f load8(const float *p)
{
    v8f r;
    memcpy(&r, p, sizeof r);
    return r;
}

MPITREE_INLINE void store8(float *p, v8f x) { memcpy(p, &x, sizeof x); }

/* x in every lane (written as x - 0, which GCC folds to a broadcast: a vector
 * constructor inlined into the target-specific builds becomes a chain of inserts). */
MPITREE_INLINE v8f bcast8(float x)
{
    const v8f zero = {0};
    return x - zero;
}

MPITREE_INLINE v8f select8(v8i mask, v8f a, v8f b) /* mask ? a : b, lane-wise */
{
    return (v8f)(((v8i)a & mask) | ((v8i)b & ~mask));
}

/* Lane-wise max in which NaN wins (as numpy's maximum): a NaN score poisons its row. */
MPITREE_INLINE v8f max8(v8f a, v8f b) { return select8((a > b) | (a != a), a, b); }

/* An excluded key's weight is -0.0 (set after the exponentials): a visible key whose
 * weight is +0.0 (it scores -inf, or exp underflows) still multiplies its value, so
 * that 0 * NaN stays NaN, while an excluded key's value is never read. */
#define EXCLUDED_BITS ((int32_t)0x80000000)

MPITREE_INLINE int excluded1(float w)
{
    int32_t bits;
    memcpy(&bits, &w, sizeof bits);
    return bits == EXCLUDED_BITS;
}

/* Lane-wise: the weight is not an excluded key's (see EXCLUDED_BITS). */
MPITREE_INLINE v8i seen8(v8f w)
{
    const v8i gone = {EXCLUDED_BITS, EXCLUDED_BITS, EXCLUDED_BITS, EXCLUDED_BITS,
                      EXCLUDED_BITS, EXCLUDED_BITS, EXCLUDED_BITS, EXCLUDED_BITS};
    return (v8i)w != gone;
}

MPITREE_INLINE float max1(float a, float b) { return a > b || a != a ? a : b; }

/* a * b + c with one rounding, lane by lane (libm's fmaf, or the FMA instruction where
 * the build has one): where no vector builtin serves, below. */
MPITREE_INLINE v8f fma8_lanes(v8f a, v8f b, v8f c)
{
    v8f r;
    for (int i = 0; i < 8; ++i)
        r[i] = __builtin_fmaf(a[i], b[i], c[i]);
    return r;
}

/* a * b + c: one rounding where `fused` (the v3 and v4 builds), two otherwise. The
 * vector FMA is GCC's builtin, not the intrinsic: the intrinsic is an always-inline
 * function of its own target, which GCC will not inline into these shared helpers.
 * Only the builds with FMA reach it (fused = 1), so only they expand it, once the
 * optimiser has dropped the other builds' dead branch: unoptimised (-O0) builds take
 * the lanes one by one (the same bits), as do builds off x86, where nothing fuses. */
#if defined(MPITREE_X86_CLONES) && defined(__OPTIMIZE__)
#include <immintrin.h> /* declares the builtin (it sets its own target to do so) */
#define FMA8_FUSED(a, b, c) __builtin_ia32_vfmaddps256((a), (b), (c))
#else
#define FMA8_FUSED(a, b, c) fma8_lanes((a), (b), (c))
#endif

MPITREE_INLINE v8f fma8(v8f a, v8f b, v8f c, const int fused)
{
    return fused ? FMA8_FUSED(a, b, c) : a * b + c;
}

MPITREE_INLINE float fma1(float a, float b, float c, const int fused)
{
    return fused ? __builtin_fmaf(a, b, c) : a * b + c;
}

/* exp(x) for 8 lanes, Cephes-style: ~1 ulp for x in [-87, 88]; exactly 0 below
 * -87.3 (so exp(-inf) = 0, as masked keys need), +inf above 88.7. Not the merge's
 * exponential (merge_exp, _native_op.c: double, rounded once, never fused) and not
 * bit-identical to it: the kernel's own weights, their bits pinned by the golden
 * hashes of tests/test_kernel.py. */
MPITREE_INLINE v8f exp8(v8f x, const int fused)
{
    const v8f zero = {0}, lo = zero - 87.3365f, hi = zero + 88.7228f;
    const v8i under = x < lo, over = x > hi;
    x = select8(under, lo, select8(over, hi, x));
    const v8f magic = zero + 12582912.0f; /* 1.5 * 2^23: round to nearest integer */
    const v8f n = fma8(x, zero + 1.44269504088896341f, magic, fused) - magic;
    const v8f r = fma8(n, zero + 2.12194440e-4f, fma8(n, zero - 0.693359375f, x, fused), fused);
    v8f p = zero + 1.9875691500e-4f;
    p = fma8(p, r, zero + 1.3981999507e-3f, fused);
    p = fma8(p, r, zero + 8.3334519073e-3f, fused);
    p = fma8(p, r, zero + 4.1665795894e-2f, fused);
    p = fma8(p, r, zero + 1.6666665459e-1f, fused);
    p = fma8(p, r, zero + 5.0000001201e-1f, fused);
    p = fma8(p * r, r, r, fused) + 1.0f;
    const v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
    const v8f y = p * (v8f)e;
    return select8(under, zero, select8(over, zero + INFINITY, y));
}

/* exp(x) for one float: exp8's lane, so that a chunk's last keys and the rescaling of
 * the running sums round as every other weight does, on every C library and CPU (libm's
 * expf differs between libraries, and glibc picks its own by the CPU's FMA). */
MPITREE_INLINE float exp1(float x, const int fused) { return exp8(bcast8(x), fused)[0]; }

#if defined(__clang__)
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

/* Lane i of the result is the sum of the lanes of x[i] (an 8x8 transpose-add). */
MPITREE_INLINE v8f hsum8x8(const v8f *x)
{
#define PAIRS(a, b) (SHUF(a, b, 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(a, b, 1, 9, 3, 11, 5, 13, 7, 15))
#define QUADS(a, b) (SHUF(a, b, 0, 1, 8, 9, 4, 5, 12, 13) + SHUF(a, b, 2, 3, 10, 11, 6, 7, 14, 15))
    const v8f u0 = QUADS(PAIRS(x[0], x[1]), PAIRS(x[2], x[3]));
    const v8f u1 = QUADS(PAIRS(x[4], x[5]), PAIRS(x[6], x[7]));
#undef PAIRS
#undef QUADS
    return SHUF(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* Dot product of a and b: vector body, scalar tail. */
MPITREE_INLINE float dot(const float *a, const float *b, int64_t dim, const int fused)
{
    const int64_t d8 = dim & ~(int64_t)7;
    v8f acc = {0};
    for (int64_t x = 0; x < d8; x += 8)
        acc = fma8(load8(a + x), load8(b + x), acc, fused);
    float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (int64_t x = d8; x < dim; ++x)
        sum = fma1(a[x], b[x], sum, fused);
    return sum;
}

/* Prefetch key row p (len floats) into L2: prefetcht1 does not hold an L1 miss
 * buffer for the line's whole trip, so the loads of the current keys keep them. */
MPITREE_INLINE void prefetch_row(const float *p, int64_t len)
{
    for (int64_t x = 0; x < len; x += 16)
        __builtin_prefetch(p + x, 0, 2);
}

#define CHUNK 256 /* keys per chunk: K and V chunks stay in L2 for later row blocks */
/* Keys per block in the value pass: 32 when one or two column blocks span the row,
 * 8 when it is split into more (fewer rows read at a stride before moving on). */
#define KEYS_WHOLE 32
#define KEYS_SPLIT 8
/* ... and in address order: a row of more than 128 floats one key at a time (its
 * column blocks one after the other), a row split otherwise two keys at a time. */
#define KEYS_IN_ORDER 2

/* Scores of one block of rb rows (q: rb rows of dim) against keys [0, n) of k:
 * s[j * rb + r] = q_r . k_j (interleaved: row r of key j). kb keys at a time, in tiles
 * of tr rows (tr divides rb) with tr * kb (8 or 16) vector accumulators reduced by
 * transpose-adds (the same tree of additions for every row and key, whatever the
 * blocking or tiling); a block's tiles take the same kb keys in turn, which the first
 * tile brought into L1. The key rows `pf` keys ahead are prefetched when pf > 0, a
 * line of each per two steps of the dot products (a burst of a block's rows of lines
 * at once stalled on the misses it had in flight: a GQA group of 4 rows ran at 67% of
 * the read floor, spread at 85%), a row's lines past the steps' reach before them.
 * `in_order` (single row only): each key's row is read whole before the next (the same
 * sums in the same order). */
MPITREE_INLINE void block_scores(const float *q, const float *k, int64_t ks, int64_t n,
                                 int64_t dim, const int rb, const int tr, const int kb,
                                 int64_t pf, int in_order, const int fused, float *s)
{
    const int64_t d8 = dim & ~(int64_t)7, nb = n - n % kb;
    const int64_t reach = (d8 + 15) & ~(int64_t)15; /* floats whose lines the steps prefetch */
    const v8f zero = {0};
    /* the tail columns' q lanes of tile t's group g of 8 scores, at (t * kb + g) / 8:
     * rb * kb <= 16 (two tiles of 8 accumulators, or one of up to 16) */
    v8f qt[2][7];
    for (int t = 0; t < rb; t += tr)
        for (int g = 0; g < tr * kb; g += 8)
            for (int64_t x = d8; x < dim; ++x)
                for (int i = 0; i < 8; ++i)
                    qt[(t * kb + g) / 8][x - d8][i] = q[(t + (g + i) % tr) * dim + x];
    for (int64_t j = 0; j < nb; j += kb) {
        const float *kj = k + j * ks;
        if (pf > 0 && reach < dim)
            for (int kk = 0; kk < kb; ++kk)
                prefetch_row(kj + (pf + kk) * ks + reach, dim - reach);
        for (int t = 0; t < rb; t += tr) {
            const float *qr = q + t * dim;
            const int64_t tpf = t ? 0 : pf; /* the first tile prefetches for the block */
            v8f acc[16];
#pragma GCC unroll 16
            for (int i = 0; i < tr * kb; ++i)
                acc[i] = zero;
            if (tr == 1 && in_order)
#pragma GCC unroll 16
                for (int kk = 0; kk < kb; ++kk)
                    for (int64_t x = 0; x < d8; x += 8)
                        acc[kk] = fma8(load8(qr + x), load8(kj + kk * ks + x), acc[kk], fused);
            else
                for (int64_t x = 0; x < d8; x += 8) {
                    v8f kv[16];
                    if (tpf > 0 && !(x & 15))
                        for (int kk = 0; kk < kb; ++kk)
                            __builtin_prefetch(kj + (tpf + kk) * ks + x, 0, 2);
#pragma GCC unroll 16
                    for (int kk = 0; kk < kb; ++kk)
                        kv[kk] = load8(kj + kk * ks + x);
#pragma GCC unroll 8
                    for (int r = 0; r < tr; ++r) {
                        const v8f qv = load8(qr + r * dim + x);
#pragma GCC unroll 16
                        for (int kk = 0; kk < kb; ++kk)
                            acc[kk * tr + r] = fma8(qv, kv[kk], acc[kk * tr + r], fused);
                    }
                }
#pragma GCC unroll 2
            for (int g = 0; g < tr * kb; g += 8) {
                v8f sv = hsum8x8(acc + g);
                for (int64_t x = d8; x < dim; ++x) { /* the tail: lane i is key (g + i) / tr */
                    v8f ka;
                    for (int i = 0; i < 8; ++i)
                        ka[i] = kj[((g + i) / tr) * ks + x];
                    sv = fma8(qt[(t * kb + g) / 8][x - d8], ka, sv, fused);
                }
                if (tr == rb)
                    store8(s + j * rb + g, sv);
                else /* lane i: row t + i % tr of key j + (g + i) / tr */
#pragma GCC unroll 8
                    for (int i = 0; i < 8; i += tr)
                        memcpy(s + (j + (g + i) / tr) * rb + t, (const float *)&sv + i,
                               sizeof(float) * (size_t)tr);
            }
        }
    }
    for (int64_t j = nb; j < n; ++j) {
        if (pf > 0)
            prefetch_row(k + (j + pf) * ks, dim);
        for (int r = 0; r < rb; ++r)
            s[j * rb + r] = dot(q + r * dim, k + j * ks, dim, fused);
    }
}

/* Fold a block's n keys of interleaved scores (s[j * rb + r]) into the rows' running
 * max m[r] and sum den[r]: in place, s = exp(s - m_new). scale[r] gets the factor
 * exp(m_old - m_new) by which row r's earlier numerator must be scaled (0 while the
 * row has seen no visible key). rb divides 8, so lane l of a vector is row l % rb. */
MPITREE_INLINE void block_weights(float *s, int64_t n, const int rb, float *m, float *den,
                                  float *scale, const int fused)
{
    const int64_t total = n * rb, t8 = total & ~(int64_t)7;
    v8f vm = bcast8(-INFINITY);
    for (int64_t e = 0; e < t8; e += 8)
        vm = max8(load8(s + e), vm);
    float cm[8], shift[8], sum[8];
    for (int r = 0; r < rb; ++r)
        cm[r] = -INFINITY;
    for (int l = 0; l < 8; ++l)
        cm[l % rb] = max1(vm[l], cm[l % rb]);
    for (int64_t e = t8; e < total; ++e)
        cm[e % rb] = max1(s[e], cm[e % rb]);
    v8f vshift;
    for (int r = 0; r < rb; ++r) {
        const float fresh = max1(cm[r], m[r]);
        shift[r] = fresh == -INFINITY ? 0.0f : fresh;
        scale[r] = m[r] == -INFINITY ? 0.0f : exp1(m[r] - shift[r], fused);
        m[r] = fresh;
        sum[r] = 0.0f;
    }
    for (int l = 0; l < 8; ++l)
        vshift[l] = shift[l % rb];
    v8f vs = {0};
    for (int64_t e = 0; e < t8; e += 8) {
        const v8f w = exp8(load8(s + e) - vshift, fused);
        store8(s + e, w);
        vs += w;
    }
    for (int l = 0; l < 8; ++l)
        sum[l % rb] += vs[l];
    for (int64_t e = t8; e < total; ++e) {
        s[e] = exp1(s[e] - shift[e % rb], fused);
        sum[e % rb] += s[e];
    }
    for (int r = 0; r < rb; ++r)
        den[r] = fma1(den[r], scale[r], sum[r], fused);
}

/* acc_r[x0 + c] += sum_j w[j * ls + r] v_j[x0 + c] for rows r < rb, keys [j0, jn), the
 * cb vectors of columns from x0: rb * cb register accumulators. `masked`: the chunk
 * has excluded keys (weight -0.0, see EXCLUDED_BITS) whose values may be garbage (a
 * cache's unused slots): a key no row of the block sees is skipped, and otherwise a
 * row keeps its multiply-add only where it sees the key (an excluded key's term never
 * enters a sum, and a seen key's term rounds as in an unmasked chunk). */
MPITREE_INLINE void block_values_cols(const float *w, const int ls, const float *v, int64_t vs,
                                      int64_t j0, int64_t jn, int64_t dim, int64_t x0,
                                      const int rb, const int cb, float *acc, int masked,
                                      int64_t pf, const int fused)
{
    v8f c[16];
#pragma GCC unroll 8
    for (int r = 0; r < rb; ++r)
#pragma GCC unroll 16
        for (int i = 0; i < cb; ++i)
            c[r * cb + i] = load8(acc + r * dim + x0 + 8 * i);
    for (int64_t j = j0; j < jn; ++j) {
        const float *vj = v + j * vs + x0, *wj = w + j * ls;
        if (pf > 0) /* this block's columns of the row pf keys ahead */
            prefetch_row(vj + pf * vs, 8 * cb);
        v8f wr[8];
#if defined(__GNUC__) && !defined(__clang__)
        /* one load and in-register broadcasts (reads up to 8 floats: scratch is padded) */
        const v8f wv = load8(wj);
#pragma GCC unroll 8
        for (int r = 0; r < rb; ++r)
            wr[r] = __builtin_shuffle(wv, (v8i){r, r, r, r, r, r, r, r});
#else
        for (int r = 0; r < rb; ++r)
            wr[r] = bcast8(wj[r]);
#endif
        if (masked) {
            int seen = 0, all = 1;
            for (int r = 0; r < rb; ++r) {
                seen |= !excluded1(wj[r]);
                all &= !excluded1(wj[r]);
            }
            if (!seen)
                continue; /* no row sees this key: its value is never read */
            if (!all) {
#pragma GCC unroll 16
                for (int i = 0; i < cb; ++i) {
                    const v8f vv = load8(vj + 8 * i);
#pragma GCC unroll 8
                    for (int r = 0; r < rb; ++r) { /* a seen key's term rounds as unmasked */
                        const v8f sum = fma8(wr[r], vv, c[r * cb + i], fused);
                        c[r * cb + i] = select8(seen8(wr[r]), sum, c[r * cb + i]);
                    }
                }
                continue;
            }
        }
#pragma GCC unroll 16
        for (int i = 0; i < cb; ++i) {
            const v8f vv = load8(vj + 8 * i);
#pragma GCC unroll 8
            for (int r = 0; r < rb; ++r)
                c[r * cb + i] = fma8(wr[r], vv, c[r * cb + i], fused);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < rb; ++r)
#pragma GCC unroll 16
        for (int i = 0; i < cb; ++i)
            store8(acc + r * dim + x0 + 8 * i, c[r * cb + i]);
}

/* The last dim - d8 (< 8) columns of the value pass over keys [j0, jn), for blocks of 4
 * or 8 rows (fewer take them row by row): a vector over the block's rows for each
 * column (lane r: row r, lanes from rb unused), one
 * multiply-add per key and column, each row's sums in key order as everywhere else;
 * as in block_values_cols, a key no row sees is skipped and an excluded key's term is
 * selected out. */
MPITREE_INLINE void block_values_tail(const float *w, const float *v, int64_t vs, int64_t j0,
                                      int64_t jn, int64_t dim, int64_t d8, const int rb,
                                      float *acc, int masked, int64_t pf, const int fused)
{
    const int cols = (int)(dim - d8);
    v8f t[7] = {{0}};
    for (int c = 0; c < cols; ++c)
        for (int r = 0; r < rb; ++r)
            t[c][r] = acc[r * dim + d8 + c];
    for (int64_t j = j0; j < jn; ++j) {
        const float *vj = v + j * vs + d8;
        if (pf > 0)
            prefetch_row(vj + pf * vs, cols);
        const v8f wv = load8(w + j * rb); /* reads up to 8 floats: scratch is padded */
        const v8i seen = seen8(wv);
        if (masked) {
            int any = 0;
            for (int r = 0; r < rb; ++r)
                any |= seen[r] != 0;
            if (!any)
                continue; /* no row sees this key: its value is never read */
        }
        for (int c = 0; c < cols; ++c) {
            const v8f sum = fma8(wv, bcast8(vj[c]), t[c], fused);
            t[c] = masked ? select8(seen, sum, t[c]) : sum;
        }
    }
    for (int c = 0; c < cols; ++c)
        for (int r = 0; r < rb; ++r)
            acc[r * dim + d8 + c] = t[c][r];
}

/* The value pass of one row block over keys [0, n): a few keys at a time (in L1),
 * columns in blocks of cb vectors, then single vectors, then a scalar tail; within a
 * column block, the block's tiles of tr rows in turn (each row's sums take the keys in
 * order, whatever the tiling). Each column block prefetches its own columns of the key
 * row `pf` ahead when pf > 0 (its first tile),
 * so the prefetches are spread over the pass rather than one burst per row.
 * `in_order`: a row not read as one column block is read one key (a row over 128
 * floats) or KEYS_IN_ORDER keys at a time (near address order: column by column over
 * 32 keys, or two keys per column block over a long row, ran at 40-50% of the read
 * floor; each sum still takes its keys in order). */
MPITREE_INLINE void block_values(const float *w, const float *v, int64_t vs, int64_t n,
                                 int64_t dim, const int rb, const int tr, const int cb,
                                 float *acc, int masked, int64_t pf, int in_order,
                                 const int fused)
{
    const int64_t wide = dim - dim % (8 * cb), d8 = dim & ~(int64_t)7;
    const int64_t keys = in_order && dim > 128      ? 1
                         : in_order && 8 * cb != dim ? KEYS_IN_ORDER
                         : 16 * cb >= dim            ? KEYS_WHOLE
                                                     : KEYS_SPLIT;
    for (int64_t j0 = 0; j0 < n; j0 += keys) {
        const int64_t jn = j0 + keys < n ? j0 + keys : n;
        for (int64_t x0 = 0; x0 < wide; x0 += 8 * cb)
            for (int t = 0; t < rb; t += tr)
                block_values_cols(w + t, rb, v, vs, j0, jn, dim, x0, tr, cb, acc + t * dim,
                                  masked, t ? 0 : pf, fused);
        for (int64_t x0 = wide; x0 < d8; x0 += 8)
            for (int t = 0; t < rb; t += tr)
                block_values_cols(w + t, rb, v, vs, j0, jn, dim, x0, tr, 1, acc + t * dim,
                                  masked, t ? 0 : pf, fused);
        if (d8 < dim && rb >= 4)
            block_values_tail(w, v, vs, j0, jn, dim, d8, rb, acc, masked, pf, fused);
        else if (d8 < dim)
            for (int64_t j = j0; j < jn; ++j) {
                if (pf > 0)
                    prefetch_row(v + (j + pf) * vs + d8, dim - d8);
                for (int r = 0; r < rb; ++r) {
                    const float x = w[j * rb + r];
                    if (masked && excluded1(x))
                        continue;
                    for (int64_t c = d8; c < dim; ++c)
                        acc[r * dim + c] = fma1(x, v[j * vs + c], acc[r * dim + c], fused);
                }
            }
    }
}

/* One chunk of keys for a block of rb rows (rows r0 .. r0 + rb - 1 of the group), in
 * register tiles of tr rows. */
MPITREE_INLINE void block_chunk(const mpitree_attn_args *a, const float *qs, const float *kc,
                                const float *vc, int64_t cn, int64_t b, int64_t h, int64_t c0,
                                int64_t r0, const int rb, const int tr, const int wide,
                                float *acc, float *mx, float *den, float *s, int64_t pf,
                                int in_order, const int fused)
{
    const int64_t dim = a->head_dim, sq = a->q_len, g = a->q_heads / a->kv_heads;
    const int kb = rb == 1 ? 8 : (wide ? 16 : 8) / tr;
    block_scores(qs + r0 * dim, kc, a->k_strides[2], cn, dim, rb, tr, kb, pf, in_order, fused,
                 s);
    int masked = 0; /* any key of this chunk excluded for some row of the block */
    if (a->vis)
        for (int r = 0; r < rb; ++r) {
            const int64_t row = r0 + r;
            const int64_t hq = a->vis_heads > 1 ? h * g + row / sq : 0;
            const uint8_t *vr = a->vis + ((b * a->vis_heads + hq) * sq + row % sq) * a->t + c0;
            if (!memchr(vr, 0, (size_t)cn))
                continue; /* the row sees the whole chunk (a tree's cached prefix) */
            for (int64_t j = 0; j < cn; ++j) {
                masked |= !vr[j];
                s[j * rb + r] = vr[j] ? s[j * rb + r] : -INFINITY; /* garbage k never leaks */
            }
        }
    float scale[8];
    block_weights(s, cn, rb, mx + r0, den + r0, scale, fused);
    if (masked) /* excluded keys: weight -0.0 (exp gave +0.0), which the value pass skips */
        for (int r = 0; r < rb; ++r) {
            const int64_t row = r0 + r;
            const int64_t hq = a->vis_heads > 1 ? h * g + row / sq : 0;
            const uint8_t *vr = a->vis + ((b * a->vis_heads + hq) * sq + row % sq) * a->t + c0;
            if (memchr(vr, 0, (size_t)cn))
                for (int64_t j = 0; j < cn; ++j)
                    s[j * rb + r] = vr[j] ? s[j * rb + r] : -0.0f;
        }
    for (int r = 0; r < rb; ++r)
        if (scale[r] != 1.0f)
            for (int64_t x = 0; x < dim; ++x)
                acc[(r0 + r) * dim + x] *= scale[r];
    block_values(s, vc, a->v_strides[2], cn, dim, rb, tr, (wide ? 16 : 8) / tr, acc + r0 * dim,
                 masked, pf, in_order, fused);
}

/* The whole kernel as build `level` runs it (4: blocking for 32 vector registers,
 * AVX-512VL; 3 and 4: blocks of 8 rows and fused multiply-adds; 1: neither);
 * `in_order`: reading in address order without prefetching (see read_order). */
MPITREE_INLINE void attend_rows(const mpitree_attn_args *a, const float *q, const float *k,
                                const float *v, float *out, float *scratch, const int level,
                                const int in_order)
{
    const int wide = level == 4, eight = level >= 3, fused = level >= 3;
    const int64_t dim = a->head_dim, sq = a->q_len, g = a->q_heads / a->kv_heads;
    const int64_t rows = g * sq, w = MPITREE_REC_WIDTH(dim);
    /* prefetch distance: about 32 KB of keys ahead */
    int64_t pf = 32768 / (4 * (dim > 0 ? dim : 1));
    pf = in_order ? 0 : pf < 4 ? 4 : pf > 256 ? 256 : pf;
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
                const float *kc = kh + c0 * a->k_strides[2], *vc = vh + c0 * a->v_strides[2];
                /* the first row block brings the chunk in (and prefetches ahead, up to
                 * the shard's end); the others find it in cache */
                const int64_t ahead = n - c0 - pf > 0 ? pf : 0;
                for (int64_t r0 = 0; r0 < rows;) {
                    const int64_t left = rows - r0, p0 = r0 ? 0 : ahead;
                    float *sb = s + r0 * CHUNK;
                    /* blocks of 8 rows in the v3 and v4 builds: a GQA group of 8
                     * (Llama-3 70B) streams each chunk in one pass, not in a prefetching
                     * block of 4 then one reading L2 (Intel Xeon VM, kernel_bw.py, 64/8,
                     * % of the read floor: v4 49-53% -> 61-66%, v3 46% -> 56%). v3 runs
                     * one as two tiles of 4 rows (8 accumulators, 12 loads per 16
                     * multiply-adds, against 9 per 8 as one tile of 8 x 1 keys): AMD
                     * Zen 4 VM, kernel_bw.py against one tile, 64/8 1.19-1.20x, 32 rows
                     * 1.23-1.27x; v4 keeps one tile of 8 rows x 2 keys (32 registers).
                     * The same bits either way: only block_weights' lanes follow the
                     * block */
                    if (eight && left >= 8) {
                        block_chunk(a, qs, kc, vc, cn, b, h, c0, r0, 8, wide ? 8 : 4, wide, acc,
                                    mx, den, sb, p0, in_order, fused);
                        r0 += 8;
                    } else if (left >= 4) {
                        block_chunk(a, qs, kc, vc, cn, b, h, c0, r0, 4, 4, wide, acc, mx, den,
                                    sb, p0, in_order, fused);
                        r0 += 4;
                    } else if (left >= 2) {
                        block_chunk(a, qs, kc, vc, cn, b, h, c0, r0, 2, 2, wide, acc, mx, den,
                                    sb, p0, in_order, fused);
                        r0 += 2;
                    } else {
                        block_chunk(a, qs, kc, vc, cn, b, h, c0, r0, 1, 1, wide, acc, mx, den,
                                    sb, p0, in_order, fused);
                        r0 += 1;
                    }
                }
            }
            for (int64_t r = 0; r < rows; ++r) {
                float *rec = out + ((b * a->q_heads + h * g) * sq + r) * w;
                rec[MPITREE_REC_M] = mx[r];
                rec[MPITREE_REC_D] = den[r];
                memcpy(rec + MPITREE_REC_N, acc + r * dim, sizeof(float) * (size_t)dim);
            }
        }
    }
}

/* Whether the call has one row per KV head over contiguous key rows, which can be
 * read in address order (the same sums as the prefetching path, bit for bit). */
static int one_row_in_order(const mpitree_attn_args *a)
{
    const int64_t dim = a->head_dim;
    return a->q_heads == a->kv_heads && a->q_len == 1 && a->k_strides[2] == dim &&
           a->v_strides[2] == dim;
}

/* `in_order` (one_row_in_order calls only): read in address order, without
 * prefetching; otherwise prefetch. Each is its own specialised copy. */
MPITREE_INLINE void attend_impl(const mpitree_attn_args *a, const float *q, const float *k,
                                const float *v, float *out, float *scratch, const int level,
                                int in_order)
{
    if (in_order)
        attend_rows(a, q, k, v, out, scratch, level, 1);
    else
        attend_rows(a, q, k, v, out, scratch, level, 0);
}

/* Scratch floats mpitree_attend_f32 needs (independent of the shard length). */
int64_t mpitree_attend_scratch(int64_t rows, int64_t dim)
{
    return 2 * rows * dim + 2 * rows + CHUNK * rows + 8; /* + 8: whole-vector weight loads */
}

/* Builds of the kernel: 4 = x86-64-v4 (AVX-512), 3 = x86-64-v3 (AVX2, FMA), 1 = the
 * baseline (x86-64 SSE2, or portable C elsewhere). */
#ifdef MPITREE_X86_CLONES
__attribute__((target("arch=x86-64-v3"))) static void
attend_v3(const mpitree_attn_args *a, const float *q, const float *k, const float *v,
          float *out, float *scratch, int in_order)
{
    attend_impl(a, q, k, v, out, scratch, 3, in_order);
}

__attribute__((target("arch=x86-64-v4"))) static void
attend_v4(const mpitree_attn_args *a, const float *q, const float *k, const float *v,
          float *out, float *scratch, int in_order)
{
    /* The wider blocking pays where a KV head's rows make the work compute-bound (8 or
     * more: a GQA group of 8, tree verification; one tile of 8 rows x 2 keys against
     * v3's two tiles of 4 x 2);
     * fewer rows stream memory better with v3's blocking (Intel Xeon VM, 512 MB of K+V,
     * % of the read floor, 4-row blocks narrow against wide, before blocks of 8: GQA
     * 32/8 82% / 78%, SmolLM2's 9/3 at D = 64 65% / 59%), and better still as v3's own
     * machine code (kernel_bw.py, GQA 32/8: 85-86% against 81-83% compiled for v4).
     * The choice follows the shape alone, which ranks share. */
    if (a->q_heads / a->kv_heads * a->q_len >= 8)
        attend_impl(a, q, k, v, out, scratch, 4, in_order);
    else
        attend_v3(a, q, k, v, out, scratch, in_order);
}

#endif

static void attend_base(const mpitree_attn_args *a, const float *q, const float *k,
                        const float *v, float *out, float *scratch, int in_order)
{
    attend_impl(a, q, k, v, out, scratch, 1, in_order);
}

/* The level names are GCC 12's; GCC 11 (Ubuntu 22.04's) checks their features, the
 * ones the kernel's code uses (the vector ISAs with the OS's support for their
 * registers, which libgcc checks; and BMI, BMI2, which every CPU with AVX2 and FMA has). */
#if defined(__GNUC__) && __GNUC__ >= 12
#define CPU_V4 __builtin_cpu_supports("x86-64-v4")
#define CPU_V3 __builtin_cpu_supports("x86-64-v3")
#else
#define CPU_V3                                                                             \
    (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&                   \
     __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2"))
#define CPU_V4                                                                             \
    (CPU_V3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&  \
     __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&           \
     __builtin_cpu_supports("avx512cd"))
#endif

static int best_level(void)
{
#ifdef MPITREE_X86_CLONES
    __builtin_cpu_init();
    if (CPU_V4)
        return 4;
    if (CPU_V3)
        return 3;
#endif
    return 1;
}

static int kernel_level = 0; /* 0: not chosen yet */

/* The best build this CPU supports (4, 3 or 1). */
int mpitree_kernel_best(void) { return best_level(); }

/* Select the build to run: `level` 4, 3 or 1, or 0 for the best this CPU supports
 * (the default). A level above the best is lowered to it. Returns the level in use.
 * Not thread-safe against running kernels: for tests and benchmarks. */
int mpitree_kernel_select(int level)
{
    const int best = best_level();
    kernel_level = level <= 0 || level > best ? best : level >= 4 ? 4 : level >= 3 ? 3 : 1;
    return kernel_level;
}

/* Which build of the kernel runs (see mpitree_kernel_select). */
const char *mpitree_kernel_isa(void)
{
    if (!kernel_level)
        mpitree_kernel_select(0);
#ifdef MPITREE_X86_CLONES
    return kernel_level == 4   ? "x86-64-v4 (AVX-512)"
           : kernel_level == 3 ? "x86-64-v3 (AVX2, FMA)"
                               : "x86-64 (SSE2)";
#else
    return "portable C";
#endif
}

/* The calling thread's floating-point mode, which changes the bits of the kernel and
 * the merge: bit 0 = subnormal results flushed to zero (x86 MXCSR.FTZ), bit 1 =
 * subnormal inputs read as zero (MXCSR.DAZ; aarch64's FPCR.FZ sets both), bits 2-3 = the
 * rounding direction (0 nearest, 1 down, 2 up, 3 toward zero). 0 = IEEE's default, or
 * not known on this platform (nor are aarch64's FEAT_AFP bits FPCR.FIZ and AH read). */
int mpitree_fp_mode(void)
{
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
    unsigned int csr;
    __asm__ volatile("stmxcsr %0" : "=m"(csr));
    return (int)(((csr >> 15) & 1) | (((csr >> 6) & 1) << 1) | (((csr >> 13) & 3) << 2));
#elif defined(__aarch64__) && defined(__GNUC__)
    static const int rounding[4] = {0, 2, 1, 3}; /* FPCR.RMode: RN, RP, RM, RZ */
    unsigned long fpcr;
    __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
    return (((fpcr >> 24) & 1) ? 3 : 0) | (rounding[(fpcr >> 22) & 3] << 2);
#else
    return 0;
#endif
}

/* Run build `level` of the kernel. */
static void attend_level(int level, const mpitree_attn_args *a, const float *q, const float *k,
                         const float *v, float *out, float *scratch, int in_order)
{
#ifdef MPITREE_X86_CLONES
    if (level == 4) {
        attend_v4(a, q, k, v, out, scratch, in_order);
        return;
    }
    if (level == 3) {
        attend_v3(a, q, k, v, out, scratch, in_order);
        return;
    }
#endif
    attend_base(a, q, k, v, out, scratch, in_order);
}

/* How one_row_in_order calls read, per build: the hardware prefetcher alone (address
 * order) or software prefetch. Which is faster differs between machines (kernel_bw.py,
 * MHA 16/16, D = 128, v4: on an AMD Zen 4 VM 91-92% of the read floor in address order
 * against 66-70% prefetching; on an Intel Xeon VM 73-82% against 84-93%). The first
 * ORDER_TRIES calls reading at least ORDER_BYTES time the two ways in turn, and the
 * process keeps the one of least time per byte (the least of its tries: a try slowed
 * by another process does not count against it). Smaller calls, and calls past the
 * tries while they run, read in address order. A decode step's layers together stream
 * from memory however small one layer's call is. Results never depend on the way: the
 * same sums. */
#define ORDER_TRIES 8
#define ORDER_BYTES (8 << 20)

static struct {
    int tries, timed, kept; /* kept: 0 until decided, then 1 + the way (1 address order) */
    double ns_per_byte[ORDER_TRIES];
} read_order[5]; /* zero: nothing timed, nothing kept (no try left a slot unwritten) */
static int forced_order = -1; /* tests and benchmarks: 1 or 0 forces a way, -1 times them */

/* Start build `level`'s timed choice over: a try still running when this is called may
 * count as one of the new ones, but it writes its own time, and a slot no try wrote
 * stays infinite, never the least. */
static void start_timing(int level)
{
    __atomic_store_n(&read_order[level].kept, 0, __ATOMIC_RELAXED);
    for (int i = 0; i < ORDER_TRIES; ++i)
        read_order[level].ns_per_byte[i] = INFINITY;
    __atomic_store_n(&read_order[level].timed, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&read_order[level].tries, 0, __ATOMIC_RELEASE);
}

static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

/* Force the way one_row_in_order calls read: 1 address order, 0 prefetching, -1 the
 * timed choice (the default), started over, -2 as it is. Returns the way build `level`
 * (4, 3, 1, lowered to the best this CPU runs; 0: the one selected) now uses: 1, 0,
 * or -1 while it has not decided. For tests and benchmarks. */
int mpitree_kernel_read_order(int force, int level)
{
    if (force >= -1 && force <= 1) /* anything else (-2) keeps what is forced */
        __atomic_store_n(&forced_order, force, __ATOMIC_RELAXED);
    if (force == -1)
        for (int l = 0; l < 5; ++l)
            start_timing(l);
    if (!kernel_level)
        mpitree_kernel_select(0);
    const int best = best_level();
    level = level <= 0 ? kernel_level : level > best ? best : level >= 4 ? 4 : level >= 3 ? 3 : 1;
    const int forced = __atomic_load_n(&forced_order, __ATOMIC_RELAXED);
    return forced >= 0 ? forced : __atomic_load_n(&read_order[level].kept, __ATOMIC_ACQUIRE) - 1;
}

/* q: (B, Hq, Sq, D) float32 contiguous; out: (B, Hq, Sq, D + 2) float32 records;
 * scratch: mpitree_attend_scratch(G * Sq, D) floats (the caller owns it). Keys are
 * taken in chunks with a running max (online softmax), K and V read once each. */
void mpitree_attend_f32(const mpitree_attn_args *a, const float *q, const float *k,
                        const float *v, float *out, float *scratch)
{
    if (!kernel_level)
        mpitree_kernel_select(0);
    const int level = kernel_level;
    if (!one_row_in_order(a)) {
        attend_level(level, a, q, k, v, out, scratch, 0);
        return;
    }
    const int forced = __atomic_load_n(&forced_order, __ATOMIC_RELAXED);
    const int chosen = __atomic_load_n(&read_order[level].kept, __ATOMIC_ACQUIRE) - 1;
    if (forced >= 0 || chosen >= 0) {
        attend_level(level, a, q, k, v, out, scratch, forced >= 0 ? forced : chosen);
        return;
    }
    double keys = 0.0;
    for (int64_t b = 0; b < a->batch; ++b)
        keys += (double)(a->lens ? a->lens[b] : a->t);
    const double bytes = 8.0 * keys * (double)(a->kv_heads * a->head_dim);
    const int attempt = bytes >= ORDER_BYTES
                        ? __atomic_fetch_add(&read_order[level].tries, 1, __ATOMIC_RELAXED)
                        : ORDER_TRIES;
    if (attempt >= ORDER_TRIES) {
        attend_level(level, a, q, k, v, out, scratch, 1);
        return;
    }
    const double t0 = now_ns();
    attend_level(level, a, q, k, v, out, scratch, attempt & 1);
    read_order[level].ns_per_byte[attempt] = (now_ns() - t0) / bytes;
    if (__atomic_add_fetch(&read_order[level].timed, 1, __ATOMIC_ACQ_REL) == ORDER_TRIES) {
        double least[2] = {INFINITY, INFINITY};
        for (int i = 0; i < ORDER_TRIES; ++i)
            least[i & 1] = fmin(least[i & 1], read_order[level].ns_per_byte[i]);
        __atomic_store_n(&read_order[level].kept, 1 + (least[1] <= least[0]), __ATOMIC_RELEASE);
    }
}
