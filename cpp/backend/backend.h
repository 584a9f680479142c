// The seam between the engine and the hardware: a Backend owns device memory (weights, KV blocks, correction
// factors, activations) and runs the ops of a forward pass and of the sharing layer on it. The engine
// (engine/model.cpp, engine/arch/*) builds a forward pass from these ops only; it never touches device memory
// except through upload()/download(). Implementations: backend/cpu (always built), backend/cuda (KVCMAS_CUDA=ON).
//
// Addresses: every `float *` / `void *` an op takes is a backend address (host memory for the CPU backend, device
// memory for CUDA) unless the parameter says "host". Shapes are row-major; "[n][d]" is n rows of d floats.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/activation.h"
#include "backend/cpu/attention.h"  // KvType, AttentionShape, kMaxCorrectionRank (plain descriptions)
#include "backend/cpu/matmul.h"     // Activations
#include "backend/cpu/ops.h"        // Rope: the rotation's parameters and its host reference math
#include "common/ggml-types.h"

namespace kvcmas::backend {

using KvType         = cpu::KvType;
using AttentionShape = cpu::AttentionShape;
using Rope           = cpu::Rope;

// A weight matrix in backend memory: n_out rows of n_in elements of `type` (GGUF's [n_in, n_out]), rows row_bytes
// apart, in the stored (possibly quantized) format.
struct Weight {
    GgmlType     type      = GgmlType::F32;
    const void * data      = nullptr;
    int64_t      n_in      = 0;
    int64_t      n_out     = 0;
    size_t       row_bytes = 0;
};

// How a KV block pool lays out rows: block b holds, per layer, K rows then V rows of n_kv_dim elements of kv_type
// ([n_layer][2][block_rows][n_kv_dim]). blocks[b] is block b's backend address.
struct KvStore {
    const std::vector<uint8_t *> * blocks       = nullptr;
    int64_t                        layer_stride = 0;  // bytes between layers inside a block
    int64_t                        v_offset     = 0;  // bytes from a K row to its V row
    int64_t                        row_bytes    = 0;
    int64_t                        n_kv_dim     = 0;
    KvType                         kv_type      = KvType::F32;
};

// Where a new KV row goes: row `row` of block `block`.
struct KvSlotRef {
    int32_t block;
    int32_t row;
};

// One run of a run table: `n` consecutive rows of one block, as indices (paged attention's block table), so a
// table means the same on any device. Keys were rotated at (their sequence position - shift). corr >= 0 names a
// correction of the table (its factor row corr_row0 belongs to the run's first row).
struct KvRunRef {
    int32_t block;
    int32_t row0;
    int32_t n;
    int32_t shift;
    int32_t corr      = -1;
    int32_t corr_row0 = 0;
};

// One layer of a low-rank correction in backend memory: K + A_k·B_k, V + A_v·B_v with A [n_rows][rank] and
// B [rank][n_kv_dim]. Made by Backend::upload_factors; freed with the last reference (also after its backend).
// host_b_k / host_b_v are the host arrays it was made from (host code such as the ridge map's setup reads B).
class Factors {
  public:
    virtual ~Factors()     = default;
    int           rank     = 0;
    int32_t       n_rows   = 0;
    const float * a_k      = nullptr;  // backend addresses
    const float * b_k      = nullptr;
    const float * a_v      = nullptr;
    const float * b_v      = nullptr;
    const float * host_b_k = nullptr;  // host
    const float * host_b_v = nullptr;
};

// The runs a sequence reads in one layer, in position order, and the corrections they name.
struct RunTable {
    std::vector<KvRunRef>        runs;
    std::vector<const Factors *> corrs;
    void                         clear() {
        runs.clear();
        corrs.clear();
    }
};

// nq consecutive query tokens of one sequence (rows [first, first + nq) of q and out): query i sees the first
// max(n_visible0 + i, n_visible_min) rows of run table `table`. n_visible_min > 0 opens the causal mask within a
// bidirectional span (Gemma 3's image tokens see the whole image); a sliding window still ends at the query's own
// position, so it starts at n_visible0 + i - window.
struct QueryBlock {
    int64_t first;
    int     nq;
    int64_t n_visible0;
    int     table;
    int64_t n_visible_min = 0;
};

// Rows [j0, j1) of one run's K (values = false) or V side through a ridge map prepared for that run (see
// engine/ridge-correction.cpp): out[i][c] = ((x_i - mu)·proj)[c] + Σ_q a[i][q]·m[q][c] for c < rank, and
// out[i][rank] = 1, where x_i is stored row j0 + i as f32 and a the run's correction factors (a_k or a_v side).
struct RidgeJob {
    KvRunRef        run;
    const Factors * f      = nullptr;  // the run's correction, or null
    bool            values = false;
    int32_t         j0 = 0, j1 = 0;
    const float *   mu         = nullptr;  // host [kd]
    const float *   proj       = nullptr;  // host [kd][rank]
    const float *   m          = nullptr;  // host [b_rank][rank]
    int             b_rank     = 0;
    float *         out        = nullptr;  // host, rows out_stride apart
    int64_t         out_stride = 0;
};

// How a LoRA factor's rows are stored: f32, f16, or i8, int8 values with one f32 scale per row (value = scale · q).
enum class LoraFactorType : uint8_t { F32, F16, I8 };

// One adapter's low-rank update of a matmul (LoRA) and the rows of the batch it applies to: A [rank][n_in] and
// B transposed, b_t [rank][n_out] stored in tiles of outputs (lora_b_index: a run of outputs is one run of bytes),
// both of `type` in backend memory, with for I8 their row scales a_scale, b_scale [rank] (backend memory); host_rows
// [n_rows] distinct rows of the batch, host_scales [n_rows] each row's scale (the sequence's adapter scale), `factor`
// the adapter's alpha / rank: row r gets y[r] += (host_scales[i] · factor) · B (A x[r]).
struct LoraGroup {
    const void *    a           = nullptr;
    const void *    b_t         = nullptr;
    LoraFactorType  type        = LoraFactorType::F32;
    const float *   a_scale     = nullptr;
    const float *   b_scale     = nullptr;
    int             rank        = 0;
    float           factor      = 1.0f;
    const int32_t * host_rows   = nullptr;
    const float *   host_scales = nullptr;
    int64_t         n_rows      = 0;
};

// One adapted matmul of a lora_add call: its output y [n][n_out] and the adapters' groups that update it.
struct LoraProduct {
    float *           y        = nullptr;
    int64_t           n_out    = 0;
    const LoraGroup * groups   = nullptr;
    int               n_groups = 0;
};

class Backend {
  public:
    virtual ~Backend()                    = default;
    virtual std::string name() const      = 0;  // "cpu" | "cuda"
    virtual std::string device() const    = 0;  // human-readable device description
    virtual int         n_threads() const = 0;  // host threads it computes with (CPU), 1 for a device backend

