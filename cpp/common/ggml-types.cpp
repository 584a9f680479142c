#include "common/ggml-types.h"

#include <cstdio>
#include <limits>

#include "common/error.h"

namespace kvcmas {

const GgmlTypeTraits * ggml_type_traits(uint32_t type_id) {
    static const GgmlTypeTraits f32{ "f32", 1, 4, true };
    static const GgmlTypeTraits f16{ "f16", 1, 2, true };
    static const GgmlTypeTraits bf16{ "bf16", 1, 2, true };
    static const GgmlTypeTraits q4_0{ "q4_0", 32, 18, true };
    static const GgmlTypeTraits q4_1{ "q4_1", 32, 20, true };
    static const GgmlTypeTraits q5_0{ "q5_0", 32, 22, true };
    static const GgmlTypeTraits q5_1{ "q5_1", 32, 24, true };
    static const GgmlTypeTraits q8_0{ "q8_0", 32, 34, true };
    static const GgmlTypeTraits q8_1{ "q8_1", 32, 36, false };
    static const GgmlTypeTraits q2_k{ "q2_K", 256, 84, false };
    static const GgmlTypeTraits q3_k{ "q3_K", 256, 110, false };
    static const GgmlTypeTraits q4_k{ "q4_K", 256, 144, true };
    static const GgmlTypeTraits q5_k{ "q5_K", 256, 176, true };
    static const GgmlTypeTraits q6_k{ "q6_K", 256, 210, true };
    static const GgmlTypeTraits q8_k{ "q8_K", 256, 292, false };
    switch (type_id) {
        case 0: return &f32;
        case 1: return &f16;
        case 2: return &q4_0;
        case 3: return &q4_1;
        case 6: return &q5_0;
        case 7: return &q5_1;
        case 8: return &q8_0;
        case 9: return &q8_1;
        case 10: return &q2_k;
        case 11: return &q3_k;
        case 12: return &q4_k;
        case 13: return &q5_k;
        case 14: return &q6_k;
        case 15: return &q8_k;
        case 30: return &bf16;
        default: return nullptr;
    }
}

const char * ggml_type_name(uint32_t type_id) {
    const GgmlTypeTraits * t = ggml_type_traits(type_id);
    if (t != nullptr) {
        return t->name;
    }
    thread_local char buf[32];
    std::snprintf(buf, sizeof(buf), "type %u", type_id);
    return buf;
}

size_t ggml_row_bytes(GgmlType type, int64_t n) {
    const GgmlTypeTraits * t = ggml_type_traits(static_cast<uint32_t>(type));
    KC_CHECK(t != nullptr, "unknown tensor type %u", static_cast<unsigned>(type));
    KC_CHECK(n >= 0 && n % t->block == 0, "%lld elements of %s is not a whole number of %lld-element blocks",
             static_cast<long long>(n), t->name, static_cast<long long>(t->block));
    const uint64_t blocks = static_cast<uint64_t>(n / t->block);
    KC_CHECK(blocks <= std::numeric_limits<size_t>::max() / t->bytes, "size of %lld %s elements overflows",
             static_cast<long long>(n), t->name);
    return static_cast<size_t>(blocks) * t->bytes;
}

}  // namespace kvcmas
