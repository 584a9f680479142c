// The CUDA backend. One device, the legacy default stream (ops run in order; download() waits for them).
//
// Kernels: mat-vec for decode (a warp per weight row reads the stored format, up to 8 tokens per pass), a TF32
// tensor-core GEMM (WMMA) on weight tiles dequantized into shared memory for prefill, RMSNorm, RoPE with the KV
// write, attention over the run table with per-run RoPE shift and the low-rank correction fused (online softmax,
// one block per (token, head)), SwiGLU, residual adds, and the sharing layer's read-back / copy / ridge kernels.
// Activations come from a small caching allocator (cudaFree would synchronize the device on every forward pass).
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "backend/cuda/cuda-backend.h"
#include "backend/cuda/quants.cuh"
#include "backend/cuda/reduce.cuh"
#include "backend/cuda/swiglu-oai.cuh"
#include "backend/cuda/vision-kernels.cuh"
#include "backend/moe-route.h"
#include "common/error.h"

namespace kvcmas::backend {
namespace {

using namespace kvcmas::cuda;

#define KC_CUDA(call)                                                                                  \
    do {                                                                                               \
        const cudaError_t err_ = (call);                                                               \
        KC_CHECK(err_ == cudaSuccess, "cuda backend: %s failed: %s", #call, cudaGetErrorString(err_)); \
    } while (0)

void check_launch(const char * what) {
    const cudaError_t err = cudaGetLastError();
    KC_CHECK(err == cudaSuccess, "cuda backend: kernel %s failed to launch: %s", what, cudaGetErrorString(err));
}

int blocks_for(int64_t n, int threads) {
    return static_cast<int>(std::min<int64_t>((n + threads - 1) / threads, 1 << 20));
}

// ---------------------------------------------------------------------------------------------------------- kernels

constexpr int kMatvecRows   = 8;  // weight rows per block (a warp each)
constexpr int kMatvecMaxTok = 8;  // tokens per mat-vec pass; larger batches take the GEMM
constexpr int kTile         = 64;
constexpr int kTileK        = 32;

// y[t][r] = w_r · x_t for nt <= kMatvecMaxTok tokens.
template <int T>
__global__ void matvec_kernel(const uint8_t * w, size_t row_bytes, int64_t n_in, int64_t n_out, const float * x, int nt,
                              float * y) {
    const int     lane = threadIdx.x % 32;
    const int64_t r    = static_cast<int64_t>(blockIdx.x) * kMatvecRows + threadIdx.x / 32;
    if (r >= n_out) {
        return;
    }
    const uint8_t * row = w + r * row_bytes;
    float           acc[kMatvecMaxTok];
#pragma unroll
    for (int t = 0; t < kMatvecMaxTok; ++t) {
        acc[t] = 0.0f;
    }
    for (int64_t k0 = lane * 8; k0 < n_in; k0 += 256) {
        float wv[8];
        load8<T>(row, k0, wv);
#pragma unroll
        for (int t = 0; t < kMatvecMaxTok; ++t) {
            if (t < nt) {
                const float4 a = *reinterpret_cast<const float4 *>(x + t * n_in + k0);
                const float4 b = *reinterpret_cast<const float4 *>(x + t * n_in + k0 + 4);
                acc[t] += wv[0] * a.x + wv[1] * a.y + wv[2] * a.z + wv[3] * a.w + wv[4] * b.x + wv[5] * b.y +
                          wv[6] * b.z + wv[7] * b.w;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < kMatvecMaxTok; ++t) {
        float v = acc[t];
        for (int off = 16; off > 0; off /= 2) {
            v += __shfl_down_sync(0xFFFFFFFFu, v, off);
        }
        if (lane == 0 && t < nt) {
            y[t * n_out + r] = v;
        }
    }
}

// y [nt][n_out] = x [nt][n_in] · wᵀ with TF32 tensor cores: a 64 (weight rows) x 64 (tokens) tile per block of 4
// warps (32 x 32 each), K in steps of 32, the weight tile dequantized into shared memory.
template <int T>
__global__ void gemm_kernel(const uint8_t * w, size_t row_bytes, int64_t n_in, int64_t n_out, const float * x,
                            int64_t nt, float * y) {
    using namespace nvcuda;
    __shared__ __align__(32) float ws[kTile][kTileK + 4];
    __shared__ __align__(32) float xs[kTile][kTileK + 4];
    __shared__ __align__(32) float cs[kTile][kTile + 4];
    const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTile, t0 = static_cast<int64_t>(blockIdx.y) * kTile;
    const int     warp = threadIdx.x / 32, wr = (warp / 2) * 32, wt = (warp % 2) * 32;
    wmma::fragment<wmma::accumulator, 16, 16, 8, float> acc[2][2];
    for (int i = 0; i < 2; ++i) {
        for (int j = 0; j < 2; ++j) {
            wmma::fill_fragment(acc[i][j], 0.0f);
        }
    }
    for (int64_t k0 = 0; k0 < n_in; k0 += kTileK) {
        // 64 rows x 4 groups of 8 = 256 groups per tile, 2 per thread (128 threads); same for x.
        for (int g = threadIdx.x; g < kTile * 4; g += blockDim.x) {
            const int     rr = g / 4, kk = (g % 4) * 8;
            float         v[8] = { 0, 0, 0, 0, 0, 0, 0, 0 };
            const int64_t r    = r0 + rr;
            if (r < n_out) {
                load8<T>(w + r * row_bytes, k0 + kk, v);
            }
            for (int i = 0; i < 8; ++i) {
                ws[rr][kk + i] = wmma::__float_to_tf32(v[i]);
            }
            const int64_t t = t0 + rr;
            for (int i = 0; i < 8; ++i) {
                xs[rr][kk + i] = t < nt ? wmma::__float_to_tf32(x[t * n_in + k0 + kk + i]) : 0.0f;
            }
        }
        __syncthreads();
        for (int kk = 0; kk < kTileK; kk += 8) {
            wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> a[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::col_major> b[2];
            for (int i = 0; i < 2; ++i) {
                wmma::load_matrix_sync(a[i], &ws[wr + 16 * i][kk], kTileK + 4);
                wmma::load_matrix_sync(b[i], &xs[wt + 16 * i][kk], kTileK + 4);
            }
            for (int i = 0; i < 2; ++i) {
                for (int j = 0; j < 2; ++j) {
                    wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
                }
            }
        }
        __syncthreads();
    }
    for (int i = 0; i < 2; ++i) {
        for (int j = 0; j < 2; ++j) {  // cs[row][token]
            wmma::store_matrix_sync(&cs[wr + 16 * i][wt + 16 * j], acc[i][j], kTile + 4, wmma::mem_row_major);
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < kTile * kTile; e += blockDim.x) {
        const int64_t t = t0 + e / kTile, r = r0 + e % kTile;
        if (t < nt && r < n_out) {
            y[t * n_out + r] = cs[e % kTile][e / kTile];
        }
    }
}

template <int T>
__global__ void embed_kernel(const uint8_t * table, size_t row_bytes, int64_t n_in, const int32_t * tokens, float * x) {
    const int32_t tok = tokens[blockIdx.x];
    if (tok < 0) {
        return;
    }
    for (int64_t k0 = threadIdx.x * 8; k0 < n_in; k0 += blockDim.x * 8) {
        float v[8];
        load8<T>(table + tok * row_bytes, k0, v);
        for (int i = 0; i < 8; ++i) {
            x[blockIdx.x * n_in + k0 + i] = v[i];
        }
    }
}

__global__ void rms_norm_kernel(const float * x, const float * w, float * y, int64_t n, float eps) {
    __shared__ double part[32];
    const float *     xr  = x + blockIdx.x * n;
    double            sum = 0.0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        sum += static_cast<double>(xr[i]) * xr[i];
    }
    sum               = block_sum(sum, part);
    const float scale = static_cast<float>(1.0 / sqrt(sum / static_cast<double>(n) + eps));
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        y[blockIdx.x * n + i] = xr[i] * scale * w[i];
    }
}

__global__ void add_kernel(float * x, const float * y, int64_t n) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        x[i] += y[i];
    }
}

__global__ void add_bias_kernel(float * y, const float * b, int64_t n_rows, int64_t n) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n_rows * n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        y[i] += b[i % n];
    }
}

__global__ void swiglu_kernel(float * g, const float * u, int64_t n) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const float v = g[i];
        g[i]          = v / (1.0f + expf(-v)) * u[i];
    }
}

