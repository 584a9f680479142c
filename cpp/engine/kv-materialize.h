// A per-sequence corrected copy of a shared span: the alternative to reading the span by reference with its
// low-rank correction fused into attention. A copy costs n rows of KV per reader instead of O(n·r) factors, but
// attention over plain rows is cheaper per call; the method layer chooses per shape (see docs/kvcmas-estimators.md).
#pragma once

#include <cstdint>

namespace kvcmas {

class Model;

// Replaces the last segment of sequence `seq` (rows of a span read by reference, optionally corrected) by a
// private copy of those rows as attention reads them: stored rows + A·B, keys re-rotated from the span's frame to
// the sequence's positions, written in the cache's row type (f16 caches round the corrected rows once). The
// sequence's length and positions do not change; it no longer refers to the span or the correction through that
// segment. Returns the rows copied. Throws kvcmas::Error for an unknown or empty sequence or when the memory budget
// cannot hold the copy (the segment is then left as it was). The caller holds the model's lock (Model::
// materialize_last_segment takes it); the rows are copied by the model's backend (Backend::kv_copy).
int32_t materialize_last_segment(Model & model, int32_t seq);

}  // namespace kvcmas
