// Test and benchmark entry points for the CPU kernels (kvcmas_cpp._testing): dequantize, matmul, matmul_reference,
// matmul_bench, thread_pool_check.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>
#include <time.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <vector>

#include "bindings/bindings.h"
#include "bindings/testing/testing.h"
#include "common/error.h"
#include "common/ggml-types.h"
#include "backend/cpu/matmul.h"
#include "backend/cpu/quants.h"
#include "backend/cpu/threadpool.h"

namespace nb = nanobind;

namespace kvcmas::py {
namespace {

using FloatMatrix = nb::ndarray<const float, nb::shape<-1, -1>, nb::c_contig, nb::device::cpu>;
using NumpyArray  = nb::ndarray<nb::numpy, float>;

const GgmlTypeTraits & weight_traits(uint32_t type_id, const char * what) {
    const GgmlTypeTraits * t = ggml_type_traits(type_id);
    KC_CHECK(t != nullptr && t->weight, "%s: %s is not a supported weight type", what, ggml_type_name(type_id));
    return *t;
}

// A new float32 array of the given shape that owns its memory.
NumpyArray new_array(size_t rows, size_t cols, bool two_d, float ** data) {
    const size_t count = rows * cols;
    std::unique_ptr<float[]> buf(new float[count > 0 ? count : 1]);
    *data = buf.get();
    nb::capsule owner(buf.get(), [](void * p) noexcept { delete[] static_cast<float *>(p); });
    float * raw = buf.release();
    if (two_d) {
        size_t shape[2] = { rows, cols };
        return NumpyArray(raw, 2, shape, owner);
    }
    size_t shape[1] = { count };
    return NumpyArray(raw, 1, shape, owner);
}

cpu::WeightView weight_view(uint32_t type_id, const nb::bytes & weight, int64_t n_in, int64_t n_out,
                            const FloatMatrix & x, const char * what) {
    const GgmlTypeTraits & t = weight_traits(type_id, what);
    KC_CHECK(n_in > 0 && n_out >= 0, "%s: bad shape n_in=%lld n_out=%lld", what, static_cast<long long>(n_in),
             static_cast<long long>(n_out));
    const size_t row_bytes = ggml_row_bytes(static_cast<GgmlType>(type_id), n_in);
    KC_CHECK(weight.size() == row_bytes * static_cast<size_t>(n_out),
             "%s: weight has %zu bytes, expected %zu for %lld rows of %lld %s elements", what, weight.size(),
             row_bytes * static_cast<size_t>(n_out), static_cast<long long>(n_out), static_cast<long long>(n_in),
             t.name);
    KC_CHECK(x.shape(1) == static_cast<size_t>(n_in), "%s: x has %zu columns, expected n_in=%lld", what, x.shape(1),
             static_cast<long long>(n_in));
    return { static_cast<GgmlType>(type_id), weight.c_str(), n_in, n_out, row_bytes };
}

NumpyArray py_dequantize(uint32_t type_id, const nb::bytes & data, int64_t n) {
    const GgmlTypeTraits & t = weight_traits(type_id, "dequantize");
    KC_CHECK(n >= 0, "dequantize: bad element count %lld", static_cast<long long>(n));
    const size_t bytes = ggml_row_bytes(static_cast<GgmlType>(type_id), n);
    KC_CHECK(data.size() == bytes, "dequantize: %lld %s elements take %zu bytes, got %zu", static_cast<long long>(n),
             t.name, bytes, data.size());
    float *    out;
    NumpyArray result = new_array(1, static_cast<size_t>(n), false, &out);
    {
        nb::gil_scoped_release release;
        cpu::dequantize_row(static_cast<GgmlType>(type_id), data.c_str(), out, n);
    }
    return result;
}

NumpyArray py_matmul(uint32_t type_id, const nb::bytes & weight, int64_t n_in, int64_t n_out, const FloatMatrix & x,
                     int n_threads, const std::string & activations) {
    const cpu::Activations act = parse_activations(activations);
    const cpu::WeightView w = weight_view(type_id, weight, n_in, n_out, x, "matmul");
    const int64_t         n_tok = static_cast<int64_t>(x.shape(0));
    float *               out;
    NumpyArray            result = new_array(static_cast<size_t>(n_tok), static_cast<size_t>(n_out), true, &out);
    {
        nb::gil_scoped_release release;
        cpu::ThreadPool        pool(n_threads);
        cpu::matmul(w, x.data(), out, n_tok, pool, act);
    }
    return result;
}

NumpyArray py_matmul_reference(uint32_t type_id, const nb::bytes & weight, int64_t n_in, int64_t n_out,
                               const FloatMatrix & x) {
    const cpu::WeightView w = weight_view(type_id, weight, n_in, n_out, x, "matmul_reference");
    const int64_t         n_tok = static_cast<int64_t>(x.shape(0));
    float *               out;
    NumpyArray            result = new_array(static_cast<size_t>(n_tok), static_cast<size_t>(n_out), true, &out);
    {
        nb::gil_scoped_release release;
        cpu::matmul_reference(w, x.data(), out, n_tok);
    }
    return result;
}

double thread_cpu_seconds() {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Benchmarks: runs matmul over every matrix of `weights` in turn (one pool, created once), `repeats` times, and
// returns the best wall time and the best CPU time of the calling thread (seconds) of one such pass; with one thread
// the CPU time is the kernel's own speed even on a busy machine.
std::pair<double, double> py_matmul_bench(uint32_t type_id, const std::vector<nb::bytes> & weights, int64_t n_in, int64_t n_out,
                       const FloatMatrix & x, int n_threads, int repeats, const std::string & activations) {
    const cpu::Activations act = parse_activations(activations);
    KC_CHECK(repeats >= 1 && !weights.empty(), "matmul_bench: need repeats >= 1 and at least one weight");
    std::vector<cpu::WeightView> views;
    for (const nb::bytes & w : weights) {
        views.push_back(weight_view(type_id, w, n_in, n_out, x, "matmul_bench"));
    }
    const int64_t      n_tok = static_cast<int64_t>(x.shape(0));
    std::vector<float> out(static_cast<size_t>(n_tok * n_out));
    double             best = 1e30, best_cpu = 1e30;
    {
        nb::gil_scoped_release release;
        cpu::ThreadPool        pool(n_threads);
        for (int i = 0; i < repeats; ++i) {
            const auto   t0     = std::chrono::steady_clock::now();
            const double t0_cpu = thread_cpu_seconds();
            for (const cpu::WeightView & w : views) {
                cpu::matmul(w, x.data(), out.data(), n_tok, pool, act);
            }
            const double s     = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            const double s_cpu = thread_cpu_seconds() - t0_cpu;
            best               = s < best ? s : best;
            best_cpu           = s_cpu < best_cpu ? s_cpu : best_cpu;
        }
    }
    return { best, best_cpu };
}

// Thread-pool check for tests: runs `rounds` jobs on one pool of n_threads; each job records how often every ith
// ran, and the thread with ith == fail_ith (if any) throws kvcmas::Error in the last round. Returns the counts.
std::vector<int> py_thread_pool_check(int n_threads, int rounds, int fail_ith) {
    std::vector<int> counts;
    {
        nb::gil_scoped_release release;
        cpu::ThreadPool        pool(n_threads);
        counts.assign(static_cast<size_t>(pool.size()), 0);
        std::vector<std::atomic<int>> calls(static_cast<size_t>(pool.size()));
        for (int r = 0; r < rounds; ++r) {
            const bool last = r == rounds - 1;
            pool.run([&](int ith, int nth) {
                KC_CHECK(nth == pool.size(), "thread pool: nth %d != size %d", nth, pool.size());
                calls[static_cast<size_t>(ith)].fetch_add(1);
                KC_CHECK(!(last && ith == fail_ith), "thread pool: job failed in thread %d", ith);
            });
        }
        for (size_t i = 0; i < counts.size(); ++i) {
            counts[i] = calls[i].load();
        }
    }
    return counts;
}

}  // namespace

void bind_kernels(nb::module_ & m) {
    m.def("thread_pool_check", &py_thread_pool_check, nb::arg("n_threads"), nb::arg("rounds"), nb::arg("fail_ith") = -1,
          "Runs `rounds` jobs on a pool and returns how often each thread index ran (tests); with fail_ith, that "
          "thread throws in the last round and the error surfaces here.");
    m.def("dequantize", &py_dequantize, nb::arg("type_id"), nb::arg("data"), nb::arg("n"),
          "Dequantizes n elements of GGUF type `type_id` (raw bytes, whole blocks) to a float32 array.");
    m.def("matmul", &py_matmul, nb::arg("type_id"), nb::arg("weight"), nb::arg("n_in"), nb::arg("n_out"), nb::arg("x"),
          nb::arg("n_threads") = 1, nb::arg("activations") = "f32",
          "y = x @ W.T for W stored as n_out rows of n_in elements of `type_id`; x float32 (n_tok, n_in), "
          "returns (n_tok, n_out). The engine's kernels. activations 'f32': f32 activations on every path, so a row's "
          "result agrees with dequantize(W) @ x to f32 rounding whatever n_tok or n_threads. 'q8': the decode path "
          "of quantized types quantizes x per 32 elements in two 8-bit passes and uses integer dot products.");
    m.def("matmul_reference", &py_matmul_reference, nb::arg("type_id"), nb::arg("weight"), nb::arg("n_in"),
          nb::arg("n_out"), nb::arg("x"), "Same as matmul, plain reference code (dequantize, f64 sums).");
    m.def("matmul_bench", &py_matmul_bench, nb::arg("type_id"), nb::arg("weights"), nb::arg("n_in"), nb::arg("n_out"),
          nb::arg("x"), nb::arg("n_threads") = 1, nb::arg("repeats") = 10, nb::arg("activations") = "f32",
          "(best wall seconds, best caller-thread CPU seconds) of one pass of matmul over all `weights` on one "
          "thread pool (benchmarks).");
}

}  // namespace kvcmas::py