__global__ void geglu_tanh_kernel(float * g, const float * u, int64_t n) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const float v = g[i];
        g[i]          = 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v))) * u[i];
    }
}

__global__ void scale_kernel(float * x, float s, int64_t n) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        x[i] *= s;
    }
}

// One thread per row (moe-route.h).
__global__ void moe_route_kernel(const float * logits, int64_t n, int n_expert, int k, bool norm, int32_t * ids,
                                 float * weights) {
    const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
    if (i < n) {
        moe_route_row(logits + i * n_expert, n_expert, k, norm, ids + i * k, weights + i * k);
    }
}

__global__ void gather_rows_kernel(const float * src, const int32_t * rows, int64_t n, int64_t width, float * dst) {
    for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < n * width;
         t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        dst[t] = src[static_cast<int64_t>(rows[t / width]) * width + t % width];
    }
}

// One thread per column, the rows in order (a row of dst may be named more than once).
__global__ void add_scaled_rows_kernel(float * dst, const float * src, const int32_t * rows, const float * scales,
                                       int64_t n, int64_t width) {
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < width;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        for (int64_t i = 0; i < n; ++i) {
            dst[static_cast<int64_t>(rows[i]) * width + c] += scales[i] * src[i * width + c];
        }
    }
}

// LoRA, one group: t [n][rank] = A x[rows[i]] (one thread per (i, c)), then y[rows[i]] += scales[i] · factor · B t[i]
// (one thread per (i, o)); A and b_t f32 or f16 (`f16`); each value summed in order, so a row's result does not
// depend on the batch.
__device__ __forceinline__ float lora_factor(const void * p, int64_t i, LoraFactorType type) {
    return type == LoraFactorType::F16  ? __half2float(static_cast<const __half *>(p)[i])
           : type == LoraFactorType::I8 ? static_cast<float>(static_cast<const int8_t *>(p)[i])
                                        : static_cast<const float *>(p)[i];
}

// I8: t carries both rows' scales (a_scale[c] · b_scale[c]), so the up kernel reads b_t's stored values as they are.
__global__ void lora_down_kernel(const float * x, int64_t n_in, const void * a, LoraFactorType type,
                                 const float * a_scale, const float * b_scale, int rank, const int32_t * rows,
                                 int64_t n, float * t) {
    for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < n * rank;
         j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const float * xr  = x + static_cast<int64_t>(rows[j / rank]) * n_in;
        const int64_t ar  = (j % rank) * n_in;
        float         acc = 0.0f;
        for (int64_t k = 0; k < n_in; ++k) {
            acc = fmaf(lora_factor(a, ar + k, type), xr[k], acc);
        }
        const int c = static_cast<int>(j % rank);
        t[j]        = type == LoraFactorType::I8 ? a_scale[c] * b_scale[c] * acc : acc;
    }
}

__global__ void lora_up_kernel(const float * t, const void * b_t, LoraFactorType type, int rank, const int32_t * rows,
                               const float * scales, float factor, int64_t n, int64_t n_out, float * y) {
    for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < n * n_out;
         j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t i = j / n_out, o = j % n_out;
        const float * ti  = t + i * rank;
        float         acc = 0.0f;
        for (int c = 0; c < rank; ++c) {
            acc = fmaf(ti[c], lora_factor(b_t, lora_b_index(c, o, rank), type), acc);
        }
        float & yo = y[static_cast<int64_t>(rows[i]) * n_out + o];
        yo         = fmaf(scales[i] * factor, acc, yo);
    }
}

// Pair (i0, i1) of rotation j in a head: neox (j, j + half), else (2j, 2j + 1).
__device__ __forceinline__ void rope_pair(int j, int half, bool neox, int & i0, int & i1) {
    i0 = neox ? j : 2 * j;
    i1 = neox ? j + half : 2 * j + 1;
}

__device__ __forceinline__ void store_row(uint8_t * dst, int64_t d, float v, bool f16) {
    if (f16) {
        reinterpret_cast<__half *>(dst)[d] = __float2half_rn(v);
    } else {
        reinterpret_cast<float *>(dst)[d] = v;
    }
}

__device__ __forceinline__ float load_row(const uint8_t * src, int64_t d, bool f16) {
    return f16 ? __half2float(reinterpret_cast<const __half *>(src)[d]) : reinterpret_cast<const float *>(src)[d];
}

