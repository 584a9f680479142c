"""Writes the seed corpora of the fuzz targets into fuzz/corpus/<target>/ (deterministic; rerun after changes).

gguf: small valid files from gguf-py's writer (every value type, nested arrays, tensors of several types, a custom
alignment, no tensors at all, and a micro llama model the engine loads and runs). tokenizer: texts in several
scripts and with special tokens, and id sequences.
chat: the default model's own template, ChatML and a few hand-written templates in common styles, with messages.
image: tiny images in every supported format and mode, a truncated one and a huge-size header.

    python fuzz/make_corpus.py
"""

from __future__ import annotations

import shutil
import struct
import tempfile
from pathlib import Path

import gguf
import numpy as np

CORPUS = Path(__file__).resolve().parent / "corpus"


def _gguf_bytes(build) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "seed.gguf"
        writer = gguf.GGUFWriter(str(path), "llama")
        build(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path.read_bytes()


def _all_value_types(w: gguf.GGUFWriter) -> None:
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4000000000)
    w.add_int32("t.i32", -2000000000)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float32("t.f32", 1.5)
    w.add_float64("t.f64", -2.25)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.arr_i32", [1, -2, 3])
    w.add_array("t.arr_str", ["a", "", "ü"])
    w.add_array("t.arr_f32", [0.5, 1.0])
    w.add_array("t.arr_arr", [[1, 2], [3]])


