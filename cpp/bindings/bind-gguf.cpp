// Python view of the GGUF reader: `_core.GgufFile(path)` with metadata as plain Python values, the tensor
// directory as dicts, and raw tensor bytes (copies) for tests.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <memory>
#include <string>

#include "bindings/bindings.h"
#include "common/error.h"
#include "gguf/gguf-file.h"

namespace nb = nanobind;

namespace kvcmas::py {

namespace {

using gguf::GgufFile;
using gguf::TensorInfo;
using gguf::Value;
using gguf::ValueType;

// Steals a new reference from the CPython API; a null result means a Python error is already set.
nb::object checked(PyObject * o) {
    if (o == nullptr) {
        throw nb::python_error();
    }
    return nb::steal(o);
}

// Token strings need not be valid UTF-8 (byte-level vocabularies split characters), so decoding never fails.
nb::object to_str(const std::string & s) {
    return checked(PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "replace"));
}

nb::object int_to_py(ValueType t, int64_t i) {
    if (t == ValueType::BOOL) {
        return nb::bool_(i != 0);
    }
    if (t == ValueType::UINT64) {
        return checked(PyLong_FromUnsignedLongLong(static_cast<unsigned long long>(i)));
    }
    return checked(PyLong_FromLongLong(i));
}

nb::object value_to_py(const Value & v);

// Builds a list of `n` items with PyList_SET_ITEM: the vocabulary arrays hold ~50k entries each.
template <typename Convert>
nb::object make_list(size_t n, Convert convert) {
    nb::object list = checked(PyList_New(static_cast<Py_ssize_t>(n)));
    for (size_t k = 0; k < n; ++k) {
        PyList_SET_ITEM(list.ptr(), static_cast<Py_ssize_t>(k), convert(k).release().ptr());
    }
    return list;
}

nb::object array_to_py(const Value & v) {
    const ValueType et = v.array_type;
    switch (et) {
        case ValueType::STRING:
            return make_list(v.strings.size(), [&](size_t k) { return to_str(v.strings[k]); });
        case ValueType::FLOAT32:
        case ValueType::FLOAT64:
            return make_list(v.floats.size(), [&](size_t k) { return checked(PyFloat_FromDouble(v.floats[k])); });
        case ValueType::ARRAY:
            return make_list(v.arrays.size(), [&](size_t k) { return value_to_py(v.arrays[k]); });
        default:
            return make_list(v.ints.size(), [&](size_t k) { return int_to_py(et, v.ints[k]); });
    }
}

nb::object value_to_py(const Value & v) {
    switch (v.type) {
        case ValueType::STRING:
            return to_str(v.str);
        case ValueType::FLOAT32:
        case ValueType::FLOAT64:
            return checked(PyFloat_FromDouble(v.f));
        case ValueType::ARRAY:
            return array_to_py(v);
        default:
            return int_to_py(v.type, v.i);
    }
}

// "uint32", "array[string]", "array[array[int32]]"; an array of arrays whose elements differ (or that is empty)
// is "array[array]".
std::string type_name(const Value & v) {
    if (v.type != ValueType::ARRAY) {
        return gguf::value_type_name(v.type);
    }
    if (v.array_type != ValueType::ARRAY) {
        return std::string("array[") + gguf::value_type_name(v.array_type) + "]";
    }
    if (v.arrays.empty()) {
        return "array[array]";
    }
    const std::string first = type_name(v.arrays[0]);
    for (const Value & inner : v.arrays) {
        if (type_name(inner) != first) {
            return "array[array]";
        }
    }
    return "array[" + first + "]";
}

nb::dict tensor_to_py(const TensorInfo & t) {
    nb::dict d;
    d["name"]      = to_str(t.name);
    d["type"]      = static_cast<uint32_t>(t.type);
    d["type_name"] = ggml_type_name(static_cast<uint32_t>(t.type));
    nb::list shape;
    for (int64_t ne : t.ne) {
        shape.append(ne);
    }
    d["shape"]   = shape;
    d["offset"]  = t.offset;
    d["n_bytes"] = t.n_bytes;
    return d;
}

}  // namespace

