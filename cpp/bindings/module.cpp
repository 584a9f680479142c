#include <nanobind/nanobind.h>

#include <cstring>

#include "bindings/bindings.h"
#include "common/error.h"

namespace nb = nanobind;

NB_MODULE(_core, m) {
    m.doc() = "kvcmas C++ core";
    // kvcmas::Error carries a message that names the file or argument at fault. Messages may quote bytes read from a
    // file that are not UTF-8, so they are decoded with replacement characters instead of failing.
    static nb::exception<kvcmas::Error> error_type(m, "KvcmasError", PyExc_ValueError);
    nb::register_exception_translator(
        [](const std::exception_ptr & p, void *) {
            try {
                std::rethrow_exception(p);
            } catch (const kvcmas::Error & e) {
                PyObject * msg =
                    PyUnicode_DecodeUTF8(e.what(), static_cast<Py_ssize_t>(std::strlen(e.what())), "replace");
                PyErr_SetObject(error_type.ptr(), msg);
                Py_XDECREF(msg);
            }
        },
        nullptr);
    kvcmas::py::bind_gguf(m);
    kvcmas::py::bind_kernels(m);
    kvcmas::py::bind_engine(m);
    kvcmas::py::bind_attention(m);
    kvcmas::py::bind_vision(m);
    kvcmas::py::bind_correction(m);
    kvcmas::py::bind_backend(m);
}
