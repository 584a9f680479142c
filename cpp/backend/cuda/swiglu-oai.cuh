// gpt-oss's clamped SwiGLU on the device (the CPU's backend/cpu/swiglu-oai.h, same formula).
#pragma once

#include <cstdint>

namespace kvcmas::cuda {

// g [n] = min(g, limit) · sigmoid(alpha · min(g, limit)) · (clamp(u, -limit, limit) + 1), in place (device
// addresses), launched on the default stream; throws kvcmas::Error when the launch fails.
void swiglu_oai(float * g, const float * u, int64_t n, float alpha, float limit);

}  // namespace kvcmas::cuda