// Token i: q_i, k_i rotated with the tables of row i; k_i, v_i stored at k_dst[i] (V at + v_offset).
__global__ void rope_kv_write_kernel(float * q, float * k, const float * v, int n_head, int n_head_kv, int hd, int half,
                                     bool neox, const float * cq, const float * sq, const float * ck, const float * sk,
                                     uint8_t * const * k_dst, int64_t v_offset, bool f16) {
    const int64_t i  = blockIdx.x;
    const int64_t qd = static_cast<int64_t>(n_head) * hd, kd = static_cast<int64_t>(n_head_kv) * hd;
    for (int p = threadIdx.x; p < n_head * half; p += blockDim.x) {
        const int h = p / half, j = p % half;
        int       i0, i1;
        rope_pair(j, half, neox, i0, i1);
        float *     x = q + i * qd + h * hd;
        const float a = x[i0], b = x[i1], c = cq[i * half + j], s = sq[i * half + j];
        x[i0] = a * c - b * s;
        x[i1] = a * s + b * c;
    }
    for (int p = threadIdx.x; p < n_head_kv * half; p += blockDim.x) {
        const int h = p / half, j = p % half;
        int       i0, i1;
        rope_pair(j, half, neox, i0, i1);
        float *     x = k + i * kd + h * hd;
        const float a = x[i0], b = x[i1], c = ck[i * half + j], s = sk[i * half + j];
        x[i0] = a * c - b * s;
        x[i1] = a * s + b * c;
    }
    __syncthreads();
    for (int64_t d = threadIdx.x; d < kd; d += blockDim.x) {
        store_row(k_dst[i], d, k[i * kd + d], f16);
        store_row(k_dst[i] + v_offset, d, v[i * kd + d], f16);
    }
}

// A run as the device kernels read it: row j of K at k + j * row_bytes.
struct DevRun {
    const uint8_t * k;
    int32_t         n;
    int32_t         shift;
    int32_t         rank;
    const float *   a_k;  // row j: a_k + j * rank
    const float *   a_v;
    const float *   b_k;  // [rank][kd]
    const float *   b_v;
};

constexpr int kAttnThreads = 128;
constexpr int kMaxHeadDim  = 256;

// out[i][h] = softmax(scale·q·Kᵀ)·V over the first n_visible[i] rows of table tab[i]'s runs, with the run's RoPE
// shift applied to a copy of q (double-precision angles, as the CPU's Rope) and its correction fused:
// scores += (q·B_k)·a_k[j], out += (Σ_j p_j a_v[j])·B_v. Online softmax over chunks of 128 keys.
__global__ void attention_kernel(const float * q, float * out, const int32_t * tab, const int64_t * n_visible,
                                 const DevRun * runs, const int32_t * table_first, int n_head, int n_head_kv, int hd,
                                 float scale, int64_t v_offset, int64_t row_bytes, bool f16, int n_rot, bool neox,
                                 const float * inv_freq, int max_rank, const float * sinks) {
    extern __shared__ float smem[];
    float *                 q_rot  = smem;                 // [hd]
    float *                 qb     = q_rot + kMaxHeadDim;  // [max_rank]
    float *                 sv     = qb + max_rank;        // [max_rank]
    float *                 p      = sv + max_rank;        // [kAttnThreads]
    float *                 red    = p + kAttnThreads;     // [kAttnThreads / 32]
    const int64_t           i      = blockIdx.x;
    const int               h      = blockIdx.y;
    const int               group  = n_head / n_head_kv;
    const int64_t           kv_off = static_cast<int64_t>(h / group) * hd;
    const float *           qi     = q + (i * n_head + h) * hd;
    const int               half   = n_rot / 2;
    const int               d0 = threadIdx.x, d1 = threadIdx.x + kAttnThreads;  // the dims this thread accumulates
    float                   acc0 = 0.0f, acc1 = 0.0f, m = -INFINITY, l = 0.0f;
    const int               t          = tab[i];
    int64_t                 left       = n_visible[i];
    int32_t                 prev_shift = 0x7FFFFFFF;
    for (int ri = table_first[t]; ri < table_first[t + 1] && left > 0; ++ri) {
        const DevRun r = runs[ri];
        const int    n = static_cast<int>(r.n < left ? r.n : left);
        left -= n;
        if (r.shift != prev_shift) {  // q rotated by -shift (R(a)q·R(b)k = R(a-s)q·R(b-s)k)
            __syncthreads();
            for (int d = threadIdx.x; d < hd; d += blockDim.x) {
                q_rot[d] = qi[d];
            }
            __syncthreads();
            if (r.shift != 0) {
                for (int j = threadIdx.x; j < half; j += blockDim.x) {
                    int i0, i1;
                    rope_pair(j, half, neox, i0, i1);
                    double sn, cn;
                    sincos(static_cast<double>(-r.shift) * static_cast<double>(inv_freq[j]), &sn, &cn);
                    const float c = static_cast<float>(cn), s = static_cast<float>(sn);
                    const float a = q_rot[i0], b = q_rot[i1];
                    q_rot[i0] = a * c - b * s;
                    q_rot[i1] = a * s + b * c;
                }
            }
            prev_shift = r.shift;
            __syncthreads();
        }
        __syncthreads();
        for (int c = threadIdx.x; c < r.rank; c += blockDim.x) {
            float s = 0.0f;
            for (int d = 0; d < hd; ++d) {
                s += q_rot[d] * r.b_k[c * static_cast<int64_t>(n_head_kv) * hd + kv_off + d];
            }
            qb[c] = s;
            sv[c] = 0.0f;
        }
        __syncthreads();
        for (int j0 = 0; j0 < n; j0 += kAttnThreads) {
            const int j     = j0 + threadIdx.x;
            float     score = -INFINITY;
            if (j < n) {
                const uint8_t * krow = r.k + j * row_bytes;
                float           s    = 0.0f;
                for (int d = 0; d < hd; ++d) {
                    s += q_rot[d] * load_row(krow, kv_off + d, f16);
                }
                for (int c = 0; c < r.rank; ++c) {
                    s += qb[c] * r.a_k[j * r.rank + c];
                }
                score = s * scale;
            }
            // chunk max
            float mx = score;
            for (int off = 16; off > 0; off /= 2) {
                mx = fmaxf(mx, __shfl_down_sync(0xFFFFFFFFu, mx, off));
            }
            if (threadIdx.x % 32 == 0) {
                red[threadIdx.x / 32] = mx;
            }
            __syncthreads();
            float m_new = m;
            for (int w = 0; w < kAttnThreads / 32; ++w) {
                m_new = fmaxf(m_new, red[w]);
            }
            const float corr = expf(m - m_new);  // m = -inf at first: exp(-inf) = 0
            const float pj   = j < n ? expf(score - m_new) : 0.0f;
            p[threadIdx.x]   = pj;
            __syncthreads();
            float psum = 0.0f;
            for (int w = 0; w < kAttnThreads; ++w) {
                psum += p[w];
            }
            l = l * corr + psum;
            m = m_new;
            acc0 *= corr;
            acc1 *= corr;
            const int cn = min(kAttnThreads, n - j0);
            for (int jj = 0; jj < cn; ++jj) {
                const uint8_t * vrow = r.k + v_offset + (j0 + jj) * row_bytes;
                if (d0 < hd) {
                    acc0 += p[jj] * load_row(vrow, kv_off + d0, f16);
                }
                if (d1 < hd) {
                    acc1 += p[jj] * load_row(vrow, kv_off + d1, f16);
                }
            }
            for (int c = threadIdx.x; c < r.rank; c += blockDim.x) {
                float s = sv[c] * corr;
                for (int jj = 0; jj < cn; ++jj) {
                    s += p[jj] * r.a_v[(j0 + jj) * r.rank + c];
                }
                sv[c] = s;
            }
            __syncthreads();
        }
        if (r.rank > 0) {  // out += (Σ p a_v)·B_v, at the softmax scale reached so far
            for (int c = 0; c < r.rank; ++c) {
                const float * bv = r.b_v + c * static_cast<int64_t>(n_head_kv) * hd + kv_off;
                if (d0 < hd) {
                    acc0 += sv[c] * bv[d0];
                }
                if (d1 < hd) {
                    acc1 += sv[c] * bv[d1];
                }
            }
            __syncthreads();
        }
    }
    if (sinks != nullptr) {  // the head's sink logit joins the denominator (gpt-oss)
        const float m_new = fmaxf(m, sinks[h]);
        const float corr  = expf(m - m_new);
        acc0 *= corr;
        acc1 *= corr;
        l = l * corr + expf(sinks[h] - m_new);
    }
    float * o = out + (i * n_head + h) * hd;
    if (d0 < hd) {
        o[d0] = acc0 / l;
    }
    if (d1 < hd) {
        o[d1] = acc1 / l;
    }
}

