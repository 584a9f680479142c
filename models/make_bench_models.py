"""Random-weight GGUF files with the shapes of real models, for benchmarks (scripts/gpu-check.sh makes them on the GPU
machine: the files are too large to travel). The weights are N(0, 0.02) F16 values drawn once into a pool that the
tensors are views of (distinct tensors may repeat values; speed does not depend on them); norms are 1.

    python3 models/make_bench_models.py OUT_DIR [--quantize Q4_K_M,Q6_K] [--keep-f16] [SHAPE ...]
    (shapes: smollm2-135m qwen2-0.5b llama3-8b qwen3-0.6b gemma3-270m qwen2.5-1.5b llama3.2-1b llama3.2-3b qwen3-4b
    qwen3-30b-a3b-4l, and llama-twin-qwen3-0.6b llama-twin-gemma3-270m llama-twin-qwen3-30b-a3b-4l: see llama_twin)

A shape with a vocabulary carries one of the real size, so llama.cpp loads the file (`kvcmas bench core --compare
llama-cpp`): llama.cpp's own vocabulary file of the family (ggml-vocab-qwen2 for Qwen2.5 and Qwen3, llama-bpe for
Llama 3.2; models/fetch_vocab.py fetches them), or for Gemma 3, whose 262,144-piece SentencePiece vocabulary has no
such file, a synthetic SentencePiece vocabulary of that size (byte pieces, the Gemma special tokens at their ids,
"▁"-prefixed filler pieces). qwen3-30b-a3b-4l is Qwen3-30B-A3B cut to 4 of its 48 layers (every layer full: 128
experts of 768 rows, 8 routed) so that it fits in memory; its speed per layer is the full model's.

--quantize also writes each file in the named llama.cpp file types, made by llama.cpp's own quantizer
(llama_model_quantize through llama-cpp-python, the `bench` extra), so the type mix of a "Q4_K_M" file is the one
people download: its widths are multiples of 256 for the K-quant shapes here (Qwen2.5-1.5B, Llama-3.2-1B/3B,
Qwen3-4B); rows that are not (Qwen2-0.5B's 896) make llama.cpp fall back to other types. The F16 source is deleted
afterwards unless --keep-f16 (it is 2-8 GB at these sizes).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np


@dataclass(frozen=True)
class Shape:
    arch: str
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    rope_theta: float
    tied: bool
    qkv_bias: bool = False
    rms_eps: float = 1e-5
    head_size: int = 0  # 0: n_embd / n_head
    qk_norm: bool = False  # per-head Q/K RMSNorm (qwen3, gemma3)
    post_norms: bool = False  # gemma3: norms after attention and feed-forward
    sliding_window: int = 0  # gemma3: every 6th layer global, the others slide
    vocab: str = ""  # llama.cpp's ggml-vocab-<vocab>.gguf with n_vocab tokens, copied in (llama.cpp needs a vocabulary)
    # or SYNTHETIC_SPM: a generated SentencePiece vocabulary of n_vocab pieces
    n_expert: int = 0  # qwen3moe: routed experts per layer, of which n_expert_used run per token
    n_expert_used: int = 0
    n_ff_exp: int = 0  # each expert's feed-forward width

    @property
    def head_dim(self) -> int:
        return self.head_size or self.n_embd // self.n_head


SYNTHETIC_SPM = "synthetic-spm"
# Qwen3's attention (128-wide heads with per-head Q/K norms) and its vocabulary, dense or MoE.
_qwen3 = functools.partial(Shape, rms_eps=1e-6, head_size=128, qk_norm=True, vocab="qwen2")

# The published configurations of these models (config.json on the Hugging Face hub).
SHAPES: dict[str, Shape] = {
    "smollm2-135m": Shape("llama", 576, 30, 9, 3, 1536, 49152, 100000.0, tied=True),
    "qwen2-0.5b": Shape("qwen2", 896, 24, 14, 2, 4864, 151936, 1000000.0, tied=True, qkv_bias=True, rms_eps=1e-6),
    "llama3-8b": Shape("llama", 4096, 32, 32, 8, 14336, 128256, 500000.0, tied=False),
    "qwen3-0.6b": _qwen3("qwen3", 1024, 28, 16, 8, 3072, 151936, 1000000.0, tied=True),
    "gemma3-270m": Shape(
        "gemma3",
        640,
        18,
        4,
        1,
        2048,
        262144,
        1000000.0,
        tied=True,
        rms_eps=1e-6,
        head_size=256,
        qk_norm=True,
        post_norms=True,
        sliding_window=512,
        vocab=SYNTHETIC_SPM,
    ),
    "qwen2.5-1.5b": Shape(
        "qwen2", 1536, 28, 12, 2, 8960, 151936, 1000000.0, tied=True, qkv_bias=True, rms_eps=1e-6, vocab="qwen2"
    ),
    "llama3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, 128256, 500000.0, tied=True, vocab="llama-bpe"),
    "llama3.2-3b": Shape("llama", 3072, 28, 24, 8, 8192, 128256, 500000.0, tied=True, vocab="llama-bpe"),
    "qwen3-4b": _qwen3("qwen3", 2560, 36, 32, 8, 9728, 151936, 1000000.0, tied=True),
    "qwen3-30b-a3b-4l": _qwen3(
        "qwen3moe", 2048, 4, 32, 4, 6144, 151936, 1000000.0, tied=False, n_expert=128, n_expert_used=8, n_ff_exp=768
    ),
}


def llama_twin(s: Shape) -> Shape:
    """A plain llama of s's size: the same widths, layers, heads, head size, vocabulary and tying, none of the
    architecture's extras (Q/K norms, post-norms, window, experts), so each extra's cost per weight byte shows against
    it. A mixture of experts' twin is the dense llama that reads what one of its tokens reads: its feed-forward is
    n_expert_used x n_ff_exp wide (the chosen experts side by side; only the router's small matrix is left out)."""
    n_ff = s.n_expert_used * s.n_ff_exp if s.n_expert else s.n_ff
    return Shape("llama", s.n_embd, s.n_layer, s.n_head, s.n_head_kv, n_ff, s.n_vocab, s.rope_theta, s.tied,
                 rms_eps=s.rms_eps, head_size=s.head_size, vocab=s.vocab)  # fmt: skip


# "llama-twin-<shape>": the llama twin of each new-architecture shape (`kvcmas bench core --twin`).
TWIN_PREFIX = "llama-twin-"
SHAPES.update({TWIN_PREFIX + n: llama_twin(SHAPES[n]) for n in ("qwen3-0.6b", "gemma3-270m", "qwen3-30b-a3b-4l")})

# llama.cpp file types (enum llama_ftype) that --quantize accepts.
FILE_TYPES = {"Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "Q4_K_S": 14, "Q8_0": 7, "IQ4_XS": 30}


def tensors(s: Shape) -> dict[str, tuple[int, ...]]:
    """GGUF tensor names and numpy shapes ([n_out, n_in] for matrices)."""
    hd, kd = s.head_dim, s.n_head_kv * s.head_dim
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (s.n_vocab, s.n_embd), "output_norm.weight": (s.n_embd,)}
    if not s.tied:
        out["output.weight"] = (s.n_vocab, s.n_embd)
    for il in range(s.n_layer):
        b = f"blk.{il}."
        out.update(
            {
                b + "attn_norm.weight": (s.n_embd,),
                b + "ffn_norm.weight": (s.n_embd,),
                b + "attn_q.weight": (s.n_head * hd, s.n_embd),
                b + "attn_k.weight": (kd, s.n_embd),
                b + "attn_v.weight": (kd, s.n_embd),
                b + "attn_output.weight": (s.n_embd, s.n_head * hd),
            }
        )
        if s.n_expert:  # one [rows, cols] matrix per expert, stacked
            out.update(
                {
                    b + "ffn_gate_inp.weight": (s.n_expert, s.n_embd),
                    b + "ffn_gate_exps.weight": (s.n_expert, s.n_ff_exp, s.n_embd),
                    b + "ffn_up_exps.weight": (s.n_expert, s.n_ff_exp, s.n_embd),
                    b + "ffn_down_exps.weight": (s.n_expert, s.n_embd, s.n_ff_exp),
                }
            )
        else:
            out.update(
                {
                    b + "ffn_gate.weight": (s.n_ff, s.n_embd),
                    b + "ffn_up.weight": (s.n_ff, s.n_embd),
                    b + "ffn_down.weight": (s.n_embd, s.n_ff),
                }
            )
        if s.qkv_bias:
            out.update({b + "attn_q.bias": (s.n_head * hd,), b + "attn_k.bias": (kd,), b + "attn_v.bias": (kd,)})
        if s.qk_norm:
            out.update({b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,)})
        if s.post_norms:
            out.update({b + "post_attention_norm.weight": (s.n_embd,), b + "post_ffw_norm.weight": (s.n_embd,)})
    return out


