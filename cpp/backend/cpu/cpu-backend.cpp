#include "backend/cpu/cpu-backend.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <new>
#include <thread>
#include <unordered_map>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#endif
#if defined(__linux__)
#include <sys/sysinfo.h>
#endif

#include "backend/cpu/attention.h"
#include "backend/cpu/cpu-features.h"
#include "backend/cpu/lora.h"
#include "backend/cpu/matmul.h"
#include "backend/cpu/moe-experts.h"
#include "backend/cpu/ops.h"
#include "backend/cpu/quants.h"
#include "backend/cpu/swiglu-oai.h"
#include "backend/cpu/threadpool.h"
#include "backend/cpu/vision-kernels.h"
#include "backend/moe-route.h"
#include "common/error.h"

namespace kvcmas::cpu {
#ifdef KC_X86
void ridge_rows_avx2(const float * x, int64_t n, int64_t kd, const float * mu, const float * proj, int rank,
                     float * out, int64_t out_stride);  // ridge-avx2.cpp
#endif
}  // namespace kvcmas::cpu

namespace kvcmas::backend {
namespace {

int default_threads(int n_threads) {
    if (n_threads > 0) {
        return n_threads;
    }
    const unsigned hw = std::thread::hardware_concurrency();
    return hw == 0 ? 1 : static_cast<int>(std::min(hw, 64u));
}

// Factors read in place from the host arrays of the correction that made them.
class HostFactors final : public Factors {};

cpu::WeightView view(const Weight & w) {
    return cpu::WeightView{ w.type, w.data, w.n_in, w.n_out, w.row_bytes };
}

// out[i * out_stride + c] = ((x_i - mu) · proj)[c] for rows x_i of x [n][kd], c < rank.
void ridge_product(const float * x, int64_t n, int64_t kd, const float * mu, const float * proj, int rank, float * out,
                   int64_t out_stride) {
#ifdef KC_X86
    if (cpu::cpu_features().avx2_fma_f16c) {
        cpu::ridge_rows_avx2(x, n, kd, mu, proj, rank, out, out_stride);
        return;
    }
#endif
    for (int64_t i = 0; i < n; ++i) {
        const float * xi = x + i * kd;
        float *       o  = out + i * out_stride;
        std::fill(o, o + rank, 0.0f);
        for (int64_t d = 0; d < kd; ++d) {  // rank-wide inner loop: vectorizes, no reduction across iterations
            const float   xd = xi[d] - mu[d];
            const float * p  = &proj[d * rank];
            for (int c = 0; c < rank; ++c) {
                o[c] += xd * p[c];
            }
        }
    }
}

class CpuBackend final : public Backend {
  public:
    explicit CpuBackend(int n_threads) : pool_(default_threads(n_threads)) {}

    std::string name() const override { return "cpu"; }
    std::string device() const override {
        return std::to_string(pool_.size()) + " CPU threads" +
               (cpu::cpu_features().avx2_fma_f16c ? " (AVX2/FMA/F16C)" : " (portable kernels)");
    }
    int n_threads() const override { return pool_.size(); }

    void * alloc(size_t bytes) override {
        void * p = std::malloc(bytes == 0 ? 1 : bytes);
        KC_CHECK(p != nullptr, "cpu backend: cannot allocate %zu bytes (out of memory)", bytes);
        return p;
    }
    void   free(void * p, size_t) override { std::free(p); }
    size_t free_bytes() const override { return 0; }  // host memory: the process's, not counted here
    void   upload(void * dst, const void * src, size_t bytes) override { std::memcpy(dst, src, bytes); }
    void   download(void * dst, const void * src, size_t bytes) override { std::memcpy(dst, src, bytes); }

    // Weights are copied into anonymous memory on 2 MiB pages: decode streams every weight once per token, and
    // read from the file's mapping (4 KiB page-cache pages) it ran at ~3/4 of that speed on this VM (issue 45,
    // docs/prefill-kernels.md Round 6). KVCMAS_WEIGHTS_IN_PLACE=1 reads the host data in place instead.
    Weight upload_weight(GgmlType type, const void * host, int64_t n_in, int64_t n_out, size_t row_bytes) override {
        static const bool in_place = std::getenv("KVCMAS_WEIGHTS_IN_PLACE") != nullptr;
        const size_t      bytes    = row_bytes * static_cast<size_t>(n_out);
        const void *      copy     = in_place || bytes == 0 ? nullptr : copy_on_huge_pages(host, bytes);
        return Weight{ type, copy != nullptr ? copy : host, n_in, n_out, row_bytes };
    }