// Row i of the rows listed in src (K at src[i], V at + v_offset): stored row as f32, + a_k[i]·B_k (a_v·B_v), keys
// rotated by shift[i] (double angles). Written to dst[i] in the store's type (copy) or to f32 out rows (read).
__global__ void materialize_kernel(const uint8_t * const * src, const float * const * a_k, const float * const * a_v,
                                   const int32_t * rank, const float * const * b_k, const float * const * b_v,
                                   const int64_t * shift, int64_t kd, int64_t v_offset, bool f16, int n_head_kv, int hd,
                                   int n_rot, bool neox, const float * inv_freq, uint8_t * const * dst, float * k_out,
                                   float * v_out) {
    extern __shared__ float row[];  // [kd]
    const int64_t           i = blockIdx.x;
    const int               r = rank[i];
    for (int side = 0; side < 2; ++side) {
        const uint8_t * s = src[i] + (side ? v_offset : 0);
        const float *   a = side ? a_v[i] : a_k[i];
        const float *   b = side ? b_v[i] : b_k[i];
        for (int64_t d = threadIdx.x; d < kd; d += blockDim.x) {
            float x = load_row(s, d, f16);
            for (int c = 0; c < r; ++c) {
                x += a[c] * b[c * kd + d];
            }
            row[d] = x;
        }
        __syncthreads();
        if (side == 0 && shift[i] != 0) {
            const int half = n_rot / 2;
            for (int p = threadIdx.x; p < n_head_kv * half; p += blockDim.x) {
                const int h = p / half, j = p % half;
                int       i0, i1;
                rope_pair(j, half, neox, i0, i1);
                double sn, cn;
                sincos(static_cast<double>(shift[i]) * static_cast<double>(inv_freq[j]), &sn, &cn);
                const float c = static_cast<float>(cn), sf = static_cast<float>(sn);
                float *     x  = row + h * hd;
                const float av = x[i0], bv = x[i1];
                x[i0] = av * c - bv * sf;
                x[i1] = av * sf + bv * c;
            }
            __syncthreads();
        }
        for (int64_t d = threadIdx.x; d < kd; d += blockDim.x) {
            if (dst != nullptr) {
                store_row(dst[i] + (side ? v_offset : 0), d, row[d], f16);
            } else {
                (side ? v_out : k_out)[i * kd + d] = row[d];
            }
        }
        __syncthreads();
    }
}

// Ridge rows: out[i][c] = Σ_d (x_i[d] - mu[d])·proj[d][c] + Σ_q a[i][q]·m[q][c], out[i][rank] = 1.
__global__ void ridge_kernel(const uint8_t * rows, int64_t row_bytes, bool f16, int64_t kd, const float * mu,
                             const float * proj, int rank, const float * a, int b_rank, const float * m, float * out) {
    extern __shared__ float x[];  // [kd]
    const int64_t           i = blockIdx.x;
    for (int64_t d = threadIdx.x; d < kd; d += blockDim.x) {
        x[d] = load_row(rows + i * row_bytes, d, f16) - mu[d];
    }
    __syncthreads();
    for (int c = threadIdx.x; c <= rank; c += blockDim.x) {
        float s = 1.0f;
        if (c < rank) {
            s = 0.0f;
            for (int64_t d = 0; d < kd; ++d) {
                s += x[d] * proj[d * rank + c];
            }
            for (int q = 0; q < b_rank; ++q) {
                s += a[i * b_rank + q] * m[q * rank + c];
            }
        }
        out[i * (rank + 1) + c] = s;
    }
}

// ---------------------------------------------------------------------------------------------------------- backend

struct TypeProbe {
    template <int T>
    void operator()() const {}
};

bool reads_type(int type) {
    return dispatch_type(type, TypeProbe{});
}

class DeviceFactors final : public Factors {
  public:
    ~DeviceFactors() override {
        for (const float * p : { a_k, b_k, a_v, b_v }) {
            cudaFree(const_cast<float *>(p));
        }
    }
};

class CudaBackend final : public Backend {
  public:
    explicit CudaBackend(int device) : device_(device) {
        int n = 0;
        KC_CUDA(cudaGetDeviceCount(&n));
        KC_CHECK(device >= 0 && device < n, "device 'cuda:%d' requested, but this machine has %d CUDA device(s)",
                 device, n);
        KC_CUDA(cudaSetDevice(device));
        KC_CUDA(cudaGetDeviceProperties(&prop_, device));
        KC_CHECK(prop_.major >= 8, "cuda backend: %s has compute capability %d.%d; kvcmas needs 8.0 or newer (TF32)",
                 prop_.name, prop_.major, prop_.minor);
    }