VOCAB_DIR = Path(__file__).parent / "generated" / "vocab"  # models/fetch_vocab.py fills it


def add_synthetic_spm_vocab(writer: gguf.GGUFWriter, n_vocab: int) -> None:
    """A SentencePiece vocabulary of n_vocab pieces as Gemma's files lay it out: <pad> <eos> <bos> <unk> at ids 0-3,
    the 256 byte pieces, then distinct "▁"-prefixed filler pieces with falling scores (no text of a model)."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581p{i}" for i in range(n_vocab - len(tokens))]
    types = [3, 3, 3, 2] + [6] * 256 + [1] * (n_vocab - 260)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 260 + [-float(i) for i in range(n_vocab - 260)])
    writer.add_token_types(types)
    writer.add_pad_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_bos_token_id(2)
    writer.add_unk_token_id(3)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)


def add_vocab(writer: gguf.GGUFWriter, s: Shape) -> None:
    """Copies the tokenizer.* keys of llama.cpp's vocabulary file for s.vocab (same token count as s.n_vocab)."""
    if s.vocab == SYNTHETIC_SPM:
        add_synthetic_spm_vocab(writer, s.n_vocab)
        return
    path = VOCAB_DIR / f"ggml-vocab-{s.vocab}.gguf"
    if not path.exists():
        sys.exit(f"{path} is missing: run models/fetch_vocab.py (llama.cpp refuses a file without a vocabulary)")
    reader = gguf.GGUFReader(path)
    n_tokens = len(reader.fields["tokenizer.ggml.tokens"].data)
    if n_tokens != s.n_vocab:
        sys.exit(f"{path} has {n_tokens} tokens, the shape needs {s.n_vocab}")
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, field.contents(), vtype)


