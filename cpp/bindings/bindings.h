// Each bind_*.cpp adds one part of the core to the `_core` extension module; testing/ holds the `_testing` module
// (kernels and backend ops for tests), built with KVCMAS_TESTING_MODULE=ON.
#pragma once

#include <nanobind/nanobind.h>

#include <string>

#include "backend/cpu/matmul.h"

namespace kvcmas::py {

void bind_gguf(nanobind::module_ & m);    // bind-gguf.cpp: GgufFile
void bind_engine(nanobind::module_ & m);  // bind-engine.cpp: Model, sequences, batches
void bind_vision(nanobind::module_ & m);  // bind-vision.cpp: VisionEncoder (mmproj towers)
// bind-correction.cpp: ridge maps, corrections built in the core, materialized copies of corrected spans
void bind_correction(nanobind::module_ & m);

// "q8" | "f32" -> how decode matmuls take their activations; anything else is an error naming the option.
cpu::Activations parse_activations(const std::string & name);  // common.cpp
const char *     activations_name(cpu::Activations act);       // common.cpp: parse_activations' inverse

// common.cpp: kvcmas::Error raised in this module's bindings reaches Python as `error_type` (an exception class),
// its message decoded with replacement characters where it quotes bytes that are not UTF-8.
void translate_errors(nanobind::handle error_type);

}  // namespace kvcmas::py
