#include "backend/cpu/cpu-features.h"

#include <cstdlib>
#include <cstring>

#if defined(KC_X86)
#    include <cpuid.h>
#endif

namespace kvcmas::cpu {

// True when `name` is set to something other than "" or "0".
static bool env_on(const char * name) {
    const char * v = std::getenv(name);
    return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
}

#if defined(KC_X86) && (defined(__GNUC__) || defined(__clang__))
// The OS saves the opmask and all 32 zmm registers (XCR0 bits 1, 2, 5, 6, 7); without it AVX-512 faults.
static bool os_saves_zmm() {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || ((ecx >> 27) & 1) == 0) {  // OSXSAVE
        return false;
    }
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (lo & 0xE6) == 0xE6;
}
#endif

static CpuFeatures detect() {
    CpuFeatures f;
    if (env_on("KVCMAS_FORCE_SCALAR")) {
        return f;
    }
#if defined(KC_X86) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    f.avx2_fma_f16c = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;  // leaf 7 subleaf 1, EAX bit 4: AVX-VNNI (VEX-encoded)
    f.avx_vnni = f.avx2_fma_f16c && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && ((eax >> 4) & 1) != 0 &&
                 !env_on("KVCMAS_NO_VNNI");
    f.avx512   = f.avx2_fma_f16c && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") && os_saves_zmm() &&
                 !env_on("KVCMAS_NO_AVX512");
    f.avx512_vnni = f.avx512 && __builtin_cpu_supports("avx512vnni") && !env_on("KVCMAS_NO_QGEMM");
    f.qgemm_avx2  = f.avx2_fma_f16c && !f.avx512_vnni && !env_on("KVCMAS_NO_QGEMM");
#endif
    return f;
}

const CpuFeatures & cpu_features() {
    static const CpuFeatures features = detect();
    return features;
}

}  // namespace kvcmas::cpu
