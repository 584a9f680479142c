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

#include "backend/cpu/matmul.h"
#include "backend/cpu/threadpool.h"
#include "gguf/gguf-file.h"

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
    // Loads and validates the file (keys' ranges, every tensor's presence and shape). Throws kvcmas::Error naming
    // the file and the problem. n_threads <= 0: all cores (at most 64).
    QwenVisionEncoder(const std::string & path, int n_threads);
    ~QwenVisionEncoder();
    QwenVisionEncoder(const QwenVisionEncoder &)             = delete;
    QwenVisionEncoder & operator=(const QwenVisionEncoder &) = delete;

    const QwenVisionParams & params() const { return p_; }
    const gguf::GgufFile &   file() const { return *file_; }
    int                      n_threads() const { return pool_.size(); }

    // patches [grid_h·grid_w][patch_dim()] as above -> [grid_h·grid_w / merge²][n_embd_out] row-major. Throws on
    // a grid that is not a positive multiple of the merge size or non-finite inputs. Thread-safe (serialised).
    std::vector<float> encode(const float * patches, int64_t n_patches, int64_t dim, int64_t grid_h, int64_t grid_w);

  private:
    struct Layer {
        std::vector<float> ln1, ln2;              // RMSNorm weights [E]
        cpu::WeightView    wq, wk, wv, wo;        // [E, E] as (n_in, n_out)
        cpu::WeightView    w_gate, w_up, w_down;  // [E, F] x2, [F, E]
        std::vector<float> bq, bk, bv, bo, b_gate, b_up, b_down;
    };

    void load_params();
    void load_weights();
    void linear(const cpu::WeightView & w, const std::vector<float> & b, const float * x, float * y, int64_t n_tok);
    void rms_rows(const std::vector<float> & w, const float * x, float * y, int64_t n_tok, int64_t n);
    // Attention of every segment [seg[s], seg[s + 1]) on its own (rows in window order); out [N, E].
    void attention(const Layer & L, const float * xn, const std::vector<int64_t> & seg, const float * cos_t,
                   const float * sin_t, float * out, int64_t N);

    std::unique_ptr<gguf::GgufFile> file_;
    QwenVisionParams                p_;
    std::vector<float>              patch_w_data_;  // [E][3][T][P][P]: the two temporal kernels interleaved
    cpu::WeightView                 patch_w_{};
    std::vector<Layer>              layers_;
    std::vector<float>              merger_ln_;
    cpu::WeightView                 mm0_{}, mm2_{};
    std::vector<float>              mm0_b_, mm2_b_;
    cpu::ThreadPool                 pool_;
    std::vector<float>              scratch_;  // attention's, kept across layers and calls (serialised)
    std::mutex                      mutex_;
};

}  // namespace kvcmas::vision
