// AVX-512 packed-panel GEMM for float weights (F32, F16, BF16) at prefill sizes (compiled with
// -mavx512f/bw/dq/vl -mfma -mf16c; called only after the run-time check). Goto-style blocking:
// - the output is cut into units of (kMicroM-multiple token rows) x (kBlockN weight rows), handed out to the pool's
//   threads from a counter;
// - per unit and k block of kBlockK, the unit's weight rows are converted to f32 while packing (f16 and bf16 cost
//   nothing extra) into 32-row panels, element [k][r] at k·32 + r (256 KiB: stays in L2);
// - micro tiles of 14 tokens x 32 weight rows keep 28 zmm accumulators; per k step 2 panel loads (L1/L2) and 14
//   broadcasts of the activations feed 28 FMAs.
// Every output is Σ over k blocks in order of the block's FMA chain: the bits do not depend on the unit, the thread
// or n_tok.
// The same panels and micro kernel serve the vision towers' attention over long segments (attention_packed_avx512):
// keys and values packed once per head, then per block of 56 query rows the scores, their exp and P·V while the
// block's scores stay in L2.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>

#include "backend/cpu/matmul-impl.h"

// GCC 12 reports the intrinsics' internal _mm512_undefined_* operands as (maybe) uninitialized (a false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace kvcmas::cpu::detail {
namespace {

constexpr int     kMicroM = 14;   // tokens per micro tile (broadcast operand)
constexpr int     kPanelN = 32;   // weight rows per packed panel (two zmm)
constexpr int64_t kBlockK = 256;  // k block: a panel slice is 32 KiB, a micro tile's activations 14 KiB
constexpr int64_t kBlockN = 256;  // weight rows per unit: the packed k block is 256 KiB (L2)
constexpr int64_t kMaxM   = 512;  // token rows per unit at most (the unit's activations k block: 512 KiB, L2)

thread_local ScratchBuffer tl_packed;
thread_local ScratchBuffer tl_scores;  // attention: one query block's scores and scaled queries
thread_local ScratchBuffer tl_heads;   // attention (the calling thread's): every head's packed keys and values

// The first n lanes (none for n <= 0, all for n >= 16).
inline __mmask16 first_lanes(int n) {
    return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : static_cast<__mmask16>((1u << n) - 1);
}

// 16x16 f32 transpose in registers: r[i] holds row i on entry, column i on return.
inline void transpose16(__m512 r[16]) {
    __m512 a[16], b[16];
    for (int i = 0; i < 8; ++i) {
        a[2 * i]     = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int q = 0; q < 4; ++q) {
        const __m512d a0 = _mm512_castps_pd(a[4 * q]), a1 = _mm512_castps_pd(a[4 * q + 1]);
        const __m512d a2 = _mm512_castps_pd(a[4 * q + 2]), a3 = _mm512_castps_pd(a[4 * q + 3]);
        b[4 * q]     = _mm512_castpd_ps(_mm512_unpacklo_pd(a0, a2));
        b[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a0, a2));
        b[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(a1, a3));
        b[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(a1, a3));
    }
    // b[4q + e], 128-bit lane L: column 4L + e, rows 4q..4q+3; a 4x4 transpose of lanes finishes it.
    for (int e = 0; e < 4; ++e) {
        const __m512 c0 = _mm512_shuffle_f32x4(b[e], b[4 + e], 0x44);
        const __m512 c1 = _mm512_shuffle_f32x4(b[e], b[4 + e], 0xEE);
        const __m512 c2 = _mm512_shuffle_f32x4(b[8 + e], b[12 + e], 0x44);
        const __m512 c3 = _mm512_shuffle_f32x4(b[8 + e], b[12 + e], 0xEE);
        r[e]            = _mm512_shuffle_f32x4(c0, c2, 0x88);
        r[4 + e]        = _mm512_shuffle_f32x4(c0, c2, 0xDD);
        r[8 + e]        = _mm512_shuffle_f32x4(c1, c3, 0x88);
        r[12 + e]       = _mm512_shuffle_f32x4(c1, c3, 0xDD);
    }
}

