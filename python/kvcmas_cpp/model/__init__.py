"""The Python face of the engine, one concept per module: the loaded model (`model.Model`, the only door to the text
core), its KV sequences (`sequence`), image rows and their positions (`image_rows`), generation (`generation`), chat
(`chat`), model files (`files`) and the core's argument checks (`checks`). Import the public names from here."""

from ..token_stream import Completion, CompletionChunk
from .checks import INT32_MAX, MAX_THREADS_PER_CPU, SIZE_MAX, token_ids, usable_cpus
from .files import default_model_path, resolve_model_path
from .generation import collect_completion
from .image_rows import BidirectionalRows, ImageFeatures, image_pos_of, is_bidirectional, mrope_offsets
from .model import Model
from .sequence import PROMPT_CHUNK, KVSequence, SharedKV

# Completion and CompletionChunk live in token_stream: importable from here too
__all__ = [
    "INT32_MAX",
    "MAX_THREADS_PER_CPU",
    "PROMPT_CHUNK",
    "SIZE_MAX",
    "BidirectionalRows",
    "Completion",
    "CompletionChunk",
    "ImageFeatures",
    "KVSequence",
    "Model",
    "SharedKV",
    "collect_completion",
    "default_model_path",
    "image_pos_of",
    "is_bidirectional",
    "mrope_offsets",
    "resolve_model_path",
    "token_ids",
    "usable_cpus",
]
