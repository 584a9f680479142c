#include "gguf/gguf-file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>

#include "common/error.h"

namespace kvcmas::gguf {

namespace {

constexpr uint32_t kMagic            = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr size_t   kDefaultAlignment = 32;
constexpr int      kMaxDims          = 4;
// Arrays of arrays recurse; a crafted file could nest them millions deep and exhaust the stack.
constexpr int      kMaxArrayDepth = 16;
constexpr uint32_t kMaxValueType  = static_cast<uint32_t>(ValueType::FLOAT64);

// The smallest number of bytes one element of `t` takes in the file, so that a count can be checked against the
// bytes left before anything is allocated for it.
size_t min_encoded_size(ValueType t) {
    switch (t) {
        case ValueType::UINT8:
        case ValueType::INT8:
        case ValueType::BOOL:
            return 1;
        case ValueType::UINT16:
        case ValueType::INT16:
            return 2;
        case ValueType::UINT32:
        case ValueType::INT32:
        case ValueType::FLOAT32:
            return 4;
        case ValueType::UINT64:
        case ValueType::INT64:
        case ValueType::FLOAT64:
        case ValueType::STRING:
            return 8;  // the u64 length
        case ValueType::ARRAY:
            return 12;  // u32 element type + u64 count
    }
    return 1;
}

bool is_integer(ValueType t) {
    switch (t) {
        case ValueType::UINT8:
        case ValueType::INT8:
        case ValueType::UINT16:
        case ValueType::INT16:
        case ValueType::UINT32:
        case ValueType::INT32:
        case ValueType::UINT64:
        case ValueType::INT64:
            return true;
        default:
            return false;
    }
}

bool is_float(ValueType t) {
    return t == ValueType::FLOAT32 || t == ValueType::FLOAT64;
}

// What a parse produces; moved into the GgufFile only once everything has been validated.
struct Parsed {
    uint32_t                                   version     = 0;
    size_t                                     alignment   = kDefaultAlignment;
    size_t                                     data_offset = 0;
    std::vector<std::pair<std::string, Value>> kv;
    std::map<std::string, size_t>              kv_index;
    std::vector<TensorInfo>                    tensors;
    std::map<std::string, size_t>              tensor_index;
};

// Bounds-checked little-endian reader over the mapped bytes. Every failure names the file, what was being read and
// where.
class Reader {
  public:
    Reader(const std::string & path, const uint8_t * data, size_t size) : path_(path), data_(data), size_(size) {}

    size_t pos() const { return pos_; }
    size_t remaining() const { return size_ - pos_; }

    [[noreturn]] void fail(const std::string & problem) const { throw Error(path_ + ": " + problem); }

    void need(size_t n, const std::string & what) const {
        if (n > remaining()) {
            fail(format("truncated: %s at offset %zu needs %zu bytes, only %zu remain", what.c_str(), pos_, n,
                        remaining()));
        }
    }

    template <typename T>
    T read(const std::string & what) {
        need(sizeof(T), what);
        T v;
        std::memcpy(&v, data_ + pos_, sizeof(T));  // the file gives no alignment guarantee
        pos_ += sizeof(T);
        return v;
    }

    std::string read_string(const std::string & what) {
        const size_t   at  = pos_;
        const uint64_t len = read<uint64_t>(what + " length");
        if (len > remaining()) {
            fail(format("%s at offset %zu: string length %llu runs past the end of the file (%zu bytes remain)",
                        what.c_str(), at, static_cast<unsigned long long>(len), remaining()));
        }
        std::string s(reinterpret_cast<const char *>(data_ + pos_), static_cast<size_t>(len));
        pos_ += static_cast<size_t>(len);
        return s;
    }

    // Reads a u64 count of items that take at least `min_item_bytes` each and checks that the rest of the file can
    // hold them, so that absurd counts fail here instead of in an allocation.
    size_t read_count(const std::string & what, size_t min_item_bytes) {
        const size_t   at = pos_;
        const uint64_t n  = read<uint64_t>(what);
        if (n > remaining() / min_item_bytes) {
            fail(format("%s %llu at offset %zu is more than the remaining %zu bytes of the file can hold", what.c_str(),
                        static_cast<unsigned long long>(n), at, remaining()));
        }
        return static_cast<size_t>(n);
    }

