// Which instruction sets this CPU offers, read once at run time, so one binary runs everywhere and takes the
// fastest kernels the machine has. KVCMAS_FORCE_SCALAR=1 in the environment forces the portable kernels.
#pragma once

namespace kvcmas::cpu {

struct CpuFeatures {
    bool avx2_fma_f16c = false;  // AVX2 + FMA3 + F16C (Haswell, Zen and later)
    // AVX-VNNI (Alder Lake, Sapphire Rapids, Zen 5 and later): 8-bit dot products in one instruction, used by the
    // q8 activation kernels. KVCMAS_NO_VNNI=1 turns it off (tests compare the two kernel sets).
    bool avx_vnni = false;
    // AVX-512 F/BW/DQ/VL with zmm state enabled by the OS (Skylake-X, Ice Lake, Sapphire Rapids, Zen 4 and later):
    // the prefill GEMM. KVCMAS_NO_AVX512=1 turns it off (tests compare it with the AVX2 kernel).
    bool avx512 = false;
    // AVX512-VNNI on top of avx512 (Ice Lake, Sapphire Rapids, Zen 4 and later): 16-bit dot products in one
    // instruction, used by the integer prefill GEMM of the 8-bit activation path (backend/cpu/qgemm.h).
    // KVCMAS_NO_AVX512=1 turns it off with avx512; KVCMAS_NO_QGEMM=1 alone (tests compare the prefill paths).
    bool avx512_vnni = false;
    // The integer prefill GEMM with AVX2 (vpmaddwd; the same bits as with AVX512-VNNI), taken where avx512_vnni is
    // not: on every AVX2 CPU unless KVCMAS_NO_QGEMM=1. KVCMAS_NO_AVX512=1 runs it here (tests compare the two).
    bool qgemm_avx2 = false;
};

const CpuFeatures & cpu_features();

}  // namespace kvcmas::cpu
