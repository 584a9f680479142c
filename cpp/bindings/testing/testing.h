// The `_testing` extension module (built with KVCMAS_TESTING_MODULE=ON): the core's kernels and backend ops one by
// one on numpy arrays, for tests and kernel benchmarks. Production code never needs it; `_core` does not contain it.
#pragma once

#include <nanobind/nanobind.h>

namespace kvcmas::py {

void bind_kernels(nanobind::module_ & m);    // bind-kernels.cpp: dequantize / matmul / thread pool entry points
void bind_attention(nanobind::module_ & m);  // bind-attention.cpp: the attention kernel on numpy KV runs
void bind_backend(nanobind::module_ & m);    // bind-backend.cpp: the backends' ops one by one (BackendOps)

}  // namespace kvcmas::py
