/* Output finishing: the attention output of merged float32 records. */
#include "_native.h"

/* Attention output of merged float32 records, heads after queries:
 * out[b, s, h, :] = n / d of rec[b, h, s] (records (B, H, Sq, D + 2), C order;
 * out (B, Sq, H, D), C order). A row with d == 0 is empty (n == 0) and gives 0;
 * the division is the one numpy's output_of performs, so the bits match. */
void mpitree_finish_f32(const float *rec, int64_t batch, int64_t heads, int64_t q_len,
                        int64_t dim, float *out)
{
    const int64_t w = MPITREE_REC_WIDTH(dim);
    for (int64_t b = 0; b < batch; ++b)
        for (int64_t h = 0; h < heads; ++h)
            for (int64_t s = 0; s < q_len; ++s) {
                const float *r = rec + ((b * heads + h) * q_len + s) * w;
                float *o = out + ((b * q_len + s) * heads + h) * dim;
                const float d = r[MPITREE_REC_D] == 0.0f ? 1.0f : r[MPITREE_REC_D];
                for (int64_t x = 0; x < dim; ++x)
                    o[x] = r[MPITREE_REC_N + x] / d;
            }
}
