#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>

#include "backend/cuda/reduce.cuh"
#include "backend/cuda/vision-kernels.cuh"
#include "common/error.h"

namespace kvcmas::cuda {

namespace {

constexpr int kThreads = 256;

void check(const char * what) {
    const cudaError_t err = cudaGetLastError();
    KC_CHECK(err == cudaSuccess, "cuda backend: kernel %s failed to launch: %s", what, cudaGetErrorString(err));
}

__global__ void layer_norm_kernel(const float * x, const float * w, const float * b, float * y, int64_t n, float eps) {
    __shared__ double part[kThreads / 32];
    const float *     xr  = x + blockIdx.x * n;
    float *           yr  = y + blockIdx.x * n;
    double            sum = 0.0;
    for (int64_t i = threadIdx.x; i < n; i += kThreads) {
        sum += xr[i];
    }
    const double mean = block_sum(sum, part) / static_cast<double>(n);
    double       sq   = 0.0;
    for (int64_t i = threadIdx.x; i < n; i += kThreads) {
        const double d = xr[i] - mean;
        sq += d * d;
    }
    const float scale = static_cast<float>(1.0 / sqrt(block_sum(sq, part) / static_cast<double>(n) + eps));
    const float m     = static_cast<float>(mean);
    for (int64_t i = threadIdx.x; i < n; i += kThreads) {  // y may alias x: every read of the row is done
        yr[i] = (xr[i] - m) * scale * w[i] + b[i];
    }
}

__global__ void activate_kernel(Activation act, float * x, const float * mul, int64_t n) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const float v = x[i];
        float       r;
        switch (act) {
            case Activation::GeluErf:
                r = 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
                break;
            case Activation::GeluTanh:
                r = v / (1.0f + expf(-2.0f * 0.79788456080286536f * (v + 0.044715f * v * v * v)));
                break;
            case Activation::QuickGelu:
                r = v / (1.0f + expf(-1.702f * v));
                break;
            default:
                r = v / (1.0f + expf(-v));
                break;
        }
        x[i] = mul != nullptr ? r * mul[i] : r;
    }
}

constexpr int kAttnWarps  = 4;  // (row, head) pairs per block
constexpr int kMaxPerLane = 8;  // output columns per lane: hd <= 256

__global__ void segment_attention_kernel(const float * q, const float * k, const float * v, float * out, int64_t n_rows,
                                         int64_t E, int64_t H, int64_t hd, float scale, const int64_t * seg,
                                         int n_seg) {
    extern __shared__ float q_shared[];  // [kAttnWarps][hd]
    const int               warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t           pair = static_cast<int64_t>(blockIdx.x) * kAttnWarps + warp;
    if (pair >= n_rows * H) {
        return;  // no block-wide barrier below: a warp leaving early stalls nobody
    }
    const int64_t row = pair / H, h = pair % H;
    float *       qh = q_shared + warp * hd;
    for (int64_t d = lane; d < hd; d += 32) {
        qh[d] = q[row * E + h * hd + d] * scale;
    }
    __syncwarp();
    int lo = 0, hi = n_seg;  // the segment s with seg[s] <= row < seg[s + 1]
    while (hi - lo > 1) {
        const int mid               = (lo + hi) / 2;
        (seg[mid] <= row ? lo : hi) = mid;
    }
    const int64_t a = seg[lo], b = seg[lo + 1];
    float         m = -FLT_MAX, l = 0.0f, acc[kMaxPerLane] = {};
    for (int64_t j0 = a; j0 < b; j0 += 32) {
        const int64_t j = j0 + lane;
        float         s = -FLT_MAX;
        if (j < b) {
            const float * kr  = k + j * E + h * hd;
            float         dot = 0.0f;
            for (int64_t d = 0; d < hd; ++d) {
                dot += qh[d] * kr[d];
            }
            s = dot;
        }
        float cmax = s;
        for (int off = 16; off > 0; off /= 2) {
            cmax = fmaxf(cmax, __shfl_xor_sync(0xFFFFFFFFu, cmax, off));
        }
        const float new_m = fmaxf(m, cmax);
        const float corr  = expf(m - new_m);
        const float p     = j < b ? expf(s - new_m) : 0.0f;
        float       psum  = p;
        for (int off = 16; off > 0; off /= 2) {
            psum += __shfl_xor_sync(0xFFFFFFFFu, psum, off);
        }
        l = l * corr + psum;
        for (int i = 0; i < kMaxPerLane; ++i) {
            acc[i] *= corr;
        }
        const int n_keys = static_cast<int>(b - j0 < 32 ? b - j0 : 32);
        for (int jj = 0; jj < n_keys; ++jj) {
            const float   pj = __shfl_sync(0xFFFFFFFFu, p, jj);
            const float * vr = v + (j0 + jj) * E + h * hd;
            for (int i = 0; i < kMaxPerLane; ++i) {
                const int64_t d = lane + 32 * i;
                if (d < hd) {
                    acc[i] += pj * vr[d];
                }
            }
        }
        m = new_m;
    }
    const float inv = 1.0f / l;
    for (int i = 0; i < kMaxPerLane; ++i) {
        const int64_t d = lane + 32 * i;
        if (d < hd) {
            out[row * E + h * hd + d] = acc[i] * inv;
        }
    }
}

