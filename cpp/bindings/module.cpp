#include <nanobind/nanobind.h>

#include "bindings/bindings.h"
#include "common/error.h"

namespace nb = nanobind;

NB_MODULE(_core, m) {
    m.doc() = "kvcmas C++ core";
    // kvcmas::Error carries a message that names the file or argument at fault.
    static nb::exception<kvcmas::Error> error_type(m, "KvcmasError", PyExc_ValueError);
    kvcmas::py::translate_errors(error_type);
    kvcmas::py::bind_gguf(m);
    kvcmas::py::bind_engine(m);
    kvcmas::py::bind_vision(m);
    kvcmas::py::bind_correction(m);
}
