#include "backend/cpu/swiglu-oai.h"

#include <algorithm>
#include <cmath>

namespace kvcmas::cpu {

void swiglu_oai(float * g, const float * u, int64_t n, float alpha, float limit) {
    for (int64_t i = 0; i < n; ++i) {
        const float x  = std::min(g[i], limit);
        const float up = std::clamp(u[i], -limit, limit);
        g[i]           = x / (1.0f + std::exp(-alpha * x)) * (up + 1.0f);
    }
}

}  // namespace kvcmas::cpu