    // ---- memory. alloc throws kvcmas::Error when the device is out of memory (nothing else is then held).
    virtual void * alloc(size_t bytes)          = 0;
    virtual void   free(void * p, size_t bytes) = 0;
    virtual size_t free_bytes() const = 0;  // device memory free now (0 for the CPU: host memory is not counted)
    virtual void   upload(void * dst, const void * host_src, size_t bytes)   = 0;
    virtual void   download(void * host_dst, const void * src, size_t bytes) = 0;
    // A weight of the file (host memory, stays mapped while the model lives) in backend memory; the CPU backend
    // reads the mapped file in place.
    virtual Weight upload_weight(GgmlType type, const void * host_data, int64_t n_in, int64_t n_out,
                                 size_t row_bytes) = 0;
    // Gives a weight's memory back before the backend goes (the backend frees all weights left when it goes).
    virtual void free_weight(const Weight & w) = 0;
    // A correction layer's factors in backend memory. The host arrays must outlive the result (the CPU backend
    // reads them in place).
    virtual std::shared_ptr<const Factors> upload_factors(int rank, int32_t n_rows, int64_t kd, const float * a_k,
                                                          const float * b_k, const float * a_v, const float * b_v) = 0;
    // Memory of one KV block (bytes), zero-filled or not; null never (throws).
    virtual uint8_t * kv_block_alloc(size_t bytes)             = 0;
    virtual void      kv_block_free(uint8_t * p, size_t bytes) = 0;