    void free_weight(const Weight & w) override {
        const std::lock_guard<std::mutex> lock(copies_mutex_);
        const auto                        it = copies_.find(w.data);
        if (it != copies_.end()) {
            unmap_copy(it->first, it->second);
            copies_.erase(it);
        }
    }

    ~CpuBackend() override {
        for (const auto & c : copies_) {
            unmap_copy(c.first, c.second);
        }
    }

    std::shared_ptr<const Factors> upload_factors(int rank, int32_t n_rows, int64_t, const float * a_k,
                                                  const float * b_k, const float * a_v, const float * b_v) override {
        auto f      = std::make_shared<HostFactors>();
        f->rank     = rank;
        f->n_rows   = n_rows;
        f->a_k      = a_k;
        f->b_k      = b_k;
        f->a_v      = a_v;
        f->b_v      = b_v;
        f->host_b_k = b_k;
        f->host_b_v = b_v;
        return f;
    }

    // Each block is its own anonymous mapping: a heap chunk of this size would stay in the allocator's arenas
    // after being freed, so trimming the pool would not lower the resident memory.
    uint8_t * kv_block_alloc(size_t bytes) override {
#if defined(__unix__) || defined(__APPLE__)
        void * p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        KC_CHECK(p != MAP_FAILED, "KV cache: cannot map a block of %zu bytes (out of memory)", bytes);
        return static_cast<uint8_t *>(p);
#else
        uint8_t * p = new (std::nothrow) uint8_t[bytes];
        KC_CHECK(p != nullptr, "KV cache: cannot allocate a block of %zu bytes (out of memory)", bytes);
        return p;
#endif
    }
    void kv_block_free(uint8_t * p, size_t bytes) override {
#if defined(__unix__) || defined(__APPLE__)
        munmap(p, bytes);
#else
        (void)bytes;
        delete[] p;
#endif
    }

    void embed_rows(const Weight & table, const int32_t * tokens, int64_t n, float * x) override {
        for (int64_t i = 0; i < n; ++i) {
            if (tokens[i] >= 0) {
                const uint8_t * row = static_cast<const uint8_t *>(table.data) + table.row_bytes * tokens[i];
                cpu::dequantize_row(table.type, row, x + i * table.n_in, table.n_in);
            }
        }
    }

    void rms_norm(const float * x, const float * w, float * y, int64_t n_rows, int64_t n, float eps) override {
        const auto rows = [&](int64_t b, int64_t e) {
            for (int64_t i = b; i < e; ++i) {
                cpu::rms_norm(x + i * n, w, y + i * n, n, eps);
            }
        };
        if (n_rows < pool_.size() * 4) {  // a decode step's few rows are not worth a pool round
            rows(0, n_rows);
        } else {  // rows are independent: the same bits at any thread count
            pool_.run([&](int ith, int nth) {
                long long b, e;
                cpu::split_range(n_rows, ith, nth, b, e);
                rows(b, e);
            });
        }
    }

    void matmul(const Weight & w, const float * x, float * y, int64_t n_tok) override {
        cpu::matmul(view(w), x, y, n_tok, pool_, act_);
    }

    void             set_activations(cpu::Activations act) override { act_ = act; }
    cpu::Activations activations() const override { return act_; }

    void matmul_multi(const Weight * w, float * const * y, int n_mats, const float * x, int64_t n_tok) override {
        KC_CHECK(n_mats > 0 && n_mats <= cpu::kMaxMatmulMulti, "matmul_multi: %d matrices", n_mats);
        cpu::WeightView v[cpu::kMaxMatmulMulti];
        for (int i = 0; i < n_mats; ++i) {
            v[i] = view(w[i]);
        }
        cpu::matmul_multi(v, y, n_mats, x, n_tok, pool_, act_);
    }

    void matmul_multi_lora(const Weight * w, float * const * y, int n_mats, const float * x, int64_t n_tok,
                           const LoraProduct * products, int n_products) override {
        KC_CHECK(n_mats > 0 && n_mats <= cpu::kMaxMatmulMulti, "matmul_multi_lora: %d matrices", n_mats);
        cpu::WeightView v[cpu::kMaxMatmulMulti];
        for (int i = 0; i < n_mats; ++i) {
            v[i] = view(w[i]);
        }
        cpu::matmul_multi_lora(v, y, n_mats, x, n_tok, products, n_products, pool_, act_, lora_);
    }

