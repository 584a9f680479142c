// The CPU backend: host memory, the AVX2 / portable kernels of backend/cpu and a thread pool.
#pragma once

#include <memory>

#include "backend/backend.h"

namespace kvcmas::backend {

// n_threads <= 0: all cores (at most 64).
std::unique_ptr<Backend> make_cpu_backend(int n_threads);

}  // namespace kvcmas::backend
