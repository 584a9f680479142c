"""AnyRes vision (LLaVA-OneVision, LLaVA-NeXT) against transformers: pixels, token counts, features and logprobs.

A random-weight LlavaOnevisionForConditionalGeneration (and LlavaNextForConditionalGeneration) made here with
transformers at small sizes, saved with the processor settings as transformers 5 saves them (processor_config.json),
converted by ``kvcmas mmproj`` (both halves), then run by kvcmas and by transformers on scikit-image's photos and
synthetic images: portrait, landscape, tiny, larger than the largest pinpoint, one and two images per prompt.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
PIL_Image = pytest.importorskip("PIL.Image")
skimage_data = pytest.importorskip("skimage.data")

import kvcmas_cpp  # noqa: E402
from helpers.vision import randomize_weights, sample_images  # noqa: E402  (weights far from transformers' init)
from kvcmas_convert.vision import convert_llava_text  # noqa: E402
from kvcmas_cpp.vision import VisionEncoder  # noqa: E402
from kvcmas_cpp.vision.anyres import ANYRES, SINGLE  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PHOTOS = Path(skimage_data.__file__).parent
S, P = 56, 14  # tile side and patch: 4 x 4 feature rows per tile
PINPOINTS = [[S * a, S * b] for a in range(1, 7) for b in range(1, 7)]  # OneVision's 1..6 x 1..6 tiles, scaled
IMAGE_TOKEN = 319
MEAN, STD = [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]


IMAGES = sample_images()  # 512 x 512 is larger than the largest pinpoint (336)


def _text_model(seed: int) -> Any:
    cfg = transformers.Qwen2Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                                   tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg)
    randomize_weights(model, seed)
    return model.eval()


def _image_processor(family: str, tile: int = S, pinpoints: list[list[int]] = PINPOINTS) -> Any:
    if family == "onevision":
        cls = transformers.LlavaOnevisionImageProcessorPil
        return cls(size={"height": tile, "width": tile}, image_grid_pinpoints=pinpoints, image_mean=MEAN, image_std=STD)
    return transformers.LlavaNextImageProcessorPil(
        size={"shortest_edge": tile}, crop_size={"height": tile, "width": tile}, image_grid_pinpoints=pinpoints
    )


def _make(root: Path, family: str, tile: int = S, pinpoints: list[list[int]] = PINPOINTS) -> tuple[Path, Any, Any]:
    """A random-weight checkpoint folder of the family (with processor_config.json), the model, its processor."""
    text = _text_model(5)
    if family == "onevision":
        vcfg = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                               num_attention_heads=2, image_size=tile, patch_size=P)  # fmt: skip
        config = transformers.LlavaOnevisionConfig(
            vision_config=vcfg, text_config=text.config, image_token_index=IMAGE_TOKEN, image_grid_pinpoints=pinpoints,
            vision_aspect_ratio="anyres_max_9", vision_feature_layer=-1, vision_feature_select_strategy="full",
        )  # fmt: skip
        cls: Any = transformers.LlavaOnevisionForConditionalGeneration
    else:
        vcfg = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                             num_attention_heads=2, image_size=tile, patch_size=P)  # fmt: skip
        config = transformers.LlavaNextConfig(
            vision_config=vcfg, text_config=text.config, image_token_index=IMAGE_TOKEN, image_grid_pinpoints=pinpoints,
            vision_feature_layer=-2, vision_feature_select_strategy="default",
        )  # fmt: skip
        cls = transformers.LlavaNextForConditionalGeneration
    torch.manual_seed(6)
    model = cls(config).eval()
    randomize_weights(model.model.vision_tower, 7)
    randomize_weights(model.model.multi_modal_projector, 8)
    with torch.no_grad():
        model.model.image_newline.copy_(torch.randn(64, generator=torch.Generator().manual_seed(9)))
    state = text.state_dict()
    model.model.language_model.load_state_dict({k[6:]: v for k, v in state.items() if k.startswith("model.")})
    model.lm_head.load_state_dict({"weight": state["lm_head.weight"]})
    folder = root / family
    model.save_pretrained(folder)
    ip = _image_processor(family, tile, pinpoints)
    processor = {"image_processor": ip.to_dict(), "image_token": "<image>", "num_image_tokens": (tile // P) ** 2,
                 "processor_class": ip.to_dict()["image_processor_type"].replace("ImageProcessor", "Processor"),
                 "vision_feature_select_strategy": config.vision_feature_select_strategy}  # fmt: skip
    if family == "onevision":
        processor["vision_aspect_ratio"] = config.vision_aspect_ratio
    (folder / "processor_config.json").write_text(json.dumps(processor, indent=2))
    return folder, model, ip


_CONVERTED: dict[str, dict[str, Any]] = {}


def _converted(name: str, factory: pytest.TempPathFactory) -> dict[str, Any]:
    """{name, folder, model, ip, enc, lm}: the checkpoint, its mmproj written by the `kvcmas mmproj` command (made
    once per session and family)."""
    if name not in _CONVERTED:
        root = factory.mktemp("anyres")
        folder, model, ip = _make(root, name)
        mmproj, text = root / f"{name}-mmproj.gguf", root / f"{name}-text.gguf"
        cmd = [sys.executable, "-m", "kvcmas_cpp.cli", "mmproj", str(folder), "-o", str(mmproj), "--outtype", "f32"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        # the text half (the checkpoint has no tokenizer files: the ids are given directly)
        convert_llava_text(folder, text, outtype="f32", vocab=False, progress=False)
        enc = VisionEncoder(mmproj, n_threads=2)
        lm = kvcmas_cpp.Model(text, n_threads=2)
        _CONVERTED[name] = {"name": name, "folder": folder, "model": model, "ip": ip, "enc": enc, "lm": lm}
    return _CONVERTED[name]


@pytest.fixture(scope="module", params=["onevision", "next"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _converted(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def onevision(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _converted("onevision", tmp_path_factory)


def _hf_inputs(fam: dict[str, Any], names: list[str]) -> dict[str, Any]:
    images = [IMAGES[n] for n in names]
    batch = [images] if fam["name"] == "onevision" else images
    return dict(fam["ip"](images=batch, return_tensors="np"))


def _hf_token_counts(fam: dict[str, Any], inputs: dict[str, Any]) -> list[int]:
    """Image tokens per image as the transformers processor writes them into the prompt."""
    cls = transformers.LlavaOnevisionProcessor if fam["name"] == "onevision" else transformers.LlavaNextProcessor
    proc = cls.__new__(cls)  # its real counting code, without a tokenizer
    proc.image_processor = fam["ip"]
    proc.image_token = "<image>"
    proc.num_image_tokens = (fam["model"].config.vision_config.image_size // P) ** 2
    proc.patch_size = P
    proc.num_additional_image_tokens = 1 if fam["name"] == "next" else 0  # CLIP's class token (then dropped)
    cfg = fam["model"].config
    proc.vision_feature_select_strategy = cfg.vision_feature_select_strategy
    proc.vision_aspect_ratio = getattr(cfg, "vision_aspect_ratio", None)
    return [len(proc.replace_image_token(inputs, i)) // len("<image>") for i in range(len(inputs["image_sizes"]))]


CASES = [["landscape"], ["portrait"], ["astronaut"], ["tiny"], ["tall"], ["coffee", "portrait"]]


@pytest.mark.parametrize("names", CASES, ids=lambda n: "+".join(n))
def test_pixels_and_token_counts_equal_the_processor(family: dict[str, Any], names: list[str]) -> None:
    """Every tower input equals the processor's pixel_values bit for bit; rows per image equal its token count."""
    enc: VisionEncoder = family["enc"]
    inputs = _hf_inputs(family, names)
    counts = _hf_token_counts(family, inputs)
    for i, name in enumerate(names):
        view = enc.view_for(len(names))
        ours = enc.preprocess(IMAGES[name], view)
        ref = np.asarray(inputs["pixel_values"][i])[: len(ours)]
        assert ours.shape == ref.shape and ours.dtype == np.float32
        assert np.array_equal(ours, ref), f"{name}: max |d| {np.abs(ours - ref).max()}"
        assert not np.any(np.asarray(inputs["pixel_values"][i])[len(ours) :]), "the processor has more inputs"
        w, h = IMAGES[name].size
        assert enc.n_image_tokens(w, h, view) == counts[i], name
    if family["name"] == "onevision" and len(names) > 1:
        assert enc.view_for(len(names)) == SINGLE and counts == [(S // P) ** 2 + 1] * len(names)


def _hf_features(fam: dict[str, Any], inputs: dict[str, Any]) -> list[np.ndarray]:
    kwargs: dict[str, Any] = {"pixel_values": torch.tensor(inputs["pixel_values"]),
                              "image_sizes": torch.tensor(np.asarray(inputs["image_sizes"]))}  # fmt: skip
    if fam["name"] == "onevision":
        kwargs["batch_num_images"] = torch.tensor(inputs["batch_num_images"])
    with torch.no_grad():
        out = fam["model"].model.get_image_features(**kwargs)
    feats = getattr(out, "pooler_output", out)
    return [f.numpy() for f in feats]


@pytest.mark.parametrize("names", CASES, ids=lambda n: "+".join(n))
def test_features_and_first_token_logprobs_equal_transformers(family: dict[str, Any], names: list[str]) -> None:
    """Features after unpad, pooling and newline rows equal get_image_features' at f32; the text model fed them
    (KVSequence.append_embeddings) gives the same first-token log-probabilities as the transformers model."""
    enc: VisionEncoder = family["enc"]
    inputs = _hf_inputs(family, names)
    refs = _hf_features(family, inputs)
    ours = [enc.encode(IMAGES[n], enc.view_for(len(names))) for n in names]
    for name, got, ref in zip(names, ours, refs, strict=True):
        assert got.shape == ref.shape, name
        err = float(np.abs(got - ref).max())
        assert err <= 1e-4 * float(np.abs(ref).max()) + 1e-6, f"{name}: max |d| {err}"
    text_ids = [[11, 42, 7], [99, 3], [250, 17, 8]]
    ids = list(text_ids[0])
    for i, f in enumerate(ours):
        ids += [IMAGE_TOKEN] * len(f) + text_ids[i + 1]
    kwargs: dict[str, Any] = {"input_ids": torch.tensor([ids]), "pixel_values": torch.tensor(inputs["pixel_values"]),
                              "image_sizes": torch.tensor(np.asarray(inputs["image_sizes"]))}  # fmt: skip
    if family["name"] == "onevision":
        kwargs["batch_num_images"] = torch.tensor(inputs["batch_num_images"])
    with torch.no_grad():
        ref_logits = family["model"](**kwargs).logits[0, -1].double()
    ref_lp = torch.log_softmax(ref_logits, -1).numpy()
    seq = family["lm"].new_sequence()
    seq.append(text_ids[0], logits="none")
    for i, f in enumerate(ours):
        seq.append_embeddings(f, logits=False)
        last = seq.append(text_ids[i + 1], logits="last" if i == len(ours) - 1 else "none")
    logits = np.asarray(last, dtype=np.float64).reshape(-1)
    lp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    assert int(lp.argmax()) == int(ref_lp.argmax())
    assert float(np.abs(lp - ref_lp).max()) <= 2e-3


def test_views_cache_and_low_detail(family: dict[str, Any]) -> None:
    """detail "low" is the single view (G² + 1 rows); each (image, view) is encoded once."""
    enc: VisionEncoder = family["enc"]
    enc.clear_cache()
    before = enc.encode_count
    photo = PHOTOS / "coffee.png"
    single = enc.encode(photo, enc.view_for(1, "low"))
    assert single.shape[0] == (S // P) ** 2 + 1 and enc.view_for(1, "low") == SINGLE
    full = enc.encode(photo, ANYRES)
    assert full.shape[0] > single.shape[0] and np.array_equal(full[-1], enc.image_newline)
    assert enc.encode(photo, SINGLE) is single and enc.encode(photo.read_bytes()) is full
    assert enc.encode_count == before + 2
    with pytest.raises(ValueError, match="view 'wide'"):
        enc.encode(photo, "wide")


def _refusal(tmp_path: Path, family_dir: Path, edit: Any) -> str:
    folder = tmp_path / "edited"
    shutil.copytree(family_dir, folder)
    edit(folder)
    from kvcmas_convert.errors import ConvertError
    from kvcmas_convert.vision import convert_mmproj

    with pytest.raises(ConvertError) as e:
        convert_mmproj(folder, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
    return str(e.value)


def _edit_json(name: str, change: Any) -> Any:
    def edit(folder: Path) -> None:
        data = json.loads((folder / name).read_text())
        change(data)
        (folder / name).write_text(json.dumps(data))

    return edit


@pytest.mark.parametrize(
    ("file", "change", "named"),
    [
        ("processor_config.json", lambda d: d["image_processor"].update(resample=2), "'resample'"),
        ("processor_config.json", lambda d: d["image_processor"].update(do_normalize=False), "'do_normalize'"),
        ("processor_config.json", lambda d: d.update(vision_aspect_ratio="anyres_max_4"), "'vision_aspect_ratio'"),
        ("processor_config.json", lambda d: d["image_processor"].update(image_grid_pinpoints=[[56, 56]]),
         "'image_grid_pinpoints'"),
        ("config.json", lambda d: d.update(image_grid_pinpoints=[[56, 100]]), "'image_grid_pinpoints'"),
        ("config.json", lambda d: d.update(vision_aspect_ratio="anyres"), "'vision_aspect_ratio'"),
        ("config.json", lambda d: d.update(vision_feature_layer=[-2, -1]), "vision_feature_layer"),
        ("config.json", lambda d: d.update(vision_feature_select_strategy="default"), "vision_feature_select_strategy"),
        ("processor_config.json", lambda d: d["image_processor"].pop("image_mean"), "['image_mean']"),
    ],
    ids=["resample", "do_normalize", "aspect-mismatch", "pinpoints-mismatch", "pinpoint-not-tile", "aspect-form",
         "layer-list", "siglip-default", "no-mean"],
)  # fmt: skip
def test_converter_refuses_what_it_cannot_represent(
    onevision: dict[str, Any], tmp_path: Path, file: str, change: Any, named: str
) -> None:
    message = _refusal(tmp_path, onevision["folder"], _edit_json(file, change))
    assert named in message, message


def test_preprocessor_config_json_is_read_too(onevision: dict[str, Any], tmp_path: Path) -> None:
    """transformers 4.x's preprocessor_config.json: read, and a setting it disagrees on is refused by name."""

    def add_old_file(folder: Path) -> None:
        settings = json.loads((folder / "processor_config.json").read_text())["image_processor"]
        (folder / "preprocessor_config.json").write_text(json.dumps({**settings, "image_mean": [0.4, 0.5, 0.5]}))

    assert "'image_mean'" in _refusal(tmp_path, onevision["folder"], add_old_file)


# ------------------------------------------------------------------------------------------------------ the server
def test_server_counts_anyres_rows_and_honours_detail(default_model_path: Path, tmp_path: Path) -> None:
    """kvcmas-server with a OneVision-style mmproj (to the default model's width): one image takes the AnyRes
    view, detail "low" and several images per prompt the single view; usage counts the rows fed; the answer is
    the one the encoder's rows give through append_embeddings."""
    import base64
    import io

    from fastapi.testclient import TestClient

    from kvcmas_cpp.server.app import Server, ServerConfig
    from kvcmas_cpp.vision.random_mmproj import write_random_mmproj

    mmproj = tmp_path / "ov.gguf"
    pinpoints = [(a, b) for a, b in PINPOINTS]
    write_random_mmproj(mmproj, image_size=S, patch_size=P, n_embd=32, n_ff=64, n_layer=2, n_head=2, n_embd_out=576,
                        outtype="f32", grid_pinpoints=pinpoints, vision_aspect_ratio="anyres_max_9")  # fmt: skip
    buf = io.BytesIO()
    IMAGES["coffee"].save(buf, "PNG")
    png = buf.getvalue()
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    enc = VisionEncoder(mmproj, n_threads=1)
    w, h = IMAGES["coffee"].size
    n_any, n_single = enc.n_image_tokens(w, h, ANYRES), enc.n_image_tokens(w, h, SINGLE)
    assert n_any > 4 * n_single and n_single == (S // P) ** 2 + 1

    model = kvcmas_cpp.Model(default_model_path, n_threads=2)
    server = Server(ServerConfig(str(default_model_path), mmproj=str(mmproj), threads=2), model)

    def image(detail: str | None = None) -> dict[str, Any]:
        return {"type": "image_url", "image_url": {"url": url, **({"detail": detail} if detail else {})}}

    def ask(c: Any, *images: dict[str, Any]) -> dict[str, Any]:
        parts = [{"type": "text", "text": "Look: "}, *images, {"type": "text", "text": " What is it?"}]
        body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 4, "temperature": 0}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return dict(r.json())

    before, after = model.apply_chat_template([{"role": "user", "content": "Look: @IMG@ What is it?"}]).split("@IMG@")
    tok = model.tokenizer
    prefix = tok.encode(before, add_special=False, parse_special=True)
    if tok.add_bos and tok.bos_id is not None:
        prefix = [tok.bos_id, *prefix]
    suffix = tok.encode(after, add_special=False, parse_special=True)
    try:
        with TestClient(server.app, base_url="http://127.0.0.1") as c:
            one = ask(c, image())
            assert one["usage"]["prompt_tokens"] == len(prefix) + n_any + len(suffix)
            assert ask(c, image("low"))["usage"]["prompt_tokens"] == len(prefix) + n_single + len(suffix)
            assert ask(c, image("high"))["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
            two = ask(c, image(), image("high"))  # OneVision: each of several images takes the single view
            assert two["usage"]["prompt_tokens"] == len(prefix) + 2 * n_single + len(suffix)
            assert two["kvcmas"]["images"] == 2
        with model.new_sequence() as seq:
            seq.append(prefix, logits="none")
            seq.append_embeddings(enc.encode(png, ANYRES))
            want = model.generate(suffix, max_tokens=4, temperature=0, sequence=seq)
        assert one["choices"][0]["message"]["content"] == want.text
    finally:
        server.scheduler.stop()


def test_preprocessor_config_json_alone_is_used(onevision: dict[str, Any], tmp_path: Path) -> None:
    """A checkpoint with only preprocessor_config.json: its settings (here another mean, one value just under 13/255,
    which the file's float32 mean would round up) reach the file; the single view's pixels (padded with the mean
    colour) still equal the processor's bit for bit."""
    from kvcmas_convert.vision import convert_mmproj

    folder = tmp_path / "old"
    shutil.copytree(onevision["folder"], folder)
    mean = [0.4, 0.5, 13 / 255 - 1e-9]
    settings = json.loads((folder / "processor_config.json").read_text())["image_processor"]
    (folder / "processor_config.json").unlink()
    (folder / "preprocessor_config.json").write_text(json.dumps({**settings, "image_mean": mean}))
    convert_mmproj(folder, tmp_path / "old.gguf", outtype="f32")
    enc = VisionEncoder(tmp_path / "old.gguf", n_threads=1)
    assert enc.config.image_mean == pytest.approx(mean) and enc.anyres is not None
    ip = transformers.LlavaOnevisionImageProcessorPil(
        size={"height": S, "width": S}, image_grid_pinpoints=PINPOINTS, image_mean=mean, image_std=STD
    )
    images = [IMAGES["coffee"], IMAGES["portrait"]]
    ref = ip(images=[images], return_tensors="np")["pixel_values"]  # [image, view, 3, S, S]
    for i, image in enumerate(images):
        assert np.array_equal(enc.preprocess(image, SINGLE), ref[i])


@pytest.mark.slow
def test_real_onevision_geometry(tmp_path_factory: pytest.TempPathFactory) -> None:
    """OneVision's real geometry (384 px tiles of 27 x 27 rows, its 36 pinpoints, anyres_max_9) on a narrow tower:
    pixels, token counts and features equal transformers' for photos up to 1920 x 1080 (7,269 rows, pooled)."""
    root = tmp_path_factory.mktemp("anyres-real")
    pinpoints = [[384 * a, 384 * b] for a in range(1, 7) for b in range(1, 7)]
    folder, model, ip = _make(root, "onevision", tile=384, pinpoints=pinpoints)
    from kvcmas_convert.vision import convert_mmproj

    convert_mmproj(folder, root / "ov.gguf", outtype="f32")
    fam = {"name": "onevision", "model": model, "ip": ip, "enc": VisionEncoder(root / "ov.gguf", n_threads=2)}
    wide = np.asarray(IMAGES["coffee"].resize((1920, 1080), PIL_Image.Resampling.BILINEAR))
    IMAGES["hd"] = PIL_Image.fromarray(wide)
    enc = fam["enc"]
    try:
        for names in (["hd"], ["astronaut"], ["portrait"], ["tall", "astronaut"]):
            inputs = _hf_inputs(fam, names)
            counts = _hf_token_counts(fam, inputs)
            refs = _hf_features(fam, inputs)
            for i, name in enumerate(names):
                view = enc.view_for(len(names))
                ours = enc.preprocess(IMAGES[name], view)
                assert np.array_equal(ours, np.asarray(inputs["pixel_values"][i])[: len(ours)]), name
                got = enc.encode(IMAGES[name], view)
                assert got.shape[0] == counts[i] == refs[i].shape[0], name
                assert float(np.abs(got - refs[i]).max()) <= 1e-4 * float(np.abs(refs[i]).max()) + 1e-6, name
            if names == ["hd"]:
                assert counts == [7269]  # the figure docs/vision.md quotes
    finally:
        del IMAGES["hd"]