    void add_bias(float * y, const float * b, int64_t n_rows, int64_t n) override {
        const auto rows = [&](int64_t r0, int64_t r1) {
            for (int64_t i = r0; i < r1; ++i) {
                add(y + i * n, b, n);
            }
        };
        if (n_rows < pool_.size() * 4) {  // a decode step's few rows are not worth a pool round
            rows(0, n_rows);
        } else {  // rows are independent: the same bits at any thread count
            rows_on_pool(n_rows, rows);
        }
    }

    void rope_kv_write(const Rope & rope, const AttentionShape & s, float * q, float * k, const float * v, int64_t n,
                       const float * cos_q, const float * sin_q, const float * cos_k, const float * sin_k,
                       const KvStore & store, int layer, const KvSlotRef * slots) override {
        const int64_t qd = static_cast<int64_t>(s.n_head) * s.head_dim, kd = store.n_kv_dim;
        const int64_t half = rope.n_rot / 2;
        const auto    rows = [&](long long b, long long e) {
            for (long long i = b; i < e; ++i) {
                rope.apply_cs(q + i * qd, s.n_head, s.head_dim, cos_q + i * half, sin_q + i * half);
                rope.apply_cs(k + i * kd, s.n_head_kv, s.head_dim, cos_k + i * half, sin_k + i * half);
                uint8_t * kr = row(store, layer, slots[i].block, slots[i].row);
                cpu::kv_store_row(store.kv_type, k + i * kd, kr, kd);
                cpu::kv_store_row(store.kv_type, v + i * kd, kr + store.v_offset, kd);
            }
        };
        if (n < pool_.size() * 4) {  // a decode step's few tokens are not worth a pool round
            rows(0, n);
        } else {
            pool_.run([&](int ith, int nth) {
                long long b, e;
                cpu::split_range(n, ith, nth, b, e);
                rows(b, e);
            });
        }
    }

    void attention(const AttentionShape & shape, const Rope & rope, const KvStore & store, int layer, const float * q,
                   float * out, int64_t, const QueryBlock * blocks, int n_blocks, const RunTable * tables,
                   int64_t max_visible) override {
        // The tables as the kernel reads them: runs with host pointers (tables_ keeps its memory between calls).
        int n_tables = 0;
        for (int b = 0; b < n_blocks; ++b) {
            n_tables = std::max(n_tables, blocks[b].table + 1);
        }
        if (static_cast<int>(runs_.size()) < n_tables) {
            runs_.resize(static_cast<size_t>(n_tables));
        }
        for (int t = 0; t < n_tables; ++t) {
            std::vector<cpu::KvRun> & out_runs = runs_[static_cast<size_t>(t)];
            out_runs.clear();
            const RunTable & table = tables[t];
            for (const KvRunRef & r : table.runs) {
                out_runs.push_back(kernel_run(store, layer, table, r));
            }
        }
        copy_busy_corrections(shape, store, blocks, n_blocks, n_tables);
        const int     nth            = pool_.size();
        const int64_t scratch_floats = cpu::attention_block_scratch_floats(shape, cpu::kMaxAttentionBlock, max_visible);
        scratch_.resize(static_cast<size_t>(scratch_floats * nth));
        const int64_t   qd      = static_cast<int64_t>(shape.n_head) * shape.head_dim;
        const int       H       = shape.n_head;
        const long long n_tasks = static_cast<long long>(n_blocks) * H;  // (block, head) pairs
        pool_.run([&](int ith, int nth_) {
            long long b, e;
            cpu::split_range(n_tasks, ith, nth_, b, e);
            float * scr = &scratch_[static_cast<size_t>(ith) * scratch_floats];
            for (long long t = b; t < e;) {
                const QueryBlock & blk = blocks[t / H];
                const int          h0  = static_cast<int>(t % H);
                const int          h1  = static_cast<int>(std::min<long long>(H, h0 + (e - t)));
                const auto &       r   = runs_[static_cast<size_t>(blk.table)];
                cpu::attend_block(shape, rope, q + blk.first * qd, qd, blk.nq, r.data(), static_cast<int>(r.size()),
                                  blk.n_visible0, h0, h1, out + blk.first * qd, qd, scr, blk.n_visible_min);
                t += h1 - h0;
            }
        });
    }