  private:
    const std::string & path_;
    const uint8_t *     data_;
    size_t              size_;
    size_t              pos_ = 0;
};

// Strict UTF-8 check (no overlong forms, surrogates or code points above U+10FFFF). Keys and tensor names must
// pass it: they are looked up by Python strings and quoted in error messages, which must be valid text.
bool is_valid_utf8(const std::string & s) {
    const auto * p   = reinterpret_cast<const unsigned char *>(s.data());
    const auto * end = p + s.size();
    while (p < end) {
        const unsigned c  = *p;
        size_t         n  = 0;
        unsigned       lo = 0x80, hi = 0xBF;  // allowed range of the first continuation byte
        if (c < 0x80) {
            ++p;
            continue;
        } else if (c >= 0xC2 && c <= 0xDF) {
            n = 1;
        } else if (c >= 0xE0 && c <= 0xEF) {
            n  = 2;
            lo = c == 0xE0 ? 0xA0 : 0x80;
            hi = c == 0xED ? 0x9F : 0xBF;
        } else if (c >= 0xF0 && c <= 0xF4) {
            n  = 3;
            lo = c == 0xF0 ? 0x90 : 0x80;
            hi = c == 0xF4 ? 0x8F : 0xBF;
        } else {
            return false;
        }
        if (static_cast<size_t>(end - p) <= n || p[1] < lo || p[1] > hi) {
            return false;
        }
        for (size_t k = 2; k <= n; ++k) {
            if (p[k] < 0x80 || p[k] > 0xBF) {
                return false;
            }
        }
        p += n + 1;
    }
    return true;
}

// Reads a key or tensor name, which must be valid UTF-8.
std::string read_name(Reader & r, const std::string & what) {
    const size_t at = r.pos();
    std::string  s  = r.read_string(what);
    if (!is_valid_utf8(s)) {
        r.fail(format("%s at offset %zu is not valid UTF-8", what.c_str(), at));
    }
    return s;
}

ValueType read_value_type(Reader & r, const std::string & what) {
    const size_t   at = r.pos();
    const uint32_t t  = r.read<uint32_t>(what);
    if (t > kMaxValueType) {
        r.fail(format("%s at offset %zu: unknown value type %u", what.c_str(), at, t));
    }
    return static_cast<ValueType>(t);
}

int64_t read_integer(Reader & r, ValueType t, const std::string & what) {
    switch (t) {
        case ValueType::UINT8:
            return r.read<uint8_t>(what);
        case ValueType::INT8:
            return r.read<int8_t>(what);
        case ValueType::UINT16:
            return r.read<uint16_t>(what);
        case ValueType::INT16:
            return r.read<int16_t>(what);
        case ValueType::UINT32:
            return r.read<uint32_t>(what);
        case ValueType::INT32:
            return r.read<int32_t>(what);
        case ValueType::UINT64:
            return static_cast<int64_t>(r.read<uint64_t>(what));  // bits kept, see Value
        case ValueType::INT64:
            return r.read<int64_t>(what);
        case ValueType::BOOL: {
            const size_t  at = r.pos();
            const uint8_t b  = r.read<uint8_t>(what);
            if (b > 1) {
                r.fail(format("%s at offset %zu: bool byte is %u, not 0 or 1", what.c_str(), at, b));
            }
            return b;
        }
        default:
            r.fail(format("%s: %s is not an integer type", what.c_str(), value_type_name(t)));
    }
}

double read_floating(Reader & r, ValueType t, const std::string & what) {
    if (t == ValueType::FLOAT32) {
        return r.read<float>(what);
    }
    return r.read<double>(what);
}

Value read_value(Reader & r, ValueType type, const std::string & what, int depth) {
    Value v;
    v.type = type;
    if (type == ValueType::STRING) {
        v.str = r.read_string(what);
    } else if (is_float(type)) {
        v.f = read_floating(r, type, what);
    } else if (type != ValueType::ARRAY) {
        v.i = read_integer(r, type, what);
    } else {
        if (depth >= kMaxArrayDepth) {
            r.fail(
                format("%s at offset %zu: arrays nested deeper than %d levels", what.c_str(), r.pos(), kMaxArrayDepth));
        }
        v.array_type    = read_value_type(r, what + " element type");
        const size_t n  = r.read_count(what + " array length", min_encoded_size(v.array_type));
        const auto   et = v.array_type;
        if (et == ValueType::STRING) {
            v.strings.reserve(n);
            for (size_t k = 0; k < n; ++k) {
                v.strings.push_back(r.read_string(what));
            }
        } else if (is_float(et)) {
            v.floats.reserve(n);
            for (size_t k = 0; k < n; ++k) {
                v.floats.push_back(read_floating(r, et, what));
            }
        } else if (et == ValueType::ARRAY) {
            v.arrays.reserve(n);
            for (size_t k = 0; k < n; ++k) {
                v.arrays.push_back(read_value(r, ValueType::ARRAY, what, depth + 1));
            }
        } else {
            v.ints.reserve(n);
            for (size_t k = 0; k < n; ++k) {
                v.ints.push_back(read_integer(r, et, what));
            }
        }
    }
    return v;
}

bool checked_mul(uint64_t a, uint64_t b, uint64_t & out) {
    return !__builtin_mul_overflow(a, b, &out);
}

bool checked_add(uint64_t a, uint64_t b, uint64_t & out) {
    return !__builtin_add_overflow(a, b, &out);
}

size_t read_alignment(const Reader & r, const Parsed & p) {
    const auto it = p.kv_index.find("general.alignment");
    if (it == p.kv_index.end()) {
        return kDefaultAlignment;
    }
    const Value & v = p.kv[it->second].second;
    if (!is_integer(v.type)) {
        r.fail(format("general.alignment has type %s, expected an integer", value_type_name(v.type)));
    }
    // UINT64 values above INT64_MAX are stored as negative bits and fail the range check too.
    const int64_t a = v.i;
    if (a <= 0 || (a & (a - 1)) != 0 || a > (int64_t{ 1 } << 30)) {
        r.fail(
            format("general.alignment must be a power of two between 1 and 2^30, got %lld", static_cast<long long>(a)));
    }
    return static_cast<size_t>(a);
}

TensorInfo read_tensor_info(Reader & r, size_t index) {
    TensorInfo t;
    t.name                  = read_name(r, format("tensor #%zu name", index));
    const std::string label = format("tensor '%s'", t.name.c_str());

    const uint32_t n_dims = r.read<uint32_t>(label + " n_dims");
    if (n_dims < 1 || n_dims > static_cast<uint32_t>(kMaxDims)) {
        r.fail(format("%s has %u dimensions (must be 1..%d)", label.c_str(), n_dims, kMaxDims));
    }
    uint64_t n_elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
        const uint64_t ne = r.read<uint64_t>(label + " dimension");
        if (ne > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
            r.fail(format("%s dimension %u is %llu, too large", label.c_str(), d, static_cast<unsigned long long>(ne)));
        }
        if (!checked_mul(n_elements, ne, n_elements) ||
            n_elements > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
            r.fail(format("%s: element count overflows", label.c_str()));
        }
        t.ne.push_back(static_cast<int64_t>(ne));
    }

