#include "vision/vision-encoder.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/cpu/quants.h"
#include "common/error.h"
#include "engine/tensor-loader.h"
#include "vision/vision-names.h"

namespace kvcmas::vision {

namespace names = vision_names;

VisionEncoder::VisionEncoder(const std::string & path, int n_threads)
    : file_(std::make_unique<gguf::GgufFile>(path)), pool_(encoder_threads(n_threads)) {
    load_params();
    load_weights();
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
        return loader.matrix(name, n_in, n_out);
    };
    const auto vector_f32 = [&](const std::string & name, int64_t n, bool required) {
        return loader.vector_f32(name, n, required);
    };
    const int64_t E = p_.n_embd, F = p_.n_ff, P = p_.patch_size;
    const char *  path = file_->path().c_str();
    auto          w    = [](const std::string & base) { return base + ".weight"; };
    auto          b    = [](const std::string & base) { return base + ".bias"; };

    patch_w_       = weight(w(names::kTensorPatchEmbd), 3 * P * P, E);
    patch_b_       = vector_f32(b(names::kTensorPatchEmbd), E, false);
    class_embd_    = vector_f32(names::kTensorClassEmbd, E, false);
    p_.class_token = !class_embd_.empty();
    pos_embd_      = vector_f32(w(names::kTensorPosEmbd), p_.n_positions() * E, true);
    pre_ln_w_      = vector_f32(w(names::kTensorPreLn), E, false);
    p_.pre_ln      = !pre_ln_w_.empty();
    pre_ln_b_      = vector_f32(b(names::kTensorPreLn), E, p_.pre_ln);
    post_ln_w_     = vector_f32(w(names::kTensorPostLn), E, false);
    p_.post_ln     = !post_ln_w_.empty();
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
    input_proj_         = cpu::WeightView{ GgmlType::F32, input_proj_t_.data(), E, n_out, sizeof(float) * E };
    soft_emb_norm_      = loader.vector_f32(names::kTensorMmSoftEmbNorm, E, true);
    p_.projector        = true;
    p_.gemma3_projector = true;
    p_.n_embd_proj      = E;
}

std::vector<float> VisionEncoder::gemma3_project(const float * x) {
    const int64_t      E = p_.n_embd, G = p_.image_size / p_.patch_size, k = p_.pool_kernel, side = G / k;
    const int64_t      n_out = side * side;
    std::vector<float> pooled(static_cast<size_t>(n_out * E));
    // AvgPool2d(k, k) over the G x G grid (patch n at row n / G, column n % G), row-major output; each window is
    // summed in float and divided by k², then each row is RMS-normalised (Gemma3RMSNorm: the stored 1 + w).
    pool_.run([&](int ith, int nth) {
        long long t0, t1;
        cpu::split_range(n_out, ith, nth, t0, t1);
        for (long long t = t0; t < t1; ++t) {
            const int64_t oy = t / side, ox = t % side;
            float *       dst = &pooled[static_cast<size_t>(t * E)];
            for (int64_t ky = 0; ky < k; ++ky) {
                for (int64_t kx = 0; kx < k; ++kx) {
                    const float * src = x + ((oy * k + ky) * G + ox * k + kx) * E;
                    for (int64_t e = 0; e < E; ++e) {
                        dst[e] += src[e];
                    }
                }
            }
            const float inv = 1.0f / static_cast<float>(k * k);
            double      ss  = 0.0;
            for (int64_t e = 0; e < E; ++e) {
                dst[e] *= inv;
                ss += static_cast<double>(dst[e]) * dst[e];
            }
            const float r = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(E)) + p_.eps);
            for (int64_t e = 0; e < E; ++e) {
                dst[e] = dst[e] * r * soft_emb_norm_[static_cast<size_t>(e)];
            }
        }
    });
    std::vector<float> out(static_cast<size_t>(n_out * input_proj_.n_out));
    linear(input_proj_, {}, pooled.data(), out.data(), n_out);
    return out;
}

void VisionEncoder::linear(const cpu::WeightView & w, const std::vector<float> & b, const float * x, float * y,
                           int64_t n_tok) {
    vision::linear(w, b, x, y, n_tok, pool_);
}

