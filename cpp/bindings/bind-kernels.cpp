#include "bindings/bindings.h"

namespace kvcmas::py {

void bind_kernels(nanobind::module_ & m) { (void) m; }

}  // namespace kvcmas::py
