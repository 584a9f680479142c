"""Vision: the mmproj converter, the C++ CLIP / SigLIP encoder and LLaVA projector, preprocessing, image loading.

References are independent of kvcmas: transformers' CLIPVisionModel / SiglipVisionModel / LlavaForConditionalGeneration
with fixed-seed random weights (no vision-language weights are available offline), transformers' image processors,
and gguf-py for the file layout. Photos are scikit-image's astronaut.png, chelsea.png and coffee.png.
"""

from __future__ import annotations

import importlib.util
import io
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("kvcmas_convert") is None:
    sys.path.insert(0, str(REPO / "convert"))

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
PIL_Image = pytest.importorskip("PIL.Image")
skimage_data = pytest.importorskip("skimage.data")

import kvcmas_convert as kc  # noqa: E402
import kvcmas_cpp  # noqa: E402
from kvcmas_cpp.vision import (  # noqa: E402
    ImageError,
    PreprocessConfig,
    VisionEncoder,
    image_hash,
    load_image,
    preprocess,
)

PHOTOS = Path(skimage_data.__file__).parent
ASTRONAUT, CHELSEA, COFFEE = PHOTOS / "astronaut.png", PHOTOS / "chelsea.png", PHOTOS / "coffee.png"
IMAGE, PATCH = 56, 14  # 4 x 4 patches
SIGLIP_IMAGE = 60  # 4 x 4 patches too, the last 4 pixel rows / columns unused (as SigLIP-so400m's 384 / 14)
N_PATCHES = (IMAGE // PATCH) ** 2


def _vision_converter() -> ModuleType:
    """kvcmas_convert.vision from this checkout, even when an installed kvcmas_convert (without it) came first."""
    try:
        from kvcmas_convert import vision

        return vision
    except ImportError:
        path = REPO / "convert" / "kvcmas_convert" / "vision.py"
        spec = importlib.util.spec_from_file_location("kvcmas_convert.vision", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["kvcmas_convert.vision"] = module
        spec.loader.exec_module(module)
        return module


kv = _vision_converter()

from helpers.vision import randomize_weights  # noqa: E402


def _clip_config(**kw: Any) -> Any:
    return transformers.CLIPVisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, image_size=IMAGE,
        patch_size=PATCH, hidden_act="quick_gelu", layer_norm_eps=1e-5, **kw,
    )  # fmt: skip


def _siglip_config(**kw: Any) -> Any:
    return transformers.SiglipVisionConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, image_size=SIGLIP_IMAGE,
        patch_size=PATCH, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, **kw,
    )  # fmt: skip


