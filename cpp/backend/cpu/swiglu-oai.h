// gpt-oss's clamped SwiGLU (OpenAI's "swiglu_oai"): the gate clamped from above, the up projection to [-limit,
// limit], a sigmoid sharpened by alpha, and (up + 1) in place of up.
#pragma once

#include <cstdint>

namespace kvcmas::cpu {

// g [n] = min(g, limit) · sigmoid(alpha · min(g, limit)) · (clamp(u, -limit, limit) + 1), in place.
void swiglu_oai(float * g, const float * u, int64_t n, float alpha, float limit);

}  // namespace kvcmas::cpu
