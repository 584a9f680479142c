#include "backend/cpu/cpu-features.h"

#include <cstdlib>
#include <cstring>

#if defined(KC_X86)
#    include <cpuid.h>
#endif

namespace kvcmas::cpu {

static CpuFeatures detect() {
    CpuFeatures f;
    const char * force = std::getenv("KVCMAS_FORCE_SCALAR");
    if (force != nullptr && std::strcmp(force, "0") != 0 && force[0] != '\0') {
        return f;
    }
#if defined(KC_X86) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    f.avx2_fma_f16c = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;  // leaf 7 subleaf 1, EAX bit 4: AVX-VNNI (VEX-encoded)
    const char * no_vnni = std::getenv("KVCMAS_NO_VNNI");
    f.avx_vnni = f.avx2_fma_f16c && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && ((eax >> 4) & 1) != 0 &&
                 (no_vnni == nullptr || no_vnni[0] == '\0' || std::strcmp(no_vnni, "0") == 0);
#endif
    return f;
}

const CpuFeatures & cpu_features() {
    static const CpuFeatures features = detect();
    return features;
}

}  // namespace kvcmas::cpu