def write(name: str, path: Path) -> Path:
    s = SHAPES[name]
    shapes = tensors(s)
    largest = max(int(np.prod(sh)) for sh in shapes.values())
    rng = np.random.default_rng(0)
    pool = (rng.standard_normal(largest + 4096, dtype=np.float32) * 0.02).astype(np.float16)
    writer = gguf.GGUFWriter(path, s.arch)
    a = s.arch
    writer.add_key_value("general.name", f"kvcmas bench {name} (random weights)", gguf.GGUFValueType.STRING)
    writer.add_key_value(f"{a}.context_length", 32768 + 1024, gguf.GGUFValueType.UINT32)
    writer.add_key_value(f"{a}.embedding_length", s.n_embd, gguf.GGUFValueType.UINT32)
    writer.add_key_value(f"{a}.block_count", s.n_layer, gguf.GGUFValueType.UINT32)
    writer.add_key_value(f"{a}.feed_forward_length", s.n_ff, gguf.GGUFValueType.UINT32)
    writer.add_key_value(f"{a}.attention.head_count", s.n_head, gguf.GGUFValueType.UINT32)
    writer.add_key_value(f"{a}.attention.head_count_kv", s.n_head_kv, gguf.GGUFValueType.UINT32)
    writer.add_key_value(f"{a}.attention.layer_norm_rms_epsilon", s.rms_eps, gguf.GGUFValueType.FLOAT32)
    writer.add_key_value(f"{a}.rope.freq_base", s.rope_theta, gguf.GGUFValueType.FLOAT32)
    if s.head_size:
        writer.add_key_value(f"{a}.attention.key_length", s.head_dim, gguf.GGUFValueType.UINT32)
        writer.add_key_value(f"{a}.attention.value_length", s.head_dim, gguf.GGUFValueType.UINT32)
    if s.n_expert:
        writer.add_key_value(f"{a}.expert_count", s.n_expert, gguf.GGUFValueType.UINT32)
        writer.add_key_value(f"{a}.expert_used_count", s.n_expert_used, gguf.GGUFValueType.UINT32)
        writer.add_key_value(f"{a}.expert_feed_forward_length", s.n_ff_exp, gguf.GGUFValueType.UINT32)
    if s.sliding_window:  # llama.cpp's gemma3 files: the window only (every 6th layer global)
        writer.add_key_value(f"{a}.attention.sliding_window", s.sliding_window, gguf.GGUFValueType.UINT32)
    if s.vocab:
        add_vocab(writer, s)
    for i, (tname, shape) in enumerate(shapes.items()):
        n = int(np.prod(shape))
        if len(shape) == 1:
            data = np.ones(shape, np.float32) if tname.endswith("norm.weight") else pool[:n].astype(np.float32)
        else:
            off = (i * 977) % 4096  # a different start per tensor
            data = pool[off : off + n].reshape(shape)
        writer.add_tensor(tname, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def quantize(src: Path, dst: Path, file_type: str) -> Path:
    """src requantized to llama.cpp file type `file_type` (a FILE_TYPES key) by llama.cpp's quantizer."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FILE_TYPES[file_type]
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize {src} -> {file_type} failed (status {rc})")
    return dst


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="make_bench_models.py", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("shapes", nargs="*", help="shapes to write (default: all): " + ", ".join(SHAPES))
    parser.add_argument("--quantize", default="", help="comma-separated llama.cpp file types: " + ", ".join(FILE_TYPES))
    parser.add_argument("--keep-f16", action="store_true", help="keep the F16 source of quantized files")
    args = parser.parse_args(argv)
    types = [t for t in args.quantize.split(",") if t]
    unknown = [t for t in types if t not in FILE_TYPES]
    if unknown:
        parser.error(f"unknown file type(s) {', '.join(unknown)}; known: {', '.join(FILE_TYPES)}")
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name in args.shapes or list(SHAPES):
        t0 = time.perf_counter()
        path = write(name, args.out_dir / f"bench-{name}-f16.gguf")
        print(f"{path}: {path.stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s", flush=True)
        for ft in types:
            t0 = time.perf_counter()
            q = quantize(path, args.out_dir / f"bench-{name}-{ft.lower()}.gguf", ft)
            print(f"{q}: {q.stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s", flush=True)
        if types and not args.keep_f16:
            path.unlink()


if __name__ == "__main__":
    main(sys.argv[1:])
