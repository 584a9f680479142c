"""`kvcmas bench vision-towers`: one image through each family's vision tower, kvcmas against transformers and
llama.cpp.

For each family a random-weight checkpoint of the real tower's size is built with transformers, converted by
``kvcmas mmproj`` (``convert_mmproj``), and one image is encoded by kvcmas (``encode_pixels``: the tower and
projector, no feature cache), by transformers (``get_image_features`` on the processor's pixel values, with
``torch.set_num_threads`` equal to kvcmas' threads) and, when llama-cpp-python is installed, by llama.cpp's
multimodal library (``mtmd_encode_chunk`` on the same mmproj, CPU, the same threads). Each is warmed up once, then
timed ``--runs`` times (median). The projector writes to 576 columns (the default text model's width, which
llama.cpp's mtmd context needs to match): a real checkpoint's wider output adds one matmul over the image tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

TEXT_WIDTH = 576  # SmolLM2-135M's n_embd: llama.cpp refuses an mmproj whose output width is not the text model's


@dataclass(frozen=True)
class Family:
    """A tower of real size: how transformers builds it and the image it is timed on."""

    name: str
    label: str
    layers: int  # blocks of the real tower
    image_size: tuple[int, int]  # (width, height) of the synthetic photo


FAMILIES = {
    "qwen2.5vl": Family("qwen2.5vl", "Qwen2.5-VL-3B/7B ViT (32 blocks, 1280 wide, windows of 112 px)", 32, (1024, 768)),
    "gemma3": Family("gemma3", "Gemma 3 SigLIP 896 px (27 blocks, 1152 wide) -> 256 tokens", 27, (1024, 768)),
}


def add_tower_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--family", default="qwen2.5vl,gemma3", help="comma-separated: " + ", ".join(FAMILIES))
    p.add_argument("--layers", type=int, default=None, help="tower blocks (default: the real depth)")
    p.add_argument("--runs", type=int, default=3, help="timed runs per engine after one warm-up (median)")
    p.add_argument("--threads", type=int, default=2, help="threads of every engine")
    p.add_argument("--outtype", choices=("f16", "f32"), default="f16", help="the mmproj's matrices")
    p.add_argument("--image", default=None, help="image file (default: a synthetic 1024 x 768 photo)")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp's multimodal path")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")


def _photo(size: tuple[int, int]) -> Any:
    """A smooth synthetic photo (gradients and a disc) of width x height: features do not depend on its content."""
    from PIL import Image

    w, h = size
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    disc = ((x - w / 2) ** 2 + (y - h / 2) ** 2 < (min(w, h) / 3) ** 2).astype(np.float32)
    rgb = np.stack([255 * x / w, 255 * y / h, 200 * disc + 30], axis=-1)
    return Image.fromarray(rgb.clip(0, 255).astype(np.uint8))


def _qwen(layers: int) -> tuple[Any, Any, dict[str, Any]]:
    import transformers

    full = [i for i in (7, 15, 23, 31) if i < layers] or [layers - 1]
    text = dict(vocab_size=256, hidden_size=TEXT_WIDTH, intermediate_size=256, num_hidden_layers=1,
                num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "mrope_section": [16, 8, 8], "rope_theta": 1e6})  # fmt: skip
    vision = dict(depth=layers, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=TEXT_WIDTH,
                  fullatt_block_indexes=full, window_size=112, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2)  # fmt: skip
    ids: dict[str, Any] = dict(
        image_token_id=251, video_token_id=252, vision_start_token_id=253, vision_end_token_id=254
    )
    config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    ip = transformers.Qwen2VLImageProcessorPil()
    return model, ip, {"image_processor": ip.to_dict(), "processor_class": "Qwen2_5_VLProcessor"}


def _gemma3(layers: int) -> tuple[Any, Any, dict[str, Any]]:
    import transformers

    vcfg = transformers.SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=layers,
                                           num_attention_heads=16, image_size=896, patch_size=14,
                                           vision_use_head=False)  # fmt: skip
    tcfg = transformers.Gemma3TextConfig(vocab_size=256, hidden_size=TEXT_WIDTH, intermediate_size=256,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1,
                                         head_dim=64, query_pre_attn_scalar=64)  # fmt: skip
    config = transformers.Gemma3Config(text_config=tcfg, vision_config=vcfg, mm_tokens_per_image=256)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    ip = transformers.Gemma3ImageProcessorPil(size={"height": 896, "width": 896}, image_mean=[0.5] * 3,
                                              image_std=[0.5] * 3, resample=2)  # fmt: skip
    return model, ip, {**ip.to_dict(), "image_seq_length": 256}


BUILDERS: dict[str, Callable[[int], tuple[Any, Any, dict[str, Any]]]] = {"qwen2.5vl": _qwen, "gemma3": _gemma3}
PROCESSOR_FILES = {"qwen2.5vl": "processor_config.json", "gemma3": "preprocessor_config.json"}


def _time_round_robin(engines: dict[str, Callable[[], np.ndarray]], runs: int) -> dict[str, Any]:
    """{name: (median wall seconds, median CPU seconds of the process, last output)}: each engine warmed up once, then
    `runs` rounds of one call each, in turn, so a change of the machine's load reaches every engine alike."""
    out = {name: fn() for name, fn in engines.items()}
    wall: dict[str, list[float]] = {name: [] for name in engines}
    cpu: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(runs):
        for name, fn in engines.items():
            w0, c0 = time.perf_counter(), time.process_time()
            out[name] = fn()
            wall[name].append(time.perf_counter() - w0)
            cpu[name].append(time.process_time() - c0)
    return {n: (statistics.median(wall[n]), statistics.median(cpu[n]), out[n]) for n in engines}


