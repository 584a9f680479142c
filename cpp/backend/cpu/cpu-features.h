// Which instruction sets this CPU offers, read once at run time, so one binary runs everywhere and takes the
// fastest kernels the machine has. KVCMAS_FORCE_SCALAR=1 in the environment forces the portable kernels.
#pragma once

namespace kvcmas::cpu {

struct CpuFeatures {
    bool avx2_fma_f16c = false;  // AVX2 + FMA3 + F16C (Haswell, Zen and later)
};

const CpuFeatures & cpu_features();

}  // namespace kvcmas::cpu