// Multi-head attention without a mask, within each of n_img images of T rows (rows of different images never see
// each other): vision-ops.h's segment_attention with one segment per image.
void VisionEncoder::attention(const Layer & L, const float * xn, float * out, int64_t T, int64_t n_img) {
    const int64_t E = p_.n_embd, H = p_.n_head, R = T * n_img;
    // Buffers live in the encoder (calls are serialised): fresh ones per layer cost page faults on every encode.
    AttentionScratch & sc = scratch_;
    for (std::vector<float> * buf : { &sc.q, &sc.k, &sc.v }) {
        buf->resize(static_cast<size_t>(R * E));
    }
    linear(L.wq, L.bq, xn, sc.q.data(), R);
    linear(L.wk, L.bk, xn, sc.k.data(), R);
    linear(L.wv, L.bv, xn, sc.v.data(), R);
    std::vector<int64_t> segments(static_cast<size_t>(n_img + 1));
    for (int64_t img = 0; img <= n_img; ++img) {
        segments[static_cast<size_t>(img)] = img * T;
    }
    segment_attention(sc.q.data(), sc.k.data(), sc.v.data(), out, E, H, segments, sc.rest, pool_);
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
    const int64_t S = p_.image_size, P = p_.patch_size, G = S / P, N = p_.n_patches(), T = p_.n_positions();
    const int64_t E = p_.n_embd, F = p_.n_ff, C = 3 * P * P, R = n_img * T;

    // Patches as rows [n_img·N][3·P·P] in the convolution weight's (channel, y, x) order.
    std::vector<float> patches(static_cast<size_t>(n_img * N * C));
    pool_.run([&](int ith, int nth) {
        long long n0, n1;
        cpu::split_range(n_img * N, ith, nth, n0, n1);
        for (long long n = n0; n < n1; ++n) {
            const int64_t img = n / N, gy = (n % N) / G, gx = (n % N) % G;
            float *       row = &patches[static_cast<size_t>(n * C)];
            for (int64_t c = 0; c < 3; ++c) {
                for (int64_t ky = 0; ky < P; ++ky) {
                    const float * src = pixels + img * 3 * S * S + (c * S + gy * P + ky) * S + gx * P;
                    std::memcpy(row + (c * P + ky) * P, src, static_cast<size_t>(P) * sizeof(float));
                }
            }
        }
    });
    const int64_t      first = p_.class_token ? 1 : 0;
    std::vector<float> x(static_cast<size_t>(R * E));
    if (first == 0) {
        linear(patch_w_, patch_b_, patches.data(), x.data(), n_img * N);
    } else {
        std::vector<float> embedded(static_cast<size_t>(n_img * N * E));
        linear(patch_w_, patch_b_, patches.data(), embedded.data(), n_img * N);
        for (int64_t img = 0; img < n_img; ++img) {
            float * dst = &x[static_cast<size_t>(img * T * E)];
            std::copy(class_embd_.begin(), class_embd_.end(), dst);
            std::copy(embedded.begin() + img * N * E, embedded.begin() + (img + 1) * N * E, dst + E);
        }
    }
    for (int64_t img = 0; img < n_img; ++img) {
        float * dst = &x[static_cast<size_t>(img * T * E)];
        for (size_t i = 0; i < pos_embd_.size(); ++i) {
            dst[i] += pos_embd_[i];
        }
    }

    auto norm_rows = [&](const std::vector<float> & w, const std::vector<float> & b, const float * src, float * dst) {
        pool_.run([&](int ith, int nth) {
            long long t0, t1;
            cpu::split_range(R, ith, nth, t0, t1);
            for (long long t = t0; t < t1; ++t) {
                layer_norm(src + t * E, w.data(), b.data(), dst + t * E, E, p_.eps);
            }
        });
    };
    auto add_into = [&](float * dst, const float * src, int64_t n) {
        for (int64_t i = 0; i < n; ++i) {
            dst[i] += src[i];
        }
    };
    if (p_.pre_ln) {
        norm_rows(pre_ln_w_, pre_ln_b_, x.data(), x.data());
    }
    std::vector<float> xn(x.size()), att(x.size()), tmp(x.size()), ff(static_cast<size_t>(R * F));
    for (const Layer & L : layers_) {
        norm_rows(L.ln1_w, L.ln1_b, x.data(), xn.data());
        attention(L, xn.data(), att.data(), T, n_img);
        linear(L.wo, L.bo, att.data(), tmp.data(), R);
        add_into(x.data(), tmp.data(), R * E);
        norm_rows(L.ln2_w, L.ln2_b, x.data(), xn.data());
        linear(L.w_up, L.b_up, xn.data(), ff.data(), R);
        pool_.run([&](int ith, int nth) {
            long long t0, t1;
            cpu::split_range(R, ith, nth, t0, t1);
            activate(p_.act, &ff[static_cast<size_t>(t0 * F)], (t1 - t0) * F);
        });
        linear(L.w_down, L.b_down, ff.data(), tmp.data(), R);
        add_into(x.data(), tmp.data(), R * E);
    }
    if (p_.post_ln) {
        norm_rows(post_ln_w_, post_ln_b_, x.data(), x.data());
    }

    if (p_.gemma3_projector) {
        std::vector<float> out;
        for (int64_t img = 0; img < n_img; ++img) {
            const std::vector<float> rows = gemma3_project(&x[static_cast<size_t>(img * T * E)]);
            out.insert(out.end(), rows.begin(), rows.end());
        }
        return out;
    }
    // The rows each image feeds the projector (its class token row dropped for select strategy "default").
    const int64_t      skip  = p_.class_token && !p_.keep_class_token ? 1 : 0;
    const int64_t      n_out = T - skip, M = n_img * n_out;
    std::vector<float> feats(static_cast<size_t>(M * E));
    for (int64_t img = 0; img < n_img; ++img) {
        const auto src = x.begin() + (img * T + skip) * E;
        std::copy(src, src + n_out * E, feats.begin() + img * n_out * E);
    }
    if (!p_.projector) {
        return feats;
    }
    std::vector<float> hidden(static_cast<size_t>(M * p_.n_embd_proj));
    linear(mm0_, mm0_b_, feats.data(), hidden.data(), M);
    pool_.run([&](int ith, int nth) {
        long long t0, t1;
        cpu::split_range(M, ith, nth, t0, t1);
        activate(p_.projector_act, &hidden[static_cast<size_t>(t0 * p_.n_embd_proj)], (t1 - t0) * p_.n_embd_proj);
    });
    std::vector<float> out(static_cast<size_t>(M * mm2_.n_out));
    linear(mm2_, mm2_b_, hidden.data(), out.data(), M);
    return out;
}

}  // namespace kvcmas::vision