// Elements [k, k + kn) (kn <= 16) of a stored row as f32, zero past kn.
template <GgmlType T>
inline __m512 load_row16(const char * row, int64_t k, int kn) {
    const __mmask16 m = first_lanes(kn);
    if constexpr (T == GgmlType::F32) {
        return _mm512_maskz_loadu_ps(m, reinterpret_cast<const float *>(row) + k);
    } else if constexpr (T == GgmlType::F16) {
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, reinterpret_cast<const uint16_t *>(row) + k));
    } else {
        const __m256i h = _mm256_maskz_loadu_epi16(m, reinterpret_cast<const uint16_t *>(row) + k);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
}

// Packs weight rows [r0, r0 + nr) x k [k0, k0 + kn) into panels of 32 rows (rows past nr zero), panel p at
// p·32·kn, element [k][r] at k·32 + r.
template <GgmlType T>
void pack_weights(const WeightView & w, int64_t r0, int nr, int64_t k0, int64_t kn, float * dst) {
    const auto * base = static_cast<const char *>(w.data);
    for (int p = 0; p * kPanelN < nr; ++p) {
        float * panel = dst + static_cast<int64_t>(p) * kPanelN * kn;
        for (int h = 0; h < 2; ++h) {
            const int rb = p * kPanelN + 16 * h;  // first row of this half, within the unit
            for (int64_t kk = 0; kk < kn; kk += 16) {
                const int kc = static_cast<int>(kn - kk < 16 ? kn - kk : 16);
                __m512    v[16];
                for (int i = 0; i < 16; ++i) {
                    v[i] = rb + i < nr ? load_row16<T>(base + (r0 + rb + i) * w.row_bytes, k0 + kk, kc)
                                       : _mm512_setzero_ps();
                }
                transpose16(v);
                for (int i = 0; i < kc; ++i) {
                    _mm512_store_ps(panel + (kk + i) * kPanelN + 16 * h, v[i]);
                }
            }
        }
    }
}

using PackFn = void (*)(const WeightView &, int64_t, int, int64_t, int64_t, float *);

// y[m·ldy + c] (+)= Σ_k x[m·ldx + k]·panel[k·32 + c] for m < MR, c < nc (<= 16·NV).
template <int MR, int NV>
void micro(const float * x, int64_t ldx, const float * panel, int64_t kn, float * y, int64_t ldy, int nc,
           bool accumulate) {
    __m512 c[MR][NV];
#pragma GCC unroll 14
    for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) {
            c[m][v] = _mm512_setzero_ps();
        }
    }
    for (int64_t k = 0; k < kn; ++k) {
        __m512 b[NV];
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) {
            b[v] = _mm512_load_ps(panel + k * kPanelN + 16 * v);
        }
#pragma GCC unroll 14
        for (int m = 0; m < MR; ++m) {
            const __m512 a = _mm512_set1_ps(x[m * ldx + k]);
#pragma GCC unroll 2
            for (int v = 0; v < NV; ++v) {
                c[m][v] = _mm512_fmadd_ps(a, b[v], c[m][v]);
            }
        }
    }
    __mmask16 mask[NV];
    for (int v = 0; v < NV; ++v) {
        mask[v] = first_lanes(nc - 16 * v);
    }
#pragma GCC unroll 14
    for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) {
            float *      ym = y + m * ldy + 16 * v;
            const __m512 r  = accumulate ? _mm512_add_ps(c[m][v], _mm512_maskz_loadu_ps(mask[v], ym)) : c[m][v];
            _mm512_mask_storeu_ps(ym, mask[v], r);
        }
    }
}

