// The CUDA backend (built with -DKVCMAS_CUDA=ON): weights, KV blocks, correction factors and activations in device
// memory, every op of backend.h as CUDA kernels. See docs/backends.md for what each kernel does and its limits.
#pragma once

#include <memory>
#include <string>

#include "backend/backend.h"

namespace kvcmas::backend {

// Whether a CUDA device and a driver new enough for this build are present; reason receives why not.
bool cuda_usable(std::string * reason);

// The backend on device `device`. Throws kvcmas::Error when it cannot be used.
std::unique_ptr<Backend> make_cuda_backend(int device);

}  // namespace kvcmas::backend
