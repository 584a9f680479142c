// The architectures kvcmas runs, by GGUF general.architecture name. One line per architecture file.
#include "engine/arch/arch.h"

namespace kvcmas {

extern const Architecture kArchLlama;     // arch/llama.cpp
extern const Architecture kArchQwen2;     // arch/qwen2.cpp
extern const Architecture kArchQwen3;     // arch/qwen3.cpp
extern const Architecture kArchQwen3Moe;  // arch/qwen3moe.cpp
extern const Architecture kArchGemma3;    // arch/gemma3.cpp
extern const Architecture kArchOlmo2;     // arch/olmo2.cpp
extern const Architecture kArchSmollm3;   // arch/smollm3.cpp
extern const Architecture kArchPhi3;      // arch/phi3.cpp
extern const Architecture kArchQwen2Vl;   // arch/qwen2vl.cpp
extern const Architecture kArchGptOss;    // arch/gpt-oss.cpp

static const Architecture * const kArchitectures[] = {
    &kArchLlama, &kArchQwen2,   &kArchQwen3, &kArchQwen3Moe, &kArchGemma3,
    &kArchOlmo2, &kArchSmollm3, &kArchPhi3,  &kArchQwen2Vl,  &kArchGptOss,
};

const Architecture * find_architecture(const std::string & name) {
    for (const Architecture * a : kArchitectures) {
        if (name == a->name) {
            return a;
        }
    }
    return nullptr;
}

std::vector<std::string> registered_architectures() {
    std::vector<std::string> out;
    for (const Architecture * a : kArchitectures) {
        out.emplace_back(a->name);
    }
    return out;
}

std::string architecture_names() {
    std::string out;
    for (const std::string & name : registered_architectures()) {
        out += (out.empty() ? "" : ", ") + name;
    }
    return out;
}

}  // namespace kvcmas
