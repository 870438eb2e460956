/* The bandwidth floor: `python -m mpitree bench` (mpitree/cli/bench.py) and
 * benchmarks/kernel_bw.py time this loop next to the kernel (_kernel.read_seconds). */
#include "_native.h"

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
