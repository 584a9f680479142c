#include <cuda_runtime.h>

#include <algorithm>

#include "backend/cuda/swiglu-oai.cuh"
#include "common/error.h"

namespace kvcmas::cuda {

namespace {

__global__ void swiglu_oai_kernel(float * g, const float * u, int64_t n, float alpha, float limit) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const float x  = fminf(g[i], limit);
        const float up = fminf(fmaxf(u[i], -limit), limit);
        g[i]           = x / (1.0f + expf(-alpha * x)) * (up + 1.0f);
    }
}

}  // namespace

void swiglu_oai(float * g, const float * u, int64_t n, float alpha, float limit) {
    if (n <= 0) {
        return;
    }
    constexpr int threads = 256;
    const int     blocks  = static_cast<int>(std::min<int64_t>((n + threads - 1) / threads, 65535));
    swiglu_oai_kernel<<<blocks, threads>>>(g, u, n, alpha, limit);
    const cudaError_t err = cudaGetLastError();
    KC_CHECK(err == cudaSuccess, "cuda backend: swiglu_oai launch failed: %s", cudaGetErrorString(err));
}

}  // namespace kvcmas::cuda
