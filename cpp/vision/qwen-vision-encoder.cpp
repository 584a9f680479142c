#include "vision/qwen-vision-encoder.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/error.h"
#include "engine/tensor-loader.h"
#include "vision/tower-weights.h"
#include "vision/vision-names.h"

namespace kvcmas::vision {

namespace names = vision_names;

QwenVisionEncoder::QwenVisionEncoder(const std::string & path, int n_threads, const std::string & backend_name)
    : file_(std::make_unique<gguf::GgufFile>(path)), be_(make_tower_backend(path, backend_name, n_threads)) {
    load_params();
    load_weights();
    file_->release_resident();  // the backend copied the weights (CPU: onto huge pages); no doubled resident size
}

QwenVisionEncoder::~QwenVisionEncoder() = default;

// An array key of n floats, or `fallback` when absent.
static std::vector<float> float_array(const gguf::GgufFile & f, const char * key, const std::vector<float> & fallback,
                                      bool positive) {
    const gguf::Value * v = f.find(key);
    if (v == nullptr) {
        return fallback;
    }
    KC_CHECK(v->type == gguf::ValueType::ARRAY && v->floats.size() == fallback.size(),
             "%s: %s must be an array of %zu floats", f.path().c_str(), key, fallback.size());
    std::vector<float> out;
    for (double x : v->floats) {
        KC_CHECK(std::isfinite(x) && (!positive || x > 0.0), "%s: %s holds an invalid value %g", f.path().c_str(), key,
                 x);
        out.push_back(static_cast<float>(x));
    }
    return out;
}

void QwenVisionEncoder::load_params() {
    const gguf::GgufFile & f    = *file_;
    const char *           path = f.path().c_str();
    const std::string      arch = f.get_string(names::kKeyArchitecture);
    KC_CHECK(arch == names::kArchClip, "%s: general.architecture is '%s', expected '%s' (an mmproj file)", path,
             arch.c_str(), names::kArchClip);
    const std::string type = f.find(names::kKeyProjectorType) ? f.get_string(names::kKeyProjectorType) : "";
    KC_CHECK(type == names::kProjectorQwen25Vl, "%s: %s is '%s', expected '%s'", path, names::kKeyProjectorType,
             type.c_str(), names::kProjectorQwen25Vl);
    p_.patch_size          = f.get_int(names::kKeyPatchSize);
    p_.n_embd              = f.get_int(names::kKeyEmbeddingLength);
    p_.n_ff                = f.get_int(names::kKeyFeedForward);
    p_.n_layer             = f.get_int(names::kKeyBlockCount);
    p_.n_head              = f.get_int(names::kKeyHeadCount);
    p_.merge_size          = f.get_int(names::kKeySpatialMergeSize, 2);
    p_.window_size         = f.get_int(names::kKeyWindowSize, 112);
    p_.temporal_patch_size = f.get_int(names::kKeyTemporalPatchSize, 2);
    p_.rope_theta          = f.get_float(names::kKeyRopeTheta, 10000.0);
    p_.min_pixels          = f.get_int(names::kKeyImageMinPixels, 56 * 56);
    p_.max_pixels          = f.get_int(names::kKeyImageMaxPixels, 14 * 14 * 4 * 16384);
    const double eps       = f.get_float(names::kKeyLayerNormEps, 1e-6);
    const auto   ll        = [](int64_t v) { return static_cast<long long>(v); };
    KC_CHECK(p_.patch_size > 0 && p_.patch_size <= 64, "%s: patch_size %lld out of range [1, 64]", path,
             ll(p_.patch_size));
    KC_CHECK(p_.temporal_patch_size == 2, "%s: %s = %lld: kvcmas runs Qwen2.5-VL's temporal patch of 2", path,
             names::kKeyTemporalPatchSize, ll(p_.temporal_patch_size));
    KC_CHECK(p_.merge_size > 0 && p_.merge_size <= 8, "%s: %s = %lld out of range [1, 8]", path,
             names::kKeySpatialMergeSize, ll(p_.merge_size));
    KC_CHECK(p_.window_size >= p_.patch_size * p_.merge_size && p_.window_size <= 65536,
             "%s: %s = %lld must hold at least one merge block (%lld pixels)", path, names::kKeyWindowSize,
             ll(p_.window_size), ll(p_.patch_size * p_.merge_size));
    KC_CHECK(p_.n_embd > 0 && p_.n_embd <= 16384, "%s: embedding_length %lld out of range", path, ll(p_.n_embd));
    KC_CHECK(p_.n_ff > 0 && p_.n_ff <= 65536, "%s: feed_forward_length %lld out of range", path, ll(p_.n_ff));
    KC_CHECK(p_.n_layer >= 0 && p_.n_layer <= 256, "%s: block_count %lld out of range", path, ll(p_.n_layer));
    KC_CHECK(p_.n_head > 0 && p_.n_head <= 256 && p_.n_embd % (4 * p_.n_head) == 0,
             "%s: head_count %lld must divide embedding_length %lld into heads of a multiple of 4", path, ll(p_.n_head),
             ll(p_.n_embd));
    KC_CHECK(std::isfinite(eps) && eps > 0.0 && eps < 1.0, "%s: layer_norm_epsilon %g out of range", path, eps);
    KC_CHECK(std::isfinite(p_.rope_theta) && p_.rope_theta > 1.0, "%s: %s = %g out of range", path,
             names::kKeyRopeTheta, p_.rope_theta);
    KC_CHECK(p_.min_pixels > 0 && p_.min_pixels <= p_.max_pixels, "%s: %s = %lld and %s = %lld are not a range", path,
             names::kKeyImageMinPixels, ll(p_.min_pixels), names::kKeyImageMaxPixels, ll(p_.max_pixels));
    p_.eps = static_cast<float>(eps);

    p_.full_attention.assign(static_cast<size_t>(p_.n_layer), false);
    if (const gguf::Value * v = f.find(names::kKeyFullAttnLayers)) {
        KC_CHECK(v->type == gguf::ValueType::ARRAY, "%s: %s must be an array of block indexes", path,
                 names::kKeyFullAttnLayers);
        for (int64_t il : v->ints) {
            KC_CHECK(il >= 0 && il < p_.n_layer, "%s: %s holds block %lld, outside [0, %lld)", path,
                     names::kKeyFullAttnLayers, ll(il), ll(p_.n_layer));
            p_.full_attention[static_cast<size_t>(il)] = true;
        }
    } else {
        const int64_t n = f.get_int(names::kKeyWindowAttnPattern, 0);
        KC_CHECK(n > 0, "%s: needs %s or %s (which blocks attend over the whole image)", path,
                 names::kKeyFullAttnLayers, names::kKeyWindowAttnPattern);
        for (int64_t il = 0; il < p_.n_layer; ++il) {
            p_.full_attention[static_cast<size_t>(il)] = (il + 1) % n == 0;
        }
    }
    const std::vector<float> clip_mean{ 0.48145466f, 0.4578275f, 0.40821073f };
    const std::vector<float> clip_std{ 0.26862954f, 0.26130258f, 0.27577711f };
    p_.image_mean = float_array(f, names::kKeyImageMean, clip_mean, false);
    p_.image_std  = float_array(f, names::kKeyImageStd, clip_std, true);
}

void QwenVisionEncoder::load_weights() {
    const TensorLoader loader(*file_);
    const int64_t      E = p_.n_embd, F = p_.n_ff, P = p_.patch_size, T = p_.temporal_patch_size;
    const int64_t      M    = p_.merge_size * p_.merge_size;
    const char *       path = file_->path().c_str();
    auto               w    = [](const std::string & base) { return base + ".weight"; };
    auto               b    = [](const std::string & base) { return base + ".bias"; };

    // The Conv3d kernel [E][3][T][P][P] from llama.cpp's two Conv2d kernels [E][3][P][P] (one per time step).
    const std::vector<float> k0 = loader.vector_f32(w(names::kTensorPatchEmbd), E * 3 * P * P, true);
    const std::vector<float> k1 = loader.vector_f32(names::kTensorPatchEmbd1, E * 3 * P * P, true);
    patch_w_data_.resize(static_cast<size_t>(E * p_.patch_dim()));
    for (int64_t e = 0; e < E; ++e) {
        for (int64_t c = 0; c < 3; ++c) {
            for (int64_t t = 0; t < T; ++t) {
                const float * src = (t == 0 ? k0 : k1).data() + (e * 3 + c) * P * P;
                std::copy(src, src + P * P, patch_w_data_.data() + ((e * 3 + c) * T + t) * P * P);
            }
        }
    }
    patch_cols_ = patch_columns(*be_, p_.patch_dim());
    patch_w_    = upload_f32_matrix(*be_, std::move(patch_w_data_), p_.patch_dim(), E, patch_cols_, patch_w_data_);
    const auto matrix = [&](const std::string & name, int64_t n_in, int64_t n_out) {
        return upload_matrix(*be_, loader, name, n_in, n_out);
    };
    const auto vector = [&](const std::string & name, int64_t n) { return upload_vector(*be_, loader, name, n, true); };

    layers_.resize(static_cast<size_t>(p_.n_layer));
    for (int64_t il = 0; il < p_.n_layer; ++il) {
        Layer &           L  = layers_[static_cast<size_t>(il)];
        const std::string bl = names::kBlockPrefix + std::to_string(il) + ".";
        L.ln1                = vector(w(bl + names::kBlkLn1), E);
        L.ln2                = vector(w(bl + names::kBlkLn2), E);
        L.wq                 = matrix(w(bl + names::kBlkAttnQ), E, E);
        L.wk                 = matrix(w(bl + names::kBlkAttnK), E, E);
        L.wv                 = matrix(w(bl + names::kBlkAttnV), E, E);
        L.wo                 = matrix(w(bl + names::kBlkAttnOut), E, E);
        L.w_gate             = matrix(w(bl + names::kBlkFfnGate), E, F);
        L.w_up               = matrix(w(bl + names::kBlkFfnUp), E, F);
        L.w_down             = matrix(w(bl + names::kBlkFfnDown), F, E);
        L.bq                 = vector(b(bl + names::kBlkAttnQ), E);
        L.bk                 = vector(b(bl + names::kBlkAttnK), E);
        L.bv                 = vector(b(bl + names::kBlkAttnV), E);
        L.bo                 = vector(b(bl + names::kBlkAttnOut), E);
        L.b_gate             = vector(b(bl + names::kBlkFfnGate), F);
        L.b_up               = vector(b(bl + names::kBlkFfnUp), F);
        L.b_down             = vector(b(bl + names::kBlkFfnDown), E);
    }
    KC_CHECK(
        file_->find_tensor(w(names::kBlockPrefix + std::to_string(p_.n_layer) + "." + names::kBlkAttnQ)) == nullptr,
        "%s: holds more blocks than clip.vision.block_count = %lld", path, static_cast<long long>(p_.n_layer));
    merger_ln_                   = vector(w(names::kTensorPostLn), E);
    mm0_                         = matrix(w(names::kTensorMm0), M * E, M * E);
    mm0_b_                       = vector(b(names::kTensorMm0), M * E);
    const gguf::TensorInfo * mm2 = file_->find_tensor(w(names::kTensorMm2));
    KC_CHECK(mm2 != nullptr && mm2->ne.size() == 2 && mm2->ne[1] > 0 && mm2->ne[1] <= 65536,
             "%s: tensor '%s' is missing or not a matrix of at most 65536 rows", path, w(names::kTensorMm2).c_str());
    p_.n_embd_out = mm2->ne[1];
    mm2_          = matrix(w(names::kTensorMm2), M * E, p_.n_embd_out);
    mm2_b_        = vector(b(names::kTensorMm2), p_.n_embd_out);
}

void QwenVisionEncoder::linear(const backend::Weight & w, const backend::Buffer & b, const float * x, float * y,
                               int64_t n_tok) {
    vision::linear(*be_, w, b, x, y, n_tok);
}

void QwenVisionEncoder::attention(const Layer & L, const float * xn, const std::vector<int64_t> & seg,
                                  const float * cos_t, const float * sin_t, float * out, int64_t N) {
    const int64_t E = p_.n_embd, H = p_.n_head, hd = E / H;
    qkv_.project(*be_, L.wq, L.bq, L.wk, L.bk, L.wv, L.bv, xn, N, E);
    float *q = qkv_.q.f32(), *k = qkv_.k.f32(), *v = qkv_.v.f32();
    be_->rotate_half_rows(q, cos_t, sin_t, N, H, hd);
    be_->rotate_half_rows(k, cos_t, sin_t, N, H, hd);
    be_->segment_attention(q, k, v, out, N, E, H, seg.data(), static_cast<int>(seg.size()) - 1);
}

std::vector<float> QwenVisionEncoder::encode(const float * patches, int64_t n_patches, int64_t dim, int64_t grid_h,
                                             int64_t grid_w) {
    const int64_t m = p_.merge_size, M = m * m, E = p_.n_embd, F = p_.n_ff, H = p_.n_head, hd = E / H;
    const auto    ll = [](int64_t v) { return static_cast<long long>(v); };
    KC_CHECK(grid_h > 0 && grid_w > 0 && grid_h % m == 0 && grid_w % m == 0 && grid_h <= 4096 && grid_w <= 4096,
             "encode: a grid of %lld x %lld patches is not a positive multiple of the merge size %lld", ll(grid_h),
             ll(grid_w), ll(m));
    KC_CHECK(patches != nullptr && n_patches == grid_h * grid_w && dim == p_.patch_dim(),
             "encode: expected patches [%lld, %lld] for a %lld x %lld grid, got [%lld, %lld]", ll(grid_h * grid_w),
             ll(p_.patch_dim()), ll(grid_h), ll(grid_w), ll(n_patches), ll(dim));
    KC_CHECK(n_patches <= 65536, "encode: %lld patches is more than kvcmas encodes at once (65536)", ll(n_patches));
    for (int64_t i = 0; i < n_patches * dim; ++i) {
        KC_CHECK(std::isfinite(patches[i]), "encode: pixel value %lld is not finite", ll(i));
    }
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t               N = n_patches, units = N / M, units_w = grid_w / m;

    // Window order: windows of ws x ws merge blocks row-major, the blocks of a window row-major (a merge block's
    // patches stay together); attention segments are the windows, or the whole image for full-attention blocks.
    const int64_t        ws = p_.window_size / m / p_.patch_size, units_h = grid_h / m;
    std::vector<int64_t> order, windows{ 0 };
    for (int64_t wr = 0; wr < units_h; wr += ws) {
        for (int64_t wc = 0; wc < units_w; wc += ws) {
            for (int64_t r = wr; r < std::min(wr + ws, units_h); ++r) {
                for (int64_t c = wc; c < std::min(wc + ws, units_w); ++c) {
                    order.push_back(r * units_w + c);
                }
            }
            windows.push_back(static_cast<int64_t>(order.size()) * M);
        }
    }
    const std::vector<int64_t> whole{ 0, N };

    // Rows in window order (gathered from the patch rows); each row's 2D RoPE angles (its patch row, then its
    // column).
    backend::Backend & be     = *be_;
    const auto         floats = [&](int64_t n) { return backend::Buffer(be, static_cast<size_t>(n) * sizeof(float)); };
    backend::Buffer    x      = floats(N * E);
    {
        const backend::Buffer d_patches = upload_padded_rows(be, patches, N, dim, patch_cols_);
        backend::Buffer       embd      = floats(N * E);
        linear(patch_w_, {}, d_patches.f32(), embd.f32(), N);
        std::vector<int32_t> rows(static_cast<size_t>(N));
        for (int64_t i = 0; i < units; ++i) {
            for (int64_t j = 0; j < M; ++j) {
                rows[static_cast<size_t>(i * M + j)] = static_cast<int32_t>(order[i] * M + j);
            }
        }
        be.gather_rows(embd.f32(), rows.data(), N, E, x.f32());
    }
    const int64_t      quarter = hd / 4, half = hd / 2;
    std::vector<float> cos_t(static_cast<size_t>(N * half)), sin_t(cos_t.size());
    for (int64_t i = 0; i < units; ++i) {
        const int64_t u = order[i];
        for (int64_t j = 0; j < M; ++j) {
            const int64_t row = (u / units_w) * m + j / m, col = (u % units_w) * m + j % m;
            const int64_t t = i * M + j;
            for (int64_t f = 0; f < quarter; ++f) {
                const double inv    = std::pow(p_.rope_theta, -static_cast<double>(2 * f) / static_cast<double>(half));
                const float  a_h    = static_cast<float>(row) * static_cast<float>(inv);
                const float  a_w    = static_cast<float>(col) * static_cast<float>(inv);
                cos_t[t * half + f] = std::cos(a_h);
                sin_t[t * half + f] = std::sin(a_h);
                cos_t[t * half + quarter + f] = std::cos(a_w);
                sin_t[t * half + quarter + f] = std::sin(a_w);
            }
        }
    }
    const backend::Buffer d_cos = backend::upload_floats(be, cos_t), d_sin = backend::upload_floats(be, sin_t);

    backend::Buffer xn = floats(N * E), att = floats(N * E), tmp = floats(N * E);
    backend::Buffer g = floats(N * F), u = floats(N * F);
    for (int64_t il = 0; il < p_.n_layer; ++il) {
        const Layer & L = layers_[static_cast<size_t>(il)];
        be.rms_norm(x.f32(), L.ln1.f32(), xn.f32(), N, E, p_.eps);
        attention(L, xn.f32(), p_.full_attention[static_cast<size_t>(il)] ? whole : windows, d_cos.f32(), d_sin.f32(),
                  att.f32(), N);
        linear(L.wo, L.bo, att.f32(), tmp.f32(), N);
        be.add(x.f32(), tmp.f32(), N * E);
        be.rms_norm(x.f32(), L.ln2.f32(), xn.f32(), N, E, p_.eps);
        linear(L.w_gate, L.b_gate, xn.f32(), g.f32(), N);
        linear(L.w_up, L.b_up, xn.f32(), u.f32(), N);
        be.activate(Activation::Silu, g.f32(), u.f32(), N, F);
        linear(L.w_down, L.b_down, g.f32(), tmp.f32(), N);
        be.add(x.f32(), tmp.f32(), N * E);
    }

    // Merger: each merge block's M rows side by side, then the MLP; output rows back in prompt order.
    be.rms_norm(x.f32(), merger_ln_.f32(), xn.f32(), N, E, p_.eps);
    backend::Buffer hidden = floats(units * M * E);
    linear(mm0_, mm0_b_, xn.f32(), hidden.f32(), units);
    be.activate(Activation::GeluErf, hidden.f32(), nullptr, units, M * E);
    backend::Buffer merged = floats(units * p_.n_embd_out), ordered = floats(units * p_.n_embd_out);
    linear(mm2_, mm2_b_, hidden.f32(), merged.f32(), units);
    std::vector<int32_t> back(static_cast<size_t>(units));  // output row order[i] is merged row i
    for (int64_t i = 0; i < units; ++i) {
        back[static_cast<size_t>(order[i])] = static_cast<int32_t>(i);
    }
    be.gather_rows(merged.f32(), back.data(), units, p_.n_embd_out, ordered.f32());
    std::vector<float> out(static_cast<size_t>(units * p_.n_embd_out));
    be.download(out.data(), ordered.data(), out.size() * sizeof(float));
    return out;
}

}  // namespace kvcmas::vision