def _tensors(w: gguf.GGUFWriter) -> None:
    w.add_uint32("llama.block_count", 1)
    w.add_tensor("a.f32", np.arange(8, dtype=np.float32).reshape(2, 4))
    w.add_tensor("b.f16", np.ones((3, 4), dtype=np.float16))
    q8 = np.zeros((1, 68), dtype=np.uint8)  # one row of 64 Q8_0 values: two blocks of f16 scale + 32 int8
    w.add_tensor("c.q8_0", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("d.empty", np.zeros((0,), dtype=np.float32))


def _aligned(w: gguf.GGUFWriter) -> None:
    w.add_custom_alignment(64)
    w.add_tensor("x", np.full((5,), 2.0, dtype=np.float32))
    w.add_tensor("y", np.full((7,), 3.0, dtype=np.float32))


def _micro_model(w: gguf.GGUFWriter) -> None:
    """The smallest model the engine loads: llama, 1 block, n_embd 16, 2 heads of 8 (1 KV head), n_ff 16, 8 tokens."""
    n_embd, n_ff, n_vocab, head_dim, n_head_kv = 16, 16, 8, 8, 1
    w.add_uint32("llama.block_count", 1)
    w.add_uint32("llama.embedding_length", n_embd)
    w.add_uint32("llama.feed_forward_length", n_ff)
    w.add_uint32("llama.attention.head_count", 2)
    w.add_uint32("llama.attention.head_count_kv", n_head_kv)
    w.add_uint32("llama.context_length", 64)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    rng = np.random.default_rng(7)

    def mat(n_out: int, n_in: int) -> np.ndarray:  # numpy [n_out, n_in] is ggml ne [n_in, n_out]
        return (rng.standard_normal((n_out, n_in)) * 0.2).astype(np.float32)

    w.add_tensor("token_embd.weight", mat(n_vocab, n_embd))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", mat(2 * head_dim, n_embd))
    w.add_tensor("blk.0.attn_k.weight", mat(n_head_kv * head_dim, n_embd).astype(np.float16))
    w.add_tensor("blk.0.attn_v.weight", mat(n_head_kv * head_dim, n_embd))
    w.add_tensor("blk.0.attn_output.weight", mat(n_embd, 2 * head_dim))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("blk.0.ffn_gate.weight", mat(n_ff, n_embd))
    w.add_tensor("blk.0.ffn_up.weight", mat(n_ff, n_embd))
    w.add_tensor("blk.0.ffn_down.weight", mat(n_embd, n_ff))


def write_gguf(folder: Path) -> None:
    seeds = {
        "micro_model.gguf": _gguf_bytes(_micro_model),
        "minimal.gguf": _gguf_bytes(lambda w: None),
        "value_types.gguf": _gguf_bytes(_all_value_types),
        "tensors.gguf": _gguf_bytes(_tensors),
        "aligned64.gguf": _gguf_bytes(_aligned),
    }
    for name, data in seeds.items():
        (folder / name).write_bytes(data)
    v2 = bytearray(seeds["tensors.gguf"])
    v2[4:8] = struct.pack("<I", 2)  # same layout is read as version 2 (only the counts' width differs in v1)
    (folder / "tensors_v2.gguf").write_bytes(bytes(v2))


TEXTS = [
    "Hello, world! How are you today?",
    "def f(x):\n    return x ** 2  # square\n\n",
    "  leading spaces and\ttabs\r\nand CRLF  ",
    "数字 123456789 and 3.14159, émigré café naïve",
    "Привет мир. こんにちは世界。 안녕하세요 🙂👍🏽 🇫🇷",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after<|im_end|><|im_start|>",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "\u0000\u0001\u007f\u00a0\u200b\u2028\ufeff",
]


def write_tokenizer(folder: Path) -> None:
    for i, text in enumerate(TEXTS):
        data = text.encode("utf-8")
        (folder / f"plain_{i}").write_bytes(b"\x00" + data)
        (folder / f"special_{i}").write_bytes(b"\x01" + data)
    (folder / "invalid_utf8").write_bytes(b"\x00ab\xff\xfe\xc3(\xe2\x82")
    id_lists = [[0, 1, 2, 3], [28, 9331, 28, 253, 17], [49151, 49152, 65535], list(range(230, 260))]
    for i, ids in enumerate(id_lists):
        (folder / f"ids_{i}").write_bytes(b"\x02" + b"".join(struct.pack("<H", t) for t in ids))


HAND_TEMPLATES = [
    # Llama-2 style: system folded into the first user turn, alternation enforced with raise_exception.
    "{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}{% set msgs = messages[1:] %}"
    "{% else %}{% set sys = '' %}{% set msgs = messages %}{% endif %}"
    "{% for m in msgs %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}"
    "{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + (sys + '\\n\\n' if loop.first and sys else '') "
    "+ m['content'] | trim + ' [/INST]' }}{% else %}{{ ' ' + m['content'] | trim + ' ' + eos_token }}{% endif %}"
    "{% endfor %}",
    # Namespace, loop controls, tojson and tools.
    "{% set ns = namespace(n=0) %}{% if tools %}{{ tools | tojson(indent=2) }}\n{% endif %}"
    "{% for m in messages %}{% set ns.n = ns.n + 1 %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
    "<{{ m.role | upper }}>{{ m.content | replace('\\n', ' ') }}</{{ m.role }}>{% endfor %}"
    "{% if add_generation_prompt %}<ASSISTANT>{% endif %}{{ ns.n }}",
    # Filters and string methods that templates use.
    "{{ bos_token }}{% for m in messages | selectattr('role', 'ne', 'system') | list %}"
    "{{ m['role'].title() }}: {{ m['content'].strip().split('\\n') | join(' / ') }}{{ '\\n' }}{% endfor %}"
    "{{ strftime_now('%Y') | length > 0 }}",
]


def write_chat(folder: Path, default_template: str) -> None:
    from kvcmas_cpp.chat import CHATML_TEMPLATE

    conversation = ["system", "You are terse.", "user", "Hi!\nTwo lines.", "assistant", "Hello.", "user", "Bye"]
    templates = [default_template, CHATML_TEMPLATE, *HAND_TEMPLATES]
    for i, template in enumerate(templates):
        for flags in (0, 1 | 2 | 4):
            data = bytes([flags]) + "\0".join([template, *conversation]).encode("utf-8")
            (folder / f"template_{i}_flags_{flags}").write_bytes(data)


def write_image(folder: Path) -> None:
    """Tiny images in every supported format and mode, a truncated one, and a header claiming a huge size."""
    import io
    import zlib

    from PIL import Image

    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (7, 5, 3), dtype=np.uint8), "RGB")
    seeds: dict[str, bytes] = {}
    for fmt, mode in (
        ("PNG", "RGB"),
        ("PNG", "RGBA"),
        ("PNG", "L"),
        ("PNG", "P"),
        ("JPEG", "RGB"),
        ("JPEG", "L"),
        ("GIF", "P"),
        ("BMP", "RGB"),
        ("WEBP", "RGB"),
        ("TIFF", "RGB"),
    ):
        buf = io.BytesIO()
        rgb.convert(mode).save(buf, format=fmt)
        seeds[f"{fmt.lower()}-{mode.lower()}"] = buf.getvalue()
    seeds["png-truncated"] = seeds["png-rgb"][: len(seeds["png-rgb"]) // 2]

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)
    seeds["png-huge-header"] = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")
    for name, data in seeds.items():
        (folder / name).write_bytes(data)


def main() -> None:
    from kvcmas_cpp._native import core
    from kvcmas_cpp.model import default_model_path

    default_template = core.GgufFile(default_model_path()).metadata()["tokenizer.chat_template"]
    for name, writer in (("gguf", write_gguf), ("tokenizer", write_tokenizer), ("chat", None), ("image", write_image)):
        folder = CORPUS / name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        if writer is not None:
            writer(folder)
        else:
            write_chat(folder, default_template)


if __name__ == "__main__":
    main()