    ~CudaBackend() override {
        cudaSetDevice(device_);
        cudaDeviceSynchronize();
        for (auto & kv : cache_) {
            for (void * p : kv.second) {
                cudaFree(p);
            }
        }
        for (void * p : weights_) {
            cudaFree(p);
        }
    }

    std::string name() const override { return "cuda"; }
    std::string device() const override {
        return std::string(prop_.name) + " (cuda:" + std::to_string(device_) + ", sm_" + std::to_string(prop_.major) +
               std::to_string(prop_.minor) + ", " + std::to_string(prop_.totalGlobalMem >> 20) + " MiB)";
    }
    int n_threads() const override { return 1; }

    // Raw device memory; throws a clear error on OOM after releasing the activation cache and retrying once.
    void * device_malloc(size_t bytes) {
        void *      p   = nullptr;
        cudaError_t err = cudaMalloc(&p, std::max<size_t>(bytes, 1));
        if (err == cudaErrorMemoryAllocation) {
            cudaGetLastError();  // clear it
            release_cache();
            err = cudaMalloc(&p, std::max<size_t>(bytes, 1));
        }
        if (err != cudaSuccess) {
            cudaGetLastError();
            size_t free_b = 0, total_b = 0;
            cudaMemGetInfo(&free_b, &total_b);
            fail("cuda backend: out of device memory: %zu bytes requested, %zu of %zu free (%s)", bytes, free_b,
                 total_b, cudaGetErrorString(err));
        }
        return p;
    }

    // Activation buffers are cached by size class (a quarter of the size's power of two, at least 4 KiB), so a
    // server's varying batch sizes reuse a bounded set of buffers.
    static size_t size_class(size_t bytes) {
        size_t step = 4096;
        while (step * 8 <= bytes) {
            step *= 2;
        }
        return (bytes + step - 1) / step * step;
    }
    void * alloc(size_t bytes) override {
        const size_t                cls = size_class(bytes);
        std::lock_guard<std::mutex> lock(cache_mutex_);
        auto                        it = cache_.find(cls);
        if (it != cache_.end() && !it->second.empty()) {
            void * p = it->second.back();
            it->second.pop_back();
            return p;
        }
        return device_malloc(cls);
    }
    void free(void * p, size_t bytes) override {
        std::lock_guard<std::mutex> lock(cache_mutex_);
        cache_[size_class(bytes)].push_back(p);
    }
    size_t free_bytes() const override {
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        return free_b;
    }
    void upload(void * dst, const void * src, size_t bytes) override {
        KC_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
    }
    void download(void * dst, const void * src, size_t bytes) override {
        KC_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
    }

    Weight upload_weight(GgmlType type, const void * host, int64_t n_in, int64_t n_out, size_t row_bytes) override {
        KC_CHECK(n_in % 32 == 0, "cuda backend: weight rows of %lld elements (the kernels need a multiple of 32)",
                 static_cast<long long>(n_in));
        KC_CHECK(reads_type(static_cast<int>(type)), "cuda backend: weight type %s has no CUDA kernel",
                 ggml_type_name(static_cast<uint32_t>(type)));
        const size_t bytes = row_bytes * static_cast<size_t>(n_out);
        void *       p     = device_malloc(bytes);
        try {
            upload(p, host, bytes);
            weights_.push_back(p);
        } catch (...) {
            cudaFree(p);
            throw;
        }
        return Weight{ type, p, n_in, n_out, row_bytes };
    }
    void free_weight(const Weight & w) override {
        auto it = std::find(weights_.begin(), weights_.end(), w.data);
        if (it != weights_.end()) {
            cudaFree(*it);
            weights_.erase(it);
        }
    }

    std::shared_ptr<const Factors> upload_factors(int rank, int32_t n_rows, int64_t kd, const float * a_k,
                                                  const float * b_k, const float * a_v, const float * b_v) override {
        auto         f        = std::make_shared<DeviceFactors>();
        const size_t na       = static_cast<size_t>(n_rows) * rank * sizeof(float);
        const size_t nb       = static_cast<size_t>(rank) * kd * sizeof(float);
        f->rank               = rank;
        f->n_rows             = n_rows;
        const float ** dst[4] = { &f->a_k, &f->b_k, &f->a_v, &f->b_v };
        const float *  src[4] = { a_k, b_k, a_v, b_v };
        for (int i = 0; i < 4; ++i) {  // f frees what was taken if a later one fails
            const size_t bytes = i % 2 == 0 ? na : nb;
            float *      p     = static_cast<float *>(device_malloc(bytes));
            *dst[i]            = p;
            upload(p, src[i], bytes);
        }
        f->host_b_k = b_k;
        f->host_b_v = b_v;
        return f;
    }

    uint8_t * kv_block_alloc(size_t bytes) override { return static_cast<uint8_t *>(device_malloc(bytes)); }
    void      kv_block_free(uint8_t * p, size_t) override { cudaFree(p); }

    void embed_rows(const Weight & table, const int32_t * tokens, int64_t n, float * x) override {
        if (n == 0) {
            return;
        }
        Buffer tok = put(tokens, n);
        dispatch_type(static_cast<int>(table.type), [&]<int T>() {
            embed_kernel<T><<<static_cast<unsigned>(n), 128>>>(static_cast<const uint8_t *>(table.data),
                                                               table.row_bytes, table.n_in,
                                                               static_cast<const int32_t *>(tok.data()), x);
        });
        check_launch("embed_rows");
    }

    void rms_norm(const float * x, const float * w, float * y, int64_t n_rows, int64_t n, float eps) override {
        if (n_rows > 0) {
            rms_norm_kernel<<<static_cast<unsigned>(n_rows), 256>>>(x, w, y, n, eps);
            check_launch("rms_norm");
        }
    }

