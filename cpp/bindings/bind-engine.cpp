#include "bindings/bindings.h"

namespace kvcmas::py {

void bind_engine(nanobind::module_ & m) { (void) m; }

}  // namespace kvcmas::py