    // ---- forward-pass ops.
    // x [n][table.n_in] = rows tokens[i] of the table for tokens[i] >= 0 (host ids); rows with -1 are left alone.
    virtual void embed_rows(const Weight & table, const int32_t * tokens, int64_t n, float * x) = 0;
    // y[i] = rms_norm(x[i]) * w for n_rows rows of width n.
    virtual void rms_norm(const float * x, const float * w, float * y, int64_t n_rows, int64_t n, float eps) = 0;
    // y [n_tok][w.n_out] = x [n_tok][w.n_in] · wᵀ, any weight type.
    virtual void matmul(const Weight & w, const float * x, float * y, int64_t n_tok) = 0;
    // What matmul's decode path over quantized weights multiplies with from now on (cpu::Activations, default F32;
    // Model sets it, Q8 by default: docs/quant-kernels.md). A backend without an 8-bit path keeps f32, reports F32.
    virtual void             set_activations(cpu::Activations act) { (void)act; }
    virtual cpu::Activations activations() const { return cpu::Activations::F32; }
    // n_mats products of the same x (Q/K/V, gate/up); each y[i] equals matmul(w[i], x, y[i], n_tok).
    virtual void matmul_multi(const Weight * w, float * const * y, int n_mats, const float * x, int64_t n_tok) = 0;
    // y [n_rows][n] += b [n] (a bias row).
    virtual void add_bias(float * y, const float * b, int64_t n_rows, int64_t n) = 0;
    // Per token i: q_i rotated with (cos_q, sin_q)[i], k_i with (cos_k, sin_k)[i] (tables [n][n_rot/2]), then k_i
    // and v_i stored (in the store's type) at slots[i] (host) of layer `layer`. q [n][n_head·hd], k, v [n][kd].
    virtual void rope_kv_write(const Rope & rope, const AttentionShape & shape, float * q, float * k, const float * v,
                               int64_t n, const float * cos_q, const float * sin_q, const float * cos_k,
                               const float * sin_k, const KvStore & store, int layer, const KvSlotRef * slots) = 0;
    // out = attention of the query blocks (host) over their run tables (host) in layer `layer`: per run a RoPE
    // shift applied to the query, the run's correction fused (scores += (q·B_k)·a_k, out += (Σp·a_v)·B_v) or, where
    // many of the call's queries read the run, added once into a transient copy (the same to f32 rounding);
    // shape.window > 0: each query attends to its last `window` visible rows only (sliding-window layers).
    // q, out [n][n_head·head_dim].
    virtual void attention(const AttentionShape & shape, const Rope & rope, const KvStore & store, int layer,
                           const float * q, float * out, int64_t n, const QueryBlock * blocks, int n_blocks,
                           const RunTable * tables, int64_t max_visible) = 0;
    // g [n_rows][n] = silu(g) * u.
    virtual void swiglu(float * g, const float * u, int64_t n_rows, int64_t n) = 0;
    // g [n_rows][n] = gelu_tanh(g) * u, gelu_tanh(x) = x/2 · (1 + tanh(sqrt(2/pi) · (x + 0.044715 x³))) (GeGLU).
    virtual void geglu_tanh(float * g, const float * u, int64_t n_rows, int64_t n) = 0;
    // g [n_rows][n] = min(g, limit) · sigmoid(alpha · min(g, limit)) · (clamp(u, -limit, limit) + 1): gpt-oss's
    // clamped SwiGLU (backend/cpu/swiglu-oai.h).
    virtual void swiglu_oai(float * g, const float * u, int64_t n_rows, int64_t n, float alpha, float limit) = 0;
    // x [n] *= s.
    virtual void scale(float * x, float s, int64_t n) = 0;
    // x [n] += y [n].
    virtual void add(float * x, const float * y, int64_t n) = 0;

    // ---- adapters. For each product (matmuls of the same input x [n][n_in], as Q/K/V or gate/up) and each row r
    // of each of its groups: y[r] += s · B (A x[r]) (y [n][n_out] the product's output). The gathered low-rank
    // products of several adapters beside the base matmuls, in one pass over x. A row's result does not depend on
    // the other rows, groups or products of the call, nor on the thread count (a batch mixing adapters gives each
    // row what it gets alone).
    virtual void lora_add(const float * x, int64_t n_in, const LoraProduct * products, int n_products) = 0;
    // matmul_multi(w, y, n_mats, x, n_tok), then lora_add(x, w[0].n_in, products, n_products), each product's y one
    // of y[i]: one call, so that a backend can run both in one pass (the CPU backend's decode path does, with the
    // same bits).
    virtual void matmul_multi_lora(const Weight * w, float * const * y, int n_mats, const float * x, int64_t n_tok,
                                   const LoraProduct * products, int n_products) {
        matmul_multi(w, y, n_mats, x, n_tok);
        lora_add(x, w[0].n_in, products, n_products);
    }