    const uint32_t               type_id = r.read<uint32_t>(label + " type");
    const GgmlTypeTraits * const traits  = ggml_type_traits(type_id);
    if (traits == nullptr) {
        r.fail(format("%s has unknown type id %u", label.c_str(), type_id));
    }
    t.type = static_cast<GgmlType>(type_id);
    if (t.ne[0] % traits->block != 0) {
        r.fail(format("%s row length %lld is not a multiple of the %s block size %lld", label.c_str(),
                      static_cast<long long>(t.ne[0]), traits->name, static_cast<long long>(traits->block)));
    }
    uint64_t n_bytes = 0;
    if (!checked_mul(static_cast<uint64_t>(n_elements / static_cast<uint64_t>(traits->block)), traits->bytes,
                     n_bytes) ||
        n_bytes > std::numeric_limits<size_t>::max()) {
        r.fail(format("%s: byte size overflows", label.c_str()));
    }
    t.n_bytes = static_cast<size_t>(n_bytes);
    t.offset  = r.read<uint64_t>(label + " offset");
    t.data    = nullptr;
    return t;
}

// Checks each tensor's data range against the data section and the other tensors, then points it into the mapping.
void place_tensors(const Reader & r, Parsed & p, const uint8_t * base, size_t file_size) {
    for (TensorInfo & t : p.tensors) {
        uint64_t begin = 0;
        uint64_t end   = 0;
        if (t.offset % p.alignment != 0) {
            r.fail(format("tensor '%s' offset %llu is not a multiple of the alignment %zu", t.name.c_str(),
                          static_cast<unsigned long long>(t.offset), p.alignment));
        }
        if (!checked_add(p.data_offset, t.offset, begin) || !checked_add(begin, t.n_bytes, end) || end > file_size) {
            r.fail(
                format("tensor '%s' data [offset %llu, %zu bytes] lies past the end of the file (%zu bytes, data "
                       "section at %zu)",
                       t.name.c_str(), static_cast<unsigned long long>(t.offset), t.n_bytes, file_size, p.data_offset));
        }
        t.data = base + begin;
    }
    std::vector<const TensorInfo *> by_offset;
    by_offset.reserve(p.tensors.size());
    for (const TensorInfo & t : p.tensors) {
        if (t.n_bytes > 0) {
            by_offset.push_back(&t);
        }
    }
    std::sort(by_offset.begin(), by_offset.end(),
              [](const TensorInfo * a, const TensorInfo * b) { return a->offset < b->offset; });
    for (size_t k = 1; k < by_offset.size(); ++k) {
        const TensorInfo & prev = *by_offset[k - 1];
        const TensorInfo & next = *by_offset[k];
        if (prev.offset + prev.n_bytes > next.offset) {  // both ends were checked to lie inside the file
            r.fail(format("tensor '%s' data [offset %llu, %zu bytes] overlaps tensor '%s' [offset %llu]",
                          prev.name.c_str(), static_cast<unsigned long long>(prev.offset), prev.n_bytes,
                          next.name.c_str(), static_cast<unsigned long long>(next.offset)));
        }
    }
}

Parsed parse(const std::string & path, const uint8_t * base, size_t size) {
    Reader r(path, base, size);
    Parsed p;

    const uint32_t magic = r.read<uint32_t>("magic");
    if (magic != kMagic) {
        r.fail(format("not a GGUF file (magic bytes %02x %02x %02x %02x, expected \"GGUF\")", base[0], base[1], base[2],
                      base[3]));
    }
    p.version = r.read<uint32_t>("version");
    if (p.version != 2 && p.version != 3) {
        if (__builtin_bswap32(p.version) == 2 || __builtin_bswap32(p.version) == 3) {
            r.fail(format("big-endian GGUF v%u files are not supported (only little-endian)",
                          __builtin_bswap32(p.version)));
        }
        r.fail(format("GGUF version %u is not supported (only versions 2 and 3 are)", p.version));
    }

    // Minimal encodings: a tensor info is name length + n_dims + one dimension + type + offset; a key/value pair
    // is key length + value type + one byte of value.
    const size_t n_tensors = r.read_count("tensor count", 8 + 4 + 8 + 4 + 8);
    const size_t n_kv      = r.read_count("metadata key/value count", 8 + 4 + 1);

    p.kv.reserve(n_kv);
    for (size_t k = 0; k < n_kv; ++k) {
        std::string       key  = read_name(r, format("metadata key #%zu", k));
        const std::string what = format("value of '%s'", key.c_str());
        const ValueType   type = read_value_type(r, what + " type");
        Value             v    = read_value(r, type, what, 0);
        if (!p.kv_index.emplace(key, p.kv.size()).second) {
            r.fail(format("duplicate metadata key '%s'", key.c_str()));
        }
        p.kv.emplace_back(std::move(key), std::move(v));
    }
    p.alignment = read_alignment(r, p);

    p.tensors.reserve(n_tensors);
    for (size_t k = 0; k < n_tensors; ++k) {
        TensorInfo t = read_tensor_info(r, k);
        if (!p.tensor_index.emplace(t.name, p.tensors.size()).second) {
            r.fail(format("duplicate tensor name '%s'", t.name.c_str()));
        }
        p.tensors.push_back(std::move(t));
    }

    // The data section starts at the next multiple of the alignment. A file without tensors may end before it.
    uint64_t data_offset = 0;
    if (!checked_add(r.pos(), p.alignment - 1, data_offset)) {
        r.fail("data section offset overflows");
    }
    p.data_offset = static_cast<size_t>(data_offset - data_offset % p.alignment);
    place_tensors(r, p, base, size);
    return p;
}

// Closes a file descriptor on every path out of the constructor.
struct FdCloser {
    int fd;
    ~FdCloser() {
        if (fd >= 0) {
            ::close(fd);
        }
    }
};

}  // namespace

