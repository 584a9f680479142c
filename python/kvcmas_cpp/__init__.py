"""kvcmas: a llama.cpp-style inference engine for multi-agent serving with cross-agent KV sharing."""

from __future__ import annotations

__version__ = "0.1.0"

from ._native import KvcmasError, backends, supported_architectures
from .agents import Agent, AgentSession, Response, ResponseChunk
from .model import Completion, CompletionChunk, KVSequence, Model, SharedKV, default_model_path
from .token_stream import Timings

__all__ = [
    "Agent",
    "AgentSession",
    "Response",
    "ResponseChunk",
    "Completion",
    "CompletionChunk",
    "KVSequence",
    "KvcmasError",
    "Model",
    "SharedKV",
    "Timings",
    "__version__",
    "backends",
    "default_model_path",
    "supported_architectures",
]