    // ---- mixture of experts.
    // Grouped expert products: for each expert g in [0, n_groups), rows [host_first[g], host_first[g+1]) of x
    // [host_first[n_groups]][n_in] (its gathered rows, expert after expert) times each of its n_mats (<= 7) weights
    // w[g·n_mats + i] into the same rows of y[i]; each expert's rows get exactly what matmul_multi over them alone
    // gives. An expert without rows is skipped (its weights are not read).
    virtual void matmul_experts(const Weight * w, int n_mats, int n_groups, const int64_t * host_first, const float * x,
                                float * const * y) = 0;
    // Per row i of logits [n][n_expert]: softmax over the experts, its k most probable (ties: lower index first)
    // into host_ids [n][k] (most probable first) and their probabilities into host_weights [n][k], divided by
    // their sum when norm.
    virtual void moe_route(const float * logits, int64_t n, int n_expert, int k, bool norm, int32_t * host_ids,
                           float * host_weights) = 0;
    // dst [n][width] = rows host_rows[i] of src.
    virtual void gather_rows(const float * src, const int32_t * host_rows, int64_t n, int64_t width, float * dst) = 0;
    // dst[host_rows[i]] += host_scales[i] · src[i] for the n rows of src [n][width], in order.
    virtual void add_scaled_rows(float * dst, const float * src, const int32_t * host_rows, const float * host_scales,
                                 int64_t n, int64_t width) = 0;

    // ---- sharing ops (corrections, copies, read-back).
    // Rows [j0, j1) of run r of `table` in layer `layer` as attention reads them (stored rows in f32, correction
    // added, keys rotated by the run's shift), into host k_out / v_out rows (stride kd floats).
    virtual void kv_read(const Rope & rope, const AttentionShape & shape, const KvStore & store, int layer,
                         const RunTable & table, int r, int32_t j0, int32_t j1, float * k_out, float * v_out) = 0;
    // Copies the rows of runs [r0, r1) of `table` (correction added; row i's key rotated by shifts[i] (host)
    // positions) to slots[i] (host) of the same layer, rounding once to the store's type.
    virtual void kv_copy(const Rope & rope, const AttentionShape & shape, const KvStore & store, int layer,
                         const RunTable & table, int r0, int r1, const int64_t * shifts, const KvSlotRef * slots) = 0;
    // Ridge map products (see RidgeJob), the jobs independent of each other.
    virtual void ridge_rows(const KvStore & store, int layer, const RidgeJob * jobs, int n_jobs, int rank) = 0;

