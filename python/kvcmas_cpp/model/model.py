"""Model: a GGUF model loaded in the engine, the one door to the text core (`_core`): its shapes, KV memory, the
forward pass, and the doors generation, the sharing layer and adapters go through."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from .. import adapters as lora
from .._native import core
from ..kv_budget import KVBudget
from ..sampling import SamplingParams, max_tokens_count, stop_strings
from ..token_stream import Completion, CompletionChunk
from ..tokenizer import Tokenizer, TokenizerError
from .chat import chat_completion, render_chat_prompt
from .checks import INT32_MAX, MAX_THREADS_PER_CPU, SIZE_MAX, check_count, token_ids, usable_cpus
from .files import default_model_path, read_metadata, read_tensors
from .generation import collect_completion, generate_chunks
from .sequence import KVSequence


class Model:
    """A GGUF model loaded in the kvcmas engine.

    Args:
        path: the GGUF file (architectures llama and qwen2), or the name of a model the store installs
            (`kvcmas models list`, e.g. "qwen2.5-coder-0.5b": its file, checked by size and sha256); default: the
            default model (SmolLM2-135M-Instruct, `default_model_path()`).
        n_threads: compute threads (default: all cores; at most MAX_THREADS_PER_CPU per usable CPU).
        n_ctx: most tokens one sequence may hold (default: the training context, at most 8192).
        kv_budget: bytes all KV blocks may take (default: four full sequences).
        kv_type: how K and V rows are stored: "f32" (default, exact) or "f16" (half the memory and bandwidth,
            like llama.cpp's default; attention still computes in f32).
        activations: what the decode steps' matrix products over quantized weights (every quantized type)
            multiply with: "q8" (default) quantizes the activations per 32 elements in two 8-bit passes for
            integer dot products, like llama.cpp (fast; logits within a stated bound of the exact ones, 100% top-1
            agreement on real text, docs/quant-kernels.md);
            "f32" keeps them exact (the logits transformers computes, to f32 rounding); "q8-fast" is "q8" except
            for Q4_K/Q5_K/Q6_K weights on CPUs with AVX2, whose prefill and decode take one 8-bit pass
            (llama.cpp's accuracy, faster; docs/prefill-kernels.md). F16/BF16/F32 weights and the CUDA backend
            always use f32 activations.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        n_threads: int | None = None,
        n_ctx: int | None = None,
        kv_budget: int | None = None,
        kv_type: Literal["f32", "f16"] = "f32",
        device: str = "cpu",
        activations: Literal["q8", "q8-fast", "f32"] = "q8",
    ) -> None:
        """device: "cpu", or "cuda" / "cuda:N" on a build with the CUDA backend (see `kvcmas_cpp.backends()`)."""
        self.path = default_model_path() if path is None else os.fspath(path)
        if isinstance(self.path, str) and not os.path.exists(self.path):
            from .. import model_store

            if self.path in model_store.MODELS:  # a name, as `--model` takes it
                self.path = model_store.resolve(self.path)
        for name, value, most in (
            ("n_threads", n_threads, INT32_MAX),
            ("n_ctx", n_ctx, INT32_MAX),
            ("kv_budget", kv_budget, SIZE_MAX),
        ):
            if value is not None:
                check_count(name, value, most)
        cpus = usable_cpus()
        if n_threads is not None and n_threads > MAX_THREADS_PER_CPU * cpus:
            raise core.KvcmasError(
                f"n_threads {n_threads} is more than {MAX_THREADS_PER_CPU} per CPU this process may use "
                f"({cpus} CPUs: at most {MAX_THREADS_PER_CPU * cpus}); threads past the cores wait on each other "
                "and slow generation down by orders of magnitude"
            )
        if kv_type not in ("f32", "f16"):
            raise ValueError(f"kv_type must be 'f32' or 'f16', got {kv_type!r}")
        core_args: tuple[Any, ...] = (self.path, n_threads or 0, n_ctx or 0, kv_budget or 0)
        if kv_type != "f32":  # only then: cores built before the option still load models the default way
            core_args += (kv_type,)
        if device != "cpu":  # likewise: cores built before the backend seam have no device argument
            core_args = (*core_args[:4], kv_type, device)
        if activations not in ("q8", "q8-fast", "f32"):
            raise ValueError(f"activations must be 'q8', 'q8-fast' or 'f32', got {activations!r}")
        if activations != "q8":  # likewise: cores built before the option run q8's place with f32
            core_args = (*core_args[:4], kv_type, device, activations)
        self._core = core.Model(*core_args)
        if kv_budget is not None and kv_budget < self.kv_block_bytes:  # no request could ever be served
            raise ValueError(
                f"kv_budget {kv_budget} bytes holds no KV block of this model ({self.kv_block_bytes} bytes, "
                f"{self.kv_block_rows} tokens); one full sequence of {self.n_ctx} tokens takes "
                f"{self.n_ctx * self.kv_row_bytes} bytes"
            )
        self._metadata: dict[str, Any] | None = None
        self._tokenizer: Tokenizer | None = None
        # per-model state other modules keep as long as the model lives (kvcmas_cpp.prefix_cache: its cache)
        self.extensions: dict[str, Any] = {}

    # ----------------------------------------------------------------------------------------------- properties
    arch = property(lambda self: self._core.arch, doc="architecture name from the file ('llama', 'qwen2')")
    device = property(lambda self: getattr(self._core, "device", "cpu"), doc="backend it runs on: 'cpu' or 'cuda'")
    activations = property(
        lambda self: getattr(self._core, "activations", "f32"), doc="'q8', 'q8-fast' or 'f32' (see the constructor)"
    )
    n_vocab = property(lambda self: self._core.n_vocab, doc="vocabulary size")
    n_ctx_train = property(lambda self: self._core.n_ctx_train, doc="context length the model was trained for")
    n_ctx = property(lambda self: self._core.n_ctx, doc="most tokens one sequence may hold")
    n_layer = property(lambda self: self._core.n_layer, doc="transformer blocks")
    n_embd = property(lambda self: self._core.n_embd, doc="hidden size")
    rope_sections = property(
        lambda self: list(self._core.rope_sections), doc="M-RoPE pairs per t / h / w position (empty: one position)"
    )
    n_ff = property(lambda self: self._core.n_ff, doc="feed-forward (MLP) width")
    kv_type = property(lambda self: self._core.kv_type, doc="how K and V rows are stored: 'f32' or 'f16'")
    n_head = property(lambda self: self._core.n_head, doc="query heads")
    n_head_kv = property(lambda self: self._core.n_head_kv, doc="key/value heads")
    n_threads = property(lambda self: self._core.n_threads, doc="compute threads")
    layer_window = property(
        lambda self: list(self._core.layer_window),
        doc="per layer: how many of the last positions a query attends to (sliding window); 0: all of them",
    )

    @property
    def kv_block_rows(self) -> int:
        """Rows (tokens) per KV block: sequences and stored spans take KV memory in whole blocks (the core's)."""
        return int(self._core.kv_block_rows)

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one KV block: kv_block_rows rows of K and V, every layer, in the cache's row type (the core's)."""
        return int(self._core.kv_block_bytes)

    @property
    def kv_row_bytes(self) -> int:
        """Bytes one token's K and V rows take in the cache, every layer, in the cache's row type (kv_type)."""
        return KVBudget(self).row_bytes  # the one byte accounting

    @property
    def kv_budget(self) -> int:
        """Bytes all KV blocks may take (the constructor's kv_budget, or the core's default)."""
        return int(getattr(self._core, "kv_budget", 0) or 0)

    @property
    def n_sequences(self) -> int:
        """KV sequences alive in the engine (stored spans' and forks' included)."""
        return int(self._core.n_seqs)

    @property
    def kv_bytes_in_use(self) -> int:
        """Bytes of the KV blocks that sequences and stored spans hold."""
        return int(self._core.kv_bytes_in_use)

    @property
    def kv_bytes_allocated(self) -> int:
        """Bytes of KV block memory the engine holds: in use plus freed blocks kept for reuse (see kv_trim)."""
        return int(self._core.kv_bytes_allocated)

    def kv_trim(self) -> int:
        """Returns the memory of free KV blocks to the system (a server calls it when idle); returns the bytes
        released. Later sequences map blocks again as they need them."""
        return int(self._core.kv_trim())

    @property
    def metadata(self) -> Mapping[str, Any]:
        """The GGUF metadata (read once, on first use)."""
        if self._metadata is None:
            self._metadata = read_metadata(self.path)
        return self._metadata

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            try:
                self._tokenizer = Tokenizer.from_gguf_metadata(self.metadata)
            except TokenizerError as e:  # the file's vocabulary is at fault: say which file
                raise TokenizerError(f"{os.path.basename(self.path)}: {e}") from None
        return self._tokenizer

    def __repr__(self) -> str:
        return f"Model({self.path!r}, arch={self.arch}, n_layer={self.n_layer}, n_embd={self.n_embd})"

    # ------------------------------------------------------------------------------------------------- text
    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of text; add_special adds BOS when the model wants it. Special tokens in text are parsed."""
        return self.tokenizer.encode(text, add_special=add_special, parse_special=True)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Renders messages with the model's chat template (sandboxed; ChatML when the file has none), as
        transformers' apply_chat_template renders it. Tool calls and a tool list attached by
        kvcmas_cpp.tools.render_tool_messages go to the template as kvcmas_cpp.tools.model_messages says (natively
        where the template renders them). template_kwargs: extra template variables (OpenAI clients'
        `chat_template_kwargs`, e.g. {"enable_thinking": False} for Qwen3); a message list may carry them on a
        message under kvcmas_cpp.chat.TEMPLATE_KWARGS_KEY (how a sharing session's prompt gets them)."""
        return render_chat_prompt(self, messages, add_generation_prompt, template_kwargs)

    # ---------------------------------------------------------------------------------------------- compute
    def _decode(
        self, seqs: Sequence[int], tokens: Sequence[int], want: np.ndarray, rope_deltas: Sequence[int] | None = None
    ) -> np.ndarray:
        offsets = None
        if rope_deltas is not None and self.rope_sections and any(rope_deltas):  # M-RoPE text after an image
            offsets = np.repeat(np.asarray(rope_deltas, dtype=np.int32)[:, None], 3, axis=1)
        return self._core.decode(
            np.asarray(seqs, dtype=np.int32),
            np.asarray(tokens, dtype=np.int32),
            np.asarray(want, dtype=np.uint8),
            rope_offsets=offsets,
        )

    def new_sequence(self) -> KVSequence:
        """An empty KV sequence."""
        return KVSequence(self, self._core.seq_new(), [])

    def decode_batch(self, steps: Sequence[tuple[KVSequence, Sequence[int]]]) -> list[np.ndarray]:
        """Appends tokens to several sequences in one forward pass; returns each sequence's last logits."""
        rows = self.decode_steps(steps, [True] * len(steps))
        return [r for r in rows if r is not None]

    def decode_steps(
        self, steps: Sequence[tuple[KVSequence, Sequence[int]]], want_last: Sequence[bool]
    ) -> list[np.ndarray | None]:
        """Appends tokens to several sequences in one forward pass (a prompt chunk beside other sequences' next
        tokens); returns each sequence's last logits where want_last says so, else None. Nothing is appended when
        the engine refuses the pass (KvcmasError)."""
        seqs: list[int] = []
        toks: list[int] = []
        want: list[int] = []
        steps = [(seq, token_ids(ids, "decode_batch")) for seq, ids in steps]
        for (seq, ids), last in zip(steps, want_last, strict=True):
            if not ids:
                raise ValueError("decode_batch: every sequence needs at least one token")
            seqs.extend([seq.id] * len(ids))
            toks.extend(ids)
            want.extend([0] * (len(ids) - 1) + [int(bool(last))])
        filled = [seq.check_fill(ids) for seq, ids in steps]
        if any(seq._rope_marks for seq, _ in steps):  # M-RoPE text after an image
            deltas = [seq._delta_at(p) for (seq, ids), k in zip(steps, filled, strict=True)
                      for p in seq._next_positions(k, len(ids))]  # fmt: skip
            out = self._decode(seqs, toks, np.asarray(want, dtype=np.uint8), deltas)
        else:
            out = self._decode(seqs, toks, np.asarray(want, dtype=np.uint8))
        for (seq, ids), k in zip(steps, filled, strict=True):
            seq.record(ids, k)
        rows = iter(out)  # the wanted rows, in order
        return [next(rows) if last else None for last in want_last]

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits [len(ids), n_vocab] (float32) at every position of a fresh sequence holding ids."""
        with self.new_sequence() as seq:
            out = seq.append(ids, logits="all")
        assert out is not None
        return out

    # ------------------------------------------------------------------------------------------- generation
    def generate(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 128,
        temperature: float = 0.8,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repeat_penalty: float = 1.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stream: bool = False,
        sequence: KVSequence | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: Mapping[int, float] | None = None,
        logprobs: int | None = None,
        constraint: Any = None,
        adapter: str | None = None,
        adapter_scale: float = 1.0,
    ) -> Completion | Iterator[CompletionChunk]:
        """Generates a continuation of prompt (text, or token ids).

        temperature 0 is greedy decoding. Stops at an end-of-generation token, a stop string (not included in the
        text), max_tokens or the sequence's end (n_ctx; finish_reason 'length'). stream=True returns an iterator of
        CompletionChunk. `sequence`: continue an existing KV sequence (its rows are reused; prompt is appended to it)
        instead of a fresh one. presence_penalty,
        frequency_penalty, logit_bias: OpenAI's (see SamplingParams). logprobs: None, or report each token's
        logprob and this many alternatives. constraint: a kvcmas_cpp.constrained.Constraint the output follows
        (it ends when the grammar is complete). adapter: the name of a loaded LoRA adapter (load_adapter) to
        generate with, at adapter_scale.
        """
        if isinstance(prompt, str):
            ids = self.tokenize(prompt, add_special=sequence is None or len(sequence) == 0)
        else:
            ids = token_ids(prompt, "generate")
        max_tokens_count(max_tokens, 0)
        params = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repeat_penalty=repeat_penalty,
            seed=seed,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            logit_bias=dict(logit_bias) if logit_bias else None,
        )
        stops = stop_strings(stop)

        def run(seq: KVSequence | None) -> Iterator[CompletionChunk]:
            return generate_chunks(self, ids, max_tokens, params, stops, seq, None, constraint, logprobs)

        chunks = run(sequence) if adapter is None else lora.run_with(self, adapter, adapter_scale, sequence, run)
        if stream:
            return chunks
        return collect_completion(chunks, self.tokenizer, logprobs is not None)

    def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        response_format: Mapping[str, Any] | None = None,
        top_logprobs: int | None = None,
        **kwargs: Any,
    ) -> Completion | Iterator[CompletionChunk]:
        """generate() on the chat-template rendering of messages (with the assistant generation prompt).

        The OpenAI chat options, as the server implements them (one implementation): tools / tool_choice /
        parallel_tool_calls (OpenAI tool objects; the calls come back in Completion.tool_calls, finish_reason
        "tool_calls"; "required" and a named function are enforced by constrained decoding), response_format
        ({"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}), logprobs=True and
        top_logprobs (Completion.logprobs: OpenAI's chat logprobs entries), chat_template_kwargs (template
        variables, e.g. {"enable_thinking": False}). Messages may carry tool_calls and tool messages. Calls are read
        in the model family's format (kvcmas_cpp.tools.tool_format_of), and a thinking model's `<think>` text comes
        back apart, in Completion.reasoning_content. With stream=True the chunks are the raw text (parse it with
        kvcmas_cpp.reasoning.ReasoningStream and kvcmas_cpp.tools.ToolCallStream).
        """
        return chat_completion(
            self, messages, tools, tool_choice, parallel_tool_calls, response_format, top_logprobs, **kwargs
        )

    # ------------------------------------------------------------------------------- the sharing layer's door
    # What kvcmas_cpp.sharing and agents need from the core, so that nothing outside this package reaches _core.
    @property
    def head_dim(self) -> int:
        """Width of one attention head's key (and value) rows."""
        return int(self._core.head_dim)

    @property
    def kv_width(self) -> int:
        """Columns of one layer's K (or V) row: n_head_kv * head_dim (the sharing layer's "kd")."""
        return self.n_head_kv * self.head_dim

    def rope_rotate(self, rows: np.ndarray, shift: int, layer: int = 0) -> np.ndarray:
        """Key rows [n, kv_width] rotated by `shift` positions with layer `layer`'s RoPE (a negative shift rotates
        back: a span's keys to its own positions 0..n-1)."""
        return np.asarray(self._core.rope_rotate(np.ascontiguousarray(rows, dtype=np.float32), int(shift), layer))

    def ridge_correction(self, maps: Any, view: KVSequence, pos: int, n: int, frame0: int, prev: Any = None) -> Any:
        """The core KvCorrection of n span rows that a ridge map set (`_core.RidgeMaps`) predicts from a reader's
        base view (view's rows pos..pos+n-1), in the frame of the stored rows (first stored position frame0), with
        the correction `prev` (a KvCorrection or None) in front of it."""
        return core.ridge_correction(self._core, maps, view.id, pos, n, frame0, prev)

    def materialize_last(self, seq: KVSequence) -> int:
        """Turns the corrected shared rows seq appended last into a private corrected copy (plain attention);
        returns the rows copied."""
        return int(core.seq_materialize_last(self._core, seq.id))

    def correction_bytes(self, seq: KVSequence) -> int:
        """Bytes of the low-rank corrections seq's segments hold."""
        return int(sum(s["corr_bytes"] for s in self.sequence_segments(seq.id)))

    # ---------------------------------------------------------------- the engine's own view (checks and tests)
    def sequence_rows(self, seq_id: int) -> int:
        """Rows the engine holds for sequence `seq_id`, reserved ones included (len(KVSequence) is Python's
        count: the two agree); KvcmasError when the engine holds no such sequence."""
        return int(self._core.seq_length(seq_id))

    def sequence_reserved(self, seq_id: int) -> int:
        """Rows of sequence `seq_id` reserved and not yet computed, as the engine counts them."""
        return int(self._core.seq_reserved(seq_id))

    def sequence_segments(self, seq_id: int) -> list[dict[str, Any]]:
        """The engine's segments of sequence `seq_id` in order: own rows or shared rows read by reference (pos, n,
        shared, shift: the keys' RoPE shift, corr_bytes: the correction they carry)."""
        return list(self._core.seq_segments(seq_id))

    def forward(
        self,
        seqs: np.ndarray,
        tokens: np.ndarray,
        want: np.ndarray,
        embd: np.ndarray | None = None,
        embd_rows: np.ndarray | None = None,
        bidirectional: np.ndarray | None = None,
        rope_offsets: np.ndarray | None = None,
    ) -> np.ndarray:
        """One forward pass of the engine as it takes one (int32 sequence ids and tokens, uint8 logit flags per
        item; input vectors, bidirectional ranges and M-RoPE offsets as the binding documents them), without the
        checks KVSequence makes first: the engine's own refusals (KvcmasError) are what a bad pass gets. Returns
        the flagged items' logits. KVSequence's bookkeeping is not updated: use KVSequence.append to grow one."""
        return self._core.decode(seqs, tokens, want, embd, embd_rows, bidirectional, rope_offsets)

    def continue_generation(
        self,
        seq: KVSequence,
        first_logits: np.ndarray,
        max_tokens: int,
        params: SamplingParams,
        stops: list[str],
        constraint: Any = None,
        logprobs: int | None = None,
    ) -> Iterator[CompletionChunk]:
        """Generates after a prompt already in `seq` whose next-token logits are `first_logits` (an agent session's
        prefilled prompt): the chunks generate(stream=True) gives, the rows appended to seq."""
        return generate_chunks(
            self, list(seq.tokens), max_tokens, params, stops, seq, first_logits, constraint, logprobs
        )

    # ------------------------------------------------------------------------- shapes and files (bench, tools)
    @staticmethod
    def file_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
        """The GGUF metadata of a model file, read without loading the model; KvcmasError (a ValueError) naming the
        file where it is not a GGUF file the core can read."""
        return dict(read_metadata(path))

    @staticmethod
    def file_tensors(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
        """The tensor table of a model file (name, shape, type_name, n_bytes, ...), read without loading the model."""
        return read_tensors(path)

    # --------------------------------------------------------------------------------------- LoRA adapters
    def load_adapter(self, path: str | os.PathLike[str], name: str | None = None) -> lora.Adapter:
        """Loads a GGUF LoRA adapter of this model (`kvcmas convert-lora` writes one from a PEFT folder) under
        `name` (default: the file's stem), for generate/chat(adapter=name) and set_sequence_adapter."""
        path = os.fspath(path)
        name = lora.new_name(self, path, name)
        aid = self._core.load_adapter(path)
        return lora.register(self, name, aid, path, dict(self._core.adapter_info(aid)))

    def unload_adapter(self, name: str) -> None:
        """Frees a loaded adapter (refused while a sequence uses it)."""
        self._core.unload_adapter(lora.lookup(self, name).id)
        lora.forget(self, name)

    @property
    def adapters(self) -> dict[str, lora.Adapter]:
        """The loaded adapters by name."""
        return dict(lora.registry(self))

    def set_sequence_adapter(self, sequence: KVSequence, adapter: str | None, scale: float = 1.0) -> None:
        """Runs the sequence's next tokens with a loaded adapter at `scale` (None: the base model)."""
        lora.set_sequence_adapter(self, sequence, adapter, scale)
