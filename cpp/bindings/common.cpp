// What both extension modules (`_core`, `_testing`) share: option parsing and error translation.
#include <cstring>

#include "bindings/bindings.h"
#include "common/error.h"

namespace nb = nanobind;

namespace kvcmas::py {

cpu::Activations parse_activations(const std::string & name) {
    if (name == "q8") {
        return cpu::Activations::Q8;
    }
    if (name == "q8-fast") {
        return cpu::Activations::Q8Fast;
    }
    KC_CHECK(name == "f32", "activations must be 'q8', 'q8-fast' or 'f32', got '%s'", name.c_str());
    return cpu::Activations::F32;
}

const char * activations_name(cpu::Activations act) {
    return act == cpu::Activations::Q8 ? "q8" : act == cpu::Activations::Q8Fast ? "q8-fast" : "f32";
}

void translate_errors(nb::handle error_type) {
    error_type.inc_ref();  // held for the life of the process, as the translator is
    nb::register_exception_translator(
        [](const std::exception_ptr & p, void * payload) {
            try {
                std::rethrow_exception(p);
            } catch (const kvcmas::Error & e) {
                PyObject * msg =
                    PyUnicode_DecodeUTF8(e.what(), static_cast<Py_ssize_t>(std::strlen(e.what())), "replace");
                PyErr_SetObject(static_cast<PyObject *>(payload), msg);
                Py_XDECREF(msg);
            }
        },
        error_type.ptr());
}

}  // namespace kvcmas::py