    // ---- vision-tower ops (vision/: CLIP / SigLIP / Qwen2.5-VL ViTs and their projectors).
    // y[i] = (x[i] - mean) / sqrt(var + eps) * w + b for n_rows rows of width n (biased variance, as torch's
    // LayerNorm); w, b [n]. y may alias x.
    virtual void layer_norm(const float * x, const float * w, const float * b, float * y, int64_t n_rows, int64_t n,
                            float eps) = 0;
    // x [n_rows][n] = act(x) in place, then times mul [n_rows][n] element-wise when mul is not null (a gated MLP:
    // silu(gate) · up).
    virtual void activate(Activation act, float * x, const float * mul, int64_t n_rows, int64_t n) = 0;
    // Bidirectional multi-head attention within segments of rows: for each segment [host_seg[s], host_seg[s + 1])
    // (s < n_seg, host_seg ascending from 0 to n_rows) and head h (columns [h·hd, (h + 1)·hd), hd = E / H):
    // out[t] = softmax(q[t]·Kᵀ / sqrt(hd)) · V over the segment's rows. q, k, v, out [n_rows][E]. A segment is an
    // image (a batch of tiles), one of Qwen2.5-VL's windows, or a whole image of up to 16,384 rows.
    virtual void segment_attention(const float * q, const float * k, const float * v, float * out, int64_t n_rows,
                                   int64_t E, int64_t H, const int64_t * host_seg, int n_seg) = 0;
    // x [n_rows][H·hd] in place: pair (i, i + hd/2) of each head of row t rotated by angle (cos_t, sin_t)[t][i]
    // (tables [n_rows][hd/2]): the rotate-half RoPE with per-row angles (Qwen2.5-VL's 2D rotary of the patches).
    virtual void rotate_half_rows(float * x, const float * cos_t, const float * sin_t, int64_t n_rows, int64_t H,
                                  int64_t hd) = 0;
    // Gemma 3's soft tokens: for each of n_img images of G x G rows x [n_img·G·G][E] (row-major grid), the k x k
    // average pooling (G % k == 0) to (G / k)² rows, each RMS-normalised with w [E]:
    // y [n_img·(G / k)²][E], image after image.
    virtual void avg_pool_rms_norm(const float * x, const float * w, float * y, int64_t n_img, int64_t G, int64_t k,
                                   int64_t E, float eps) = 0;
};

// A buffer of backend memory, freed when it goes.
class Buffer {
  public:
    Buffer() = default;
    Buffer(Backend & b, size_t bytes) : b_(&b), p_(bytes ? b.alloc(bytes) : nullptr), bytes_(bytes) {}
    ~Buffer() { reset(); }
    Buffer(const Buffer &)             = delete;
    Buffer & operator=(const Buffer &) = delete;
    Buffer(Buffer && o) noexcept : b_(o.b_), p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr; }
    Buffer & operator=(Buffer && o) noexcept {
        if (this != &o) {
            reset();
            b_     = o.b_;
            p_     = o.p_;
            bytes_ = o.bytes_;
            o.p_   = nullptr;
        }
        return *this;
    }
    void reset() {
        if (p_ != nullptr) {
            b_->free(p_, bytes_);
            p_ = nullptr;
        }
    }
    float * f32() const { return static_cast<float *>(p_); }
    void *  data() const { return p_; }
    size_t  bytes() const { return bytes_; }

  private:
    Backend * b_     = nullptr;
    void *    p_     = nullptr;
    size_t    bytes_ = 0;
};

// A host vector copied into a new buffer.
Buffer upload_floats(Backend & b, const std::vector<float> & host);
// A LoRA factor's rows [n_rows][width] (host f32) in new buffers as `type` stores them: data, and for I8 the row
// scales [n_rows] (scales left empty otherwise).
void upload_lora_factor(Backend & b, const float * rows, int64_t n_rows, int64_t width, LoraFactorType type,
                        Buffer & data, Buffer & scales);

// Where B's element (rank row c, output o) lies in a LoRA group's b_t: outputs in tiles of kLoraTile, each tile
// [rank][kLoraTile] (outputs past n_out zero), so that the outputs of a block of rows are read in one sequential run
// (upload_lora_b writes this layout).
constexpr int64_t kLoraTile = 8;
constexpr int64_t lora_b_index(int64_t c, int64_t o, int rank) {
    return (o / kLoraTile) * rank * kLoraTile + c * kLoraTile + o % kLoraTile;
}
// B transposed, b_t [rank][n_out] (host f32), in new buffers as `type` stores it, laid out by lora_b_index: data, and
// for I8 the scales [rank] of its rank rows.
void upload_lora_b(Backend & b, const float * b_t, int rank, int64_t n_out, LoraFactorType type, Buffer & data,
                   Buffer & scales);

// Throws kvcmas::Error unless host_seg [n_seg + 1] ascends from 0 to n_rows and H heads divide E: the arguments
// every backend's segment_attention checks.
void check_segments(const int64_t * host_seg, int n_seg, int64_t n_rows, int64_t E, int64_t H);

// Backends compiled into this build, by name ("cpu", and "cuda" with KVCMAS_CUDA=ON).
std::vector<std::string> compiled_backends();
// Whether a compiled backend can run here; reason receives why not (no device, driver too old, ...).
bool backend_usable(const std::string & name, std::string * reason);
// A backend by name: "cpu" (n_threads <= 0: all cores, at most 64) or "cuda" / "cuda:N". Throws kvcmas::Error
// naming the problem: a name this build does not know, CUDA not compiled in, or compiled in but no usable GPU.
std::unique_ptr<Backend> make_backend(const std::string & name, int n_threads);

}  // namespace kvcmas::backend
