// Each bind_*.cpp adds one part of the core to the `_core` extension module.
#pragma once

#include <nanobind/nanobind.h>

namespace kvcmas::py {

void bind_gguf(nanobind::module_ & m);       // bind-gguf.cpp: GgufFile
void bind_kernels(nanobind::module_ & m);    // bind-kernels.cpp: dequantize / matmul entry points for tests
void bind_engine(nanobind::module_ & m);     // bind-engine.cpp: Model, sequences, batches
void bind_attention(nanobind::module_ & m);  // bind-attention.cpp: the attention kernel, for tests
void bind_vision(nanobind::module_ & m);     // bind-vision.cpp: VisionEncoder (mmproj towers)
// bind-correction.cpp: ridge maps, corrections built in the core, materialized copies of corrected spans
void bind_correction(nanobind::module_ & m);
void bind_backend(nanobind::module_ & m);  // bind-backend.cpp: the backends' ops one by one, for tests

}  // namespace kvcmas::py
