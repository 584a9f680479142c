#include "backend/backend.h"

#include <cstdlib>
#include <cstring>

#include "backend/cpu/cpu-backend.h"
#include "backend/cpu/lora.h"
#include "common/error.h"

#ifdef KVCMAS_CUDA
#include "backend/cuda/cuda-backend.h"
#endif

namespace kvcmas::backend {

Buffer upload_floats(Backend & b, const std::vector<float> & host) {
    Buffer buf(b, host.size() * sizeof(float));
    if (!host.empty()) {
        b.upload(buf.data(), host.data(), host.size() * sizeof(float));
    }
    return buf;
}

void upload_lora_factor(Backend & b, const float * rows, int64_t n_rows, int64_t width, LoraFactorType type,
                        Buffer & data, Buffer & scales) {
    std::vector<uint8_t> bytes;
    std::vector<float>   row_scales;
    cpu::encode_lora_rows(rows, n_rows, width, type, bytes, row_scales);
    data = Buffer(b, bytes.size());
    if (!bytes.empty()) {
        b.upload(data.data(), bytes.data(), bytes.size());
    }
    scales = row_scales.empty() ? Buffer() : upload_floats(b, row_scales);
}

void upload_lora_b(Backend & b, const float * b_t, int rank, int64_t n_out, LoraFactorType type, Buffer & data,
                   Buffer & scales) {
    std::vector<uint8_t> rows;
    std::vector<float>   row_scales;
    cpu::encode_lora_rows(b_t, rank, n_out, type, rows, row_scales);
    const size_t         es      = rows.size() / static_cast<size_t>(rank * n_out);
    const int64_t        n_tiles = (n_out + kLoraTile - 1) / kLoraTile;
    std::vector<uint8_t> tiled(static_cast<size_t>(n_tiles * rank * kLoraTile) * es, 0);
    for (int c = 0; c < rank; ++c) {
        for (int64_t o = 0; o < n_out; ++o) {
            std::memcpy(&tiled[static_cast<size_t>(lora_b_index(c, o, rank)) * es],
                        &rows[static_cast<size_t>(c * n_out + o) * es], es);
        }
    }
    data = Buffer(b, tiled.size());
    b.upload(data.data(), tiled.data(), tiled.size());
    scales = row_scales.empty() ? Buffer() : upload_floats(b, row_scales);
}

void check_segments(const int64_t * host_seg, int n_seg, int64_t n_rows, int64_t E, int64_t H) {
    KC_CHECK(H > 0 && E > 0 && E % H == 0, "segment_attention: %lld heads do not divide rows of %lld",
             static_cast<long long>(H), static_cast<long long>(E));
    KC_CHECK(n_seg >= 1 && host_seg[0] == 0 && host_seg[n_seg] == n_rows,
             "segment_attention: %d segments must run from row 0 to row %lld", n_seg, static_cast<long long>(n_rows));
    for (int s = 0; s < n_seg; ++s) {
        KC_CHECK(host_seg[s] <= host_seg[s + 1], "segment_attention: segment %d ends before it starts", s);
    }
}

std::vector<std::string> compiled_backends() {
#ifdef KVCMAS_CUDA
    return { "cpu", "cuda" };
#else
    return { "cpu" };
#endif
}

bool backend_usable(const std::string & name, std::string * reason) {
    if (name == "cpu") {
        return true;
    }
    if (name == "cuda" || name.rfind("cuda:", 0) == 0) {
#ifdef KVCMAS_CUDA
        return cuda_usable(reason);
#else
        if (reason != nullptr) {
            *reason = "this build of kvcmas has no CUDA backend (rebuild with -DKVCMAS_CUDA=ON)";
        }
        return false;
#endif
    }
    if (reason != nullptr) {
        *reason = "unknown backend '" + name + "'";
    }
    return false;
}

std::unique_ptr<Backend> make_backend(const std::string & name, int n_threads) {
    if (name == "cpu") {
        return make_cpu_backend(n_threads);
    }
    if (name == "cuda" || name.rfind("cuda:", 0) == 0) {
#ifdef KVCMAS_CUDA
        int device = 0;
        if (name.size() > 5) {
            char *     end = nullptr;
            const long d   = std::strtol(name.c_str() + 5, &end, 10);
            KC_CHECK(end != nullptr && *end == '\0' && d >= 0 && d < 1024, "device '%s': expected cuda or cuda:N",
                     name.c_str());
            device = static_cast<int>(d);
        }
        std::string why;
        KC_CHECK(cuda_usable(&why), "device '%s' requested: %s", name.c_str(), why.c_str());
        return make_cuda_backend(device);
#else
        fail(
            "device '%s' requested, but this build of kvcmas has no CUDA backend (CPU-only build; rebuild with "
            "-DKVCMAS_CUDA=ON, e.g. pip install . -C cmake.define.KVCMAS_CUDA=ON)",
            name.c_str());
#endif
    }
    fail("unknown device '%s' (this build has: cpu%s)", name.c_str(),
#ifdef KVCMAS_CUDA
         ", cuda"
#else
         ""
#endif
    );
}

}  // namespace kvcmas::backend
