// LoRA adapters of a base model, as llama.cpp writes them (GGUF with general.type "adapter", adapter.type "lora",
// adapter.lora.alpha, and per target matrix "<name>.lora_a" A [n_in, rank] and "<name>.lora_b" B [rank, n_out] in
// GGUF order, i.e. A is rank rows of n_in and B n_out rows of rank). A sequence using an adapter with scale s computes
// every target matmul as y = W x + s · (alpha / rank) · B (A x). Targets: the attention projections (Q, K, V, output)
// and the dense feed-forward (gate, up, down).
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "engine/arch/arch.h"
#include "gguf/gguf-file.h"

namespace kvcmas {

enum class LoraTarget : uint8_t { Q, K, V, Output, Gate, Up, Down };
constexpr int kLoraTargets = 7;

// A target's low-rank factors in backend memory: a [rank][n_in], and B transposed, b_t [rank][n_out] in tiles of
// outputs (backend::lora_b_index), stored as the
// base matrix's precision allows: F32 over an F32 matrix (an f32 model computes its update exactly), F16 over F16 /
// BF16, I8 (per-row scales a_scale, b_scale [rank]) over a quantized one, whose own rounding is far coarser (a decode
// step reads a quarter of the f32 bytes: docs/engine-speed.md, "LoRA adapters").
struct LoraPair {
    backend::Buffer         a, b_t, a_scale, b_scale;
    backend::LoraFactorType type  = backend::LoraFactorType::F32;
    int                     rank  = 0;
    int64_t                 n_in  = 0;
    int64_t                 n_out = 0;
};

class LoraAdapter {
  public:
    // Reads `path` and checks it against the base model (its file and parameters): an adapter file of type lora
    // with an alpha, of the base's architecture, each tensor a lora_a / lora_b pair of a target matrix the base has
    // with matching shapes. Throws kvcmas::Error naming the file and the problem; nothing is kept on error.
    LoraAdapter(const std::string & path, const gguf::GgufFile & base, const ModelParams & p, backend::Backend & be);

    const std::string & path() const { return path_; }
    float               alpha() const { return alpha_; }
    // Layer il's factors of target t, or null where the adapter leaves it alone.
    const LoraPair * pair(int il, LoraTarget t) const;
    int              n_pairs() const { return n_pairs_; }
    int              max_rank() const { return max_rank_; }
    size_t           bytes() const { return bytes_; }  // backend memory of the factors

  private:
    std::string                                                      path_;
    float                                                            alpha_    = 0.0f;
    int                                                              n_pairs_  = 0;
    int                                                              max_rank_ = 0;
    size_t                                                           bytes_    = 0;
    std::vector<std::array<std::unique_ptr<LoraPair>, kLoraTargets>> layers_;
};

// One matmul of the current layer, y [st.n][w.n_out] = in · wᵀ, the weight of target `target`.
struct LoraOutput {
    LoraTarget              target;
    const backend::Weight * w;
    float *                 y;
};

// The outputs' matmuls of the same input in [st.n][n_in] (one matmul_multi: Q/K/V, gate/up; a single one: matmul)
// plus, where the batch's sequences use adapters (st.lora), each adapter's update of the targets it adapts, in one
// backend call (Backend::matmul_multi_lora); without adapters exactly the base's matmuls.
void adapted_matmul(ForwardState & st, const float * in, std::initializer_list<LoraOutput> outputs);

}  // namespace kvcmas