    void matmul(const Weight & w, const float * x, float * y, int64_t n_tok) override {
        if (n_tok == 0) {
            return;
        }
        const auto * wd = static_cast<const uint8_t *>(w.data);
        if (n_tok <= kMatvecMaxTok) {
            dispatch_type(static_cast<int>(w.type), [&]<int T>() {
                matvec_kernel<T><<<blocks_for(w.n_out, kMatvecRows), 32 * kMatvecRows>>>(
                    wd, w.row_bytes, w.n_in, w.n_out, x, static_cast<int>(n_tok), y);
            });
            check_launch("matvec");
        } else {
            const dim3 grid(static_cast<unsigned>((w.n_out + kTile - 1) / kTile),
                            static_cast<unsigned>((n_tok + kTile - 1) / kTile));
            dispatch_type(static_cast<int>(w.type), [&]<int T>() {
                gemm_kernel<T><<<grid, 128>>>(wd, w.row_bytes, w.n_in, w.n_out, x, n_tok, y);
            });
            check_launch("gemm");
        }
    }

    void matmul_multi(const Weight * w, float * const * y, int n_mats, const float * x, int64_t n_tok) override {
        for (int i = 0; i < n_mats; ++i) {
            matmul(w[i], x, y[i], n_tok);
        }
    }

    void matmul_experts(const Weight * w, int n_mats, int n_groups, const int64_t * host_first, const float * x,
                        float * const * y) override {
        for (int g = 0; g < n_groups; ++g) {  // expert by expert: each launch already fills the device
            const int64_t m = host_first[g + 1] - host_first[g];
            if (m <= 0) {
                continue;
            }
            for (int i = 0; i < n_mats; ++i) {
                matmul(w[g * n_mats + i], x + host_first[g] * w[0].n_in, y[i] + host_first[g] * w[i].n_out, m);
            }
        }
    }

    void add_bias(float * y, const float * b, int64_t n_rows, int64_t n) override {
        if (n_rows * n > 0) {
            add_bias_kernel<<<blocks_for(n_rows * n, 256), 256>>>(y, b, n_rows, n);
            check_launch("add_bias");
        }
    }
    void add(float * x, const float * y, int64_t n) override {
        if (n > 0) {
            add_kernel<<<blocks_for(n, 256), 256>>>(x, y, n);
            check_launch("add");
        }
    }
    void swiglu(float * g, const float * u, int64_t n_rows, int64_t n) override {
        if (n_rows * n > 0) {
            swiglu_kernel<<<blocks_for(n_rows * n, 256), 256>>>(g, u, n_rows * n);
            check_launch("swiglu");
        }
    }

    void swiglu_oai(float * g, const float * u, int64_t n_rows, int64_t n, float alpha, float limit) override {
        cuda::swiglu_oai(g, u, n_rows * n, alpha, limit);
    }
    void geglu_tanh(float * g, const float * u, int64_t n_rows, int64_t n) override {
        if (n_rows * n > 0) {
            geglu_tanh_kernel<<<blocks_for(n_rows * n, 256), 256>>>(g, u, n_rows * n);
            check_launch("geglu_tanh");
        }
    }

    void moe_route(const float * logits, int64_t n, int n_expert, int k, bool norm, int32_t * host_ids,
                   float * host_weights) override {
        if (n == 0) {
            return;
        }
        Buffer    ids(*this, sizeof(int32_t) * static_cast<size_t>(n * k));
        Buffer    weights(*this, sizeof(float) * static_cast<size_t>(n * k));
        int32_t * d_ids = static_cast<int32_t *>(ids.data());
        moe_route_kernel<<<blocks_for(n, 64), 64>>>(logits, n, n_expert, k, norm, d_ids, weights.f32());
        check_launch("moe_route");
        download(host_ids, ids.data(), sizeof(int32_t) * static_cast<size_t>(n * k));
        download(host_weights, weights.data(), sizeof(float) * static_cast<size_t>(n * k));
    }

    void gather_rows(const float * src, const int32_t * host_rows, int64_t n, int64_t width, float * dst) override {
        if (n * width == 0) {
            return;
        }
        Buffer rows = put(host_rows, n);
        gather_rows_kernel<<<blocks_for(n * width, 256), 256>>>(src, static_cast<const int32_t *>(rows.data()), n,
                                                                width, dst);
        check_launch("gather_rows");
    }

    void add_scaled_rows(float * dst, const float * src, const int32_t * host_rows, const float * host_scales,
                         int64_t n, int64_t width) override {
        if (n * width == 0) {
            return;
        }
        Buffer rows = put(host_rows, n), scales = put(host_scales, n);
        add_scaled_rows_kernel<<<blocks_for(width, 256), 256>>>(dst, src, static_cast<const int32_t *>(rows.data()),
                                                                scales.f32(), n, width);
        check_launch("add_scaled_rows");
    }

    void lora_add(const float * x, int64_t n_in, const LoraProduct * products, int n_products) override {
        for (int p = 0; p < n_products; ++p) {
            const LoraProduct & pr = products[p];
            for (int g = 0; g < pr.n_groups; ++g) {
                const LoraGroup & gr = pr.groups[g];
                if (gr.n_rows == 0 || gr.rank == 0) {
                    continue;
                }
                Buffer          rows = put(gr.host_rows, gr.n_rows), scales = put(gr.host_scales, gr.n_rows);
                Buffer          t(*this, sizeof(float) * static_cast<size_t>(gr.n_rows * gr.rank));
                const int32_t * d_rows = static_cast<const int32_t *>(rows.data());
                lora_down_kernel<<<blocks_for(gr.n_rows * gr.rank, 128), 128>>>(
                    x, n_in, gr.a, gr.type, gr.a_scale, gr.b_scale, gr.rank, d_rows, gr.n_rows, t.f32());
                check_launch("lora_add (A)");
                lora_up_kernel<<<blocks_for(gr.n_rows * pr.n_out, 256), 256>>>(
                    t.f32(), gr.b_t, gr.type, gr.rank, d_rows, scales.f32(), gr.factor, gr.n_rows, pr.n_out, pr.y);
                check_launch("lora_add (B)");
            }
        }
    }

    void scale(float * x, float s, int64_t n) override {
        if (n > 0) {
            scale_kernel<<<blocks_for(n, 256), 256>>>(x, s, n);
            check_launch("scale");
        }
    }

    void rope_kv_write(const Rope & rope, const AttentionShape & s, float * q, float * k, const float * v, int64_t n,
                       const float * cos_q, const float * sin_q, const float * cos_k, const float * sin_k,
                       const KvStore & store, int layer, const KvSlotRef * slots) override {
        if (n == 0) {
            return;
        }
        std::vector<uint8_t *> dst(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) {
            dst[static_cast<size_t>(i)] = row_addr(store, layer, slots[i].block, slots[i].row);
        }
        Buffer d = put(dst.data(), n);
        rope_kv_write_kernel<<<static_cast<unsigned>(n), 128>>>(
            q, k, v, s.n_head, s.n_head_kv, s.head_dim, rope.n_rot / 2, rope.neox, cos_q, sin_q, cos_k, sin_k,
            static_cast<uint8_t * const *>(d.data()), store.v_offset, store.kv_type == KvType::F16);
        check_launch("rope_kv_write");
    }