@pytest.fixture(scope="module")
def towers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Bare CLIP and SigLIP vision models saved as checkpoints: {kind: (folder, eval-mode model)}."""
    root = tmp_path_factory.mktemp("towers")
    out = {}
    for kind, cls, cfg, seed in (
        ("clip", transformers.CLIPVisionModel, _clip_config(), 1),
        ("siglip", transformers.SiglipVisionModel, _siglip_config(), 2),
    ):
        torch.manual_seed(seed)
        model = cls(cfg).eval()
        randomize_weights(model, seed)
        model.save_pretrained(root / kind)
        out[kind] = (root / kind, model)
    return out


def _pixels(seed: int, size: int = IMAGE) -> Any:
    return torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _assert_close(ours: np.ndarray, ref: np.ndarray, rel: float = 1e-4) -> None:
    assert ours.shape == ref.shape
    scale = float(np.abs(ref).max())
    assert scale > 0.05, "reference too small to be a meaningful check"
    err = float(np.abs(ours - ref).max())
    assert err <= rel * scale + 1e-6, f"max abs diff {err:.3g} vs max |ref| {scale:.3g}"


# ------------------------------------------------------------------------------------------------ vision towers
@pytest.mark.parametrize(
    ("kind", "feature_layer", "strategy"),
    [("clip", None, None), ("clip", 1, "default"), ("clip", -2, "full"), ("siglip", None, None),
     ("siglip", -2, None), ("siglip", 0, None)],
)  # fmt: skip
def test_tower_features_match_transformers(
    towers: dict[str, tuple[Path, Any]], tmp_path: Path, kind: str, feature_layer: int | None, strategy: str | None
) -> None:
    """Features of the chosen hidden state equal transformers' (f32 file): last_hidden_state (SigLIP's includes the
    post-LayerNorm), hidden_states[i] (the output of block i, 0 = the embeddings, CLIP's after its pre-LayerNorm),
    with the class token kept ("full") or dropped ("default")."""
    folder, model = towers[kind]
    out = tmp_path / "t.gguf"
    result = kv.convert_mmproj(folder, out, outtype="f32", feature_layer=feature_layer, select_strategy=strategy)
    enc = VisionEncoder(out, n_threads=2)
    assert not enc.has_projector and enc.n_embd == 64
    px = _pixels(3, IMAGE if kind == "clip" else SIGLIP_IMAGE)
    with torch.no_grad():
        hf = model(pixel_values=px, output_hidden_states=True)
    ref = (hf.last_hidden_state if feature_layer is None else hf.hidden_states[feature_layer])[0].numpy()
    if kind == "clip" and strategy == "default":
        ref = ref[1:]
    assert enc.n_tokens == result.n_tokens == ref.shape[0]
    _assert_close(enc.encode_pixels(px[0].numpy()), ref)
    n_blocks = 3 if feature_layer is None else (feature_layer if feature_layer >= 0 else 4 + feature_layer)
    assert gguf.GGUFReader(out).get_field("clip.vision.block_count").contents() == n_blocks


def test_f16_file_matches_f16_rounded_weights(towers: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    """An f16 mmproj computes what transformers computes with the same matrices rounded to f16 (vectors and the
    embedding tables stay f32), and the result is the same on 1 and 2 threads."""
    folder, model = towers["clip"]
    kv.convert_mmproj(folder, tmp_path / "h.gguf", outtype="f16")
    rounded = transformers.CLIPVisionModel(model.config).eval()
    rounded.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if p.ndim >= 2 and "position_embedding" not in name:
                p.copy_(p.half().float())
        px = _pixels(4)
        ref = rounded(pixel_values=px).last_hidden_state[0].numpy()
    one = VisionEncoder(tmp_path / "h.gguf", n_threads=1).encode_pixels(px[0].numpy())
    two = VisionEncoder(tmp_path / "h.gguf", n_threads=2).encode_pixels(px[0].numpy())
    _assert_close(two, ref)
    np.testing.assert_allclose(one, two, rtol=0, atol=1e-5)


def test_mmproj_layout_uses_llama_cpp_names(towers: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    """The file as gguf-py reads it: llama.cpp's clip keys and v.* tensor names, ggml-order shapes."""
    kv.convert_mmproj(
        towers["clip"][0], tmp_path / "c.gguf", outtype="f16", feature_layer=-2, select_strategy="default"
    )
    r = gguf.GGUFReader(tmp_path / "c.gguf")
    f = {name: field.contents() for name, field in r.fields.items()}
    assert f["general.architecture"] == "clip" and f["clip.has_vision_encoder"] is True
    assert (f["clip.vision.image_size"], f["clip.vision.patch_size"], f["clip.vision.embedding_length"]) == (56, 14, 64)
    assert (f["clip.vision.feed_forward_length"], f["clip.vision.attention.head_count"]) == (128, 4)
    assert f["clip.vision.block_count"] == 2 and f["kvcmas.vision.feature_layer"] == -2
    assert f["clip.use_gelu"] is False and f["kvcmas.vision.hidden_act"] == "quick_gelu"
    np.testing.assert_allclose(f["clip.vision.image_mean"], [0.48145466, 0.4578275, 0.40821073], rtol=1e-6)
    shapes = {t.name: (t.tensor_type.name, [int(x) for x in t.shape]) for t in r.tensors}
    assert shapes["v.patch_embd.weight"] == ("F16", [14, 14, 3, 64])
    assert shapes["v.class_embd"] == ("F32", [64])
    assert shapes["v.position_embd.weight"] == ("F32", [64, N_PATCHES + 1])
    assert shapes["v.blk.1.attn_q.weight"] == ("F16", [64, 64]) and shapes["v.blk.1.ffn_up.weight"][1] == [64, 128]
    assert {"v.pre_ln.weight", "v.blk.0.ln1.bias", "v.blk.1.ln2.weight", "v.blk.1.attn_out.bias"} <= set(shapes)
    assert "v.blk.2.attn_q.weight" not in shapes and "v.post_ln.weight" not in shapes


# ------------------------------------------------------------------------------------------- LLaVA end to end
def _text_model(kind: str, seed: int) -> Any:
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(seed)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    randomize_weights(model, seed)
    return model.eval()


def _hf_processor(enc_kind: str) -> Any:
    if enc_kind == "clip":
        return transformers.CLIPImageProcessor(
            size={"shortest_edge": IMAGE}, crop_size={"height": IMAGE, "width": IMAGE}
        )
    return transformers.SiglipImageProcessor(size={"height": SIGLIP_IMAGE, "width": SIGLIP_IMAGE})


@pytest.mark.parametrize(
    ("vision", "text", "photo"),
    [("clip", "llama", CHELSEA), ("siglip", "qwen2", ASTRONAUT)],
    ids=["llava1.5-style-clip-llama-chelsea", "onevision-style-siglip-qwen2-astronaut"],
)
def test_llava_logits_match_transformers(tmp_path: Path, vision: str, text: str, photo: Path) -> None:
    """A LLaVA model (random tower + projector + tiny text model) on a real photo: our image features equal
    transformers' get_image_features, and the text model fed those features at the image positions (through
    KVSequence.append_embeddings) gives transformers' LlavaForConditionalGeneration logits.

    CLIP runs as LLaVA-1.5 (hidden_states[-2], class token dropped); SigLIP as LLaVA-OneVision's base resolution
    (hidden_states[-1], all tokens)."""
    text_model = _text_model(text, 5)
    image_token = 319
    vcfg = _clip_config() if vision == "clip" else _siglip_config()
    layer, strategy = (-2, "default") if vision == "clip" else (-1, "full")
    config = transformers.LlavaConfig(
        vision_config=vcfg, text_config=text_model.config, image_token_index=image_token, vision_feature_layer=layer,
        vision_feature_select_strategy=strategy, projector_hidden_act="gelu", image_seq_length=N_PATCHES,
    )  # fmt: skip
    torch.manual_seed(6)
    llava = transformers.LlavaForConditionalGeneration(config).eval()
    randomize_weights(llava.model.vision_tower, 7)
    randomize_weights(llava.model.multi_modal_projector, 8)
    state = text_model.state_dict()
    llava.model.language_model.load_state_dict({k[6:]: v for k, v in state.items() if k.startswith("model.")})
    llava.lm_head.load_state_dict({"weight": state["lm_head.weight"]})
    llava.save_pretrained(tmp_path / "llava")
    # Both halves from the LLaVA checkpoint: the tower + projector, and the language model (renamed, then converted).
    kv.convert_mmproj(tmp_path / "llava", tmp_path / "mmproj.gguf", outtype="f32")
    kv.convert_llava_text(tmp_path / "llava", tmp_path / "text.gguf", outtype="f32", vocab=False, progress=False)

    enc = VisionEncoder(tmp_path / "mmproj.gguf", n_threads=2)
    model = kvcmas_cpp.Model(tmp_path / "text.gguf", n_threads=2)
    enc.check_text_model(model.n_embd)
    assert enc.n_tokens == N_PATCHES and enc.n_embd == 64

    image = PIL_Image.open(photo)
    pixel_values = _hf_processor(vision)(images=image, return_tensors="pt")["pixel_values"]
    ids = [11, 42, 7] + [image_token] * enc.n_tokens + [99, 3, 250, 17]
    with torch.no_grad():
        hf_feats = llava.get_image_features(pixel_values=pixel_values)
        hf_feats = getattr(hf_feats, "pooler_output", hf_feats)
        hf_feats = (hf_feats[0] if isinstance(hf_feats, (list, tuple)) else hf_feats[0]).numpy()
        hf_logits = llava(input_ids=torch.tensor([ids]), pixel_values=pixel_values).logits[0].numpy()

    features = enc.encode(photo)  # path -> load -> preprocess -> tower -> projector
    _assert_close(features, hf_feats)
    seq = model.new_sequence()
    seq.append(ids[:3], logits="none")
    last_image_row = seq.append_embeddings(features, logits=True)
    tail = seq.append(ids[3 + enc.n_tokens :], logits="all")
    ours = np.concatenate([last_image_row[None], tail])
    _assert_close(ours, hf_logits[2 + enc.n_tokens :], rel=2e-4)
    assert int(ours[-1].argmax()) == int(hf_logits[-1].argmax())


# ----------------------------------------------------------------------------------------------- preprocessing
@pytest.mark.parametrize("photo", [ASTRONAUT, CHELSEA, COFFEE], ids=lambda p: p.stem)
@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (PreprocessConfig.clip(336), {"cls": "CLIPImageProcessor"}),
        (PreprocessConfig.clip(224, resize_size=256),
         {"cls": "CLIPImageProcessor", "size": {"shortest_edge": 256}, "crop_size": {"height": 224, "width": 224}}),
        (PreprocessConfig.siglip(384), {"cls": "SiglipImageProcessor", "size": {"height": 384, "width": 384}}),
    ],
    ids=["clip336", "clip256-crop224", "siglip384"],
)  # fmt: skip
def test_preprocess_matches_hf_processors(photo: Path, ours: PreprocessConfig, theirs: dict[str, Any]) -> None:
    """Pixel values equal the Hugging Face processors' within float rounding (1/255 of the value range, scaled by
    the std, would be one 8-bit step)."""
    kwargs = dict(theirs)
    cls = getattr(transformers, kwargs.pop("cls"))
    if "crop_size" not in kwargs and cls is transformers.CLIPImageProcessor:
        kwargs = {"size": {"shortest_edge": ours.image_size}, "crop_size": {"height": ours.image_size,
                  "width": ours.image_size}}  # fmt: skip
    ref = cls(**kwargs)(images=PIL_Image.open(photo), return_tensors="np")["pixel_values"][0]
    got = preprocess(load_image(photo), ours)
    assert got.shape == ref.shape == (3, ours.image_size, ours.image_size) and got.dtype == np.float32
    one_step = (1 / 255) / min(ours.image_std)
    assert float(np.abs(got - ref).max()) < 1e-3 * one_step


