/*
 * What the sources of mpitree's compiled library share. They build one extension,
 * mpitree._native (plain C: no mpi.h, no Python.h), which mpitree/_library.py loads with
 * ctypes; the structs, enums and functions below are its whole interface (_library.py
 * mirrors them; tests/test_library.py checks the mirror against this header as the
 * compiler lays it out). The sources, one job each:
 *   _native_op.c      the (m, d, n) combine, as the MPI user functions of the op, and
 *                     its own exponential (no libm: the same bits everywhere)
 *   _native_kernel.c  the float32 local-attention kernel: its ISA builds and dispatch
 *   _native_finish.c  the attention output of merged records
 *   _native_step.c    the one step, bound once (mpitree_step): MPI_Finalized asked, the
 *                     agreement where one is bound, this rank's records (the kernel, or
 *                     a state's copied in), the merge's collective (MPI_Start/MPI_Wait
 *                     through addresses handed over by mpi4py, so still no mpi.h) and
 *                     the output
 *   _native_read.c    the stream-read bandwidth floor that benchmarks measure against
 * (mpitree/_native_call.c is another extension, with Python.h: the CPython function
 * through which a later decode layer calls mpitree_step_run, without ctypes.)
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

/* What mpitree_step_run returns (mpitree/_library.py StepCode mirrors it). Codes 0 to 2:
 * the agreement, where one is bound, held on every rank, and the merge ran. */
enum mpitree_code {
    MPITREE_OK = 0,          /* out written */
    MPITREE_FLAGGED = 1,     /* a rank's flag says it failed: out untouched */
    MPITREE_MERGE_ERROR = 2, /* the merge's MPI call returned the error code in mpi_error */
    MPITREE_UNBOUND = 3,     /* no merge is bound (no flag or no MPI_Finalized): nothing ran */
    MPITREE_FINALIZED = 4,   /* MPI is finalized: nothing ran */
    MPITREE_DISAGREED = 5,   /* the agreement's result, in got, is not sent: nothing else ran */
    MPITREE_AGREE_ERROR = 6, /* MPI_Finalized or the agreement returned the error code in
                                mpi_error: nothing else ran */
};

/* This rank's records (mpitree_step.local; mpitree/_library.py StepLocal mirrors it). */
enum mpitree_local {
    MPITREE_LOCAL_KERNEL = 0, /* the kernel over the bound shard: this call's q, t, lens, vis */
    MPITREE_LOCAL_COPY = 1,   /* nbytes of source copied in (allreduce_state) */
};

/* The output's layout (mpitree_step.output; mpitree/_library.py StepOutput mirrors it). */
enum mpitree_output {
    MPITREE_OUTPUT_LAYER = 0,   /* n / d in transformers' (B, Sq, Hq, D), C order */
    MPITREE_OUTPUT_HEADS = 1,   /* n / d in tree_decode's (B, Hq, Sq, D), C order */
    MPITREE_OUTPUT_RECORDS = 2, /* the merged records themselves (nbytes) */
};

/* The one compiled step (_native_step.c), bound once: a step sets only this call's
 * fields. Bound by mpitree/_steps.py Bound (a recurring one-shot call, a DecodePlan,
 * a transformers decode layer). */
typedef struct {
    /* this call's */
    const float *q;        /* (B, Hq, Sq, D) query, C order (local KERNEL) */
    const float *k, *v;    /* the shard's K and V, strides in args (a layer binds them) */
    int64_t t;             /* the shard length T */
    const int64_t *lens;   /* (B,) keys used per batch row, each in [0, t], or NULL (all t) */
    const uint8_t *vis;    /* (B, Hm, Sq, T) visibility, or NULL (every key) */
    int64_t vis_heads;     /* Hm: 1 or Hq */
    const void *source;    /* local COPY: the records copied in */
    /* bound: the local part and the output */
    int64_t local;         /* an enum mpitree_local */
    int64_t output;        /* an enum mpitree_output */
    float *rec;            /* the merge's float32 (rows, D + 2) records */
    int64_t nbytes;        /* their bytes (the flag record not included): COPY, RECORDS */
    float *scratch;        /* local KERNEL: mpitree_attend_scratch(G * Sq, D) floats */
    mpitree_attn_args args; /* local KERNEL: the kernel's arguments */
    /* bound: the agreement, or none (allreduce NULL: a layer's later step, one rank) */
    int (*finalized)(int *flag);  /* MPI_Finalized: asked first, every step */
    void (*allreduce)(void);      /* MPI_Allreduce (its handles' type), or NULL */
    int64_t handle_bytes;         /* sizeof an MPI handle: 4 (int) or a pointer's */
    int64_t comm, int64_type, min_op; /* the agreement's handles, by value */
    int64_t sent[4], got[4];      /* this rank's agreement vector, the MIN */
    /* bound: the merge's persistent all-reduce of the records and the flag */
    int (*start)(void *request);              /* MPI_Start, or NULL: one rank, no collective */
    int (*wait)(void *request, void *status); /* MPI_Wait */
    void *request;                            /* the address of the request's handle */
    float *flag;                              /* the merge buffer's flag record (its m) */
    int64_t timed;                            /* nonzero: write the two durations below */
    int64_t kernel_ns, collective_ns;         /* this rank's records; the merge */
    int64_t mpi_error;                        /* the failing MPI call's error code */
    int64_t status[MPITREE_STATUS_WORDS];     /* room for one MPI_Status */
} mpitree_step;

/* _native_step.c */
int64_t mpitree_struct_size(int which); /* sizeof: 0 mpitree_step, 1 mpitree_attn_args */

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

/* _native_step.c */
void mpitree_step_local(mpitree_step *s);
void mpitree_step_output(const mpitree_step *s, void *out);
int mpitree_step_run(mpitree_step *s, void *out);

/* _native_read.c */
float mpitree_read_f32(const float *x, int64_t n);

#endif