    void attention(const AttentionShape & shape, const Rope & rope, const KvStore & store, int layer, const float * q,
                   float * out, int64_t n, const QueryBlock * blocks, int n_blocks, const RunTable * tables,
                   int64_t) override {
        KC_CHECK(shape.head_dim <= kMaxHeadDim, "cuda backend: head size %d over the attention kernel's %d",
                 shape.head_dim, kMaxHeadDim);
        KC_CHECK(shape.window == 0,
                 "cuda backend: sliding-window attention (window %lld) has no CUDA kernel yet; use device 'cpu'",
                 static_cast<long long>(shape.window));
        int n_tables = 0;
        for (int b = 0; b < n_blocks; ++b) {
            n_tables = std::max(n_tables, blocks[b].table + 1);
        }
        std::vector<DevRun>  runs;
        std::vector<int32_t> first{ 0 };
        int                  max_rank = 0;
        for (int t = 0; t < n_tables; ++t) {
            for (const KvRunRef & r : tables[t].runs) {
                runs.push_back(dev_run(store, layer, tables[t], r));
                max_rank = std::max(max_rank, runs.back().rank);
            }
            first.push_back(static_cast<int32_t>(runs.size()));
        }
        std::vector<int32_t> tab(static_cast<size_t>(n));
        std::vector<int64_t> vis(static_cast<size_t>(n));
        for (int b = 0; b < n_blocks; ++b) {
            for (int i = 0; i < blocks[b].nq; ++i) {
                tab[static_cast<size_t>(blocks[b].first + i)] = blocks[b].table;
                vis[static_cast<size_t>(blocks[b].first + i)] =
                    std::max(blocks[b].n_visible0 + i, blocks[b].n_visible_min);
            }
        }
        Buffer       d_runs = put(runs.data(), runs.size()), d_first = put(first.data(), first.size());
        Buffer       d_tab = put(tab.data(), tab.size()), d_vis = put(vis.data(), vis.size());
        Buffer       d_inv = put(rope.inv_freq.data(), rope.inv_freq.size());
        const size_t smem  = sizeof(float) * (kMaxHeadDim + 2 * static_cast<size_t>(max_rank) + kAttnThreads + 32);
        const dim3   grid(static_cast<unsigned>(n), static_cast<unsigned>(shape.n_head));
        attention_kernel<<<grid, kAttnThreads, smem>>>(
            q, out, static_cast<const int32_t *>(d_tab.data()), static_cast<const int64_t *>(d_vis.data()),
            static_cast<const DevRun *>(d_runs.data()), static_cast<const int32_t *>(d_first.data()), shape.n_head,
            shape.n_head_kv, shape.head_dim, shape.scale, store.v_offset, store.row_bytes, store.kv_type == KvType::F16,
            rope.n_rot, rope.neox, static_cast<const float *>(d_inv.data()), max_rank, shape.sinks);
        check_launch("attention");
    }

    void kv_read(const Rope & rope, const AttentionShape & s, const KvStore & store, int layer, const RunTable & table,
                 int ri, int32_t j0, int32_t j1, float * k_out, float * v_out) override {
        const KvRunRef &                     r = table.runs[static_cast<size_t>(ri)];
        std::vector<int64_t>                 shifts(static_cast<size_t>(j1 - j0), r.shift);
        std::vector<std::pair<int, int32_t>> rows;
        for (int32_t j = j0; j < j1; ++j) {
            rows.emplace_back(ri, j);
        }
        const int64_t n = j1 - j0, kd = store.n_kv_dim;
        Buffer        k(*this, sizeof(float) * n * kd), v(*this, sizeof(float) * n * kd);
        materialize(rope, s, store, layer, table, rows, shifts.data(), nullptr, k.f32(), v.f32());
        download(k_out, k.data(), sizeof(float) * n * kd);
        download(v_out, v.data(), sizeof(float) * n * kd);
    }

    void kv_copy(const Rope & rope, const AttentionShape & s, const KvStore & store, int layer, const RunTable & table,
                 int r0, int r1, const int64_t * shifts, const KvSlotRef * slots) override {
        std::vector<std::pair<int, int32_t>> rows;
        for (int ri = r0; ri < r1; ++ri) {
            for (int32_t j = 0; j < table.runs[static_cast<size_t>(ri)].n; ++j) {
                rows.emplace_back(ri, j);
            }
        }
        materialize(rope, s, store, layer, table, rows, shifts, slots, nullptr, nullptr);
    }

    void ridge_rows(const KvStore & store, int layer, const RidgeJob * jobs, int n_jobs, int rank) override {
        const int64_t kd = store.n_kv_dim;
        for (int t = 0; t < n_jobs; ++t) {
            const RidgeJob & job = jobs[t];
            const int64_t    n   = job.j1 - job.j0;
            Buffer           mu = put(job.mu, kd), proj = put(job.proj, kd * rank);
            Buffer           m = put(job.m, std::max<int64_t>(1, static_cast<int64_t>(job.b_rank) * rank));
            Buffer           out(*this, sizeof(float) * n * (rank + 1));
            const float *    a = nullptr;
            if (job.f != nullptr) {
                a = (job.values ? job.f->a_v : job.f->a_k) +
                    (static_cast<int64_t>(job.run.corr_row0) + job.j0) * job.f->rank;
            }
            const uint8_t * rows =
                row_addr(store, layer, job.run.block, job.run.row0 + job.j0) + (job.values ? store.v_offset : 0);
            ridge_kernel<<<static_cast<unsigned>(n), 128, sizeof(float) * kd>>>(
                rows, store.row_bytes, store.kv_type == KvType::F16, kd, mu.f32(), proj.f32(), rank, a, job.b_rank,
                m.f32(), out.f32());
            check_launch("ridge_rows");
            std::vector<float> host(static_cast<size_t>(n * (rank + 1)));
            download(host.data(), out.data(), host.size() * sizeof(float));
            for (int64_t i = 0; i < n; ++i) {
                std::memcpy(job.out + i * job.out_stride, &host[static_cast<size_t>(i * (rank + 1))],
                            sizeof(float) * (rank + 1));
            }
        }
    }

