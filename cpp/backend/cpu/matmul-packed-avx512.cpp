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
#include <immintrin.h>

#include <algorithm>
#include <atomic>

#include "backend/cpu/matmul-impl.h"

// GCC 12 reports the intrinsics' internal _mm512_undefined_* operands as maybe uninitialized (a false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace kvcmas::cpu::detail {
namespace {

constexpr int     kMicroM = 14;   // tokens per micro tile (broadcast operand)
constexpr int     kPanelN = 32;   // weight rows per packed panel (two zmm)
constexpr int64_t kBlockK = 256;  // k block: a panel slice is 32 KiB, a micro tile's activations 14 KiB
constexpr int64_t kBlockN = 256;  // weight rows per unit: the packed k block is 256 KiB (L2)
constexpr int64_t kMaxM   = 512;  // token rows per unit at most (the unit's activations k block: 512 KiB, L2)

thread_local ScratchBuffer tl_packed;

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
    const __mmask16 m = kn >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << kn) - 1);
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
        const int n = nc - 16 * v;
        mask[v]     = n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : static_cast<__mmask16>((1u << n) - 1);
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

}  // namespace kvcmas::cpu::detail
