#include "common/ggml-types.h"

#include <cstdio>
#include <limits>
#include <string>

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
    static const GgmlTypeTraits q2_k{ "q2_K", 256, 84, true };
    static const GgmlTypeTraits q3_k{ "q3_K", 256, 110, true };
    static const GgmlTypeTraits q4_k{ "q4_K", 256, 144, true };
    static const GgmlTypeTraits q5_k{ "q5_K", 256, 176, true };
    static const GgmlTypeTraits q6_k{ "q6_K", 256, 210, true };
    static const GgmlTypeTraits q8_k{ "q8_K", 256, 292, false };
    // Known so that files holding them parse and are refused by name (no kernels here).
    static const GgmlTypeTraits iq2_xxs{ "iq2_xxs", 256, 66, false };
    static const GgmlTypeTraits iq2_xs{ "iq2_xs", 256, 74, false };
    static const GgmlTypeTraits iq3_xxs{ "iq3_xxs", 256, 98, false };
    static const GgmlTypeTraits iq1_s{ "iq1_s", 256, 50, false };
    static const GgmlTypeTraits iq4_nl{ "iq4_nl", 32, 18, true };
    static const GgmlTypeTraits iq3_s{ "iq3_s", 256, 110, false };
    static const GgmlTypeTraits iq2_s{ "iq2_s", 256, 82, false };
    static const GgmlTypeTraits iq4_xs{ "iq4_xs", 256, 136, true };
    static const GgmlTypeTraits i8{ "i8", 1, 1, false };
    static const GgmlTypeTraits i16{ "i16", 1, 2, false };
    static const GgmlTypeTraits i32{ "i32", 1, 4, false };
    static const GgmlTypeTraits i64{ "i64", 1, 8, false };
    static const GgmlTypeTraits f64{ "f64", 1, 8, false };
    static const GgmlTypeTraits iq1_m{ "iq1_m", 256, 56, false };
    static const GgmlTypeTraits tq1_0{ "tq1_0", 256, 54, false };
    static const GgmlTypeTraits tq2_0{ "tq2_0", 256, 66, false };
    static const GgmlTypeTraits mxfp4{ "mxfp4", 32, 17, true };  // backend/cpu/quants-mxfp4.h
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
        case 16: return &iq2_xxs;
        case 17: return &iq2_xs;
        case 18: return &iq3_xxs;
        case 19: return &iq1_s;
        case 20: return &iq4_nl;
        case 21: return &iq3_s;
        case 22: return &iq2_s;
        case 23: return &iq4_xs;
        case 24: return &i8;
        case 25: return &i16;
        case 26: return &i32;
        case 27: return &i64;
        case 28: return &f64;
        case 29: return &iq1_m;
        case 30: return &bf16;
        case 34: return &tq1_0;
        case 35: return &tq2_0;
        case 39: return &mxfp4;
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

const char * ggml_weight_type_names() {
    static const std::string names = [] {
        std::string out;
        for (uint32_t id = 0; id < 64; ++id) {
            const GgmlTypeTraits * t = ggml_type_traits(id);
            if (t != nullptr && t->weight) {
                out += (out.empty() ? "" : ", ") + std::string(t->name);
            }
        }
        return out;
    }();
    return names.c_str();
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
