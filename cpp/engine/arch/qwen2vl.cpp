// qwen2vl (the text model of Qwen2-VL / Qwen2.5-VL): the qwen2 layer (Q/K/V biases, NeoX RoPE pairing) with M-RoPE:
// rope.dimension_sections splits the rotated pairs among the temporal, height and width positions of each token
// (Batch::rope_offsets; text tokens have all three equal, which is plain RoPE).
#include <string>

#include "common/error.h"
#include "engine/arch/decoder.h"
#include "engine/gguf-names.h"

namespace kvcmas {

static void configure(ModelParams & p, const gguf::GgufFile & f) {
    p.rope_neox             = true;
    const std::string   key = p.arch + "." + gguf_names::kArchKeyRopeDimensionSections;
    const gguf::Value * v   = f.find(key);
    KC_CHECK(v != nullptr && v->type == gguf::ValueType::ARRAY && v->ints.size() == 4,
             "%s: %s must be an array of 4 integers (M-RoPE sections: temporal, height, width, unused)",
             f.path().c_str(), key.c_str());
    int64_t sum = 0;
    for (int64_t s : v->ints) {
        KC_CHECK(s >= 0, "%s: %s holds a negative section", f.path().c_str(), key.c_str());
        sum += s;
    }
    KC_CHECK(v->ints[3] == 0 && sum == p.n_rot / 2,
             "%s: %s = [%lld, %lld, %lld, %lld] must split the %lld rotated pairs among the first three sections",
             f.path().c_str(), key.c_str(), static_cast<long long>(v->ints[0]), static_cast<long long>(v->ints[1]),
             static_cast<long long>(v->ints[2]), static_cast<long long>(v->ints[3]),
             static_cast<long long>(p.n_rot / 2));
    p.rope_sections = v->ints;
}

extern const Architecture kArchQwen2;  // arch/qwen2.cpp: the same layer

// (kArchQwen2 is constant-initialized: its pointers are set before this dynamic initialization reads them)
extern const Architecture kArchQwen2Vl = { gguf_names::kArchQwen2Vl, configure, kArchQwen2.load_layer,
                                           kArchQwen2.forward_layer };

}  // namespace kvcmas
