// Reductions over a thread block, shared by the CUDA backend's kernels.
#pragma once

namespace kvcmas::cuda {

// The sum of v over the block, returned to every thread (blockDim.x a multiple of 32, at most 1024; shared holds
// blockDim.x / 32 doubles).
__device__ inline double block_sum(double v, double * shared) {
    for (int off = 16; off > 0; off /= 2) {
        v += __shfl_down_sync(0xFFFFFFFFu, v, off);
    }
    if (threadIdx.x % 32 == 0) {
        shared[threadIdx.x / 32] = v;
    }
    __syncthreads();
    double s = 0.0;
    for (int i = 0; i < static_cast<int>(blockDim.x / 32); ++i) {
        s += shared[i];
    }
    __syncthreads();
    return s;
}

}  // namespace kvcmas::cuda