const char * value_type_name(ValueType t) {
    switch (t) {
        case ValueType::UINT8:
            return "uint8";
        case ValueType::INT8:
            return "int8";
        case ValueType::UINT16:
            return "uint16";
        case ValueType::INT16:
            return "int16";
        case ValueType::UINT32:
            return "uint32";
        case ValueType::INT32:
            return "int32";
        case ValueType::FLOAT32:
            return "float32";
        case ValueType::BOOL:
            return "bool";
        case ValueType::STRING:
            return "string";
        case ValueType::ARRAY:
            return "array";
        case ValueType::UINT64:
            return "uint64";
        case ValueType::INT64:
            return "int64";
        case ValueType::FLOAT64:
            return "float64";
    }
    return "unknown";
}

int64_t TensorInfo::n_elements() const {
    int64_t n = 1;
    for (int64_t d : ne) {
        n *= d;  // the product was checked against INT64_MAX when the file was parsed
    }
    return n;
}

GgufFile::GgufFile(const std::string & path) : path_(path) {
    const FdCloser fd{ ::open(path.c_str(), O_RDONLY | O_CLOEXEC) };
    if (fd.fd < 0) {
        fail("%s: cannot open: %s", path.c_str(), std::strerror(errno));
    }
    struct stat st{};
    if (::fstat(fd.fd, &st) != 0) {
        fail("%s: cannot stat: %s", path.c_str(), std::strerror(errno));
    }
    if (S_ISDIR(st.st_mode)) {
        fail("%s: is a directory, not a GGUF file", path.c_str());
    }
    if (!S_ISREG(st.st_mode)) {
        fail("%s: not a regular file", path.c_str());
    }
    if (st.st_size == 0) {
        fail("%s: file is empty, not a GGUF file", path.c_str());
    }
    const size_t size = static_cast<size_t>(st.st_size);
    void *       map  = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd.fd, 0);
    if (map == MAP_FAILED) {
        fail("%s: cannot map %zu bytes: %s", path.c_str(), size, std::strerror(errno));
    }
    Parsed p;
    try {
        p = parse(path, static_cast<const uint8_t *>(map), size);
    } catch (...) {
        ::munmap(map, size);
        throw;
    }
    map_          = map;
    size_         = size;
    version_      = p.version;
    alignment_    = p.alignment;
    data_offset_  = p.data_offset;
    kv_           = std::move(p.kv);
    kv_index_     = std::move(p.kv_index);
    tensors_      = std::move(p.tensors);
    tensor_index_ = std::move(p.tensor_index);
}