__global__ void rotate_half_kernel(float * x, const float * cos_t, const float * sin_t, int64_t H, int64_t hd) {
    const int64_t t = blockIdx.x, half = hd / 2;
    for (int64_t idx = threadIdx.x; idx < H * half; idx += blockDim.x) {
        const int64_t h = idx / half, i = idx % half;
        float *       r = x + (t * H + h) * hd;
        const float   c = cos_t[t * half + i], s = sin_t[t * half + i];
        const float   a = r[i], b = r[i + half];
        r[i]        = a * c - b * s;
        r[i + half] = b * c + a * s;
    }
}

__global__ void avg_pool_rms_kernel(const float * x, const float * w, float * y, int64_t G, int64_t k, int64_t E,
                                    float eps) {
    __shared__ double part[kThreads / 32];
    const int64_t     side = G / k, per_image = side * side;
    const int64_t     t = blockIdx.x, img = t / per_image, oy = (t % per_image) / side, ox = (t % per_image) % side;
    const float *     xi  = x + img * G * G * E;
    float *           yr  = y + t * E;
    const float       inv = 1.0f / static_cast<float>(k * k);
    double            ss  = 0.0;
    for (int64_t e = threadIdx.x; e < E; e += kThreads) {
        float sum = 0.0f;
        for (int64_t ky = 0; ky < k; ++ky) {
            for (int64_t kx = 0; kx < k; ++kx) {
                sum += xi[((oy * k + ky) * G + ox * k + kx) * E + e];
            }
        }
        yr[e] = sum * inv;
        ss += static_cast<double>(yr[e]) * yr[e];
    }
    const float r = 1.0f / sqrtf(static_cast<float>(block_sum(ss, part) / static_cast<double>(E)) + eps);
    for (int64_t e = threadIdx.x; e < E; e += kThreads) {
        yr[e] = yr[e] * r * w[e];
    }
}

}  // namespace

void layer_norm(const float * x, const float * w, const float * b, float * y, int64_t n_rows, int64_t n, float eps) {
    if (n_rows > 0) {
        layer_norm_kernel<<<static_cast<unsigned>(n_rows), kThreads>>>(x, w, b, y, n, eps);
        check("layer_norm");
    }
}

void activate(Activation act, float * x, const float * mul, int64_t n) {
    if (n > 0) {
        const int blocks = static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 1 << 20));
        activate_kernel<<<blocks, kThreads>>>(act, x, mul, n);
        check("activate");
    }
}

void segment_attention(const float * q, const float * k, const float * v, float * out, int64_t n_rows, int64_t E,
                       int64_t H, const int64_t * seg, int n_seg) {
    const int64_t hd = E / H;
    KC_CHECK(hd <= 32 * kMaxPerLane, "cuda backend: segment_attention with heads of %lld columns (at most %d)",
             static_cast<long long>(hd), 32 * kMaxPerLane);
    const int64_t pairs = n_rows * H;
    if (pairs == 0) {
        return;
    }
    const unsigned blocks = static_cast<unsigned>((pairs + kAttnWarps - 1) / kAttnWarps);
    segment_attention_kernel<<<blocks, 32 * kAttnWarps, sizeof(float) * kAttnWarps * hd>>>(
        q, k, v, out, n_rows, E, H, hd, 1.0f / sqrtf(static_cast<float>(hd)), seg, n_seg);
    check("segment_attention");
}

void rotate_half_rows(float * x, const float * cos_t, const float * sin_t, int64_t n_rows, int64_t H, int64_t hd) {
    if (n_rows > 0) {
        rotate_half_kernel<<<static_cast<unsigned>(n_rows), 128>>>(x, cos_t, sin_t, H, hd);
        check("rotate_half_rows");
    }
}

void avg_pool_rms_norm(const float * x, const float * w, float * y, int64_t n_img, int64_t G, int64_t k, int64_t E,
                       float eps) {
    const int64_t n_out = n_img * (G / k) * (G / k);
    if (n_out > 0) {
        avg_pool_rms_kernel<<<static_cast<unsigned>(n_out), kThreads>>>(x, w, y, G, k, E, eps);
        check("avg_pool_rms_norm");
    }
}

}  // namespace kvcmas::cuda
