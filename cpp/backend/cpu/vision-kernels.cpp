#include "backend/cpu/vision-kernels.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#include "backend/cpu/attention.h"
#include "backend/cpu/cpu-features.h"
#include "backend/cpu/matmul.h"

namespace kvcmas::cpu {

void layer_norm(const float * x, const float * w, const float * b, float * y, int64_t n, float eps) {
    // Two passes in double: features of a ViT reach magnitudes where a one-pass f32 variance loses digits.
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        sum += x[i];
    }
    const double mean = sum / static_cast<double>(n);
    double       sq   = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        const double d = x[i] - mean;
        sq += d * d;
    }
    const float scale = static_cast<float>(1.0 / std::sqrt(sq / static_cast<double>(n) + eps));
    const float m     = static_cast<float>(mean);
    for (int64_t i = 0; i < n; ++i) {
        y[i] = (x[i] - m) * scale * w[i] + b[i];
    }
}

#ifdef KC_X86
bool activate_avx2(Activation act, float * x, int64_t n);  // vision-kernels-avx2.cpp
#endif

void activate(Activation act, float * x, int64_t n) {
#ifdef KC_X86
    if (cpu_features().avx2_fma_f16c && activate_avx2(act, x, n)) {
        return;
    }
#endif
    activate_portable(act, x, n);
}

void activate_portable(Activation act, float * x, int64_t n) {
    switch (act) {
        case Activation::GeluErf:
            for (int64_t i = 0; i < n; ++i) {
                x[i] = 0.5f * x[i] * (1.0f + std::erf(x[i] * 0.70710678118654752f));
            }
            return;
        case Activation::GeluTanh:
            // 0.5 x (1 + tanh(u)) == x / (1 + exp(-2u)): one expf instead of tanhf (which calls expm1f), ~2x faster;
            // exp overflowing to inf for very negative x gives the correct limit -0.
            for (int64_t i = 0; i < n; ++i) {
                const float v = x[i];
                const float u = 0.79788456080286536f * (v + 0.044715f * v * v * v);
                x[i]          = v / (1.0f + std::exp(-2.0f * u));
            }
            return;
        case Activation::QuickGelu:
            for (int64_t i = 0; i < n; ++i) {
                x[i] = x[i] / (1.0f + std::exp(-1.702f * x[i]));
            }
            return;
        case Activation::Silu:
            for (int64_t i = 0; i < n; ++i) {
                x[i] = x[i] / (1.0f + std::exp(-x[i]));
            }
            return;
    }
}

void softmax(float * x, int64_t n) {
    float mx = x[0];
    for (int64_t i = 1; i < n; ++i) {
        mx = x[i] > mx ? x[i] : mx;
    }
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        x[i] = std::exp(x[i] - mx);
        sum += x[i];
    }
    const float inv = static_cast<float>(1.0 / sum);
    for (int64_t i = 0; i < n; ++i) {
        x[i] *= inv;
    }
}

// Segments up to this length run the fused kernel: their keys and values stay in cache across a query block.
constexpr int64_t kFusedSegmentMax = 512;

#ifdef KC_X86
void softmax_avx2(float * x, int64_t n);  // vision-kernels-avx2.cpp
#endif
#ifdef KC_AVX512
namespace detail {
// One segment of n rows from row a, all heads, as blocks of query rows whose scores stay in cache
// (matmul-packed-avx512.cpp; AVX-512 CPUs only).
void attention_packed_avx512(const float * q, const float * k, const float * v, float * out, int64_t E, int64_t H,
                             int64_t a, int64_t n, ThreadPool & pool);
}  // namespace detail
#endif

static void softmax_rows(float * x, int64_t n_rows, int64_t n, ThreadPool & pool) {
#ifdef KC_X86
    const bool avx2 = cpu_features().avx2_fma_f16c;
#else
    const bool avx2 = false;
#endif
    pool.run([&](int ith, int nth) {
        long long t0, t1;
        split_range(n_rows, ith, nth, t0, t1);
        for (long long t = t0; t < t1; ++t) {
#ifdef KC_X86
            if (avx2) {
                softmax_avx2(x + t * n, n);
                continue;
            }
#endif
            softmax(x + t * n, n);
        }
    });
}