    void swiglu(float * g, const float * u, int64_t n_rows, int64_t n) override {
        if (n_rows < pool_.size() * 4) {  // element-wise: a decode step's few rows are not worth a pool round
            cpu::silu_mul(g, u, g, n_rows * n);
        } else {
            pool_.run([&](int ith, int nth) {
                long long b, e;
                cpu::split_range(n_rows, ith, nth, b, e);
                cpu::silu_mul(g + b * n, u + b * n, g + b * n, (e - b) * n);
            });
        }
    }

    void geglu_tanh(float * g, const float * u, int64_t n_rows, int64_t n) override {
        pool_.run([&](int ith, int nth) {
            long long b, e;
            cpu::split_range(n_rows, ith, nth, b, e);
            cpu::gelu_tanh_mul(g + b * n, u + b * n, g + b * n, (e - b) * n);
        });
    }

    void swiglu_oai(float * g, const float * u, int64_t n_rows, int64_t n, float alpha, float limit) override {
        pool_.run([&](int ith, int nth) {
            long long b, e;
            cpu::split_range(n_rows, ith, nth, b, e);
            cpu::swiglu_oai(g + b * n, u + b * n, (e - b) * n, alpha, limit);
        });
    }

    void lora_add(const float * x, int64_t n_in, const LoraProduct * products, int n_products) override {
        cpu::lora_add(x, n_in, products, n_products, pool_, lora_);
    }

    void matmul_experts(const Weight * w, int n_mats, int n_groups, const int64_t * host_first, const float * x,
                        float * const * y) override {
        KC_CHECK(n_mats > 0 && n_mats <= cpu::kMaxMatmulMulti && n_groups >= 0, "matmul_experts: %d x %d matrices",
                 n_groups, n_mats);
        std::vector<cpu::WeightView> v(static_cast<size_t>(n_groups) * static_cast<size_t>(n_mats));
        for (size_t i = 0; i < v.size(); ++i) {
            v[i] = view(w[i]);
        }
        cpu::matmul_experts(v.data(), n_mats, n_groups, host_first, x, y, pool_, act_);
    }

    void moe_route(const float * logits, int64_t n, int n_expert, int k, bool norm, int32_t * host_ids,
                   float * host_weights) override {
        for (int64_t i = 0; i < n; ++i) {
            backend::moe_route_row(logits + i * n_expert, n_expert, k, norm, host_ids + i * k, host_weights + i * k);
        }
    }

    void gather_rows(const float * src, const int32_t * host_rows, int64_t n, int64_t width, float * dst) override {
        for (int64_t i = 0; i < n; ++i) {
            std::memcpy(dst + i * width, src + static_cast<int64_t>(host_rows[i]) * width, sizeof(float) * width);
        }
    }

    void add_scaled_rows(float * dst, const float * src, const int32_t * host_rows, const float * host_scales,
                         int64_t n, int64_t width) override {
        for (int64_t i = 0; i < n; ++i) {
            float * d = dst + static_cast<int64_t>(host_rows[i]) * width;
            for (int64_t c = 0; c < width; ++c) {
                d[c] += host_scales[i] * src[i * width + c];
            }
        }
    }

    void scale(float * x, float s, int64_t n) override {
        for (int64_t i = 0; i < n; ++i) {
            x[i] *= s;
        }
    }

    void add(float * x, const float * y, int64_t n) override {
        for (int64_t i = 0; i < n; ++i) {
            x[i] += y[i];
        }
    }

    void kv_read(const Rope & rope, const AttentionShape & s, const KvStore & store, int layer, const RunTable & table,
                 int ri, int32_t j0, int32_t j1, float * k_out, float * v_out) override {
        const cpu::KvRun r = kernel_run(store, layer, table, table.runs[static_cast<size_t>(ri)]);
        for (int32_t j = j0; j < j1; ++j) {
            float * k = k_out + (j - j0) * store.n_kv_dim;
            float * v = v_out + (j - j0) * store.n_kv_dim;
            load_corrected_row(store, r, j, k, v);
            if (r.shift != 0) {
                rope.apply(k, s.n_head_kv, s.head_dim, static_cast<double>(r.shift));
            }
        }
    }

