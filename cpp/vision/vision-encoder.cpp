#include "vision/vision-encoder.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/error.h"
#include "engine/tensor-loader.h"
#include "vision/tower-weights.h"
#include "vision/vision-names.h"

namespace kvcmas::vision {

namespace names = vision_names;

VisionEncoder::VisionEncoder(const std::string & path, int n_threads, const std::string & backend_name)
    : file_(std::make_unique<gguf::GgufFile>(path)), be_(make_tower_backend(path, backend_name, n_threads)) {
    load_params();
    load_weights();
    file_->release_resident();  // the backend copied the weights (CPU: onto huge pages); no doubled resident size
}

VisionEncoder::~VisionEncoder() = default;

int64_t VisionEncoder::n_output_embd() const {
    if (!p_.projector) {
        return p_.n_embd;
    }
    return p_.gemma3_projector ? input_proj_.n_out : mm2_.n_out;
}

// A string key, or `fallback` when absent; an error when present with another type.
static std::string string_key(const gguf::GgufFile & f, const char * key, const char * fallback) {
    return f.find(key) == nullptr ? std::string(fallback) : f.get_string(key);
}

static Activation activation_key(const gguf::GgufFile & f, const char * key, Activation fallback) {
    if (f.find(key) == nullptr) {
        return fallback;
    }
    const std::string name = f.get_string(key);
    Activation        act;
    KC_CHECK(parse_activation(name.c_str(), act),
             "%s: %s = '%s' is not a supported activation (gelu, gelu_pytorch_tanh, gelu_new, quick_gelu, silu)",
             f.path().c_str(), key, name.c_str());
    return act;
}

void VisionEncoder::load_params() {
    const gguf::GgufFile & f    = *file_;
    const char *           path = f.path().c_str();
    const std::string      arch = f.get_string(names::kKeyArchitecture);
    KC_CHECK(arch == names::kArchClip, "%s: general.architecture is '%s', expected '%s' (an mmproj file)", path,
             arch.c_str(), names::kArchClip);
    KC_CHECK(f.get_bool(names::kKeyHasVisionEncoder, false), "%s: %s is not true (no vision encoder in this file)",
             path, names::kKeyHasVisionEncoder);
    p_.image_size    = f.get_int(names::kKeyImageSize);
    p_.patch_size    = f.get_int(names::kKeyPatchSize);
    p_.n_embd        = f.get_int(names::kKeyEmbeddingLength);
    p_.n_ff          = f.get_int(names::kKeyFeedForward);
    p_.n_layer       = f.get_int(names::kKeyBlockCount);
    p_.n_head        = f.get_int(names::kKeyHeadCount);
    const double eps = f.get_float(names::kKeyLayerNormEps);
    KC_CHECK(p_.patch_size > 0 && p_.patch_size <= 64, "%s: patch_size %lld out of range [1, 64]", path,
             static_cast<long long>(p_.patch_size));
    // A stride-P convolution without padding: floor(S / P) patches a side (SigLIP-so400m: 384 / 14 -> 27, the
    // last 6 pixel rows and columns unused).
    KC_CHECK(p_.image_size >= p_.patch_size && p_.image_size <= 4096,
             "%s: image_size %lld must lie in [patch_size %lld, 4096]", path, static_cast<long long>(p_.image_size),
             static_cast<long long>(p_.patch_size));
    KC_CHECK(p_.n_patches() <= 16384, "%s: %lld patches per image is more than kvcmas supports (16384)", path,
             static_cast<long long>(p_.n_patches()));
    KC_CHECK(p_.n_embd > 0 && p_.n_embd <= 16384, "%s: embedding_length %lld out of range", path,
             static_cast<long long>(p_.n_embd));
    KC_CHECK(p_.n_ff > 0 && p_.n_ff <= 65536, "%s: feed_forward_length %lld out of range", path,
             static_cast<long long>(p_.n_ff));
    KC_CHECK(p_.n_layer >= 0 && p_.n_layer <= 256, "%s: block_count %lld out of range", path,
             static_cast<long long>(p_.n_layer));
    KC_CHECK(p_.n_head > 0 && p_.n_head <= 256 && p_.n_embd % p_.n_head == 0,
             "%s: head_count %lld must divide embedding_length %lld", path, static_cast<long long>(p_.n_head),
             static_cast<long long>(p_.n_embd));
    KC_CHECK(std::isfinite(eps) && eps > 0.0 && eps < 1.0, "%s: layer_norm_epsilon %g out of range", path, eps);
    p_.eps = static_cast<float>(eps);

    // The MLP activation: kvcmas's exact name, else llama.cpp's flags (use_gelu means its tanh approximation).
    Activation legacy = Activation::QuickGelu;
    if (f.get_bool(names::kKeyUseSilu, false)) {
        legacy = Activation::Silu;
    } else if (f.get_bool(names::kKeyUseGelu, false)) {
        legacy = Activation::GeluTanh;
    }
    p_.act                     = activation_key(f, names::kKeyHiddenAct, legacy);
    p_.projector_act           = activation_key(f, names::kKeyProjectorAct, Activation::GeluErf);
    const std::string strategy = string_key(f, names::kKeySelectStrategy, "default");
    KC_CHECK(strategy == "default" || strategy == "full", "%s: %s = '%s' must be 'default' or 'full'", path,
             names::kKeySelectStrategy, strategy.c_str());
    p_.keep_class_token = strategy == "full";

    for (const char * key : { names::kKeyImageMean, names::kKeyImageStd }) {
        const bool           is_mean = std::strcmp(key, names::kKeyImageMean) == 0;
        std::vector<float> & out     = is_mean ? p_.image_mean : p_.image_std;
        const gguf::Value *  v       = f.find(key);
        if (v == nullptr) {
            out = { 0.5f, 0.5f, 0.5f };  // SigLIP's, and the most common default
            continue;
        }
        KC_CHECK(v->type == gguf::ValueType::ARRAY && v->floats.size() == 3, "%s: %s must be an array of 3 floats",
                 path, key);
        for (double x : v->floats) {
            KC_CHECK(std::isfinite(x) && (is_mean || x > 0.0), "%s: %s holds an invalid value %g", path, key, x);
            out.push_back(static_cast<float>(x));
        }
    }
    p_.model_type  = string_key(f, names::kKeyModelType, "clip");
    p_.resize_mode = string_key(f, names::kKeyResizeMode, "square");
    KC_CHECK(p_.resize_mode == "square" || p_.resize_mode == "shortest_edge",
             "%s: %s = '%s' must be 'square' or 'shortest_edge'", path, names::kKeyResizeMode, p_.resize_mode.c_str());
    p_.resize_size = f.get_int(names::kKeyResizeSize, p_.image_size);
    KC_CHECK(p_.resize_size >= p_.image_size && p_.resize_size <= 8192,
             "%s: %s = %lld must lie in [image_size %lld, 8192]", path, names::kKeyResizeSize,
             static_cast<long long>(p_.resize_size), static_cast<long long>(p_.image_size));
    p_.resample = string_key(f, names::kKeyResample, "bicubic");
    KC_CHECK(p_.resample == "bicubic" || p_.resample == "bilinear", "%s: %s = '%s' must be 'bicubic' or 'bilinear'",
             path, names::kKeyResample, p_.resample.c_str());
    p_.rescale_factor = f.get_float(names::kKeyRescaleFactor, 1.0 / 255.0);
    KC_CHECK(std::isfinite(p_.rescale_factor) && p_.rescale_factor > 0.0, "%s: %s = %g out of range", path,
             names::kKeyRescaleFactor, p_.rescale_factor);
}

void VisionEncoder::load_weights() {
    const TensorLoader loader(*file_);
    const auto         weight = [&](const std::string & name, int64_t n_in, int64_t n_out) {
        return upload_matrix(*be_, loader, name, n_in, n_out);
    };
    const auto vector_f32 = [&](const std::string & name, int64_t n, bool required) {
        return upload_vector(*be_, loader, name, n, required);
    };
    const int64_t E = p_.n_embd, F = p_.n_ff, P = p_.patch_size, C = 3 * P * P;
    const char *  path = file_->path().c_str();
    auto          w    = [](const std::string & base) { return base + ".weight"; };
    auto          b    = [](const std::string & base) { return base + ".bias"; };

    patch_cols_ = patch_columns(*be_, C);
    if (patch_cols_ == C) {
        patch_w_ = weight(w(names::kTensorPatchEmbd), C, E);
    } else {
        patch_w_ = upload_f32_matrix(*be_, loader.vector_f32(w(names::kTensorPatchEmbd), C * E, true), C, E,
                                     patch_cols_, patch_w_host_);
    }
    patch_b_       = vector_f32(b(names::kTensorPatchEmbd), E, false);
    class_embd_    = loader.vector_f32(names::kTensorClassEmbd, E, false);
    p_.class_token = !class_embd_.empty();
    pos_embd_      = vector_f32(w(names::kTensorPosEmbd), p_.n_positions() * E, true);
    pre_ln_w_      = vector_f32(w(names::kTensorPreLn), E, false);
    p_.pre_ln      = pre_ln_w_.data() != nullptr;
    pre_ln_b_      = vector_f32(b(names::kTensorPreLn), E, p_.pre_ln);
    post_ln_w_     = vector_f32(w(names::kTensorPostLn), E, false);
    p_.post_ln     = post_ln_w_.data() != nullptr;
    post_ln_b_     = vector_f32(b(names::kTensorPostLn), E, p_.post_ln);

    layers_.resize(static_cast<size_t>(p_.n_layer));
    for (int64_t il = 0; il < p_.n_layer; ++il) {
        Layer &           L  = layers_[static_cast<size_t>(il)];
        const std::string bl = names::kBlockPrefix + std::to_string(il) + ".";
        L.ln1_w              = vector_f32(w(bl + names::kBlkLn1), E, true);
        L.ln1_b              = vector_f32(b(bl + names::kBlkLn1), E, true);
        L.ln2_w              = vector_f32(w(bl + names::kBlkLn2), E, true);
        L.ln2_b              = vector_f32(b(bl + names::kBlkLn2), E, true);
        L.wq                 = weight(w(bl + names::kBlkAttnQ), E, E);
        L.wk                 = weight(w(bl + names::kBlkAttnK), E, E);
        L.wv                 = weight(w(bl + names::kBlkAttnV), E, E);
        L.wo                 = weight(w(bl + names::kBlkAttnOut), E, E);
        L.w_up               = weight(w(bl + names::kBlkFfnUp), E, F);
        L.w_down             = weight(w(bl + names::kBlkFfnDown), F, E);
        L.bq                 = vector_f32(b(bl + names::kBlkAttnQ), E, false);
        L.bk                 = vector_f32(b(bl + names::kBlkAttnK), E, false);
        L.bv                 = vector_f32(b(bl + names::kBlkAttnV), E, false);
        L.bo                 = vector_f32(b(bl + names::kBlkAttnOut), E, false);
        L.b_up               = vector_f32(b(bl + names::kBlkFfnUp), F, false);
        L.b_down             = vector_f32(b(bl + names::kBlkFfnDown), E, false);
    }
    // A block beyond block_count would be silently ignored: refuse it (a truncated key, not a smaller model).
    KC_CHECK(
        file_->find_tensor(w(names::kBlockPrefix + std::to_string(p_.n_layer) + "." + names::kBlkAttnQ)) == nullptr,
        "%s: holds more blocks than clip.vision.block_count = %lld", path, static_cast<long long>(p_.n_layer));

    const gguf::TensorInfo * mm0 = file_->find_tensor(w(names::kTensorMm0));
    if (file_->find_tensor(names::kTensorMmInputProj) != nullptr) {
        load_gemma3_projector();
        return;
    }
    p_.projector = mm0 != nullptr;
    if (p_.projector) {
        const std::string type = string_key(*file_, names::kKeyProjectorType, names::kProjectorMlp);
        KC_CHECK(type == names::kProjectorMlp,
                 "%s: projector type '%s' with tensor %s is not supported (kvcmas runs "
                 "'mlp' and 'gemma3')",
                 path, type.c_str(), w(names::kTensorMm0).c_str());
        KC_CHECK(mm0->ne.size() == 2, "%s: tensor '%s' must be a matrix", path, w(names::kTensorMm0).c_str());
        p_.n_embd_proj               = mm0->ne[1];
        mm0_                         = weight(w(names::kTensorMm0), E, p_.n_embd_proj);
        mm0_b_                       = vector_f32(b(names::kTensorMm0), p_.n_embd_proj, false);
        const gguf::TensorInfo * mm2 = file_->find_tensor(w(names::kTensorMm2));
        KC_CHECK(mm2 != nullptr && mm2->ne.size() == 2, "%s: tensor '%s' is missing or not a matrix", path,
                 w(names::kTensorMm2).c_str());
        KC_CHECK(mm2->ne[1] > 0 && mm2->ne[1] <= 65536, "%s: projector output width %lld out of range", path,
                 static_cast<long long>(mm2->ne[1]));
        mm2_   = weight(w(names::kTensorMm2), p_.n_embd_proj, mm2->ne[1]);
        mm2_b_ = vector_f32(b(names::kTensorMm2), mm2_.n_out, false);
    }
}

void VisionEncoder::load_gemma3_projector() {
    const gguf::GgufFile & f    = *file_;
    const char *           path = f.path().c_str();
    const std::string      type = string_key(f, names::kKeyProjectorType, "");
    KC_CHECK(type == names::kProjectorGemma3, "%s: tensor %s needs %s = '%s', the file says '%s'", path,
             names::kTensorMmInputProj, names::kKeyProjectorType, names::kProjectorGemma3, type.c_str());
    const int64_t E = p_.n_embd, G = p_.image_size / p_.patch_size;
    p_.pool_kernel = f.get_int(names::kKeyProjScaleFactor, 4);  // llama.cpp's default for every Gemma 3 size
    KC_CHECK(p_.pool_kernel >= 1 && p_.pool_kernel <= G && G % p_.pool_kernel == 0,
             "%s: %s = %lld must divide the %lld patches a side", path, names::kKeyProjScaleFactor,
             static_cast<long long>(p_.pool_kernel), static_cast<long long>(G));
    KC_CHECK(p_.post_ln && !p_.class_token,
             "%s: a gemma3 projector reads a SigLIP tower's last_hidden_state "
             "(v.post_ln present, no class token)",
             path);
    const gguf::TensorInfo * proj = f.find_tensor(names::kTensorMmInputProj);
    KC_CHECK(proj->ne.size() == 2 && proj->ne[1] == E && proj->ne[0] > 0 && proj->ne[0] <= 65536,
             "%s: tensor %s must be [n_embd_out, %lld] (GGUF order)", path, names::kTensorMmInputProj,
             static_cast<long long>(E));
    const int64_t            n_out = proj->ne[0];
    const TensorLoader       loader(f);
    const std::vector<float> w = loader.vector_f32(names::kTensorMmInputProj, E * n_out, true);  // [E][n_out]
    input_proj_t_.resize(w.size());
    for (int64_t e = 0; e < E; ++e) {
        for (int64_t o = 0; o < n_out; ++o) {
            input_proj_t_[static_cast<size_t>(o * E + e)] = w[static_cast<size_t>(e * n_out + o)];
        }
    }
    input_proj_         = be_->upload_weight(GgmlType::F32, input_proj_t_.data(), E, n_out, sizeof(float) * E);
    soft_emb_norm_      = upload_vector(*be_, loader, names::kTensorMmSoftEmbNorm, E, true);
    p_.projector        = true;
    p_.gemma3_projector = true;
    p_.n_embd_proj      = E;
}

void VisionEncoder::linear(const backend::Weight & w, const backend::Buffer & b, const float * x, float * y,
                           int64_t n_tok) {
    vision::linear(*be_, w, b, x, y, n_tok);
}

// Multi-head attention without a mask, within each of n_img images of T rows (rows of different images never see
// each other): the backend's segment_attention with one segment per image.
void VisionEncoder::attention(const Layer & L, const float * xn, float * out, int64_t T, int64_t n_img) {
    const int64_t E = p_.n_embd, H = p_.n_head, R = T * n_img;
    qkv_.project(*be_, L.wq, L.bq, L.wk, L.bk, L.wv, L.bv, xn, R, E);
    std::vector<int64_t> segments(static_cast<size_t>(n_img + 1));
    for (int64_t img = 0; img <= n_img; ++img) {
        segments[static_cast<size_t>(img)] = img * T;
    }
    be_->segment_attention(qkv_.q.f32(), qkv_.k.f32(), qkv_.v.f32(), out, R, E, H, segments.data(),
                           static_cast<int>(n_img));
}

std::vector<float> VisionEncoder::encode(const float * pixels, int64_t channels, int64_t height, int64_t width) {
    return encode_batch(pixels, 1, channels, height, width);
}

std::vector<float> VisionEncoder::encode_batch(const float * pixels, int64_t n_images, int64_t channels, int64_t height,
                                               int64_t width) {
    const int64_t S = p_.image_size;
    KC_CHECK(pixels != nullptr && n_images >= 1 && channels == 3 && height == S && width == S,
             "%s: the encoder takes preprocessed images of shape [n >= 1, 3, %lld, %lld], got [%lld, %lld, %lld, %lld]",
             file_->path().c_str(), static_cast<long long>(S), static_cast<long long>(S),
             static_cast<long long>(n_images), static_cast<long long>(channels), static_cast<long long>(height),
             static_cast<long long>(width));
    const int64_t per_image = 3 * S * S;
    for (int64_t i = 0; i < n_images * per_image; ++i) {
        KC_CHECK(std::isfinite(pixels[i]), "encode: pixel value %lld of image %lld is not finite",
                 static_cast<long long>(i % per_image), static_cast<long long>(i / per_image));
    }
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t               n_out_rows = p_.n_output_tokens() * n_output_embd();
    std::vector<float>          out(static_cast<size_t>(n_images * n_out_rows));
    for (int64_t i0 = 0; i0 < n_images; i0 += kMaxBatch) {
        const int64_t            n    = std::min(kMaxBatch, n_images - i0);
        const std::vector<float> rows = encode_locked(pixels + i0 * per_image, n);
        std::copy(rows.begin(), rows.end(), out.begin() + i0 * n_out_rows);
    }
    return out;
}

std::vector<float> VisionEncoder::encode_locked(const float * pixels, int64_t n_img) {
    const int64_t      S = p_.image_size, P = p_.patch_size, G = S / P, N = p_.n_patches(), T = p_.n_positions();
    const int64_t      E = p_.n_embd, F = p_.n_ff, R = n_img * T, Cp = patch_cols_;
    backend::Backend & be = *be_;
    using backend::Buffer;
    const auto floats = [&](int64_t n) { return Buffer(be, static_cast<size_t>(n) * sizeof(float)); };

    // Patches as rows [n_img·N][3·P·P] in the convolution weight's (channel, y, x) order (host preprocessing),
    // zero-padded to the weight's columns.
    std::vector<float> patches(static_cast<size_t>(n_img * N * Cp), 0.0f);
    for (int64_t n = 0; n < n_img * N; ++n) {
        const int64_t img = n / N, gy = (n % N) / G, gx = (n % N) % G;
        float *       row = &patches[static_cast<size_t>(n * Cp)];
        for (int64_t c = 0; c < 3; ++c) {
            for (int64_t ky = 0; ky < P; ++ky) {
                const float * src = pixels + img * 3 * S * S + (c * S + gy * P + ky) * S + gx * P;
                std::memcpy(row + (c * P + ky) * P, src, static_cast<size_t>(P) * sizeof(float));
            }
        }
    }
    const Buffer  d_patches = upload_floats(be, patches);
    const int64_t first     = p_.class_token ? 1 : 0;
    Buffer        x         = floats(R * E);
    if (first == 0) {
        linear(patch_w_, patch_b_, d_patches.f32(), x.f32(), n_img * N);
    } else {
        // [class_embd; the patch rows of every image], then each image's class row and its patch rows gathered.
        Buffer embedded = floats((1 + n_img * N) * E);
        be.upload(embedded.data(), class_embd_.data(), static_cast<size_t>(E) * sizeof(float));
        linear(patch_w_, patch_b_, d_patches.f32(), embedded.f32() + E, n_img * N);
        std::vector<int32_t> rows(static_cast<size_t>(R));
        for (int64_t img = 0; img < n_img; ++img) {
            rows[static_cast<size_t>(img * T)] = 0;
            for (int64_t n = 0; n < N; ++n) {
                rows[static_cast<size_t>(img * T + 1 + n)] = static_cast<int32_t>(1 + img * N + n);
            }
        }
        be.gather_rows(embedded.f32(), rows.data(), R, E, x.f32());
    }
    for (int64_t img = 0; img < n_img; ++img) {
        be.add(x.f32() + img * T * E, pos_embd_.f32(), T * E);
    }

    if (p_.pre_ln) {
        be.layer_norm(x.f32(), pre_ln_w_.f32(), pre_ln_b_.f32(), x.f32(), R, E, p_.eps);
    }
    Buffer xn = floats(R * E), att = floats(R * E), tmp = floats(R * E), ff = floats(R * F);
    for (const Layer & L : layers_) {
        be.layer_norm(x.f32(), L.ln1_w.f32(), L.ln1_b.f32(), xn.f32(), R, E, p_.eps);
        attention(L, xn.f32(), att.f32(), T, n_img);
        linear(L.wo, L.bo, att.f32(), tmp.f32(), R);
        be.add(x.f32(), tmp.f32(), R * E);
        be.layer_norm(x.f32(), L.ln2_w.f32(), L.ln2_b.f32(), xn.f32(), R, E, p_.eps);
        linear(L.w_up, L.b_up, xn.f32(), ff.f32(), R);
        be.activate(p_.act, ff.f32(), nullptr, R, F);
        linear(L.w_down, L.b_down, ff.f32(), tmp.f32(), R);
        be.add(x.f32(), tmp.f32(), R * E);
    }
    if (p_.post_ln) {
        be.layer_norm(x.f32(), post_ln_w_.f32(), post_ln_b_.f32(), x.f32(), R, E, p_.eps);
    }

    const int64_t      n_embd_out = n_output_embd();
    std::vector<float> out;
    if (p_.gemma3_projector) {
        // k x k average pooling of each image's G x G grid, RMSNorm (Gemma3RMSNorm: the stored 1 + w), projection
        // (image by image, as one image's rows are multiplied alone).
        const int64_t side = G / p_.pool_kernel, n_rows = side * side;
        Buffer        pooled = floats(n_img * n_rows * E), proj = floats(n_img * n_rows * n_embd_out);
        be.avg_pool_rms_norm(x.f32(), soft_emb_norm_.f32(), pooled.f32(), n_img, G, p_.pool_kernel, E, p_.eps);
        for (int64_t img = 0; img < n_img; ++img) {
            be.matmul(input_proj_, pooled.f32() + img * n_rows * E, proj.f32() + img * n_rows * n_embd_out, n_rows);
        }
        out.resize(static_cast<size_t>(n_img * n_rows * n_embd_out));
        be.download(out.data(), proj.data(), out.size() * sizeof(float));
        return out;
    }
    // The rows each image feeds the projector (its class token row dropped for select strategy "default").
    const int64_t skip  = p_.class_token && !p_.keep_class_token ? 1 : 0;
    const int64_t n_out = T - skip, M = n_img * n_out;
    Buffer        feats;
    if (skip != 0) {
        std::vector<int32_t> rows;
        for (int64_t img = 0; img < n_img; ++img) {
            for (int64_t t = skip; t < T; ++t) {
                rows.push_back(static_cast<int32_t>(img * T + t));
            }
        }
        feats = floats(M * E);
        be.gather_rows(x.f32(), rows.data(), M, E, feats.f32());
    } else {
        feats = std::move(x);
    }
    const Buffer * result = &feats;
    Buffer         hidden, projected;
    if (p_.projector) {
        hidden = floats(M * p_.n_embd_proj);
        linear(mm0_, mm0_b_, feats.f32(), hidden.f32(), M);
        be.activate(p_.projector_act, hidden.f32(), nullptr, M, p_.n_embd_proj);
        projected = floats(M * mm2_.n_out);
        linear(mm2_, mm2_b_, hidden.f32(), projected.f32(), M);
        result = &projected;
    }
    out.resize(static_cast<size_t>(M * n_embd_out));
    be.download(out.data(), result->data(), out.size() * sizeof(float));
    return out;
}

}  // namespace kvcmas::vision