GgufFile::~GgufFile() {
    if (map_ != nullptr) {
        ::munmap(map_, size_);
    }
}

void GgufFile::release_resident() const {
    if (map_ != nullptr) {
        ::madvise(map_, size_, MADV_DONTNEED);
    }
}

const Value * GgufFile::find(const std::string & key) const {
    const auto it = kv_index_.find(key);
    return it == kv_index_.end() ? nullptr : &kv_[it->second].second;
}

const TensorInfo * GgufFile::find_tensor(const std::string & name) const {
    const auto it = tensor_index_.find(name);
    return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

std::string GgufFile::get_string(const std::string & key) const {
    const Value * v = find(key);
    KC_CHECK(v != nullptr, "%s: metadata key '%s' is missing", path_.c_str(), key.c_str());
    KC_CHECK(v->type == ValueType::STRING, "%s: metadata key '%s' has type %s, expected string", path_.c_str(),
             key.c_str(), value_type_name(v->type));
    return v->str;
}

int64_t GgufFile::get_int(const std::string & key) const {
    const Value * v = find(key);
    KC_CHECK(v != nullptr, "%s: metadata key '%s' is missing", path_.c_str(), key.c_str());
    KC_CHECK(is_integer(v->type), "%s: metadata key '%s' has type %s, expected an integer", path_.c_str(), key.c_str(),
             value_type_name(v->type));
    KC_CHECK(!(v->type == ValueType::UINT64 && v->i < 0), "%s: metadata key '%s' value %llu does not fit int64",
             path_.c_str(), key.c_str(), static_cast<unsigned long long>(v->i));
    return v->i;
}

int64_t GgufFile::get_int(const std::string & key, int64_t fallback) const {
    return find(key) == nullptr ? fallback : get_int(key);
}

double GgufFile::get_float(const std::string & key) const {
    const Value * v = find(key);
    KC_CHECK(v != nullptr, "%s: metadata key '%s' is missing", path_.c_str(), key.c_str());
    if (is_float(v->type)) {
        return v->f;
    }
    KC_CHECK(is_integer(v->type), "%s: metadata key '%s' has type %s, expected a number", path_.c_str(), key.c_str(),
             value_type_name(v->type));
    if (v->type == ValueType::UINT64) {
        return static_cast<double>(static_cast<uint64_t>(v->i));
    }
    return static_cast<double>(v->i);
}

double GgufFile::get_float(const std::string & key, double fallback) const {
    return find(key) == nullptr ? fallback : get_float(key);
}

bool GgufFile::get_bool(const std::string & key, bool fallback) const {
    const Value * v = find(key);
    if (v == nullptr) {
        return fallback;
    }
    KC_CHECK(v->type == ValueType::BOOL, "%s: metadata key '%s' has type %s, expected bool", path_.c_str(), key.c_str(),
             value_type_name(v->type));
    return v->i != 0;
}

}  // namespace kvcmas::gguf