    void kv_copy(const Rope & rope, const AttentionShape & s, const KvStore & store, int layer, const RunTable & table,
                 int r0, int r1, const int64_t * shifts, const KvSlotRef * slots) override {
        // Rows of the runs, numbered in order: (run, row in run) of each.
        std::vector<std::pair<int, int32_t>> rows;
        for (int ri = r0; ri < r1; ++ri) {
            for (int32_t j = 0; j < table.runs[static_cast<size_t>(ri)].n; ++j) {
                rows.emplace_back(ri, j);
            }
        }
        const int64_t   kd = store.n_kv_dim;
        const long long n  = static_cast<long long>(rows.size());
        pool_.run([&](int ith, int nth) {
            long long b, e;
            cpu::split_range(n, ith, nth, b, e);
            std::vector<float> k(static_cast<size_t>(kd)), v(static_cast<size_t>(kd));
            std::vector<float> cs(static_cast<size_t>(rope.n_rot / 2)), sn(static_cast<size_t>(rope.n_rot / 2));
            int64_t            cached_shift = 0;
            bool               have_angles  = false;
            for (long long i = b; i < e; ++i) {
                const int        ri = rows[static_cast<size_t>(i)].first;
                const int32_t    j  = rows[static_cast<size_t>(i)].second;
                const cpu::KvRun r  = kernel_run(store, layer, table, table.runs[static_cast<size_t>(ri)]);
                load_corrected_row(store, r, j, k.data(), v.data());
                const int64_t shift = shifts[i];
                if (shift != 0) {  // constant over consecutive rows: the angles are computed once
                    if (!have_angles || shift != cached_shift) {
                        rope.angles(static_cast<double>(shift), cs.data(), sn.data());
                        cached_shift = shift;
                        have_angles  = true;
                    }
                    rope.apply_cs(k.data(), s.n_head_kv, s.head_dim, cs.data(), sn.data());
                }
                uint8_t * dst = row(store, layer, slots[i].block, slots[i].row);
                cpu::kv_store_row(store.kv_type, k.data(), dst, kd);
                cpu::kv_store_row(store.kv_type, v.data(), dst + store.v_offset, kd);
            }
        });
    }

    void ridge_rows(const KvStore & store, int layer, const RidgeJob * jobs, int n_jobs, int rank) override {
        const int64_t kd = store.n_kv_dim;
        pool_.run([&](int ith, int nth) {
            long long b, e;
            cpu::split_range(n_jobs, ith, nth, b, e);
            std::vector<float> buf;
            for (long long t = b; t < e; ++t) {
                const RidgeJob & job = jobs[t];
                const uint8_t *  base =
                    row(store, layer, job.run.block, job.run.row0) + (job.values ? store.v_offset : 0);
                const uint8_t * first = base + static_cast<int64_t>(job.j0) * store.row_bytes;
                const int64_t   n     = job.j1 - job.j0;
                const float *   x     = reinterpret_cast<const float *>(first);
                if (store.kv_type != KvType::F32) {
                    buf.resize(static_cast<size_t>(n * kd));
                    for (int64_t j = 0; j < n; ++j) {
                        cpu::kv_load_row(store.kv_type, first + j * store.row_bytes, &buf[static_cast<size_t>(j * kd)],
                                         kd);
                    }
                    x = buf.data();
                }
                ridge_product(x, n, kd, job.mu, job.proj, rank, job.out, job.out_stride);
                const float * a      = nullptr;
                int           a_rank = 0;
                if (job.f != nullptr) {
                    a_rank = job.f->rank;
                    a      = (job.values ? job.f->a_v : job.f->a_k) + static_cast<int64_t>(job.run.corr_row0) * a_rank;
                }
                for (int64_t j = job.j0; j < job.j1; ++j) {
                    float * o = job.out + (j - job.j0) * job.out_stride;
                    for (int qi = 0; qi < job.b_rank; ++qi) {
                        const float   aq = a[j * a_rank + qi];
                        const float * mq = job.m + static_cast<int64_t>(qi) * rank;
                        for (int c = 0; c < rank; ++c) {
                            o[c] += aq * mq[c];
                        }
                    }
                    o[rank] = 1.0f;
                }
            }
        });
    }

