// The architectures kvcmas runs, by GGUF general.architecture name. One line per architecture file.
#include "engine/arch/arch.h"

namespace kvcmas {

extern const Architecture kArchLlama;  // arch/llama.cpp
extern const Architecture kArchQwen2;  // arch/qwen2.cpp

static const Architecture * const kArchitectures[] = { &kArchLlama, &kArchQwen2 };

const Architecture * find_architecture(const std::string & name) {
    for (const Architecture * a : kArchitectures) {
        if (name == a->name) {
            return a;
        }
    }
    return nullptr;
}

std::string architecture_names() {
    std::string out;
    for (const Architecture * a : kArchitectures) {
        out += (out.empty() ? "" : ", ") + std::string(a->name);
    }
    return out;
}

}  // namespace kvcmas