@pytest.mark.parametrize("mode", ["RGBA", "LA", "L", "P"])
def test_color_modes_convert_like_hf(mode: str) -> None:
    """Gray, palette and transparent images become RGB as Hugging Face's convert_to_rgb does (alpha over white)."""
    rgb = PIL_Image.open(CHELSEA).convert("RGB").resize((90, 60))
    image = rgb.convert(mode)
    if mode in ("RGBA", "LA"):
        alpha = PIL_Image.linear_gradient("L").resize(image.size)
        image.putalpha(alpha)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    ref = transformers.SiglipImageProcessor(size={"height": 56, "width": 56})(images=image, return_tensors="np")
    got = preprocess(load_image(buf.getvalue()), PreprocessConfig.siglip(56))
    assert float(np.abs(got - ref["pixel_values"][0]).max()) < 1e-4


# ------------------------------------------------------------------------------------------------- bad images
def _png_header(width: int, height: int) -> bytes:
    """A PNG whose IHDR declares width x height with one tiny (wrong) IDAT: what a decompression bomb looks like
    before decoding."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


def _encoded(fmt: str, size: tuple[int, int] = (64, 48)) -> bytes:
    buf = io.BytesIO()
    PIL_Image.open(COFFEE).convert("RGB").resize(size).save(buf, format=fmt)
    return buf.getvalue()


BAD_IMAGES: dict[str, tuple[Any, str]] = {
    "empty": (b"", "empty"),
    "not-an-image": (b"hello, this is text and not a picture at all" * 4, "not an image"),
    "corrupt-header": (b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, "corrupt PNG file"),
    "truncated-png": (_encoded("PNG")[:300], "truncated or corrupt"),
    "truncated-jpeg": (_encoded("JPEG")[:400], "truncated or corrupt"),
    "zero-width": (_png_header(0, 10), "corrupt PNG file"),
    "zero-size-pil": (PIL_Image.new("RGB", (0, 0)), "zero size"),
    "huge-dimensions": (_png_header(100_000, 100_000), "decompression bomb"),
    "bomb-under-pillow-limit": (_png_header(8000, 8000), "more than the limit"),
    "unsupported-format": (_encoded("PPM"), "not an image in a supported format"),
    "missing-file": (Path("/nonexistent/picture.png"), "cannot read the file"),
}


@pytest.mark.parametrize("case", list(BAD_IMAGES))
def test_bad_images_raise_image_error(case: str) -> None:
    src, message = BAD_IMAGES[case]
    with pytest.raises(ImageError, match=message) as info:
        load_image(src, max_pixels=50_000_000 if case != "bomb-under-pillow-limit" else 10_000_000)
    assert isinstance(info.value, kvcmas_cpp.KvcmasError)  # what docs/python-api.md promises for a bad file or argument


def test_limits_are_configurable(tmp_path: Path) -> None:
    data = _encoded("PNG", (64, 48))
    assert load_image(data, max_pixels=64 * 48).size == (64, 48)
    with pytest.raises(ImageError, match="max_pixels"):
        load_image(data, max_pixels=64 * 48 - 1)
    with pytest.raises(ImageError, match="max_bytes"):
        load_image(data, max_bytes=len(data) - 1)
    (tmp_path / "x.png").write_bytes(data)
    with pytest.raises(ImageError, match="max_bytes"):
        load_image(tmp_path / "x.png", max_bytes=100)
    with pytest.raises(ImageError, match="max_pixels"):
        load_image(PIL_Image.new("RGB", (100, 100)), max_pixels=9999)
    with pytest.raises(TypeError):
        load_image(12345)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------- cache and encoder API
def test_feature_cache_encodes_each_image_once(towers: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    """The same picture as a path, bytes and a PIL image is one cache entry; another picture is another encode;
    the least recently used entry goes first; cached features are read-only."""
    kv.convert_mmproj(towers["siglip"][0], tmp_path / "s.gguf", outtype="f32")
    enc = VisionEncoder(tmp_path / "s.gguf", n_threads=2, cache_size=1)
    first = enc.encode(CHELSEA)
    again = [enc.encode(CHELSEA.read_bytes()), enc.encode(PIL_Image.open(CHELSEA)), enc.encode(str(CHELSEA))]
    assert enc.encode_count == 1 and all(a is first for a in again)
    assert enc.image_hash(CHELSEA) == image_hash(PIL_Image.open(CHELSEA)) != enc.image_hash(ASTRONAUT)
    with pytest.raises(ValueError):
        first[0, 0] = 1.0
    other = enc.encode(ASTRONAUT)
    assert enc.encode_count == 2 and not np.array_equal(other, first)
    np.testing.assert_array_equal(enc.encode(CHELSEA), first)  # evicted (cache_size 1): encoded again, same result
    assert enc.encode_count == 3
    np.testing.assert_array_equal(enc.encode_pixels(enc.preprocess(CHELSEA)), first)
    with pytest.raises(ImageError):
        enc.encode(b"not an image")


def test_bad_mmproj_files_and_inputs(towers: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    folder, _ = towers["clip"]
    good = tmp_path / "c.gguf"
    kv.convert_mmproj(folder, good, outtype="f32")
    enc = VisionEncoder(good, n_threads=1)
    with pytest.raises(ValueError, match=r"3, 56, 56\], got \[1, 3, 32, 32\]"):
        enc.encode_pixels(np.zeros((3, 32, 32), np.float32))
    with pytest.raises(ValueError, match="not finite"):
        enc.encode_pixels(np.full((3, 56, 56), np.nan, np.float32))
    with pytest.raises(ValueError, match="no projector"):
        enc.check_text_model(64)
    # A file without one of its tensors, and a text model's file, are refused with the name of what is wrong.
    reader = gguf.GGUFReader(good)
    broken = tmp_path / "broken.gguf"
    writer = gguf.GGUFWriter(broken, "clip")
    for name, field in reader.fields.items():
        if name.startswith(("clip.", "kvcmas.")):
            value = field.contents()
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        if t.name != "v.blk.1.ffn_up.weight":
            writer.add_tensor(t.name, np.array(t.data).reshape([int(x) for x in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(kvcmas_cpp.KvcmasError, match="v.blk.1.ffn_up.weight' is missing"):
        VisionEncoder(broken)
    text_like = tmp_path / "text.gguf"
    w = gguf.GGUFWriter(text_like, "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(kvcmas_cpp.KvcmasError, match="general.architecture is 'llama'"):
        VisionEncoder(text_like)
    with pytest.raises(kc.ConvertError, match="unsupported architecture"):
        text = tmp_path / "txt"
        _text_model("llama", 1).save_pretrained(text)
        kv.convert_mmproj(text, tmp_path / "x.gguf")


def test_cli_writes_mmproj(towers: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    out = tmp_path / "cli.gguf"
    proc = subprocess.run(
        [sys.executable, "-m", "kvcmas_convert", "mmproj", str(towers["siglip"][0]), "-o", str(out), "--outtype",
         "f32", "--feature-layer", "-1"],
        cwd=REPO / "convert", capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"{N_PATCHES} image tokens" in proc.stderr
    enc = VisionEncoder(out, n_threads=1)
    assert (enc.model_type, enc.n_tokens, enc.config.resize_mode) == ("siglip", N_PATCHES, "square")


def test_concurrent_readers_share_one_encode(towers: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    """Agents on several threads reading one image: one encode, everyone gets the same (cached) array."""
    import threading

    kv.convert_mmproj(
        towers["clip"][0], tmp_path / "c.gguf", outtype="f16", feature_layer=-2, select_strategy="default"
    )
    enc = VisionEncoder(tmp_path / "c.gguf", n_threads=2)
    data = COFFEE.read_bytes()
    results: list[np.ndarray] = []
    errors: list[BaseException] = []

    def agent() -> None:
        try:
            results.append(enc.encode(data))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=agent) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 4 and enc.encode_count == 1
    assert all(r is results[0] for r in results) and results[0].shape == (N_PATCHES, 64)