  private:
    // A copy of `bytes` bytes of host at a 2 MiB-aligned address with MADV_HUGEPAGE, or nullptr when no memory
    // could be mapped or the copy would leave less than kKeepFree of free memory (the caller then reads host in
    // place: a file larger than the free memory still loads, its later weights read from the page cache).
    const void * copy_on_huge_pages(const void * host, size_t bytes) {
#if defined(__linux__)
        constexpr size_t kHuge     = size_t(1) << 21;
        constexpr size_t kKeepFree = size_t(1) << 30;
        const size_t     len       = (bytes + 4095) & ~size_t(4095);
        struct sysinfo   mem{};
        if (sysinfo(&mem) == 0 &&
            (static_cast<uint64_t>(mem.freeram) + mem.bufferram) * mem.mem_unit < uint64_t(len) + kKeepFree) {
            return nullptr;
        }
        void * p = mmap(nullptr, len + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) {
            return nullptr;
        }
        auto *       base = static_cast<char *>(p);
        char *       a    = reinterpret_cast<char *>((reinterpret_cast<uintptr_t>(base) + kHuge - 1) & ~(kHuge - 1));
        const size_t head = static_cast<size_t>(a - base);
        if (head > 0) {
            munmap(base, head);  // the slack around the aligned range goes back at once
        }
        if (kHuge - head > 0) {
            munmap(a + len, kHuge - head);
        }
        madvise(a, len, MADV_HUGEPAGE);
        std::memcpy(a, host, bytes);
        mprotect(a, len, PROT_READ);
        const std::lock_guard<std::mutex> lock(copies_mutex_);
        copies_.emplace(a, len);
        return a;
#else
        (void)host;
        (void)bytes;
        return nullptr;
#endif
    }
    static void unmap_copy(const void * p, size_t len) {
#if defined(__linux__)
        munmap(const_cast<void *>(p), len);
#endif
    }
    std::mutex                               copies_mutex_;
    std::unordered_map<const void *, size_t> copies_;  // weight copies: address -> mapped length
    // Corrected runs that enough queries of this call read are corrected once into copy_ (K + A_k·B_k, V + A_v·B_v,
    // f32, in the stored frame) and read as plain runs: the fused correction costs each query O(rank) per key and head,
    // a copy O(rank·kd) per key once, so a copy is cheaper when the queries that see the run times n_head reach kd
    // (a prefill over a corrected span: a reader's tail, its recomputed rows). A decode step (one query per sequence)
    // keeps the fused path. f32 stores only: the kernel reads one element type per call, and an f16 copy would round
    // the corrected rows. Consecutive runs of one correction (its factor rows contiguous) are one product. At most
    // kMaxCopyBytes per call; runs past it stay fused.
    static constexpr int64_t kMaxCopyBytes = 64LL << 20;

