"""Gemma 3 multimodal against transformers: pixels, image features, prompt ids and first-token logprobs with images.

A random-weight Gemma3ForConditionalGeneration made here with transformers at small widths but the real structure
(SigLIP with 14-px patches, 4 x 4 average pooling to mm_tokens_per_image soft tokens, the RMSNorm + projection
projector, a gemma3 text model with a sliding and a global layer), saved with its processor settings and a small
byte-level BPE tokenizer holding Gemma's image tokens, converted by ``kvcmas mmproj`` (both halves), then run by
kvcmas and by transformers (Gemma3Processor, the model with token_type_ids) at f32. The sliding window (8) is shorter
than an image's span (16 soft tokens), so the bidirectional mask within an image meets the window.
"""

from __future__ import annotations

import json
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
from helpers.vision import randomize_weights, shared_image_prompt  # noqa: E402  (weights far from transformers' near-zero init)
from kvcmas_convert.vision import convert_llava_text  # noqa: E402
from kvcmas_cpp.vision import VisionEncoder  # noqa: E402

PHOTOS = Path(skimage_data.__file__).parent
S, P, TOKENS = 224, 14, 16  # 16 x 16 patches pooled 4 x 4 -> 4 x 4 soft tokens
VOCAB, BOI, EOI, IMAGE_TOKEN = 320, 300, 301, 302  # the tokenizer's ids of Gemma's image tokens (checked)
WINDOW = 8
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def _tokenizer() -> Any:
    """A byte-level BPE tokenizer with Gemma 3's special tokens (the real one is not available offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = ["User: look at this picture. What is it? A cat, a dog, an astronaut.\n\nModel: it is a cat.\n"] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>", "<bos>"], initial_alphabet=alphabet)
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens(["<start_of_image>", "<end_of_image>", "<image_soft_token>", "<start_of_turn>",
                            "<end_of_turn>"])  # fmt: skip
    ids = [tok.token_to_id(t) for t in ("<start_of_image>", "<end_of_image>", "<image_soft_token>")]
    assert ids == [BOI, EOI, IMAGE_TOKEN] and tok.get_vocab_size() <= VOCAB
    extra = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<end_of_turn>", pad_token="<pad>",
        extra_special_tokens=extra, chat_template=CHAT_TEMPLATE,
    )  # fmt: skip


def _images() -> dict[str, Any]:
    chelsea = PIL_Image.open(PHOTOS / "chelsea.png").convert("RGB")  # 451 x 300
    rng = np.random.default_rng(3)
    return {
        "landscape": chelsea,
        "portrait": chelsea.transpose(PIL_Image.Transpose.ROTATE_90),
        "astronaut": PIL_Image.open(PHOTOS / "astronaut.png").convert("RGB"),  # 512 x 512
        "tiny": PIL_Image.fromarray(rng.integers(0, 256, (7, 10, 3), dtype=np.uint8)),
    }


IMAGES = _images()


def _image_processor() -> Any:
    return transformers.Gemma3ImageProcessorPil(
        size={"height": S, "width": S}, image_mean=[0.5] * 3, image_std=[0.5] * 3, resample=2
    )


def _make(root: Path) -> tuple[Path, Any]:
    tcfg = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, max_position_embeddings=8192,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    vcfg = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=S, patch_size=P,
        vision_use_head=False,
    )  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=tcfg, vision_config=vcfg, mm_tokens_per_image=TOKENS, boi_token_index=BOI, eoi_token_index=EOI,
        image_token_index=IMAGE_TOKEN,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(6)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    randomize_weights(model, 7)
    folder = root / "gemma3"
    model.save_pretrained(folder)
    ip = _image_processor()
    processor = {"image_processor": ip.to_dict(), "image_seq_length": TOKENS, "processor_class": "Gemma3Processor"}
    (folder / "processor_config.json").write_text(json.dumps(processor, indent=2))
    _tokenizer().save_pretrained(folder)
    return folder, model


def _processor() -> Any:
    return transformers.Gemma3Processor(image_processor=_image_processor(), tokenizer=_tokenizer(),
                                        image_seq_length=TOKENS)  # fmt: skip


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """{folder, model, enc, lm}: the checkpoint, its mmproj written by the `kvcmas mmproj` command, its text GGUF."""
    root = tmp_path_factory.mktemp("gemma3")
    folder, model = _make(root)
    mmproj, text = root / "gemma3-mmproj.gguf", root / "gemma3-text.gguf"
    cmd = [sys.executable, "-m", "kvcmas_cpp.cli", "mmproj", str(folder), "-o", str(mmproj), "--outtype", "f32"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"{TOKENS} image tokens" in done.stderr
    convert_llava_text(folder, text, outtype="f32", progress=False)
    enc = VisionEncoder(mmproj, n_threads=2)
    lm = kvcmas_cpp.Model(text, n_threads=2)
    return {"folder": folder, "model": model, "enc": enc, "lm": lm, "text": text, "mmproj": mmproj}


def test_mmproj_holds_the_gemma3_projector(gemma3: dict[str, Any]) -> None:
    """llama.cpp's clip names: projector type "gemma3", the pooling factor, mm.soft_emb_norm stored as 1 + w."""
    from gguf import GGUFReader

    enc: VisionEncoder = gemma3["enc"]
    assert enc.n_tokens == TOKENS and enc.n_embd == 64 and enc.projector_type == "gemma3"
    assert enc.pool_kernel == 4 and enc.config.resample == "bilinear"
    reader = GGUFReader(enc.path)
    assert reader.fields["clip.projector_type"].contents() == "gemma3"
    assert reader.fields["clip.vision.projector.scale_factor"].contents() == 4
    tensors = {t.name: t for t in reader.tensors}
    proj = gemma3["model"].model.multi_modal_projector
    norm = np.asarray(tensors["mm.soft_emb_norm.weight"].data)
    assert np.array_equal(norm, proj.mm_soft_emb_norm.weight.detach().numpy() + 1)
    weight = np.asarray(tensors["mm.input_projection.weight"].data).reshape(32, 64)
    assert np.array_equal(weight, proj.mm_input_projection_weight.detach().numpy())


