// GGUF reader: memory-maps a GGUF v2 or v3 file and parses its header, metadata and tensor directory.
// Every count, length, offset, size and type read from the file is validated before use; any problem throws
// kvcmas::Error whose message starts with the file path and names what is wrong ("model.gguf: tensor
// 'blk.0.attn_q.weight' data [offset 1234, 5678 bytes] lies past the end of the file (4096 bytes)").
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/ggml-types.h"

namespace kvcmas::gguf {

enum class ValueType : uint32_t {
    UINT8   = 0,
    INT8    = 1,
    UINT16  = 2,
    INT16   = 3,
    UINT32  = 4,
    INT32   = 5,
    FLOAT32 = 6,
    BOOL    = 7,
    STRING  = 8,
    ARRAY   = 9,
    UINT64  = 10,
    INT64   = 11,
    FLOAT64 = 12,
};

const char * value_type_name(ValueType t);

// One metadata value. Scalars fill one field by kind (integers and bool in `i`, except UINT64 values above
// INT64_MAX, which keep their bits in `i` and are reported as uint64 by `type`); arrays fill `array_type` and one
// of the vectors below, by element kind; arrays of arrays fill `arrays`.
struct Value {
    ValueType                type       = ValueType::UINT8;
    ValueType                array_type = ValueType::UINT8;  // element type when type == ARRAY
    int64_t                  i          = 0;                 // integer and bool scalars
    double                   f          = 0.0;               // FLOAT32 / FLOAT64 scalars
    std::string              str;                            // STRING scalar
    std::vector<int64_t>     ints;                           // ARRAY of integers or bools
    std::vector<double>      floats;                         // ARRAY of FLOAT32 / FLOAT64
    std::vector<std::string> strings;                        // ARRAY of STRING
    std::vector<Value>       arrays;                         // ARRAY of ARRAY
};

// One tensor of the directory, validated: 1..4 dimensions, each >= 0 (zero is allowed, as ggml does, and gives an
// empty tensor) with a product that fits int64; a known type with ne[0] a whole number of blocks; offset a multiple
// of the alignment; data inside the file and not overlapping another tensor's.
struct TensorInfo {
    std::string          name;
    GgmlType             type;
    std::vector<int64_t> ne;       // ggml order: ne[0] is the fastest-varying (row length)
    uint64_t             offset;   // from the start of the data section, as stored
    size_t               n_bytes;  // whole tensor
    const void *         data;     // points into the mapping; valid while the GgufFile lives
    int64_t              n_elements() const;
};

// Holds the read-only mapping for its lifetime (released in the destructor). Limits beyond the format's: metadata
// arrays may nest at most 16 deep, general.alignment must be an integer power of two in [1, 2^30], bool bytes must
// be 0 or 1, keys and tensor names must be unique and valid UTF-8. Parsed metadata takes memory proportional to the
// metadata's size in the file; tensor data is never copied.
class GgufFile {
  public:
    // Maps and parses `path`. Throws kvcmas::Error naming the file when it cannot be opened, is not GGUF, has an
    // unsupported version (only 2 and 3 are), or any field is out of range.
    explicit GgufFile(const std::string & path);
    ~GgufFile();
    GgufFile(const GgufFile &)             = delete;
    GgufFile & operator=(const GgufFile &) = delete;

    const std::string & path() const { return path_; }
    uint32_t            version() const { return version_; }
    size_t              alignment() const { return alignment_; }
    size_t              file_size() const { return size_; }
    // File offset of the aligned data section (tensor offsets are relative to it); in a file without tensors it may
    // equal or exceed file_size().
    size_t data_offset() const { return data_offset_; }

    // Metadata in file order.
    const std::vector<std::pair<std::string, Value>> & metadata() const { return kv_; }
    const Value *                                      find(const std::string & key) const;  // nullptr if absent

    // Typed access. The throwing forms name the file and key when the key is missing or has another kind
    // (integer getters accept every integer type; get_float accepts floats and integers).
    std::string get_string(const std::string & key) const;
    int64_t     get_int(const std::string & key) const;
    int64_t     get_int(const std::string & key, int64_t fallback) const;
    double      get_float(const std::string & key) const;
    double      get_float(const std::string & key, double fallback) const;
    bool        get_bool(const std::string & key, bool fallback) const;

    const std::vector<TensorInfo> & tensors() const { return tensors_; }
    const TensorInfo *              find_tensor(const std::string & name) const;  // nullptr if absent

    // Drops this process's page mappings of the file (MADV_DONTNEED): every pointer stays valid and a later read maps
    // its page again from the page cache. For a caller that copied the tensors it reads (no doubled resident size).
    void release_resident() const;

  private:
    std::string                                path_;
    uint32_t                                   version_     = 0;
    size_t                                     alignment_   = 32;
    void *                                     map_         = nullptr;
    size_t                                     size_        = 0;
    size_t                                     data_offset_ = 0;
    std::vector<std::pair<std::string, Value>> kv_;
    std::map<std::string, size_t>              kv_index_;
    std::vector<TensorInfo>                    tensors_;
    std::map<std::string, size_t>              tensor_index_;
};

}  // namespace kvcmas::gguf