// One segment of n rows from row a, head by head through the GEMM (K and Vᵀ as f32 weight views).
static void gemm_attention(const float * q, const float * k, const float * v, float * out, int64_t E, int64_t H,
                           int64_t a, int64_t n, std::vector<float> & scratch, ThreadPool & pool) {
    const int64_t hd = E / H;
    scratch.resize(static_cast<size_t>(n * n + 3 * n * hd));
    float *     scores = scratch.data();
    float *     qh = scores + n * n, *vt = qh + n * hd, *oh = vt + n * hd;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    for (int64_t h = 0; h < H; ++h) {
        pool.run([&](int ith, int nth) {
            long long t0, t1;
            split_range(n, ith, nth, t0, t1);
            for (long long t = t0; t < t1; ++t) {
                for (int64_t d = 0; d < hd; ++d) {
                    qh[t * hd + d] = q[(a + t) * E + h * hd + d] * scale;
                    vt[d * n + t]  = v[(a + t) * E + h * hd + d];
                }
            }
        });
        const WeightView kview{ GgmlType::F32, k + a * E + h * hd, hd, n, static_cast<size_t>(E) * sizeof(float) };
        matmul(kview, qh, scores, n, pool);
        softmax_rows(scores, n, n, pool);
        const WeightView vview{ GgmlType::F32, vt, n, hd, static_cast<size_t>(n) * sizeof(float) };
        matmul(vview, scores, oh, n, pool);
        pool.run([&](int ith, int nth) {
            long long t0, t1;
            split_range(n, ith, nth, t0, t1);
            for (long long t = t0; t < t1; ++t) {
                std::memcpy(&out[(a + t) * E + h * hd], &oh[t * hd], static_cast<size_t>(hd) * sizeof(float));
            }
        });
    }
}

void segment_attention(const float * q, const float * k, const float * v, float * out, int64_t E, int64_t H,
                       const int64_t * seg, int n_seg, std::vector<float> & scratch, ThreadPool & pool) {
    const int64_t        hd = E / H;
    const AttentionShape shape{ static_cast<int>(H), static_cast<int>(H), static_cast<int>(hd), E,
                                1.0f / std::sqrt(static_cast<float>(hd)) };
    const Rope           no_rope;  // rows come rotated; every run has shift 0
    constexpr int        kBlock = kMaxAttentionBlock;
    struct Task {
        int64_t a, n, q0;  // segment start and length, first query of the block (in the segment)
    };
    std::vector<Task> tasks;
    int64_t           most = 0;
    for (int s = 0; s < n_seg; ++s) {
        const int64_t a = seg[s], n = seg[s + 1] - seg[s];
        if (n > kFusedSegmentMax) {
#ifdef KC_AVX512
            if (cpu_features().avx512) {
                detail::attention_packed_avx512(q, k, v, out, E, H, a, n, pool);
                continue;
            }
#endif
            gemm_attention(q, k, v, out, E, H, a, n, scratch, pool);
            continue;
        }
        most = std::max(most, n);
        for (int64_t q0 = 0; q0 < n; q0 += kBlock) {
            tasks.push_back({ a, n, q0 });
        }
    }
    if (tasks.empty()) {
        return;
    }
    const int64_t        scratch_floats = attention_block_scratch_floats(shape, kBlock, most);
    std::atomic<int64_t> next{ 0 };  // blocks handed out one by one: threads of a loaded machine finish unevenly
    pool.run([&](int, int) {
        std::vector<float> local(static_cast<size_t>(scratch_floats));
        for (int64_t i = next++; i < static_cast<int64_t>(tasks.size()); i = next++) {
            const Task & t  = tasks[static_cast<size_t>(i)];
            const int    nq = static_cast<int>(std::min<int64_t>(kBlock, t.n - t.q0));
            const KvRun  run{ k + t.a * E, v + t.a * E, static_cast<int32_t>(t.n), 0 };
            // Query j of the block sees max(n_visible0 + j, n_visible_min) = all n rows of its segment.
            attend_block(shape, no_rope, q + (t.a + t.q0) * E, E, nq, &run, 1, t.n - nq + 1, 0, static_cast<int>(H),
                         out + (t.a + t.q0) * E, E, local.data(), t.n);
        }
    });
}

void rotate_half_rows(float * x, const float * cos_t, const float * sin_t, int64_t r0, int64_t r1, int64_t H,
                      int64_t hd) {
    const int64_t half = hd / 2;
    for (int64_t t = r0; t < r1; ++t) {
        const float * c = cos_t + t * half;
        const float * s = sin_t + t * half;
        for (int64_t h = 0; h < H; ++h) {
            float * v = x + (t * H + h) * hd;
            for (int64_t i = 0; i < half; ++i) {
                const float a = v[i], b = v[i + half];
                v[i]        = a * c[i] - b * s[i];
                v[i + half] = b * c[i] + a * s[i];
            }
        }
    }
}

void avg_pool_rms_row(const float * x, const float * w, float * y, int64_t t, int64_t G, int64_t k, int64_t E,
                      float eps) {
    const int64_t side = G / k, oy = t / side, ox = t % side;
    std::fill(y, y + E, 0.0f);
    for (int64_t ky = 0; ky < k; ++ky) {
        for (int64_t kx = 0; kx < k; ++kx) {
            const float * src = x + ((oy * k + ky) * G + ox * k + kx) * E;
            for (int64_t e = 0; e < E; ++e) {
                y[e] += src[e];
            }
        }
    }
    const float inv = 1.0f / static_cast<float>(k * k);
    double      ss  = 0.0;
    for (int64_t e = 0; e < E; ++e) {
        y[e] *= inv;
        ss += static_cast<double>(y[e]) * y[e];
    }
    const float r = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(E)) + eps);
    for (int64_t e = 0; e < E; ++e) {
        y[e] = y[e] * r * w[e];
    }
}

}  // namespace kvcmas::cpu
