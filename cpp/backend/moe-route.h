// Top-k routing of one token over the experts, shared by the CPU backend and the CUDA kernel (one thread a row):
// softmax of the row's logits, the k most probable experts (ties: lower index first) into ids, most probable first,
// their probabilities into weights, divided by their sum when norm.
#pragma once

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define KC_HOST_DEVICE __host__ __device__
#else
#define KC_HOST_DEVICE
#endif

namespace kvcmas::backend {

KC_HOST_DEVICE inline void moe_route_row(const float * logits, int n_expert, int k, bool norm, int32_t * ids,
                                         float * weights) {
    float mx = logits[0];
    for (int e = 1; e < n_expert; ++e) {
        mx = logits[e] > mx ? logits[e] : mx;
    }
    float sum = 0.0f;
    for (int e = 0; e < n_expert; ++e) {
        sum += expf(logits[e] - mx);
    }
    float chosen = 0.0f;
    for (int j = 0; j < k; ++j) {
        int best = -1;
        for (int e = 0; e < n_expert; ++e) {
            bool taken = false;
            for (int t = 0; t < j; ++t) {
                taken = taken || ids[t] == e;
            }
            if (!taken && (best < 0 || logits[e] > logits[best])) {
                best = e;
            }
        }
        ids[j]     = best;
        weights[j] = expf(logits[best] - mx) / sum;
        chosen += weights[j];
    }
    for (int j = 0; norm && j < k; ++j) {
        weights[j] /= chosen;
    }
}

}  // namespace kvcmas::backend