void bind_gguf(nb::module_ & m) {
    nb::class_<GgufFile>(m, "GgufFile",
                         "A memory-mapped, fully validated GGUF v2/v3 file. Raises KvcmasError (naming the path and "
                         "the problem) for anything malformed.")
        .def(
            "__init__",
            [](GgufFile * self, nb::object path) {
                // str, bytes and os.PathLike alike; os.fsencode keeps paths that are not valid UTF-8 (surrogate
                // escapes) as the file system's bytes instead of failing the str -> std::string conversion.
                const nb::bytes        raw = nb::cast<nb::bytes>(nb::module_::import_("os").attr("fsencode")(path));
                const std::string      p(raw.c_str(), raw.size());
                nb::gil_scoped_release release;
                new (self) GgufFile(p);
            },
            nb::arg("path"))
        .def_prop_ro(
            "path",
            [](const GgufFile & f) {
                return nb::module_::import_("os").attr("fsdecode")(nb::bytes(f.path().data(), f.path().size()));
            },
            "The path as os.fsdecode gives it (file names that are not UTF-8 keep their bytes as surrogates).")
        .def_prop_ro("version", &GgufFile::version)
        .def_prop_ro("alignment", &GgufFile::alignment)
        .def_prop_ro("file_size", &GgufFile::file_size)
        .def_prop_ro("data_offset", &GgufFile::data_offset, "File offset of the aligned tensor data section.")
        .def(
            "metadata",
            [](const GgufFile & f) {
                nb::dict d;
                for (const auto & [key, value] : f.metadata()) {
                    d[to_str(key)] = value_to_py(value);
                }
                return d;
            },
            "Metadata in file order: int/float/bool/str scalars, (nested) lists for arrays; strings decoded as UTF-8 "
            "with errors='replace'.")
        .def(
            "value_types",
            [](const GgufFile & f) {
                nb::dict d;
                for (const auto & [key, value] : f.metadata()) {
                    d[to_str(key)] = type_name(value);
                }
                return d;
            },
            "Key -> GGUF type name, e.g. 'uint32' or 'array[string]'.")
        .def(
            "tensors",
            [](const GgufFile & f) {
                nb::list out;
                for (const TensorInfo & t : f.tensors()) {
                    out.append(tensor_to_py(t));
                }
                return out;
            },
            "Tensor directory in file order: dicts with name, type (ggml id), type_name, shape (ggml order: "
            "shape[0] is the row length), offset (within the data section) and n_bytes.")
        .def(
            "tensor_bytes",
            [](const GgufFile & f, const std::string & name) {
                const TensorInfo * t = f.find_tensor(name);
                KC_CHECK(t != nullptr, "%s: no tensor named '%s'", f.path().c_str(), name.c_str());
                return nb::bytes(static_cast<const char *>(t->data), t->n_bytes);
            },
            nb::arg("name"), "A copy of the tensor's raw bytes as stored in the file.")
        .def(
            "string_bytes",
            [](const GgufFile & f, const std::string & key) -> nb::object {
                const Value * v = f.find(key);
                KC_CHECK(v != nullptr, "%s: metadata key '%s' is missing", f.path().c_str(), key.c_str());
                const auto as_bytes = [](const std::string & s) { return nb::bytes(s.data(), s.size()); };
                if (v->type == ValueType::STRING) {
                    return as_bytes(v->str);
                }
                KC_CHECK(v->type == ValueType::ARRAY && v->array_type == ValueType::STRING,
                         "%s: metadata key '%s' is not a string or an array of strings", f.path().c_str(), key.c_str());
                return make_list(v->strings.size(), [&](size_t k) { return nb::object(as_bytes(v->strings[k])); });
            },
            nb::arg("key"),
            "The undecoded bytes of a string (bytes) or array-of-strings (list[bytes]) value, for vocabularies whose "
            "tokens are not valid UTF-8.")
        // The typed getters the engine uses; without a fallback a missing key raises.
        .def(
            "get_string", [](const GgufFile & f, const std::string & key) { return to_str(f.get_string(key)); },
            nb::arg("key"))
        .def("get_int", nb::overload_cast<const std::string &>(&GgufFile::get_int, nb::const_), nb::arg("key"))
        .def("get_int", nb::overload_cast<const std::string &, int64_t>(&GgufFile::get_int, nb::const_), nb::arg("key"),
             nb::arg("fallback"))
        .def("get_float", nb::overload_cast<const std::string &>(&GgufFile::get_float, nb::const_), nb::arg("key"))
        .def("get_float", nb::overload_cast<const std::string &, double>(&GgufFile::get_float, nb::const_),
             nb::arg("key"), nb::arg("fallback"))
        .def("get_bool", &GgufFile::get_bool, nb::arg("key"), nb::arg("fallback"))
        .def("__repr__", [](const GgufFile & f) {
            return format("GgufFile('%s', version=%u, %zu keys, %zu tensors)", f.path().c_str(), f.version(),
                          f.metadata().size(), f.tensors().size());
        });
}

}  // namespace kvcmas::py
