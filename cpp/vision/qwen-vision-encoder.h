// Vision tower of Qwen2.5-VL (an mmproj GGUF with clip.projector_type "qwen2.5vl_merger", llama.cpp's layout):
// a ViT at the image's own resolution, then the 2x2 patch merger that projects to the text model's width.
//
// Input: the processor's patches [N][3·T·P·P] (T = 2 temporal copies of the image, P = 14), in its order: merge
// blocks of 2x2 patches row-major over the grid, the 4 patches of a block row-major; grid_h x grid_w patches
// (both even), N = grid_h·grid_w.
//   x = patches · patch_embdᵀ                                      [N, E]   (the Conv3d as one matmul)
//   2D RoPE per head: pairs (i, i + hd/2), the first hd/4 rotated by the patch row, the next hd/4 by its column
//   blocks: x += attn(RMSNorm1(x)); x += down(silu(gate(h)) * up(h)), h = RMSNorm2(x); attention is over all
//     patches in the full-attention blocks (clip.vision.wa_layer_indexes, or every n_wa_pattern-th), and within
//     windows of window_size / P patches a side (whole merge blocks) in the others
//   merger: RMSNorm (v.post_ln), each block's 4 rows concatenated -> mm.2(gelu(mm.0(.)))     [N / 4, n_embd_out]
// Output rows are the merge blocks row-major (the image tokens in prompt order).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "gguf/gguf-file.h"
#include "vision/tower-weights.h"

namespace kvcmas::vision {

struct QwenVisionParams {
    int64_t           patch_size          = 0;  // P
    int64_t           temporal_patch_size = 2;  // T: copies of a still image the Conv3d reads
    int64_t           merge_size          = 2;  // patches a side merged into one output row
    int64_t           window_size         = 0;  // pixels a side of an attention window
    int64_t           n_embd              = 0;  // E
    int64_t           n_ff                = 0;
    int64_t           n_layer             = 0;
    int64_t           n_head              = 0;
    int64_t           n_embd_out          = 0;  // the text model's width
    float             eps                 = 1e-6f;
    double            rope_theta          = 10000.0;
    std::vector<bool> full_attention;  // [n_layer]
    // Dynamic resolution (applied by the caller, recorded so the file is self-contained).
    int64_t            min_pixels = 0, max_pixels = 0;
    std::vector<float> image_mean, image_std;

    int64_t patch_dim() const { return 3 * temporal_patch_size * patch_size * patch_size; }
};

class QwenVisionEncoder {
  public:
    // Loads and validates the file (keys' ranges, every tensor's presence and shape) and uploads the weights to a
    // backend made by name ("cpu", "cuda", "cuda:N") that runs every op of the tower. Throws kvcmas::Error naming
    // the file and the problem, or the backend this build does not know or cannot run. n_threads <= 0: all cores
    // (at most 64; the CPU backend's threads).
    QwenVisionEncoder(const std::string & path, int n_threads, const std::string & backend_name = "cpu");
    ~QwenVisionEncoder();
    QwenVisionEncoder(const QwenVisionEncoder &)             = delete;
    QwenVisionEncoder & operator=(const QwenVisionEncoder &) = delete;

    const QwenVisionParams & params() const { return p_; }
    const gguf::GgufFile &   file() const { return *file_; }
    int                      n_threads() const { return be_->n_threads(); }
    std::string              backend_name() const { return be_->name(); }

    // patches [grid_h·grid_w][patch_dim()] as above -> [grid_h·grid_w / merge²][n_embd_out] row-major. Throws on
    // a grid that is not a positive multiple of the merge size or non-finite inputs. Thread-safe (serialised).
    std::vector<float> encode(const float * patches, int64_t n_patches, int64_t dim, int64_t grid_h, int64_t grid_w);

  private:
    struct Layer {
        backend::Buffer ln1, ln2;              // RMSNorm weights [E]
        backend::Weight wq, wk, wv, wo;        // [E, E] as (n_in, n_out)
        backend::Weight w_gate, w_up, w_down;  // [E, F] x2, [F, E]
        backend::Buffer bq, bk, bv, bo, b_gate, b_up, b_down;
    };

    void load_params();
    void load_weights();
    void linear(const backend::Weight & w, const backend::Buffer & b, const float * x, float * y, int64_t n_tok);
    // Attention of every segment [seg[s], seg[s + 1]) on its own (rows in window order); out [N, E].
    void attention(const Layer & L, const float * xn, const std::vector<int64_t> & seg, const float * cos_t,
                   const float * sin_t, float * out, int64_t N);

    std::unique_ptr<gguf::GgufFile>   file_;
    QwenVisionParams                  p_;
    std::unique_ptr<backend::Backend> be_;            // before every buffer: they go first
    std::vector<float>                patch_w_data_;  // [E][3][T][P][P]: the two temporal kernels interleaved
    backend::Weight                   patch_w_{};
    int64_t                           patch_cols_ = 0;  // patch_w_.n_in: patch_dim(), padded with zeros for a device
    std::vector<Layer>                layers_;
    backend::Buffer                   merger_ln_;
    backend::Weight                   mm0_{}, mm2_{};
    backend::Buffer                   mm0_b_, mm2_b_;
    QkvRows                           qkv_;  // attention's [N, E] x3
    std::mutex                        mutex_;
};

}  // namespace kvcmas::vision
