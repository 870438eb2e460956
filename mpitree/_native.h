/*
 * What the sources of mpitree's compiled library share. They build one extension,
 * mpitree._native (plain C: no mpi.h, no Python.h), which mpitree/_library.py loads with
 * ctypes; the structs and functions below are its whole interface (_library.py mirrors
 * them). The sources, one job each:
 *   _native_op.c      the (m, d, n) combine, as the MPI user functions of the op, and
 *                     its own exponential (no libm: the same bits everywhere)
 *   _native_kernel.c  the float32 local-attention kernel: its ISA builds and dispatch
 *   _native_finish.c  the attention output of merged records
 *   _native_layer.c   one decode layer's step, bound once: the kernel, the merge's
 *                     collective (MPI_Start/MPI_Wait through addresses handed over by
 *                     mpi4py, so still no mpi.h) and finishing
 *   _native_read.c    the stream-read bandwidth floor that benchmarks measure against
 * (mpitree/_native_call.c is another extension, with Python.h: the CPython function
 * through which a later decode layer calls mpitree_layer_step_f32, without ctypes.)
 */
#ifndef MPITREE_NATIVE_H
#define MPITREE_NATIVE_H

#include <float.h>
#include <math.h>
#include <stdint.h>

/* Every source's bits assume IEEE arithmetic in each type's own precision. */
#if defined(__FAST_MATH__) || FLT_EVAL_METHOD != 0
#error "mpitree's library needs IEEE arithmetic in each type's precision (no -ffast-math, no x87)"
#endif

/* The record layout, the C half of its one definition (mpitree/_state.py: M, D, N,
 * width): a row's partial state is D + 2 values [m, d, n_0 .. n_{D-1}] (float32 or
 * float64): m the reference logit (the running max), d the softmax denominator and n
 * its numerator relative to m. A merge buffer ends in one flag record: its m is 1 on
 * a rank whose local work failed, MPITREE_FLAG_CLEAR (-inf, the empty state's m)
 * elsewhere, and it merges like any record (its m is a max). */
#define MPITREE_REC_M 0
#define MPITREE_REC_D 1
#define MPITREE_REC_N 2
#define MPITREE_REC_WIDTH(dim) ((dim) + 2)
#define MPITREE_FLAG_CLEAR (-INFINITY)

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define MPITREE_X86_CLONES 1
#if __GNUC__ >= 12
#define MPITREE_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else /* GCC 11 has no dispatcher for the x86-64-v3 level */
#define MPITREE_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#define MPITREE_INLINE static inline __attribute__((always_inline))
#else
#define MPITREE_CLONES
#define MPITREE_INLINE static inline
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

#define MPITREE_STATUS_WORDS 8 /* an MPI_Status fits: 20 bytes MPICH, 24 Open MPI, 32 MPI ABI */

typedef struct {
    const float *q;     /* this step's (B, Hq, Sq, D) query, C order */
    int64_t t;          /* this step's shard length T */
    const uint8_t *vis; /* this step's (B, Hm, Sq, T) visibility, or NULL (every key) */
    int64_t vis_heads;  /* Hm: 1 or Hq */
    const float *k, *v; /* bound: the shard's K and V, strides in args */
    float *rec;         /* bound: the merge's (B, Hq, Sq, D + 2) records */
    float *scratch;     /* bound: mpitree_attend_scratch(G * Sq, D) floats */
    mpitree_attn_args args;
    /* bound by BoundLayer.bind_merge: the merge's persistent all-reduce, run from here */
    int (*finalized)(int *flag);               /* MPI_Finalized: checked first, every step */
    int (*start)(void *request);               /* MPI_Start, or NULL: one rank, no collective */
    int (*wait)(void *request, void *status);  /* MPI_Wait */
    void *request;                             /* the address of the request's handle */
    float *flag;                               /* the merge buffer's flag record (its m) */
    int64_t timed;                             /* nonzero: write the two durations below */
    int64_t kernel_ns, collective_ns;
    int64_t mpi_error;                         /* the failing MPI call's error code */
    int64_t status[MPITREE_STATUS_WORDS];      /* room for one MPI_Status */
} mpitree_layer;

typedef struct {
    int (*finalized)(int *flag);              /* MPI_Finalized: checked first, every call */
    void (*allreduce)(void);                  /* MPI_Allreduce (its handles' type), or NULL */
    int64_t handle_bytes;                     /* sizeof an MPI handle: 4 (int) or a pointer's */
    int64_t comm, int64_type, min_op;         /* the agreement's handles, by value */
    int64_t sent[4], got[4];                  /* this rank's agreement vector, the MIN */
    int (*start)(void *request);              /* MPI_Start, or NULL: one rank, no collective */
    int (*wait)(void *request, void *status); /* MPI_Wait */
    void *request;                            /* the address of the merge's request handle */
    float *flag;                              /* the merge buffer's flag record (its m) */
    float *records;                           /* the merge buffer's float32 records */
    int64_t nbytes;                           /* their bytes (the flag record not included) */
    mpitree_attn_args kernel;                 /* tree_decode: the bound kernel's arguments */
    float *scratch;                           /* tree_decode: the kernel's scratch */
    int64_t mpi_error;                        /* the failing MPI call's error code */
    int64_t status[MPITREE_STATUS_WORDS];     /* room for one MPI_Status */
} mpitree_oneshot;

/* _native_op.c */
int mpitree_nslots(void);
void *mpitree_bind_slot(int bits, int slot, int dim);
void mpitree_combine(int bits, const void *in, void *io, int count, int dim);
void mpitree_merge_exp(int bits, const void *x, void *y, int64_t n);

/* _native_kernel.c */
int64_t mpitree_attend_scratch(int64_t rows, int64_t dim);
int mpitree_kernel_best(void);
int mpitree_kernel_select(int level);
const char *mpitree_kernel_isa(void);
int mpitree_fp_mode(void);
int mpitree_kernel_read_order(int force, int level);
void mpitree_attend_f32(const mpitree_attn_args *a, const float *q, const float *k,
                        const float *v, float *out, float *scratch);

/* _native_finish.c */
void mpitree_finish_f32(const float *rec, int64_t batch, int64_t heads, int64_t q_len,
                        int64_t dim, float *out);

/* _native_layer.c */
void mpitree_layer_attend_f32(mpitree_layer *l);
void mpitree_layer_finish_f32(const mpitree_layer *l, float *out);
int mpitree_layer_step_f32(mpitree_layer *l, float *out);

/* _native_oneshot.c */
int mpitree_oneshot_merge_f32(mpitree_oneshot *o, const void *in, void *out);
int mpitree_oneshot_decode_f32(mpitree_oneshot *o, const float *q, const float *k,
                               const float *v, int64_t t, float *out);

/* _native_read.c */
float mpitree_read_f32(const float *x, int64_t n);

#endif
