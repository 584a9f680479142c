#include "backend/cpu/lora.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/backend.h"
#include "backend/cpu/cpu-features.h"
#include "backend/cpu/matmul.h"
#include "backend/cpu/quants.h"
#include "backend/cpu/threadpool.h"
#include "common/error.h"

namespace kvcmas::cpu {

#ifdef KC_X86
float lora_dot_avx2(const void * a_row, backend::LoraFactorType type, const float * x, int64_t n);
void  lora_up_avx2(const float * t, int rank, const void * b_t, backend::LoraFactorType type, int64_t o0, int64_t o1,
                   float s, float * y);
#endif

namespace {

// Outputs per B work item: a few cache lines of each of the rank rows of b_t.
constexpr int64_t kUpBlock = 64;
// Fewer multiply-adds than this in a lora_add call run on the calling thread (a pool round costs more than a few
// MB of factors take one thread to stream on a busy machine); decode steps do not come here, their products run in
// the base matmul's job (matmul_multi_lora).
constexpr int64_t kParallelMacs = 1 << 20;

using backend::LoraFactorType;

float factor_at(const void * p, LoraFactorType type, int64_t i) {
    switch (type) {
        case LoraFactorType::F16:
            return fp16_to_fp32(static_cast<const uint16_t *>(p)[i]);
        case LoraFactorType::I8:
            return static_cast<float>(static_cast<const int8_t *>(p)[i]);
        default:
            return static_cast<const float *>(p)[i];
    }
}

size_t factor_bytes(LoraFactorType type) {
    return type == LoraFactorType::F32 ? sizeof(float) : type == LoraFactorType::F16 ? sizeof(uint16_t) : 1;
}

// Work items [b, e) of a list whose running costs are `cost` (cost[j] = the items before j), for thread ith of nth.
void share(const std::vector<int64_t> & cost, int ith, int nth, size_t & b, size_t & e) {
    const int64_t total = cost.back();
    const auto    at    = [&](int k) {
        return static_cast<size_t>(
            std::lower_bound(cost.begin(), cost.end() - 1, total / nth * k + std::min<int64_t>(k, total % nth)) -
            cost.begin());
    };
    b = at(ith);
    e = ith + 1 == nth ? cost.size() - 1 : at(ith + 1);
}

}  // namespace

void encode_lora_rows(const float * rows, int64_t n_rows, int64_t width, LoraFactorType type,
                      std::vector<uint8_t> & bytes, std::vector<float> & scales) {
    const size_t n = static_cast<size_t>(n_rows * width);
    bytes.resize(n * factor_bytes(type));
    scales.clear();
    if (type == LoraFactorType::F32) {
        std::memcpy(bytes.data(), rows, n * sizeof(float));
    } else if (type == LoraFactorType::F16) {
        uint16_t * h = reinterpret_cast<uint16_t *>(bytes.data());
        for (size_t i = 0; i < n; ++i) {
            h[i] = fp32_to_fp16(rows[i]);
        }
    } else {
        int8_t * q = reinterpret_cast<int8_t *>(bytes.data());
        for (int64_t r = 0; r < n_rows; ++r) {
            const float * v    = rows + r * width;
            float         amax = 0.0f;
            for (int64_t i = 0; i < width; ++i) {
                amax = std::max(amax, std::fabs(v[i]));
            }
            const float d   = amax / 127.0f;
            const float inv = d > 0.0f ? 1.0f / d : 0.0f;
            for (int64_t i = 0; i < width; ++i) {
                q[r * width + i] = static_cast<int8_t>(std::lrintf(std::clamp(v[i] * inv, -127.0f, 127.0f)));
            }
            scales.push_back(d);
        }
    }
}

float lora_dot(const void * a_row, backend::LoraFactorType type, const float * x, int64_t n) {
#ifdef KC_X86
    if (cpu_features().avx2_fma_f16c) {
        return lora_dot_avx2(a_row, type, x, n);
    }
#endif
    float acc[8] = {};
    for (int64_t i = 0; i < n; ++i) {
        acc[i % 8] = std::fma(factor_at(a_row, type, i), x[i], acc[i % 8]);
    }
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

void lora_up(const float * t, int rank, const void * b_t, backend::LoraFactorType type, int64_t o0, int64_t o1, float s,
             float * y) {
#ifdef KC_X86
    if (cpu_features().avx2_fma_f16c) {
        lora_up_avx2(t, rank, b_t, type, o0, o1, s, y);
        return;
    }
#endif
    for (int64_t o = o0; o < o1; ++o) {
        float u = 0.0f;
        for (int c = 0; c < rank; ++c) {
            u = std::fma(t[c], factor_at(b_t, type, backend::lora_b_index(c, o, rank)), u);
        }
        y[o] = std::fma(s, u, y[o]);
    }
}

namespace {

// Plans a call's work items into sc (allocating only to grow) and returns whether there is any.
bool plan(int64_t n_in, const backend::LoraProduct * products, int n_products, LoraScratch & sc) {
    size_t n_t = 0;
    for (int p = 0; p < n_products; ++p) {
        for (int g = 0; g < products[p].n_groups; ++g) {
            n_t += static_cast<size_t>(products[p].groups[g].n_rows * products[p].groups[g].rank);
        }
    }
    if (n_t == 0) {
        return false;
    }
    if (sc.t.size() < n_t) {
        sc.t.resize(n_t);
    }
    sc.down.clear();
    sc.up.clear();
    sc.whole.clear();
    sc.product_wholes.assign(1, 0);
    sc.down_cost.assign(1, 0);
    sc.up_cost.assign(1, 0);
    sc.whole_cost.assign(1, 0);
    float * t = sc.t.data();
    for (int p = 0; p < n_products; ++p) {
        const backend::LoraProduct & pr = products[p];
        for (int gi = 0; gi < pr.n_groups; ++gi) {
            const backend::LoraGroup & g = pr.groups[gi];
            if (g.n_rows == 0 || g.rank == 0) {
                continue;
            }
            sc.whole.push_back(LoraScratch::Whole{ sc.down.size(), 0, sc.up.size(), 0, &g, t });
            for (int c = 0; c < g.rank; ++c) {
                sc.down.push_back(LoraScratch::Down{ &g, c, t });
                sc.down_cost.push_back(sc.down_cost.back() + g.n_rows * n_in);
            }
            for (int64_t o0 = 0; o0 < pr.n_out; o0 += kUpBlock) {
                const int64_t o1 = std::min(pr.n_out, o0 + kUpBlock);
                sc.up.push_back(LoraScratch::Up{ &g, t, pr.y, pr.n_out, o0, o1 });
                sc.up_cost.push_back(sc.up_cost.back() + g.n_rows * (o1 - o0) * g.rank);
            }
            t += g.n_rows * g.rank;
            sc.whole.back().d1 = sc.down.size();
            sc.whole.back().u1 = sc.up.size();
            sc.whole_cost.push_back(sc.whole_cost.back() + (sc.down_cost.back() - sc.down_cost[sc.whole.back().d0]) +
                                    (sc.up_cost.back() - sc.up_cost[sc.whole.back().u0]));
        }
        sc.product_wholes.push_back(sc.whole.size());
    }
    return true;
}

// The A products of items [b, e) of sc.down: t = A x for each rank row, of each of the group's rows.
void run_down(const float * x, int64_t n_in, const LoraScratch & sc, size_t b, size_t e) {
    for (size_t j = b; j < e; ++j) {
        const LoraScratch::Down &  d = sc.down[j];
        const backend::LoraGroup & g = *d.g;
        const void * a = static_cast<const char *>(g.a) + factor_bytes(g.type) * static_cast<size_t>(d.c * n_in);
        // I8: both rows' scales go into t, so the B products read the stored values as they are.
        const float scale = g.type == LoraFactorType::I8 ? g.a_scale[d.c] * g.b_scale[d.c] : 1.0f;
        for (int64_t i = 0; i < g.n_rows; ++i) {
            d.t[i * g.rank + d.c] = scale * lora_dot(a, g.type, x + static_cast<int64_t>(g.host_rows[i]) * n_in, n_in);
        }
    }
}

// y[rows of g] [o0, o1) += s · B t (t the group's A products, y [n][n_out]).
void run_up(const backend::LoraGroup & g, const float * t, float * y, int64_t n_out, int64_t o0, int64_t o1) {
    for (int64_t i = 0; i < g.n_rows; ++i) {
        lora_up(t + i * g.rank, g.rank, g.b_t, g.type, o0, o1, g.host_scales[i] * g.factor,
                y + static_cast<int64_t>(g.host_rows[i]) * n_out);
    }
}

}  // namespace

void lora_add(const float * x, int64_t n_in, const backend::LoraProduct * products, int n_products, ThreadPool & pool,
              LoraScratch & sc) {
    if (!plan(n_in, products, n_products, sc)) {
        return;
    }
    const auto down = [&](size_t b, size_t e) { run_down(x, n_in, sc, b, e); };
    const auto up   = [&](size_t b, size_t e) {
        for (size_t j = b; j < e; ++j) {
            const LoraScratch::Up & u = sc.up[j];
            run_up(*u.g, u.t, u.y, u.n_out, u.o0, u.o1);
        }
    };
    if (pool.size() == 1 || sc.down_cost.back() + sc.up_cost.back() < kParallelMacs) {
        down(0, sc.down.size());
        up(0, sc.up.size());
        return;
    }
    // Whole groups per thread where they split evenly enough (a batch of several adapters, Q vs K and V, gate vs
    // up): one pool round.
    const int nth  = pool.size();
    int64_t   most = 0;
    for (int k = 0; k < nth; ++k) {
        size_t b, e;
        share(sc.whole_cost, k, nth, b, e);
        most = std::max(most, sc.whole_cost[e] - sc.whole_cost[b]);
    }
    if (most * 3 <= sc.whole_cost.back() * 4 / nth) {
        pool.run([&](int ith, int nth_) {
            size_t b, e;
            share(sc.whole_cost, ith, nth_, b, e);
            for (size_t j = b; j < e; ++j) {
                down(sc.whole[j].d0, sc.whole[j].d1);
                up(sc.whole[j].u0, sc.whole[j].u1);
            }
        });
        return;
    }
    // Otherwise two pool rounds, not one with a barrier: the pool runs a descheduled worker's part on the caller, which
    // a barrier inside a part would make wait for that worker instead.
    pool.run([&](int ith, int nth) {
        size_t b, e;
        share(sc.down_cost, ith, nth, b, e);
        down(b, e);
    });
    pool.run([&](int ith, int nth) {
        size_t b, e;
        share(sc.up_cost, ith, nth, b, e);
        up(b, e);
    });
}

void matmul_multi_lora(const WeightView * w, float * const * y, int n_mats, const float * x, int64_t n_tok,
                       const backend::LoraProduct * products, int n_products, ThreadPool & pool, Activations act,
                       LoraScratch & sc) {
    const int64_t n_in = w[0].n_in;
    if (!plan(n_in, products, n_products, sc)) {
        matmul_multi(w, y, n_mats, x, n_tok, pool, act);
        return;
    }
    KC_CHECK(n_mats >= 1 && n_mats <= kMaxMatmulMulti, "matmul_multi_lora: %d matrices", n_mats);
    int product_of[kMaxMatmulMulti];  // the product that updates y[m], or -1
    int matched = 0;
    for (int m = 0; m < n_mats; ++m) {
        product_of[m] = -1;
        for (int p = 0; p < n_products; ++p) {
            product_of[m] = products[p].y == y[m] ? p : product_of[m];
        }
        matched += product_of[m] >= 0 ? 1 : 0;
    }
    KC_CHECK(matched == n_products, "matmul_multi_lora: %d of %d products update none of the %d outputs",
             n_products - matched, n_products, n_mats);
    DecodeHook hook;
    hook.n_pre = static_cast<int64_t>(sc.whole.size());
    hook.pre   = [&](int64_t j) {
        run_down(x, n_in, sc, sc.whole[static_cast<size_t>(j)].d0, sc.whole[static_cast<size_t>(j)].d1);
    };
    hook.post = [&](int m, int64_t r0, int64_t r1) {
        const int p = product_of[m];
        if (p < 0) {
            return;
        }
        for (size_t j = sc.product_wholes[static_cast<size_t>(p)]; j < sc.product_wholes[static_cast<size_t>(p) + 1];
             ++j) {
            run_up(*sc.whole[j].g, sc.whole[j].t, y[m], products[p].n_out, r0, r1);
        }
    };
    if (!matmul_multi_hooked(w, y, n_mats, x, n_tok, pool, act, hook)) {
        lora_add(x, n_in, products, n_products, pool, sc);
    }
}

}  // namespace kvcmas::cpu
