// LeakSanitizer check of the core without a Python host (the interpreter leaks by design at exit, which hides
// ours). Built and run by scripts/ci-sanitize.sh against the ASan build of kvcmas_core:
//
//   leak_check MODEL.gguf SCRATCH_DIR
//
// Loads the model, runs sequences through every KV operation (new, decode, fork, share, append shared rows,
// truncate, remove, decode errors, a sequence left open at exit), and loads many broken copies of the file so that
// every error path of the GGUF reader and the model loader unwinds. Exits 0 when all went as expected; LSan then
// reports any block still allocated and unreachable, and makes the exit code non-zero.
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "common/error.h"
#include "engine/model.h"
#include "gguf/gguf-file.h"

namespace {

int g_failures = 0;

void expect(bool ok, const char * what) {
    if (!ok) {
        std::fprintf(stderr, "leak_check: FAILED: %s\n", what);
        ++g_failures;
    }
}

std::vector<float> decode_tokens(kvcmas::Model & model, int32_t seq, const std::vector<int32_t> & tokens) {
    kvcmas::Batch batch;
    for (size_t i = 0; i < tokens.size(); ++i) {
        batch.items.push_back({ seq, tokens[i], -1, i + 1 == tokens.size() });
    }
    return model.decode(batch);
}

template <typename F>
bool throws_kvcmas_error(F && f) {
    try {
        f();
    } catch (const kvcmas::Error &) {
        return true;
    }
    return false;
}

void exercise_model(const std::string & path) {
    kvcmas::Model model(path, 2, 128, 0);
    const int32_t a = model.seq_new();
    expect(decode_tokens(model, a, { 1, 2, 3, 4, 5, 6, 7, 8 }).size() == static_cast<size_t>(model.params().n_vocab),
           "decode returns one row of logits");
    const int32_t b = model.seq_fork(a);
    decode_tokens(model, b, { 9, 10 });
    decode_tokens(model, a, { 11 });
    kvcmas::KvSegment rows = model.seq_span(a, 2, 4);
    const int32_t     c    = model.seq_new();
    decode_tokens(model, c, { 12, 13 });
    model.seq_append_span(c, rows, nullptr);
    rows.span.reset();
    decode_tokens(model, c, { 14 });
    model.seq_truncate(a, 3);
    decode_tokens(model, a, { 15, 16 });
    expect(throws_kvcmas_error([&] { decode_tokens(model, a, { -5 }); }), "a negative token id is refused");
    expect(throws_kvcmas_error([&] { decode_tokens(model, 12345, { 1 }); }), "an unknown sequence is refused");
    expect(throws_kvcmas_error([&] { model.seq_truncate(b, 1000); }), "truncating past the end is refused");
    std::vector<float> k(
        static_cast<size_t>(model.params().n_layer * 2 * model.params().n_head_kv * model.params().head_dim));
    std::vector<float> v(k.size());
    model.read_kv(c, 0, 2, k.data(), v.data());
    model.seq_remove(b);
    model.seq_remove(a);
    // free blocks go back to the system; c keeps its rows and grows into newly mapped blocks
    const size_t in_use = model.kv_bytes_in_use();
    expect(model.kv_trim() > 0 && model.kv_bytes_allocated() == in_use, "trim releases exactly the free blocks");
    decode_tokens(model, c, std::vector<int32_t>(40, 17));
    // c stays open: the model's destructor must free it.
}

void exercise_broken_files(const std::string & path, const std::string & scratch) {
    std::ifstream           in(path, std::ios::binary);
    const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const std::string       broken = scratch + "/broken.gguf";
    size_t                  errors = 0;
    std::vector<size_t>     cuts;
    for (size_t cut = 0; cut < 4096 && cut < bytes.size(); cut += 7) {
        cuts.push_back(cut);
    }
    cuts.push_back(bytes.size() - 1);
    for (size_t cut : cuts) {
        std::ofstream(broken, std::ios::binary | std::ios::trunc)
            .write(bytes.data(), static_cast<std::streamsize>(cut));
        errors += throws_kvcmas_error([&] { kvcmas::gguf::GgufFile f(broken); });
        errors += throws_kvcmas_error([&] { kvcmas::Model m(broken, 1, 64, 0); });
    }
    expect(errors == 2 * cuts.size(), "every truncated copy is refused by the reader and the loader");
    expect(throws_kvcmas_error([&] { kvcmas::gguf::GgufFile f(scratch + "/missing.gguf"); }),
           "a missing file is refused");
    kvcmas::gguf::GgufFile whole(path);
    expect(throws_kvcmas_error([&] { whole.get_string("no.such.key"); }), "a missing key is refused");
}

}  // namespace

int main(int argc, char ** argv) {
    if (argc != 3) {
        std::fprintf(stderr, "usage: leak_check MODEL.gguf SCRATCH_DIR\n");
        return 2;
    }
    try {
        exercise_model(argv[1]);
        exercise_broken_files(argv[1], argv[2]);
    } catch (const std::exception & e) {
        std::fprintf(stderr, "leak_check: unexpected exception: %s\n", e.what());
        return 1;
    }
    std::printf("leak_check: %s\n", g_failures == 0 ? "ok" : "FAILED");
    return g_failures == 0 ? 0 : 1;
}
