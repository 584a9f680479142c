"""Random-weight GGUF files with the shapes of real models, for benchmarks (scripts/gpu-check.sh makes them on the GPU
machine: the files are too large to travel). The weights are N(0, 0.02) F16 values drawn once into a pool that the
tensors are views of (distinct tensors may repeat values; speed does not depend on them); norms are 1.

    python3 models/make_bench_models.py OUT_DIR [smollm2-135m qwen2-0.5b llama3-8b qwen3-0.6b gemma3-270m]
"""

from __future__ import annotations

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

    @property
    def head_dim(self) -> int:
        return self.head_size or self.n_embd // self.n_head


# The published configurations of these models (config.json on the Hugging Face hub).
SHAPES: dict[str, Shape] = {
    "smollm2-135m": Shape("llama", 576, 30, 9, 3, 1536, 49152, 100000.0, tied=True),
    "qwen2-0.5b": Shape("qwen2", 896, 24, 14, 2, 4864, 151936, 1000000.0, tied=True, qkv_bias=True, rms_eps=1e-6),
    "llama3-8b": Shape("llama", 4096, 32, 32, 8, 14336, 128256, 500000.0, tied=False),
    "qwen3-0.6b": Shape(
        "qwen3", 1024, 28, 16, 8, 3072, 151936, 1000000.0, tied=True, rms_eps=1e-6, head_size=128, qk_norm=True
    ),
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
    ),
}


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
    if s.sliding_window:  # llama.cpp's gemma3 files: the window only (every 6th layer global)
        writer.add_key_value(f"{a}.attention.sliding_window", s.sliding_window, gguf.GGUFValueType.UINT32)
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


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit(__doc__)
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for name in argv[1:] or list(SHAPES):
        t0 = time.perf_counter()
        path = write(name, out / f"bench-{name}-f16.gguf")
        print(f"{path}: {path.stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