    void copy_busy_corrections(const AttentionShape & shape, const KvStore & store, const QueryBlock * blocks,
                               int n_blocks, int n_tables) {
        if (store.kv_type != KvType::F32) {
            return;
        }
        struct Group {
            int     table, r0, r1;  // runs [r0, r1) of the table
            int64_t n, off;         // rows, first row in copy_
        };
        std::vector<Group> groups;
        int64_t            total = 0;
        const int64_t      kd    = store.n_kv_dim;
        table_queries_.assign(static_cast<size_t>(n_tables), 0);
        for (int b = 0; b < n_blocks; ++b) {
            table_queries_[static_cast<size_t>(blocks[b].table)] += blocks[b].nq;
        }
        for (int t = 0; t < n_tables; ++t) {
            if (table_queries_[static_cast<size_t>(t)] * shape.n_head < kd) {
                continue;  // too few queries for any of its runs (a decode step): nothing to scan
            }
            std::vector<cpu::KvRun> & runs = runs_[static_cast<size_t>(t)];
            int64_t                   at   = 0;  // the run's first row in the table
            for (int r = 0; r < static_cast<int>(runs.size()); ++r) {
                const cpu::KvRun & run = runs[static_cast<size_t>(r)];
                int64_t readers = 0;  // queries of this table that see the run (query i sees n_visible0 + i rows)
                for (int b = 0; run.rank > 0 && b < n_blocks; ++b) {
                    if (blocks[b].table == t) {
                        readers +=
                            blocks[b].n_visible_min > at
                                ? blocks[b].nq
                                : std::clamp<int64_t>(blocks[b].n_visible0 + blocks[b].nq - 1 - at, 0, blocks[b].nq);
                    }
                }
                const bool fits = (total + run.n) * 2 * kd * static_cast<int64_t>(sizeof(float)) <= kMaxCopyBytes;
                if (run.rank > 0 && readers * shape.n_head >= kd && fits) {
                    const cpu::KvRun * prev = r > 0 ? &runs[static_cast<size_t>(r - 1)] : nullptr;
                    const bool         join = !groups.empty() && groups.back().table == t && groups.back().r1 == r &&
                                              prev->b_k == run.b_k && prev->rank == run.rank &&
                                              prev->a_k + static_cast<int64_t>(prev->n) * prev->rank == run.a_k &&
                                              prev->a_v + static_cast<int64_t>(prev->n) * prev->rank == run.a_v;
                    if (join) {
                        groups.back().r1 = r + 1;
                        groups.back().n += run.n;
                    } else {
                        groups.push_back(Group{ t, r, r + 1, run.n, total });
                    }
                    total += run.n;
                }
                at += run.n;
            }
        }
        if (groups.empty()) {
            return;
        }
        copy_.resize(static_cast<size_t>(2 * total * kd));
        float * k_all = copy_.data();
        float * v_all = k_all + total * kd;
        for (const Group & g : groups) {
            std::vector<cpu::KvRun> & runs  = runs_[static_cast<size_t>(g.table)];
            const cpu::KvRun &        first = runs[static_cast<size_t>(g.r0)];
            const int                 rank  = first.rank;
            for (int side = 0; side < 2; ++side) {  // K, then V: out = A·B (one GEMM), then + the stored rows
                const float * a   = side == 0 ? first.a_k : first.a_v;
                const float * b   = side == 0 ? first.b_k : first.b_v;
                float *       out = (side == 0 ? k_all : v_all) + g.off * kd;
                b_t_.resize(static_cast<size_t>(kd * rank));  // Bᵀ [kd][rank]: matmul's weight rows
                for (int c = 0; c < rank; ++c) {
                    for (int64_t d = 0; d < kd; ++d) {
                        b_t_[static_cast<size_t>(d * rank + c)] = b[c * kd + d];
                    }
                }
                const cpu::WeightView w{ GgmlType::F32, b_t_.data(), rank, kd,
                                         sizeof(float) * static_cast<size_t>(rank) };
                cpu::matmul(w, a, out, g.n, pool_);
                int64_t row = 0;
                for (int r = g.r0; r < g.r1; ++r) {
                    const cpu::KvRun & run    = runs[static_cast<size_t>(r)];
                    const float *      stored = static_cast<const float *>(side == 0 ? run.k : run.v);
                    for (int64_t j = 0; j < run.n; ++j) {
                        float *       o = out + (row + j) * kd;
                        const float * s = stored + j * kd;
                        for (int64_t d = 0; d < kd; ++d) {
                            o[d] += s[d];
                        }
                    }
                    row += run.n;
                }
            }
            int64_t row = g.off;
            for (int r = g.r0; r < g.r1; ++r) {
                cpu::KvRun & run = runs[static_cast<size_t>(r)];
                run              = cpu::KvRun{ k_all + row * kd, v_all + row * kd, run.n, run.shift };
                row += run.n;
            }
        }
    }

    // Row j of run r as read (stored row + its correction, f32, in the stored frame: no shift applied) into k, v
    // ([n_kv_dim] each), for kv_read and kv_copy (attention applies corrections itself, fused or copied per call).
    static void load_corrected_row(const KvStore & store, const cpu::KvRun & r, int32_t j, float * k, float * v) {
        const int64_t kd = store.n_kv_dim;
        cpu::kv_load_row(store.kv_type, static_cast<const uint8_t *>(r.k) + j * store.row_bytes, k, kd);
        cpu::kv_load_row(store.kv_type, static_cast<const uint8_t *>(r.v) + j * store.row_bytes, v, kd);
        const float * ak = r.a_k + static_cast<int64_t>(j) * r.rank;
        const float * av = r.a_v + static_cast<int64_t>(j) * r.rank;
        for (int c = 0; c < r.rank; ++c) {
            const float * bk = r.b_k + static_cast<int64_t>(c) * kd;
            const float * bv = r.b_v + static_cast<int64_t>(c) * kd;
            for (int64_t d = 0; d < kd; ++d) {
                k[d] += ak[c] * bk[d];
                v[d] += av[c] * bv[d];
            }
        }
    }