def _kvcmas_features(mmproj: Path, image: Any, threads: int) -> Callable[[], np.ndarray]:
    """kvcmas' tower and projector on the preprocessed image (encode_pixels: no feature cache)."""
    from ..vision import VisionEncoder

    enc = VisionEncoder(mmproj, n_threads=threads)
    pixels = enc.preprocess(image)
    if isinstance(pixels, tuple):  # Qwen2.5-VL: (patches, grid)
        return lambda: enc.encode_pixels(*pixels)
    return lambda: enc.encode_pixels(pixels)


def _torch_features(model: Any, ip: Any, image: Any) -> Callable[[], np.ndarray]:
    import torch

    inputs = ip(images=[image], return_tensors="pt")
    kwargs = {"pixel_values": inputs["pixel_values"]}
    if "image_grid_thw" in inputs:
        kwargs["image_grid_thw"] = inputs["image_grid_thw"]

    def run() -> np.ndarray:
        with torch.inference_mode():
            out = model.model.get_image_features(**kwargs)
        out = getattr(out, "pooler_output", out)
        out = out[0] if isinstance(out, (list, tuple)) else out
        return out.reshape(-1, out.shape[-1]).float().numpy()

    return run


def _llama_cpp_features(mmproj: Path, image: Any, threads: int) -> tuple[Callable[[], np.ndarray], Callable[[], None]]:
    """(encode, close): llama.cpp's mtmd encoding the image's one image chunk on the CPU. Raises RuntimeError naming
    why it cannot (llama-cpp-python missing, the mmproj refused)."""
    import ctypes

    try:
        import llama_cpp
        from llama_cpp import mtmd_cpp as mtmd
    except ImportError as e:
        raise RuntimeError(f"llama-cpp-python is not installed ({e})") from e
    from ..model import resolve_model_path

    llm = llama_cpp.Llama(resolve_model_path(None), n_ctx=256, n_threads=threads, verbose=False)
    params = mtmd.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.print_timings, params.warmup = False, threads, False, False
    ctx = mtmd.mtmd_init_from_file(str(mmproj).encode(), llm.model, params)
    if not ctx:
        llm.close()
        raise RuntimeError(f"llama.cpp's mtmd_init_from_file refused {mmproj.name}")
    rgb = np.ascontiguousarray(np.asarray(image.convert("RGB"), dtype=np.uint8))
    data = rgb.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
    bitmap = mtmd.mtmd_bitmap_init(rgb.shape[1], rgb.shape[0], data)
    chunks = mtmd.mtmd_input_chunks_init()
    marker = mtmd.mtmd_default_marker()
    text = mtmd.mtmd_input_text(marker, len(marker), False, True)
    bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
    if mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1) != 0:
        raise RuntimeError("llama.cpp's mtmd_tokenize failed on the image")
    chunk = next(
        mtmd.mtmd_input_chunks_get(chunks, i)
        for i in range(mtmd.mtmd_input_chunks_size(chunks))
        if mtmd.mtmd_input_chunk_get_type(mtmd.mtmd_input_chunks_get(chunks, i)) == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE
    )
    n_tokens = mtmd.mtmd_input_chunk_get_n_tokens(chunk)

    def run() -> np.ndarray:
        if mtmd.mtmd_encode_chunk(ctx, chunk) != 0:
            raise RuntimeError("llama.cpp's mtmd_encode_chunk failed")
        embd = mtmd.mtmd_get_output_embd(ctx)
        return np.ctypeslib.as_array(embd, shape=(n_tokens * TEXT_WIDTH,)).reshape(n_tokens, TEXT_WIDTH).copy()

    def close() -> None:
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmap)
        mtmd.mtmd_free(ctx)
        llm.close()

    return run, close