using MicroFn = void (*)(const float *, int64_t, const float *, int64_t, float *, int64_t, int, bool);
template <int NV>
struct MicroTable {
    static constexpr MicroFn fn[kMicroM + 1] = {
        nullptr,       micro<1, NV>,  micro<2, NV>,  micro<3, NV>,  micro<4, NV>,
        micro<5, NV>,  micro<6, NV>,  micro<7, NV>,  micro<8, NV>,  micro<9, NV>,
        micro<10, NV>, micro<11, NV>, micro<12, NV>, micro<13, NV>, micro<14, NV>,
    };
};
static_assert(kMicroM == 14, "micro tiles of up to 14 tokens");

PackFn pack_fn(GgmlType type) {
    switch (type) {
        case GgmlType::F32:
            return pack_weights<GgmlType::F32>;
        case GgmlType::F16:
            return pack_weights<GgmlType::F16>;
        case GgmlType::BF16:
            return pack_weights<GgmlType::BF16>;
        default:
            return nullptr;
    }
}

}  // namespace

bool gemm_packed_avx512_supports(GgmlType type) {
    return pack_fn(type) != nullptr;
}

void gemm_packed_avx512(const WeightView & w, const float * x, float * y, int64_t n_tok, ThreadPool & pool) {
    const PackFn  pack = pack_fn(w.type);
    const int64_t N = w.n_out, K = w.n_in;
    const int     nth = pool.size();
    // Units: weight-row blocks of nb rows (all rows up to kBlockN, so that a micro tile's activations serve every
    // panel; halved down to one panel only while the tokens cannot give 4 units per thread), token blocks of mb
    // rows (a multiple of the micro tile; more of them while there are fewer than 4 units per thread).
    const int64_t n_tiles = (n_tok + kMicroM - 1) / kMicroM;
    int64_t       nb      = std::min(kBlockN, (N + kPanelN - 1) / kPanelN * kPanelN);
    while (nb > kPanelN && (N + nb - 1) / nb * n_tiles < 4 * nth) {
        nb /= 2;
    }
    const int64_t n_nb           = (N + nb - 1) / nb;
    int64_t       n_mb           = std::max<int64_t>((n_tok + kMaxM - 1) / kMaxM, (4 * nth + n_nb - 1) / n_nb);
    n_mb                         = std::min(n_mb, n_tiles);
    int64_t mb                   = (n_tok + n_mb - 1) / n_mb;
    mb                           = (mb + kMicroM - 1) / kMicroM * kMicroM;
    n_mb                         = (n_tok + mb - 1) / mb;
    const int64_t        n_units = n_nb * n_mb;
    std::atomic<int64_t> next{ 0 };
    pool.run([&](int, int) {
        auto * packed =
            static_cast<float *>(tl_packed.get(static_cast<size_t>(nb + kPanelN) * kBlockK * sizeof(float)));
        for (int64_t u = next.fetch_add(1, std::memory_order_relaxed); u < n_units;
             u         = next.fetch_add(1, std::memory_order_relaxed)) {
            // Units of one weight block are consecutive: threads working at the same time share its rows in L3.
            const int64_t r0 = (u / n_mb) * nb, m0 = (u % n_mb) * mb;
            const int     nr = static_cast<int>(std::min(nb, N - r0));
            const int64_t me = std::min(n_tok, m0 + mb);
            for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
                const int64_t kn = std::min(kBlockK, K - k0);
                pack(w, r0, nr, k0, kn, packed);
                for (int64_t t0 = m0; t0 < me; t0 += kMicroM) {
                    const int tn = static_cast<int>(std::min<int64_t>(kMicroM, me - t0));
                    for (int p = 0; p * kPanelN < nr; ++p) {
                        const int nc = std::min(kPanelN, nr - p * kPanelN);
                        (nc > 16 ? MicroTable<2>::fn : MicroTable<1>::fn)[tn](
                            x + t0 * K + k0, K, packed + static_cast<int64_t>(p) * kPanelN * kn, kn,
                            y + t0 * N + r0 + p * kPanelN, N, nc, k0 > 0);
                    }
                }
            }
        }
    });
}

