"""kvcmas_convert: Hugging Face checkpoints to GGUF files that kvcmas (and llama.cpp) run.

``convert(HF_DIR, OUT)`` writes a GGUF file; ``kvcmas_settings(metadata)`` reads the ``kvcmas.*`` correction
settings back with their defaults; ``cli.add_subcommands`` adds ``convert`` / ``gguf show`` / ``gguf set`` to an
argparse CLI.
"""

from .constants import KVCMAS_SETTINGS
from .convert import OUTTYPES, ConvertResult, convert
from .errors import ConvertError
from .gguf_tools import read_metadata, set_values
from .gptoss import GptOssModel  # noqa: F401  (registers GptOssForCausalLM)
from .models import MODEL_CLASSES
from .settings import default_settings, kvcmas_settings

__all__ = [
    "KVCMAS_SETTINGS", "MODEL_CLASSES", "OUTTYPES", "ConvertError", "ConvertResult", "convert", "default_settings",
    "kvcmas_settings", "read_metadata", "set_values",
]  # fmt: skip
