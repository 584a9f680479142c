#include "backend/cpu/moe-experts.h"

#include <algorithm>
#include <atomic>
#include <vector>

#include "common/error.h"

namespace kvcmas::cpu {

void matmul_experts(const WeightView * w, int n_mats, int n_groups, const int64_t * first, const float * x,
                    float * const * y, ThreadPool & pool, Activations act) {
    KC_CHECK(n_mats >= 1 && n_mats <= kMaxMatmulMulti, "matmul_experts: %d matrices per expert, at most %d", n_mats,
             kMaxMatmulMulti);
    KC_CHECK(n_groups >= 0 && first[0] == 0, "matmul_experts: %d groups, first row %lld (must be 0)", n_groups,
             static_cast<long long>(n_groups > 0 ? first[0] : 0));
    std::vector<int> busy;  // the groups with rows, largest first
    for (int g = 0; g < n_groups; ++g) {
        KC_CHECK(first[g + 1] >= first[g], "matmul_experts: group %d has %lld rows", g,
                 static_cast<long long>(first[g + 1] - first[g]));
        for (int i = 0; i < n_mats; ++i) {
            KC_CHECK(w[g * n_mats + i].n_out == w[i].n_out && w[g * n_mats + i].n_in == w[0].n_in,
                     "matmul_experts: expert %d matrix %d has shape [%lld, %lld], expert 0 [%lld, %lld]", g, i,
                     static_cast<long long>(w[g * n_mats + i].n_in), static_cast<long long>(w[g * n_mats + i].n_out),
                     static_cast<long long>(w[0].n_in), static_cast<long long>(w[i].n_out));
        }
        if (first[g + 1] > first[g]) {
            busy.push_back(g);
        }
    }
    std::stable_sort(busy.begin(), busy.end(),
                     [&](int a, int b) { return first[a + 1] - first[a] > first[b + 1] - first[b]; });
    const auto group = [&](int g, ThreadPool & on) {
        float * yg[kMaxMatmulMulti];
        for (int i = 0; i < n_mats; ++i) {
            yg[i] = y[i] + first[g] * w[i].n_out;
        }
        matmul_multi(&w[g * n_mats], yg, n_mats, x + first[g] * w[0].n_in, first[g + 1] - first[g], on, act);
    };
    const int nth = pool.size();
    if (nth == 1 || static_cast<int>(busy.size()) < 2 * nth) {
        for (const int g : busy) {
            group(g, pool);
        }
        return;
    }
    std::atomic<size_t> next{ 0 };
    pool.run([&](int, int) {
        ThreadPool solo(1);  // no worker threads: the calling thread computes the group alone
        for (size_t j = next.fetch_add(1, std::memory_order_relaxed); j < busy.size();
             j        = next.fetch_add(1, std::memory_order_relaxed)) {
            group(busy[j], solo);
        }
    });
}

}  // namespace kvcmas::cpu