  private:
    template <typename V>
    Buffer put(const V * host, int64_t count) {
        Buffer b(*this, sizeof(V) * static_cast<size_t>(std::max<int64_t>(count, 1)));
        if (count > 0) {
            upload(b.data(), host, sizeof(V) * static_cast<size_t>(count));
        }
        return b;
    }

    static uint8_t * row_addr(const KvStore & store, int layer, int32_t block, int32_t row) {
        return (*store.blocks)[static_cast<size_t>(block)] + layer * store.layer_stride +
               static_cast<int64_t>(row) * store.row_bytes;
    }

    static DevRun dev_run(const KvStore & store, int layer, const RunTable & table, const KvRunRef & r) {
        DevRun d{ row_addr(store, layer, r.block, r.row0), r.n, r.shift, 0, nullptr, nullptr, nullptr, nullptr };
        if (r.corr >= 0) {
            const Factors * f   = table.corrs[static_cast<size_t>(r.corr)];
            const int64_t   off = static_cast<int64_t>(r.corr_row0) * f->rank;
            d.rank              = f->rank;
            d.a_k               = f->a_k + off;
            d.a_v               = f->a_v + off;
            d.b_k               = f->b_k;
            d.b_v               = f->b_v;
        }
        return d;
    }

    // Rows (run index, row in run) of `table`, row i's key rotated by shifts[i] positions, to slots (copy) or to
    // the f32 rows k_out / v_out (read).
    void materialize(const Rope & rope, const AttentionShape & s, const KvStore & store, int layer,
                     const RunTable & table, const std::vector<std::pair<int, int32_t>> & rows, const int64_t * shifts,
                     const KvSlotRef * slots, float * k_out, float * v_out) {
        const int64_t n = static_cast<int64_t>(rows.size());
        if (n == 0) {
            return;
        }
        std::vector<const uint8_t *> src;
        std::vector<const float *>   ak, av, bk, bv;
        std::vector<int32_t>         rank;
        std::vector<uint8_t *>       dst;
        for (const auto & row : rows) {
            const DevRun  d = dev_run(store, layer, table, table.runs[static_cast<size_t>(row.first)]);
            const int32_t j = row.second;
            src.push_back(d.k + j * store.row_bytes);
            ak.push_back(d.a_k != nullptr ? d.a_k + static_cast<int64_t>(j) * d.rank : nullptr);
            av.push_back(d.a_v != nullptr ? d.a_v + static_cast<int64_t>(j) * d.rank : nullptr);
            bk.push_back(d.b_k);
            bv.push_back(d.b_v);
            rank.push_back(d.rank);
        }
        if (slots != nullptr) {
            for (int64_t i = 0; i < n; ++i) {
                dst.push_back(row_addr(store, layer, slots[i].block, slots[i].row));
            }
        }
        Buffer d_src = put(src.data(), n), d_ak = put(ak.data(), n), d_av = put(av.data(), n);
        Buffer d_bk = put(bk.data(), n), d_bv = put(bv.data(), n), d_rank = put(rank.data(), n);
        Buffer d_shift = put(shifts, n), d_dst = put(dst.data(), static_cast<int64_t>(dst.size()));
        Buffer d_inv = put(rope.inv_freq.data(), static_cast<int64_t>(rope.inv_freq.size()));
        materialize_kernel<<<static_cast<unsigned>(n), 128, sizeof(float) * store.n_kv_dim>>>(
            static_cast<const uint8_t * const *>(d_src.data()), static_cast<const float * const *>(d_ak.data()),
            static_cast<const float * const *>(d_av.data()), static_cast<const int32_t *>(d_rank.data()),
            static_cast<const float * const *>(d_bk.data()), static_cast<const float * const *>(d_bv.data()),
            static_cast<const int64_t *>(d_shift.data()), store.n_kv_dim, store.v_offset, store.kv_type == KvType::F16,
            s.n_head_kv, s.head_dim, rope.n_rot, rope.neox, static_cast<const float *>(d_inv.data()),
            slots != nullptr ? static_cast<uint8_t * const *>(d_dst.data()) : nullptr, k_out, v_out);
        check_launch("materialize");
    }

    // ---- vision-tower ops (backend/cuda/vision-kernels.cu).
    void layer_norm(const float * x, const float * w, const float * b, float * y, int64_t n_rows, int64_t n,
                    float eps) override {
        cuda::layer_norm(x, w, b, y, n_rows, n, eps);
    }
    void activate(Activation act, float * x, const float * mul, int64_t n_rows, int64_t n) override {
        cuda::activate(act, x, mul, n_rows * n);
    }
    void segment_attention(const float * q, const float * k, const float * v, float * out, int64_t n_rows, int64_t E,
                           int64_t H, const int64_t * host_seg, int n_seg) override {
        check_segments(host_seg, n_seg, n_rows, E, H);
        Buffer seg = put(host_seg, n_seg + 1);
        cuda::segment_attention(q, k, v, out, n_rows, E, H, static_cast<const int64_t *>(seg.data()), n_seg);
    }
    void rotate_half_rows(float * x, const float * cos_t, const float * sin_t, int64_t n_rows, int64_t H,
                          int64_t hd) override {
        cuda::rotate_half_rows(x, cos_t, sin_t, n_rows, H, hd);
    }
    void avg_pool_rms_norm(const float * x, const float * w, float * y, int64_t n_img, int64_t G, int64_t k, int64_t E,
                           float eps) override {
        cuda::avg_pool_rms_norm(x, w, y, n_img, G, k, E, eps);
    }

    void release_cache() {
        for (auto & kv : cache_) {
            for (void * p : kv.second) {
                cudaFree(p);
            }
        }
        cache_.clear();
    }

    int                                   device_;
    cudaDeviceProp                        prop_{};
    std::vector<void *>                   weights_;
    std::mutex                            cache_mutex_;
    std::map<size_t, std::vector<void *>> cache_;  // freed activation buffers by size, for reuse
};

}  // namespace

bool cuda_usable(std::string * reason) {
    int               n   = 0;
    const cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess || n == 0) {
        cudaGetLastError();
        if (reason != nullptr) {
            *reason = err == cudaSuccess ? std::string("this build has the CUDA backend, but no CUDA device is visible")
                                         : std::string("this build has the CUDA backend, but no usable GPU/driver: ") +
                                               cudaGetErrorString(err);
        }
        return false;
    }
    return true;
}

std::unique_ptr<Backend> make_cuda_backend(int device) {
    return std::make_unique<CudaBackend>(device);
}

}  // namespace kvcmas::backend
