// AVX-512 prefill tile kernel (compiled with -mavx512f/bw/dq/vl -mfma -mf16c; called only after the run-time check):
// the f32 GEMM of gemm_tile_avx2 with 16-float vectors and 32 registers, on the same packed panels.
#include <immintrin.h>

#include "backend/cpu/matmul-impl.h"

namespace kvcmas::cpu::detail {
namespace {

// Outer-product form as in matmul-avx2.cpp: a 16-row panel slice is one zmm per k step. A micro tile covers two
// panels (32 rows) × 12 tokens: 24 accumulators + 2 weight vectors + 1 broadcast = 27 of 32 zmm; per k step 2
// weight loads (L1) and 12 broadcasts (L2) feed 24 FMAs.
constexpr int     kMicroT = 12;
constexpr int64_t kBlockK = 256;  // k block: two panel slices are 32 KiB, two thirds of a 48 KiB L1
constexpr int     kBlockT = 96;   // token block: its k-block slice of activations (96 KiB) stays in L2

// Bits of the rows r < rn (0..16) of a 16-row vector.
inline __mmask16 row_mask(int rn) {
    return rn >= 16 ? __mmask16(0xFFFF) : rn <= 0 ? __mmask16(0) : static_cast<__mmask16>((1u << rn) - 1);
}

// y[t·ldy + r] (+)= Σ_k x[t·ldx + k] · panel_v[k·16 + r % 16] for t < NT, r < nr (≤ 16·NV), v = r / 16.
template <int NT, int NV>
void micro(const float * const * panels, const float * x, int64_t ldx, int64_t kn, float * y, int64_t ldy, int nr,
           bool accumulate) {
    __m512 c[NT][NV];
#pragma GCC unroll 12
    for (int t = 0; t < NT; ++t) {
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) {
            c[t][v] = _mm512_setzero_ps();
        }
    }
    const float * p0 = panels[0];
    const float * p1 = panels[NV - 1];
    for (int64_t k = 0; k < kn; ++k) {
        __m512 b[NV];
        b[0] = _mm512_load_ps(p0 + kGemmPanelRows * k);
        if constexpr (NV == 2) {
            b[1] = _mm512_load_ps(p1 + kGemmPanelRows * k);
        }
#pragma GCC unroll 12
        for (int t = 0; t < NT; ++t) {
            const __m512 a = _mm512_set1_ps(x[t * ldx + k]);
#pragma GCC unroll 2
            for (int v = 0; v < NV; ++v) {
                c[t][v] = _mm512_fmadd_ps(a, b[v], c[t][v]);
            }
        }
    }
    __mmask16 m[NV];
    for (int v = 0; v < NV; ++v) {
        m[v] = row_mask(nr - 16 * v);
    }
#pragma GCC unroll 12
    for (int t = 0; t < NT; ++t) {
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) {
            float *      yt = y + t * ldy + 16 * v;
            const __m512 r  = accumulate ? _mm512_add_ps(c[t][v], _mm512_maskz_loadu_ps(m[v], yt)) : c[t][v];
            _mm512_mask_storeu_ps(yt, m[v], r);
        }
    }
}

using MicroFn = void (*)(const float * const *, const float *, int64_t, int64_t, float *, int64_t, int, bool);
template <int NV>
struct MicroTable {
    static constexpr MicroFn fn[kMicroT + 1] = { nullptr,       micro<1, NV>,  micro<2, NV>, micro<3, NV>, micro<4, NV>,
                                                 micro<5, NV>,  micro<6, NV>,  micro<7, NV>, micro<8, NV>, micro<9, NV>,
                                                 micro<10, NV>, micro<11, NV>, micro<12, NV> };
};
static_assert(kMicroT == 12, "micro tiles of up to 12 tokens");

}  // namespace

void gemm_tile_avx512(const float * w, int64_t ldw, int nr, const float * x, int64_t ldx, int nt, int64_t n, float * y,
                      int64_t ldy) {
    const int     n_panels = (nr + kGemmPanelRows - 1) / kGemmPanelRows;
    const float * packed   = pack_panels_avx2(w, ldw, nr, n);
    const auto    panel_at = [&](int p, int64_t k0) {
        return packed + static_cast<size_t>(p) * kGemmPanelRows * static_cast<size_t>(n) + k0 * kGemmPanelRows;
    };
    // k blocks outer, then token blocks (their activation slice stays in L2 across all panels), then panel pairs
    // (their slices stay in L1 across the token block), then micro tiles.
    for (int64_t k0 = 0; k0 < n; k0 += kBlockK) {
        const int64_t kn = n - k0 < kBlockK ? n - k0 : kBlockK;
        for (int tb = 0; tb < nt; tb += kBlockT) {
            const int te = nt - tb < kBlockT ? nt : tb + kBlockT;
            for (int p = 0; p < n_panels; p += 2) {
                const int       nv      = n_panels - p >= 2 ? 2 : 1;
                const float *   pair[2] = { panel_at(p, k0), panel_at(p + nv - 1, k0) };
                const int       rn      = nr - p * kGemmPanelRows < 32 ? nr - p * kGemmPanelRows : 32;
                const MicroFn * table   = nv == 2 ? MicroTable<2>::fn : MicroTable<1>::fn;
                for (int t0 = tb; t0 < te; t0 += kMicroT) {
                    const int tn = te - t0 < kMicroT ? te - t0 : kMicroT;
                    table[tn](pair, x + t0 * ldx + k0, ldx, kn, y + t0 * ldy + p * kGemmPanelRows, ldy, rn, k0 > 0);
                }
            }
        }
    }
}

}  // namespace kvcmas::cpu::detail
