#include "backend/cpu/cpu-features.h"

#include <cstdlib>
#include <cstring>

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
#endif
    return f;
}

const CpuFeatures & cpu_features() {
    static const CpuFeatures features = detect();
    return features;
}

}  // namespace kvcmas::cpu
