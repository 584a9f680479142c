// The element-wise activations of the vision towers' MLPs and projectors, by what they compute (Hugging Face names
// in parentheses): what Backend::activate applies. A plain description, so that every backend and the vision
// encoders (which read the names from the mmproj file) share one definition.
#pragma once

#include <cstring>

namespace kvcmas {

enum class Activation {
    GeluErf,    // x * Φ(x), exact ("gelu")
    GeluTanh,   // tanh approximation ("gelu_pytorch_tanh", "gelu_new")
    QuickGelu,  // x * sigmoid(1.702 x) ("quick_gelu", OpenAI CLIP)
    Silu,       // x * sigmoid(x) ("silu")
};

// Parses a Hugging Face activation name; returns false when it is not one of the above.
inline bool parse_activation(const char * name, Activation & out) {
    struct Entry {
        const char * name;
        Activation   act;
    };
    static const Entry kEntries[] = {
        { "gelu", Activation::GeluErf },         { "gelu_pytorch_tanh", Activation::GeluTanh },
        { "gelu_new", Activation::GeluTanh },    { "gelu_fast", Activation::GeluTanh },
        { "quick_gelu", Activation::QuickGelu }, { "silu", Activation::Silu },
        { "swish", Activation::Silu },
    };
    for (const Entry & e : kEntries) {
        if (std::strcmp(name, e.name) == 0) {
            out = e.act;
            return true;
        }
    }
    return false;
}

}  // namespace kvcmas