// e^x per lane for x <= 0 (clamped below -87, where it is 0 to f32's precision): the range reduction and degree-6
// polynomial of exp_avx2 (simd-avx2.h), the power of two applied by scalef; about 1e-7 relative error.
inline __m512 exp_nonpositive(__m512 x) {
    x        = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 f = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
    f        = _mm512_roundscale_ps(f, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x        = _mm512_fnmadd_ps(f, _mm512_set1_ps(0.693359375f), x);
    x        = _mm512_fnmadd_ps(f, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y        = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y        = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y        = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y        = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y        = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y        = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, f);
}

// x[i] = e^(x[i] - max(x)) over one row of n scores; returns 1 / Σ x[i] (the sum over 16 f32 lanes, then in f64),
// the softmax's division left to the caller.
float exp_shifted_row(float * x, int64_t n) {
    __m512  vmax = _mm512_set1_ps(x[0]);
    int64_t i    = 0;
    for (; i + 16 <= n; i += 16) {
        vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(x + i));
    }
    const __mmask16 tail = first_lanes(static_cast<int>(n - i));
    vmax                 = _mm512_mask_max_ps(vmax, tail, vmax, _mm512_maskz_loadu_ps(tail, x + i));
    const __m512 vm      = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512       vsum    = _mm512_setzero_ps();
    for (i = 0; i + 16 <= n; i += 16) {
        const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm));
        _mm512_storeu_ps(x + i, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, x + i), vm));
    _mm512_mask_storeu_ps(x + i, tail, e);
    vsum = _mm512_mask_add_ps(vsum, tail, vsum, e);
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, vsum);
    double sum = 0.0;
    for (float l : lanes) {
        sum += l;
    }
    return static_cast<float>(1.0 / sum);
}

// Query rows per attention task: their scores (56 x n floats, 896 KiB at n = 4096) stay in L2 from Q·Kᵀ through
// the softmax to P·V.
constexpr int64_t kQueryBlock = 4 * kMicroM;