    // ---- vision-tower ops: rows shared out over the pool (each row's bits do not depend on the split, except
    // activate's, whose AVX2 loop runs 8 values at a time over a thread's rows and leaves a tail of fewer than 8
    // to the portable code: rows of a multiple of 8 values, as every tower's, give the same bits at any count).
    template <typename F>
    void rows_on_pool(int64_t n_rows, const F & f) {
        pool_.run([&](int ith, int nth) {
            long long b, e;
            cpu::split_range(n_rows, ith, nth, b, e);
            if (b < e) {
                f(static_cast<int64_t>(b), static_cast<int64_t>(e));
            }
        });
    }

    void layer_norm(const float * x, const float * w, const float * b, float * y, int64_t n_rows, int64_t n,
                    float eps) override {
        rows_on_pool(n_rows, [&](int64_t r0, int64_t r1) {
            for (int64_t t = r0; t < r1; ++t) {
                cpu::layer_norm(x + t * n, w, b, y + t * n, n, eps);
            }
        });
    }

    void activate(Activation act, float * x, const float * mul, int64_t n_rows, int64_t n) override {
        rows_on_pool(n_rows, [&](int64_t r0, int64_t r1) {
            cpu::activate(act, x + r0 * n, (r1 - r0) * n);
            if (mul != nullptr) {
                for (int64_t i = r0 * n; i < r1 * n; ++i) {
                    x[i] *= mul[i];
                }
            }
        });
    }

    void segment_attention(const float * q, const float * k, const float * v, float * out, int64_t n_rows, int64_t E,
                           int64_t H, const int64_t * host_seg, int n_seg) override {
        check_segments(host_seg, n_seg, n_rows, E, H);
        cpu::segment_attention(q, k, v, out, E, H, host_seg, n_seg, scratch_, pool_);
    }

    void rotate_half_rows(float * x, const float * cos_t, const float * sin_t, int64_t n_rows, int64_t H,
                          int64_t hd) override {
        rows_on_pool(n_rows, [&](int64_t r0, int64_t r1) { cpu::rotate_half_rows(x, cos_t, sin_t, r0, r1, H, hd); });
    }

    void avg_pool_rms_norm(const float * x, const float * w, float * y, int64_t n_img, int64_t G, int64_t k, int64_t E,
                           float eps) override {
        const int64_t per_image = (G / k) * (G / k);
        rows_on_pool(n_img * per_image, [&](int64_t r0, int64_t r1) {
            for (int64_t t = r0; t < r1; ++t) {
                cpu::avg_pool_rms_row(x + (t / per_image) * G * G * E, w, y + t * E, t % per_image, G, k, E, eps);
            }
        });
    }

    static uint8_t * row(const KvStore & store, int layer, int32_t block, int32_t r) {
        return (*store.blocks)[static_cast<size_t>(block)] + layer * store.layer_stride +
               static_cast<int64_t>(r) * store.row_bytes;
    }

    static cpu::KvRun kernel_run(const KvStore & store, int layer, const RunTable & table, const KvRunRef & r) {
        const uint8_t * k = row(store, layer, r.block, r.row0);
        cpu::KvRun      run{ k, k + store.v_offset, r.n, r.shift };
        if (r.corr >= 0) {
            const Factors * f   = table.corrs[static_cast<size_t>(r.corr)];
            const int64_t   off = static_cast<int64_t>(r.corr_row0) * f->rank;
            run.rank            = f->rank;
            run.a_k             = f->a_k + off;
            run.a_v             = f->a_v + off;
            run.b_k             = f->b_k;
            run.b_v             = f->b_v;
        }
        return run;
    }

    cpu::ThreadPool                      pool_;
    cpu::Activations                     act_ = cpu::Activations::F32;  // exact until told (Model sets Q8)
    std::vector<std::vector<cpu::KvRun>> runs_;
    std::vector<float>                   scratch_;
    std::vector<float>                   copy_;  // corrected rows of the call's busy runs (copy_busy_corrections)
    std::vector<float>                   b_t_;   // a correction's Bᵀ, the copy's GEMM weight
    std::vector<int64_t>                 table_queries_;  // per run table, the call's queries (copy_busy_corrections)
    cpu::LoraScratch                     lora_;           // lora_add's plan and A products, kept between calls
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int n_threads) {
    return std::make_unique<CpuBackend>(n_threads);
}

}  // namespace kvcmas::backend
