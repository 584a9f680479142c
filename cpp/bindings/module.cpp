#include <nanobind/nanobind.h>

#include "bindings/bindings.h"
#include "common/error.h"

NB_MODULE(_core, m) {
    m.doc() = "kvcmas C++ core";
    // kvcmas::Error carries a message that names the file or argument at fault.
    nanobind::exception<kvcmas::Error>(m, "KvcmasError", PyExc_ValueError);
    kvcmas::py::bind_gguf(m);
    kvcmas::py::bind_kernels(m);
    kvcmas::py::bind_engine(m);
    kvcmas::py::bind_attention(m);
}