def _max_delta(a: np.ndarray, b: np.ndarray) -> tuple[float | None, str]:
    """(max |a - b| or None when the shapes differ, the same as table text with the reference's largest value)."""
    if a.shape != b.shape:
        return None, f"shapes {a.shape} vs {b.shape}"
    d = float(np.abs(a - b).max())
    return d, f"{d:.1e} (|ref| <= {float(np.abs(b).max()):.2g})"


def fill_zero_matrices(model: Any) -> None:
    """Draws N(0, 0.02) values into the matrices transformers initialises to zero (Gemma 3's input projection), so a
    random checkpoint's every matrix is used."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2 and not p.any():
                p.normal_(0.0, 0.02)


def bench_family(fam: Family, args: argparse.Namespace, image: Any, tmp: Path) -> dict[str, Any]:
    import torch

    from kvcmas_convert.vision import convert_mmproj

    layers = args.layers or fam.layers
    torch.manual_seed(0)
    print(f"building {fam.name} ({layers} blocks) with transformers ...", file=sys.stderr)
    model, ip, processor = BUILDERS[fam.name](layers)
    fill_zero_matrices(model)
    folder = tmp / fam.name
    model.save_pretrained(folder)
    (folder / PROCESSOR_FILES[fam.name]).write_text(json.dumps(processor))
    mmproj = tmp / f"{fam.name}-{args.outtype}.gguf"
    convert_mmproj(folder, mmproj, outtype=args.outtype)
    for part in ("model", "language_model"):  # only the tower and projector are timed
        inner = getattr(model.model, part, None)
        if inner is not None and hasattr(inner, "layers"):
            inner.layers = torch.nn.ModuleList()
    row: dict[str, Any] = {"family": fam.name, "layers": layers, "threads": args.threads, "outtype": args.outtype}

    torch.set_num_threads(args.threads)
    engines = {"kvcmas": _kvcmas_features(mmproj, image, args.threads), "torch": _torch_features(model, ip, image)}
    close: Callable[[], None] = lambda: None  # noqa: E731
    row["llama_cpp_s"], row["llama_cpp_note"] = None, "skipped"
    if not args.no_llama_cpp:
        try:
            engines["llama_cpp"], close = _llama_cpp_features(mmproj, image, args.threads)
        except RuntimeError as e:
            row["llama_cpp_note"] = str(e)
    print(f"timing {', '.join(engines)} ({args.threads} threads, torch {torch.__version__}) ...", file=sys.stderr)
    try:
        timed = _time_round_robin(engines, args.runs)
    finally:
        close()
    (row["kvcmas_s"], row["kvcmas_cpu_s"], ours), (row["torch_s"], row["torch_cpu_s"], ref) = (
        timed["kvcmas"],
        timed["torch"],
    )
    row["tokens"] = int(ours.shape[0])
    row["delta_torch"], row["delta_torch_text"] = _max_delta(ours, ref)
    row["ref_max"] = float(np.abs(ref).max())
    if "llama_cpp" in timed:
        row["llama_cpp_s"], row["llama_cpp_cpu_s"], lc = timed["llama_cpp"]
        delta = _max_delta(lc, ref)[1]
        row["llama_cpp_note"] = f"{lc.shape[0]} tokens (its own resize), max abs diff vs transformers {delta}"
    return row


def run_vision_towers(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.family.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown or not names:
        print(f"error: --family {args.family!r}: known families are {', '.join(FAMILIES)}", file=sys.stderr)
        return 2
    if args.runs < 1 or args.threads < 1 or (args.layers is not None and args.layers < 1):
        print("error: --runs, --threads and --layers must be at least 1", file=sys.stderr)
        return 2
    import os

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            fam = FAMILIES[name]
            image = _photo(fam.image_size) if args.image is None else None
            if image is None:
                from PIL import Image

                image = Image.open(args.image).convert("RGB")
            rows.append(bench_family(fam, args, image, Path(tmp)))
    print(f"load average {os.getloadavg()[0]:.1f} at the end; median of {args.runs} rounds after a warm-up; "
          "wall seconds (CPU seconds of the process)\n")  # fmt: skip
    print("| tower | blocks | tokens | mmproj | kvcmas s | transformers s | kvcmas / transformers | llama.cpp s | "
          "kvcmas / llama.cpp | max abs diff vs transformers | llama.cpp |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        lc = r["llama_cpp_s"]
        lc_cells = f"{lc:.1f} ({r['llama_cpp_cpu_s']:.1f}) | {r['kvcmas_s'] / lc:.2f}x" if lc else "- | -"
        print(
            f"| {r['family']} | {r['layers']} | {r['tokens']} | {r['outtype']} | {r['kvcmas_s']:.1f} "
            f"({r['kvcmas_cpu_s']:.1f}) | {r['torch_s']:.1f} ({r['torch_cpu_s']:.1f}) | "
            f"{r['kvcmas_s'] / r['torch_s']:.2f}x | {lc_cells} | {r['delta_torch_text']} | {r['llama_cpp_note']} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0