@pytest.mark.parametrize("name", list(IMAGES))
def test_pixels_equal_the_processor(gemma3: dict[str, Any], name: str) -> None:
    """The tower input equals Gemma3ImageProcessor's pixel_values bit for bit (bilinear resize to 224 x 224)."""
    ref = _image_processor()(images=[IMAGES[name]], return_tensors="np")["pixel_values"][0]
    ours = gemma3["enc"].preprocess(IMAGES[name])
    assert ours.shape == ref.shape == (3, S, S) and ours.dtype == np.float32
    assert np.array_equal(ours, ref), f"{name}: max |d| {np.abs(ours - ref).max()}"


def _hf_features(model: Any, names: list[str]) -> np.ndarray:
    pixels = _image_processor()(images=[IMAGES[n] for n in names], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = model.model.get_image_features(pixel_values=pixels)
    return np.asarray(getattr(out, "pooler_output", out))


def test_features_equal_transformers(gemma3: dict[str, Any]) -> None:
    """Tower, post-LayerNorm, 4 x 4 average pooling, RMSNorm and projection equal get_image_features' at f32."""
    names = list(IMAGES)
    refs = _hf_features(gemma3["model"], names)
    for name, ref in zip(names, refs, strict=True):
        got = gemma3["enc"].encode(IMAGES[name])
        assert got.shape == ref.shape == (TOKENS, 64), name
        err = float(np.abs(got - ref).max())
        assert err <= 1e-4 * float(np.abs(ref).max()) + 1e-6, f"{name}: max |d| {err}"


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def _prompt(texts: list[list[int]], n_images: int) -> list[int]:
    ids = list(texts[0])
    for i in range(n_images):
        ids += [BOI] + [IMAGE_TOKEN] * TOKENS + [EOI] + texts[i + 1]
    return ids


def _kvcmas_logprobs(
    gemma3: dict[str, Any], texts: list[list[int]], names: list[str], bidirectional: bool = True
) -> Any:  # noqa: E501
    enc: VisionEncoder = gemma3["enc"]
    with gemma3["lm"].new_sequence() as seq:
        seq.append(texts[0] + [BOI], logits="none")
        last = None
        for i, name in enumerate(names):
            seq.append_embeddings(enc.encode(IMAGES[name]), bidirectional=bidirectional)
            last = seq.append([EOI] + texts[i + 1] + ([BOI] if i + 1 < len(names) else []), logits="last")
        return _log_softmax(np.asarray(last))


TEXTS = [[2, 11, 42, 7, 13, 21, 34, 55, 89, 5], [99, 3], [250, 17, 8, 1]]  # 10 tokens before the first image


@pytest.mark.parametrize("names", [["landscape"], ["astronaut"], ["portrait", "tiny"]], ids=lambda n: "+".join(n))
def test_first_token_logprobs_equal_transformers(gemma3: dict[str, Any], names: list[str]) -> None:
    """The text model fed the image rows (unscaled, where token embeddings are scaled by sqrt(n_embd)) with the
    bidirectional mask within each image (and the sliding window ending at each token's own position) gives the
    first-token log-probabilities of Gemma3ForConditionalGeneration with pixel_values and token_type_ids."""
    texts = TEXTS[: len(names) + 1]
    ids = _prompt(texts, len(names))
    pixels = _image_processor()(images=[IMAGES[n] for n in names], return_tensors="pt")["pixel_values"]
    input_ids = torch.tensor([ids])
    token_type_ids = (input_ids == IMAGE_TOKEN).long()
    with torch.no_grad():
        ref_logits = gemma3["model"](input_ids=input_ids, pixel_values=pixels, token_type_ids=token_type_ids).logits
    ref = torch.log_softmax(ref_logits[0, -1].double(), -1).numpy()
    got = _kvcmas_logprobs(gemma3, texts, names)
    assert int(got.argmax()) == int(ref.argmax())
    assert float(np.abs(got - ref).max()) <= 2e-3
    # the mask matters here: image rows attending only causally answer measurably differently
    causal = _kvcmas_logprobs(gemma3, texts, names, bidirectional=False)
    assert float(np.abs(causal - ref).max()) > 1e-2


def _hf_logprobs(gemma3: dict[str, Any], ids: list[int], names: list[str]) -> np.ndarray:
    pixels = _image_processor()(images=[IMAGES[n] for n in names], return_tensors="pt")["pixel_values"]
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        logits = gemma3["model"](
            input_ids=input_ids, pixel_values=pixels, token_type_ids=(input_ids == IMAGE_TOKEN).long()
        ).logits
    return torch.log_softmax(logits[0, -1].double(), -1).numpy()


PROMPTS = {
    "one": ("<bos>User: look at this<start_of_image>What is it?\n", ["astronaut"]),
    "two": ("<bos>User: a cat <start_of_image> and a dog\n<start_of_image>\nWhich is it?", ["landscape", "tiny"]),
}


@pytest.mark.parametrize("case", list(PROMPTS))
def test_prompt_as_the_processor_writes_it(gemma3: dict[str, Any], case: str) -> None:
    """vision.gemma3: each <start_of_image> becomes the processor's "\\n\\n<start_of_image>" + soft tokens +
    "<end_of_image>\\n\\n", tokenized once: the ids equal Gemma3Processor's input_ids, the image rows stand where its
    token_type_ids are 1, and the prompt fed by segments (the server's plain path, in chunks of 17 rows that never
    split an image) gives transformers' first-token logprobs."""
    from kvcmas_cpp.model import is_bidirectional
    from kvcmas_cpp.server.backend import prefill_segments
    from kvcmas_cpp.vision import gemma3 as g3

    text, names = PROMPTS[case]
    ref = _processor()(text=[text], images=[[IMAGES[n] for n in names]], return_tensors="np")
    ref_ids = [int(t) for t in ref["input_ids"][0]]
    lm, enc = gemma3["lm"], gemma3["enc"]
    tok = lm.tokenizer
    expanded = text.replace(g3.BOI, g3.image_text(enc.n_tokens))
    ids = tok.encode(expanded, False, True)
    assert ids == ref_ids
    assert g3.image_token_id(tok) == IMAGE_TOKEN
    images = [enc.encode(IMAGES[n]) for n in names]
    segments = g3.segments(ids, IMAGE_TOKEN, images)
    kinds = np.concatenate([np.full(len(seg), is_bidirectional(seg)) for seg in segments])
    assert np.array_equal(kinds, ref["token_type_ids"][0] == 1)
    done = prefill_segments(lm, segments, chunk_tokens=17)
    try:
        got = _log_softmax(done.logits)
    finally:
        done.seq.close()
    want = _hf_logprobs(gemma3, ref_ids, names)
    assert int(got.argmax()) == int(want.argmax())
    assert float(np.abs(got - want).max()) <= 2e-3
    with pytest.raises(ValueError, match="image tokens"):
        g3.segments(ids, IMAGE_TOKEN, images[:-1])


def test_agent_session_shares_an_image(gemma3: dict[str, Any]) -> None:
    """AgentSession.share(image=...) with a Gemma 3 mmproj: the image's rows stand between the processor's begin /
    end tokens, computed bidirectionally; the first agent's first-token logprobs equal transformers' on the prompt
    the session built (its ids, the image's soft tokens where the rows are), and a fullshared team's first agent
    answers the same."""
    from kvcmas_cpp.agents import AgentSession

    lm, enc = gemma3["lm"], gemma3["enc"]
    photo = PHOTOS / "astronaut.png"
    first: dict[str, Any] = {}
    for method in ("nonshared", "fullshared"):
        with AgentSession(lm, method, vision=enc) as team:
            agents = [team.agent(n, system=f"You are {n}.") for n in ("a cat", "a dog")]
            team.share(image=photo, text="What is it?", label="Question")
            p = team.prefill_agent(agents[0])
            try:
                tokens, logits = list(p.seq.tokens), np.asarray(p.logits)
            finally:
                p.close()
            first[method] = logits
            replies = [a.respond(max_tokens=2) for a in agents]
            assert all(r.text is not None for r in replies)
    ids = [IMAGE_TOKEN if t < 0 else t for t in tokens]
    at = ids.index(IMAGE_TOKEN)
    assert ids[at - 1] == BOI and ids[at + TOKENS] == EOI and ids.count(IMAGE_TOKEN) == TOKENS
    want = _hf_logprobs(gemma3, ids, ["astronaut"])
    got = _log_softmax(first["nonshared"])
    assert int(got.argmax()) == int(want.argmax()) and float(np.abs(got - want).max()) <= 2e-3
    assert np.array_equal(first["fullshared"], first["nonshared"])


def test_server_image_parts(gemma3: dict[str, Any]) -> None:
    """kvcmas-server with the Gemma 3 mmproj: image_url parts become the processor's image text in the rendered
    template, tokenized once (usage counts the processor's ids) and the greedy answer is transformers' (generate
    with pixel_values and token_type_ids)."""
    import base64
    import io

    from fastapi.testclient import TestClient

    from kvcmas_cpp.server.app import Server, ServerConfig

    lm = gemma3["lm"]
    urls = []
    for name in ("landscape", "tiny"):
        buf = io.BytesIO()
        IMAGES[name].save(buf, "PNG")
        urls.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    parts = [{"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {"url": urls[0]}},
             {"type": "text", "text": " and "}, {"type": "image_url", "image_url": {"url": urls[1]}},
             {"type": "text", "text": " What is it?"}]  # fmt: skip
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 3, "temperature": 0}
    server = Server(ServerConfig(str(gemma3["text"]), mmproj=str(gemma3["mmproj"]), threads=2), lm)
    try:
        with TestClient(server.app, base_url="http://127.0.0.1") as c:
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            answer = r.json()
    finally:
        server.scheduler.stop()
    rendered = lm.apply_chat_template(
        [{"role": "user", "content": "Look: <start_of_image> and <start_of_image> What is it?"}]
    )
    ref = _processor()(text=[rendered], images=[[IMAGES["landscape"], IMAGES["tiny"]]], return_tensors="pt")
    assert answer["usage"]["prompt_tokens"] == ref["input_ids"].shape[1]
    with torch.no_grad():
        out = gemma3["model"].generate(**ref, max_new_tokens=3, do_sample=False)
    want = _tokenizer().decode(out[0, ref["input_ids"].shape[1] :], skip_special_tokens=True)
    assert want and answer["choices"][0]["message"]["content"] == want


def test_bad_bidirectional_spans_are_refused(gemma3: dict[str, Any]) -> None:
    """The engine names what is wrong with a bidirectional span and changes nothing."""
    from kvcmas_cpp._native import core

    lm = gemma3["lm"]
    with lm.new_sequence() as a, lm.new_sequence() as b:
        n = lm.n_embd
        seqs = np.array([a.id, a.id, b.id], dtype=np.int32)
        tokens = np.array([5, 6, 7], dtype=np.int32)
        want = np.zeros(3, dtype=np.uint8)
        cases = {"outside the batch": [0, 4], "several sequences": [1, 3], "pairs": [0, 1, 2]}
        for message, span in cases.items():
            with pytest.raises(core.KvcmasError, match=message):
                lm.forward(seqs, tokens, want, np.zeros((1, n), np.float32), np.full(3, -1, np.int32),
                                np.array(span, dtype=np.int32))  # fmt: skip
        assert lm.sequence_rows(a.id) == 0 and lm.sequence_rows(b.id) == 0


def _edited(gemma3: dict[str, Any], tmp_path: Path, name: str, change: Any) -> str:
    import shutil

    from kvcmas_convert.errors import ConvertError
    from kvcmas_convert.vision import convert_mmproj

    folder = tmp_path / "edited"
    shutil.copytree(gemma3["folder"], folder)
    data = json.loads((folder / name).read_text())
    change(data)
    (folder / name).write_text(json.dumps(data))
    with pytest.raises(ConvertError) as e:
        convert_mmproj(folder, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
    return str(e.value)


@pytest.mark.parametrize(
    ("file", "change", "named"),
    [
        ("config.json", lambda d: d.update(mm_tokens_per_image=15), "'mm_tokens_per_image'"),
        ("config.json", lambda d: d.update(mm_tokens_per_image=9), "'mm_tokens_per_image'"),  # 3 does not divide 16
        ("processor_config.json", lambda d: d["image_processor"].update(do_pan_and_scan="yes"), "'do_pan_and_scan'"),
        ("processor_config.json", lambda d: d["image_processor"].update(resample=0), "'resample'"),
        ("processor_config.json", lambda d: d.update(image_seq_length=64), "'image_seq_length'"),
    ],
    ids=["not-square", "not-dividing", "pan-and-scan", "resample", "seq-length"],
)
def test_converter_refuses_what_it_cannot_represent(
    gemma3: dict[str, Any], tmp_path: Path, file: str, change: Any, named: str
) -> None:
    message = _edited(gemma3, tmp_path, file, change)
    assert named in message, message


@pytest.mark.slow
def test_real_gemma3_geometry(tmp_path: Path) -> None:
    """Gemma 3's real image geometry (896 px, 64 x 64 patches of 14 px pooled 4 x 4 to 256 soft tokens) on a narrow
    tower: pixels and features equal transformers'."""
    from kvcmas_convert.vision import convert_mmproj

    vcfg = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=896, patch_size=P, vision_use_head=False)  # fmt: skip # noqa: E501
    tcfg = transformers.Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         query_pre_attn_scalar=16)  # fmt: skip
    config = transformers.Gemma3Config(text_config=tcfg, vision_config=vcfg, mm_tokens_per_image=256)
    torch.manual_seed(1)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    randomize_weights(model.model.vision_tower, 2)
    randomize_weights(model.model.multi_modal_projector, 3)
    model.save_pretrained(tmp_path / "real")
    ip = transformers.Gemma3ImageProcessorPil(size={"height": 896, "width": 896}, image_mean=[0.5] * 3,
                                              image_std=[0.5] * 3, resample=2)  # fmt: skip
    (tmp_path / "real" / "preprocessor_config.json").write_text(json.dumps({**ip.to_dict(), "image_seq_length": 256}))
    convert_mmproj(tmp_path / "real", tmp_path / "real.gguf", outtype="f32")
    enc = VisionEncoder(tmp_path / "real.gguf", n_threads=2)
    assert enc.n_tokens == 256 and enc.pool_kernel == 4
    names = ["landscape", "astronaut"]
    pixels = ip(images=[IMAGES[n] for n in names], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = model.model.get_image_features(pixel_values=pixels)
    refs = np.asarray(getattr(out, "pooler_output", out))
    for i, name in enumerate(names):
        assert np.array_equal(enc.preprocess(IMAGES[name]), pixels[i].numpy()), name
        got = enc.encode(IMAGES[name])
        assert got.shape == refs[i].shape == (256, 64)
        assert float(np.abs(got - refs[i]).max()) <= 1e-4 * float(np.abs(refs[i]).max()) + 1e-6, name


def test_portable_kernels_open_the_mask_too(gemma3: dict[str, Any], tmp_path: Path) -> None:
    """KVCMAS_FORCE_SCALAR=1 (the portable attention kernel, as on CPUs without AVX2): the same logprobs."""
    import os

    names = ["portrait", "tiny"]
    texts = TEXTS[: len(names) + 1]
    script = f"""
import numpy as np, kvcmas_cpp
from kvcmas_cpp.vision import VisionEncoder
from PIL import Image
enc = VisionEncoder({str(gemma3["mmproj"])!r}, n_threads=1)
lm = kvcmas_cpp.Model({str(gemma3["text"])!r}, n_threads=1)
texts, images = {texts!r}, [np.load(p) for p in {[str(tmp_path / f"{n}.npy") for n in names]!r}]
with lm.new_sequence() as seq:
    seq.append(texts[0] + [{BOI}], logits="none")
    for i, rows in enumerate(images):
        seq.append_embeddings(enc.encode(Image.fromarray(rows)), bidirectional=True)
        last = seq.append([{EOI}] + texts[i + 1] + ([{BOI}] if i + 1 < len(images) else []), logits="last")
np.save({str(tmp_path / "out.npy")!r}, np.asarray(last))
"""
    for n in names:
        np.save(tmp_path / f"{n}.npy", np.asarray(IMAGES[n]))
    env = {**os.environ, "KVCMAS_FORCE_SCALAR": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    got = _log_softmax(np.load(tmp_path / "out.npy"))
    want = _hf_logprobs(gemma3, _prompt(texts, len(names)), names)
    assert int(got.argmax()) == int(want.argmax()) and float(np.abs(got - want).max()) <= 2e-3


@pytest.mark.parametrize("method", ["nonshared", "kvcmas"])
def test_session_prompt_equals_the_processor(gemma3: dict[str, Any], method: str) -> None:
    """A chat whose content holds two images (AgentSession.prefill, as the server passes image parts, in chunks of
    17 rows): the prompt's ids are Gemma3Processor's for the rendered chat, each image's rows where its soft tokens
    are, and the first-token logprobs are transformers'."""
    from kvcmas_cpp.agents import AgentSession

    lm, enc = gemma3["lm"], gemma3["enc"]
    names = ["landscape", "tiny"]
    rows = [enc.encode(IMAGES[n]) for n in names]
    content = ["Look: ", rows[0], " and", rows[1], rows[1], "\nWhat is it?"]  # text, image, text, two images, text
    names.append("tiny")
    rendered = lm.apply_chat_template(
        [{"role": "user", "content": "Look: <start_of_image> and<start_of_image><start_of_image>\nWhat is it?"}]
    )
    ref = _processor()(text=[rendered], images=[[IMAGES[n] for n in names]], return_tensors="np")
    ref_ids = [int(t) for t in ref["input_ids"][0]]
    with AgentSession(lm, method, vision=enc) as team:
        p = team.prefill([{"role": "user", "content": content}], chunk_tokens=17)
        try:
            ids = [IMAGE_TOKEN if t < 0 else t for t in p.seq.tokens]
            logits = np.asarray(p.logits)
        finally:
            p.close()
    assert ids == ref_ids
    want = _hf_logprobs(gemma3, ref_ids, names)
    got = _log_softmax(logits)
    assert int(got.argmax()) == int(want.argmax()) and float(np.abs(got - want).max()) <= 2e-3


def _rewrite(src: Path, dst: Path, keys: dict[str, Any], drop: str | None = None) -> Path:
    """A copy of an mmproj with some keys changed (string / uint32 values) and a tensor dropped."""
    import gguf

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, "clip")
    for name, fld in reader.fields.items():
        if name.startswith(("clip.", "kvcmas.")) and name not in keys:
            vtype = fld.types[0]
            writer.add_key_value(name, fld.contents(), vtype,
                                 sub_type=fld.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)  # fmt: skip
    for name, value in keys.items():
        if isinstance(value, str):
            writer.add_string(name, value)
        else:
            writer.add_uint32(name, value)
    for t in reader.tensors:
        if t.name != drop:
            writer.add_tensor(t.name, np.array(t.data).reshape([int(x) for x in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.mark.parametrize(
    ("keys", "drop", "named"),
    [
        ({"clip.projector_type": "mlp"}, None, "needs clip.projector_type = 'gemma3'"),
        ({"clip.vision.projector.scale_factor": 3}, None, "must divide the 16 patches"),
        ({"kvcmas.vision.resample": "lanczos"}, None, "'bicubic' or 'bilinear'"),
        ({}, "mm.soft_emb_norm.weight", "mm.soft_emb_norm.weight"),
        ({}, "v.post_ln.weight", "last_hidden_state"),
    ],
    ids=["type", "pooling", "resample", "no-norm", "no-post-ln"],
)
def test_bad_gemma3_mmproj_files_are_refused(
    gemma3: dict[str, Any], tmp_path: Path, keys: dict[str, Any], drop: str | None, named: str
) -> None:
    bad = _rewrite(gemma3["mmproj"], tmp_path / "bad.gguf", keys, drop)
    with pytest.raises(kvcmas_cpp.KvcmasError, match=named):
        VisionEncoder(bad, n_threads=1)


def test_text_model_without_the_image_tokens_is_refused(default_model_path: Path) -> None:
    """A Gemma 3 mmproj needs a vocabulary with its image tokens (checked when a session or server loads it)."""
    from kvcmas_cpp.vision import gemma3 as g3

    lm = kvcmas_cpp.Model(default_model_path, n_threads=1)
    with pytest.raises(ValueError, match="no <image_soft_token> token"):
        g3.image_token_id(lm.tokenizer)
    with pytest.raises(ValueError, match="no <start_of_image> token"):
        g3.marker_ids(lm.tokenizer)


# Pan-and-scan: settings unlike the processor's defaults (256, 4, 1.2), so the test shows they are read from the file
PAS = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 200, "pan_and_scan_max_num_crops": 3,
       "pan_and_scan_min_ratio_to_activate": 1.5}  # fmt: skip
PAS_IMAGES = {
    "wide": IMAGES["astronaut"].resize((1200, 300)),  # 3 crops of 400 x 300
    "tall": IMAGES["landscape"].resize((301, 1000)),  # 3 crops of 301 x 334 (the last one 301 x 332)
    "below-ratio": IMAGES["astronaut"].resize((600, 450)),  # 1.33 < 1.5: none (the defaults would give 2)
}
PAS_CROPS = {"wide": 3, "tall": 3, "below-ratio": 0}


def _pas_image_processor() -> Any:
    return transformers.Gemma3ImageProcessorPil(
        size={"height": S, "width": S}, image_mean=[0.5] * 3, image_std=[0.5] * 3, resample=2, **PAS
    )


@pytest.fixture(scope="module")
def gemma3_pas(gemma3: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The Gemma 3 checkpoint with pan-and-scan on in its processor_config.json, converted to an mmproj."""
    import shutil

    from kvcmas_convert.vision import convert_mmproj

    folder = tmp_path_factory.mktemp("gemma3-pas") / "gemma3"
    shutil.copytree(gemma3["folder"], folder)
    data = json.loads((folder / "processor_config.json").read_text())
    data["image_processor"].update(PAS)
    (folder / "processor_config.json").write_text(json.dumps(data))
    mmproj = folder.parent / "pas-mmproj.gguf"
    convert_mmproj(folder, mmproj, outtype="f32")
    return {**gemma3, "enc": VisionEncoder(mmproj, n_threads=2), "mmproj": mmproj}


def test_mmproj_records_pan_and_scan(gemma3: dict[str, Any], gemma3_pas: dict[str, Any]) -> None:
    """The converter writes the processor's settings under kvcmas.vision.pan_and_scan.*, and only when it is on."""
    from gguf import GGUFReader

    from kvcmas_cpp.vision import gemma3 as g3

    fields = GGUFReader(gemma3_pas["mmproj"]).fields
    assert fields[g3.KEY_PAN_AND_SCAN].contents() is True
    assert fields[g3.KEY_PAS_MIN_CROP_SIZE].contents() == 200 and fields[g3.KEY_PAS_MAX_NUM_CROPS].contents() == 3
    assert g3.read_pan_and_scan(str(gemma3_pas["mmproj"])) == g3.PanAndScan(200, 3, 1.5)
    assert g3.read_pan_and_scan(str(gemma3["mmproj"])) is None
    assert g3.KEY_PAN_AND_SCAN not in GGUFReader(gemma3["mmproj"]).fields


@pytest.mark.parametrize("name", list(PAS_IMAGES))
def test_pan_and_scan_pixels_equal_the_processor(gemma3_pas: dict[str, Any], name: str) -> None:
    """Base image then crops: the processor's pixel_values with do_pan_and_scan, bit for bit; pan_and_scan=False
    gives its pixel_values with pan-and-scan off."""
    from kvcmas_cpp.vision import gemma3 as g3

    enc, image = gemma3_pas["enc"], PAS_IMAGES[name]
    ref = _pas_image_processor()(images=[image], return_tensors="np")
    assert list(ref["num_crops"]) == [PAS_CROPS[name]]
    ours = g3.pixel_values(enc, image)
    assert ours.shape == ref["pixel_values"].shape == (1 + PAS_CROPS[name], 3, S, S)
    assert np.array_equal(ours, ref["pixel_values"]), f"{name}: max |d| {np.abs(ours - ref['pixel_values']).max()}"
    off = _image_processor()(images=[image], return_tensors="np")["pixel_values"]
    assert np.array_equal(g3.pixel_values(enc, image, pan_and_scan=False), off)


def test_pan_and_scan_prompt_and_logprobs_equal_transformers(gemma3_pas: dict[str, Any]) -> None:
    """The processor's text for an image with crops ("Here is the original image ... crops to help you see better
    ..."), tokenized once, equals Gemma3Processor's input_ids; the base image and crop rows where its
    token_type_ids are 1 give Gemma3ForConditionalGeneration's first-token logprobs at f32."""
    from kvcmas_cpp.model import is_bidirectional
    from kvcmas_cpp.server.backend import prefill_segments
    from kvcmas_cpp.vision import gemma3 as g3

    names = ["wide", "below-ratio", "tall"]
    text = "<bos>User: a <start_of_image> then<start_of_image> and <start_of_image>\nWhich is it?"
    processor = transformers.Gemma3Processor(image_processor=_pas_image_processor(), tokenizer=_tokenizer(),
                                             image_seq_length=TOKENS)  # fmt: skip
    # Gemma3Processor's own defaults (off; 256, 4, 1.2) override its image processor's settings: pass them per call
    ref = processor(text=[text], images=[[PAS_IMAGES[n] for n in names]], return_tensors="pt", **PAS)
    lm, enc = gemma3_pas["lm"], gemma3_pas["enc"]
    views = [g3.encode_views(enc, PAS_IMAGES[n]) for n in names]
    assert [len(v) - 1 for v in views] == [PAS_CROPS[n] for n in names]
    ids = lm.tokenizer.encode(g3.expand(text, enc.n_tokens, [len(v) - 1 for v in views]), False, True)
    assert ids == [int(t) for t in ref["input_ids"][0]]
    segments = g3.segments(ids, IMAGE_TOKEN, [rows for v in views for rows in v])
    kinds = np.concatenate([np.full(len(seg), is_bidirectional(seg)) for seg in segments])
    assert np.array_equal(kinds, ref["token_type_ids"][0].numpy() == 1)
    done = prefill_segments(lm, segments, chunk_tokens=40)
    try:
        got = _log_softmax(done.logits)
    finally:
        done.seq.close()
    with torch.no_grad():
        logits = gemma3_pas["model"](**ref).logits
    want = torch.log_softmax(logits[0, -1].double(), -1).numpy()
    assert int(got.argmax()) == int(want.argmax())
    assert float(np.abs(got - want).max()) <= 2e-3
    # without the crops the answer differs: the crops' rows matter
    plain_ids = lm.tokenizer.encode(g3.expand(text, enc.n_tokens, [0, 0, 0]), False, True)
    plain = prefill_segments(lm, g3.segments(plain_ids, IMAGE_TOKEN, [v[0] for v in views]), chunk_tokens=40)
    try:
        assert float(np.abs(_log_softmax(plain.logits) - got).max()) > 1e-2
    finally:
        plain.seq.close()


def test_server_pan_and_scan_and_detail_low(gemma3_pas: dict[str, Any]) -> None:
    """kvcmas-server with a pan-and-scan mmproj: an image part gets its crops as Gemma3Processor writes them (usage
    counts its input_ids with pan-and-scan; the greedy answer is transformers'), and detail "low" turns them off."""
    import base64
    import io

    from fastapi.testclient import TestClient

    from kvcmas_cpp.server.app import Server, ServerConfig

    lm = gemma3_pas["lm"]
    buf = io.BytesIO()
    PAS_IMAGES["wide"].save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    rendered = lm.apply_chat_template([{"role": "user", "content": "Look: <start_of_image> What is it?"}])
    processor = transformers.Gemma3Processor(image_processor=_pas_image_processor(), tokenizer=_tokenizer(),
                                             image_seq_length=TOKENS)  # fmt: skip
    server = Server(ServerConfig(str(gemma3_pas["text"]), mmproj=str(gemma3_pas["mmproj"]), threads=2), lm)
    try:
        with TestClient(server.app, base_url="http://127.0.0.1") as c:
            for detail, pas in ((None, True), ("low", False)):
                image_url = {"url": url} if detail is None else {"url": url, "detail": detail}
                parts = [{"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": image_url},
                         {"type": "text", "text": " What is it?"}]  # fmt: skip
                body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 3, "temperature": 0}
                r = c.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                ref = processor(text=[rendered], images=[[PAS_IMAGES["wide"]]], return_tensors="pt",
                                **{**PAS, "do_pan_and_scan": pas})  # fmt: skip
                assert r.json()["usage"]["prompt_tokens"] == ref["input_ids"].shape[1], detail
                with torch.no_grad():
                    out = gemma3_pas["model"].generate(**ref, max_new_tokens=3, do_sample=False)
                want = _tokenizer().decode(out[0, ref["input_ids"].shape[1] :], skip_special_tokens=True)
                assert want and r.json()["choices"][0]["message"]["content"] == want, detail
    finally:
        server.scheduler.stop()


def test_agent_session_shares_an_image_with_crops(gemma3_pas: dict[str, Any]) -> None:
    """AgentSession.share(image=...) with a pan-and-scan mmproj: the span holds the processor's text for the image
    and its crops, and the first agent's first-token logprobs equal transformers' on the prompt the session built."""
    from kvcmas_cpp.vision import gemma3 as g3

    lm, enc = gemma3_pas["lm"], gemma3_pas["enc"]
    ids, logits = shared_image_prompt(lm, enc, PAS_IMAGES["wide"], "What is it?", IMAGE_TOKEN)
    want_span = lm.tokenizer.encode(g3.crops_text(TOKENS, 3), False, True)
    assert any(ids[i : i + len(want_span)] == want_span for i in range(len(ids)))
    assert ids.count(IMAGE_TOKEN) == 4 * TOKENS
    pixels = _pas_image_processor()(images=[PAS_IMAGES["wide"]], return_tensors="pt")["pixel_values"]
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        ref = gemma3_pas["model"](input_ids=input_ids, pixel_values=pixels,
                                  token_type_ids=(input_ids == IMAGE_TOKEN).long()).logits  # fmt: skip
    want = torch.log_softmax(ref[0, -1].double(), -1).numpy()
    got = _log_softmax(logits)
    assert int(got.argmax()) == int(want.argmax()) and float(np.abs(got - want).max()) <= 2e-3