void attention_packed_avx512(const float * q, const float * k, const float * v, float * out, int64_t E, int64_t H,
                             int64_t a, int64_t n, ThreadPool & pool) {
    const int64_t hd = E / H, n_kpan = (n + kPanelN - 1) / kPanelN, n_vpan = (hd + kPanelN - 1) / kPanelN;
    // Per head: keys as 32-key panels over all hd (element [d][key] at d·32 + key), then values as panels of 32
    // columns over all n keys (element [key][c] at key·32 + c, zero past hd).
    const int64_t        k_floats = n_kpan * kPanelN * hd, per_head = k_floats + n_vpan * kPanelN * n;
    auto *               packed = static_cast<float *>(tl_heads.get(static_cast<size_t>(H * per_head) * sizeof(float)));
    constexpr int64_t    kChunk = 8 * kPanelN;  // keys per packing unit
    const int64_t        n_chunks = (n + kChunk - 1) / kChunk;
    std::atomic<int64_t> next{ 0 };
    pool.run([&](int, int) {
        for (int64_t u = next.fetch_add(1, std::memory_order_relaxed); u < H * n_chunks;
             u         = next.fetch_add(1, std::memory_order_relaxed)) {
            const int64_t    h = u / n_chunks, r0 = (u % n_chunks) * kChunk;
            const int        nr = static_cast<int>(std::min(kChunk, n - r0));
            float *          kp = packed + h * per_head, *vp = kp + k_floats;
            const WeightView keys{ GgmlType::F32, k + a * E + h * hd, hd, n, static_cast<size_t>(E) * sizeof(float) };
            pack_weights<GgmlType::F32>(keys, r0, nr, 0, hd, kp + r0 * hd);
            for (int64_t t = r0; t < r0 + nr; ++t) {
                const float * src = v + (a + t) * E + h * hd;
                for (int64_t p = 0; p < n_vpan; ++p) {
                    const int nc  = static_cast<int>(std::min<int64_t>(kPanelN, hd - p * kPanelN));
                    float *   dst = vp + p * kPanelN * n + t * kPanelN;
                    _mm512_store_ps(dst, _mm512_maskz_loadu_ps(first_lanes(nc), src + p * kPanelN));
                    _mm512_store_ps(dst + 16, _mm512_maskz_loadu_ps(first_lanes(nc - 16), src + p * kPanelN + 16));
                }
            }
        }
    });
    const int64_t n_qb  = (n + kQueryBlock - 1) / kQueryBlock;
    const float   scale = 1.0f / std::sqrt(static_cast<float>(hd));
    next                = 0;
    pool.run([&](int, int) {
        auto *  s  = static_cast<float *>(tl_scores.get(static_cast<size_t>(kQueryBlock * (n + hd)) * sizeof(float)));
        float * qs = s + kQueryBlock * n;
        for (int64_t u = next.fetch_add(1, std::memory_order_relaxed); u < H * n_qb;
             u         = next.fetch_add(1, std::memory_order_relaxed)) {
            const int64_t h = u / n_qb, q0 = (u % n_qb) * kQueryBlock, nq = std::min(kQueryBlock, n - q0);
            const float * kp = packed + h * per_head, *vp = kp + k_floats;
            for (int64_t t = 0; t < nq; ++t) {
                for (int64_t d = 0; d < hd; ++d) {
                    qs[t * hd + d] = q[(a + q0 + t) * E + h * hd + d] * scale;
                }
            }
            // Scores: each key panel stays in L1 across the block's micro tiles.
            for (int64_t p = 0; p < n_kpan; ++p) {
                const int nc = static_cast<int>(std::min<int64_t>(kPanelN, n - p * kPanelN));
                for (int64_t t0 = 0; t0 < nq; t0 += kMicroM) {
                    const int tn = static_cast<int>(std::min<int64_t>(kMicroM, nq - t0));
                    (nc > 16 ? MicroTable<2>::fn : MicroTable<1>::fn)[tn](qs + t0 * hd, hd, kp + p * kPanelN * hd, hd,
                                                                          s + t0 * n + p * kPanelN, n, nc, false);
                }
            }
            float inv_sum[kQueryBlock];
            for (int64_t t = 0; t < nq; ++t) {
                inv_sum[t] = exp_shifted_row(s + t * n, n);
            }
            // Probabilities times values, k blocks of kBlockK keys added in order, straight into the output rows.
            for (int64_t k0 = 0; k0 < n; k0 += kBlockK) {
                const int64_t kn = std::min(kBlockK, n - k0);
                for (int64_t t0 = 0; t0 < nq; t0 += kMicroM) {
                    const int tn = static_cast<int>(std::min<int64_t>(kMicroM, nq - t0));
                    for (int64_t p = 0; p < n_vpan; ++p) {
                        const int nc = static_cast<int>(std::min<int64_t>(kPanelN, hd - p * kPanelN));
                        (nc > 16 ? MicroTable<2>::fn : MicroTable<1>::fn)[tn](
                            s + t0 * n + k0, n, vp + p * kPanelN * n + k0 * kPanelN, kn,
                            out + (a + q0 + t0) * E + h * hd + p * kPanelN, E, nc, k0 > 0);
                    }
                }
            }
            for (int64_t t = 0; t < nq; ++t) {  // the softmax's division, on hd outputs instead of n scores
                float * o = out + (a + q0 + t) * E + h * hd;
                for (int64_t d = 0; d < hd; ++d) {
                    o[d] *= inv_sum[t];
                }
            }
        }
    });
}

}  // namespace kvcmas::cpu::detail
