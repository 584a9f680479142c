#include <nanobind/nanobind.h>

#include "bindings/bindings.h"
#include "bindings/testing/testing.h"

namespace nb = nanobind;

NB_MODULE(_testing, m) {
    m.doc() = "kvcmas C++ core: kernels and backend ops one by one, for tests and kernel benchmarks";
    // Errors raise the production module's KvcmasError (one class whichever module failed); importing
    // kvcmas_cpp._native loads `_core` the way the package does (KVCMAS_CORE_PATH included).
    kvcmas::py::translate_errors(nb::module_::import_("kvcmas_cpp._native").attr("KvcmasError"));
    kvcmas::py::bind_kernels(m);
    kvcmas::py::bind_attention(m);
    kvcmas::py::bind_backend(m);
}
