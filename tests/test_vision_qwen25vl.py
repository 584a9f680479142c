"""Qwen2.5-VL against transformers: M-RoPE in the text model, the windowed ViT with its 2x2 merger, dynamic
resolution, and the first generated token with an image.

A random-weight Qwen2_5_VLForConditionalGeneration made here with transformers at small widths (real patch size,
temporal patch, merge size and window), converted by ``kvcmas convert`` (the text half, ``qwen2vl``) and ``kvcmas
mmproj`` (the tower), then run by kvcmas and by transformers at f32.
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

import kvcmas_cpp  # noqa: E402
from helpers.vision import byte_bpe, randomize_weights, sample_images, shared_image_prompt  # noqa: E402  (weights far from transformers' init)
from kvcmas_cpp.model import image_pos_of  # noqa: E402
from kvcmas_cpp.vision import VisionEncoder  # noqa: E402
from kvcmas_cpp.vision.qwen import QwenVisionEncoder  # noqa: E402

MIN_PIXELS, MAX_PIXELS = 56 * 56, 448 * 448  # at most 1,024 patches (256 image tokens): a fast test tower

REPO = Path(__file__).resolve().parent.parent
VOCAB = 400
IMAGE_TOKEN, VISION_START, VISION_END = 397, 395, 396
IMAGES = sample_images()
SECTIONS = [2, 3, 3]  # M-RoPE pairs of the temporal, height and width positions (head_dim 16)


def _config() -> Any:
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "mrope_section": SECTIONS, "rope_theta": 10000.0})  # fmt: skip
    vision = dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                  fullatt_block_indexes=[1, 3], window_size=112, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2)  # fmt: skip
    return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN,
                                         video_token_id=398, vision_start_token_id=VISION_START,
                                         vision_end_token_id=VISION_END)  # fmt: skip


def _image_processor() -> Any:
    return transformers.Qwen2VLImageProcessorPil(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})


def _run(*args: str) -> None:
    cmd = [sys.executable, "-m", "kvcmas_cpp.cli", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """{folder, model, ip, lm, enc}: the checkpoint (with processor_config.json as transformers 5 writes it), the
    transformers model and image processor, the text GGUF written by `kvcmas convert` and the tower by `kvcmas
    mmproj`."""
    root = tmp_path_factory.mktemp("qwen25vl")
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(_config()).eval()
    randomize_weights(model, 11)
    folder = root / "qwen25vl"
    model.save_pretrained(folder)
    ip = _image_processor()
    processor = {"image_processor": ip.to_dict(), "processor_class": "Qwen2_5_VLProcessor"}
    (folder / "processor_config.json").write_text(json.dumps(processor, indent=2))
    text, mmproj = root / "text.gguf", root / "mmproj.gguf"
    _run("convert", str(folder), "-o", str(text), "--outtype", "f32", "--no-vocab")
    _run("mmproj", str(folder), "-o", str(mmproj), "--outtype", "f32")
    lm = kvcmas_cpp.Model(text, n_threads=2)
    return {"folder": folder, "model": model, "ip": ip, "lm": lm, "enc": VisionEncoder(mmproj, n_threads=2)}


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def test_text_only_logits_equal_transformers(qwen: dict[str, Any]) -> None:
    """A sequence of text only (t = h = w) gives transformers' logits at every position."""
    lm = qwen["lm"]
    assert lm.arch == "qwen2vl" and lm.rope_sections == [*SECTIONS, 0]
    ids = np.random.default_rng(1).integers(0, 390, 37).tolist()
    with torch.no_grad():
        ref = qwen["model"](input_ids=torch.tensor([ids])).logits[0].numpy()
    ours = lm.logits(ids)
    assert ours.shape == ref.shape
    assert np.abs(_log_softmax(ours) - _log_softmax(ref)).max() <= 2e-3
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


CASES = ["landscape", "portrait", "astronaut", "coffee", "tiny", "tall"]


@pytest.mark.parametrize("name", CASES)
def test_pixels_and_token_counts_equal_the_processor(qwen: dict[str, Any], name: str) -> None:
    """The tower's input equals the processor's pixel_values bit for bit; the grid and the image-token count are
    its image_grid_thw and what Qwen2_5_VLProcessor writes into the prompt."""
    enc: QwenVisionEncoder = qwen["enc"]
    assert isinstance(enc, QwenVisionEncoder)  # VisionEncoder opens a Qwen2.5-VL file as its own class
    assert (enc.qwen.min_pixels, enc.qwen.max_pixels) == (MIN_PIXELS, MAX_PIXELS)  # read from the checkpoint
    out = qwen["ip"](images=[IMAGES[name]], return_tensors="np")
    patches, grid = enc.preprocess(IMAGES[name])
    assert patches.dtype == np.float32 and np.array_equal(patches, out["pixel_values"])
    assert [1, *grid] == out["image_grid_thw"][0].tolist()
    proc = transformers.Qwen2_5_VLProcessor.__new__(transformers.Qwen2_5_VLProcessor)  # its counting, no tokenizer
    proc.image_processor, proc.image_token = qwen["ip"], "<|image_pad|>"
    count = len(proc.replace_image_token(out, 0)) // len("<|image_pad|>")
    w, h = IMAGES[name].size
    assert enc.n_image_tokens(w, h) == count == int(np.prod(enc.grid(w, h)))


def _hf_features(qwen: dict[str, Any], name: str) -> np.ndarray:
    out = qwen["ip"](images=[IMAGES[name]], return_tensors="pt")
    with torch.no_grad():
        feats = qwen["model"].model.get_image_features(pixel_values=out["pixel_values"],
                                                       image_grid_thw=out["image_grid_thw"])  # fmt: skip
    feats = getattr(feats, "pooler_output", feats)
    return (feats[0] if isinstance(feats, (list, tuple)) else feats).numpy()


@pytest.mark.parametrize("name", CASES)
def test_image_features_equal_transformers(qwen: dict[str, Any], name: str) -> None:
    """The windowed / full-attention ViT, 2D RoPE and the merger give transformers' features at f32."""
    ref = _hf_features(qwen, name)
    ours = qwen["enc"].encode(IMAGES[name])
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= 1e-4 * max(1.0, float(np.abs(ref).max()))


def test_windows_matter(qwen: dict[str, Any]) -> None:
    """The windowed blocks are windowed: transformers with every block attending fully gives features far from
    ours (so the equality above checks the windows, and not a tower that attends over the whole image)."""
    enc: QwenVisionEncoder = qwen["enc"]
    assert enc.full_attention == [False, True, False, True] and enc.window_size == 112
    visual = qwen["model"].model.visual
    saved = visual.fullatt_block_indexes
    try:
        visual.fullatt_block_indexes = list(range(len(visual.blocks)))
        everywhere = _hf_features(qwen, "astronaut")  # 32 x 32 patches: 4 x 4 windows
    finally:
        visual.fullatt_block_indexes = saved
    assert np.abs(qwen["enc"].encode(IMAGES["astronaut"]) - everywhere).max() > 1e-2


def _prompt(qwen: dict[str, Any], names: list[str], seed: int) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Text pieces around the images (each image between <|vision_start|> and <|vision_end|>) and each image's
    (rows, cols) of tokens."""
    rng = np.random.default_rng(seed)
    pieces = [rng.integers(0, 390, 5).tolist() + [VISION_START]]
    for i, _ in enumerate(names):
        tail = rng.integers(0, 390, 4).tolist()
        pieces.append([VISION_END, *tail] + ([VISION_START] if i + 1 < len(names) else []))
    grids = [qwen["enc"].grid(*IMAGES[n].size) for n in names]
    return pieces, grids


def _hf_inputs(qwen: dict[str, Any], names: list[str], pieces: list[list[int]], grids: list[tuple[int, int]]) -> Any:
    ids = list(pieces[0])
    for (rows, cols), piece in zip(grids, pieces[1:], strict=True):
        ids += [IMAGE_TOKEN] * (rows * cols) + piece
    out = qwen["ip"](images=[IMAGES[n] for n in names], return_tensors="pt")
    input_ids = torch.tensor([ids])
    return input_ids, out["pixel_values"], out["image_grid_thw"], (input_ids == IMAGE_TOKEN).int()


@pytest.mark.parametrize("names", [["landscape"], ["tall"], ["coffee", "tiny"]], ids=lambda n: "+".join(n))
def test_mrope_positions_equal_get_rope_index(qwen: dict[str, Any], names: list[str]) -> None:
    """Sequence positions plus the offsets kvcmas decodes with are transformers' (t, h, w) positions for every
    token, images and the text after them included."""
    pieces, grids = _prompt(qwen, names, 7)
    input_ids, _, thw, mm = _hf_inputs(qwen, names, pieces, grids)
    ref, ref_delta = qwen["model"].model.get_rope_index(input_ids, mm_token_type_ids=mm, image_grid_thw=thw)
    image_pos = np.zeros((input_ids.shape[1], 3), dtype=np.int64)  # (k, rows, cols) of each image row
    at = len(pieces[0])
    for (rows, cols), piece in zip(grids, pieces[1:], strict=True):
        image_pos[at : at + rows * cols] = np.stack([np.arange(rows * cols), [rows] * (rows * cols),
                                                     [cols] * (rows * cols)], axis=1)  # fmt: skip
        at += rows * cols + len(piece)
    positions = np.arange(input_ids.shape[1])
    offsets, marks = kvcmas_cpp.model.mrope_offsets(image_pos, positions.tolist(), [])
    ours = positions[:, None] + offsets
    delta = sum(d for _, d in marks)
    assert np.array_equal(np.asarray(ours).T, ref[:, 0].numpy()) and delta == int(ref_delta)


@pytest.mark.parametrize("names", [["landscape"], ["portrait"], ["astronaut"], ["tiny"], ["tall"], ["coffee", "tiny"]],
                         ids=lambda n: "+".join(n))  # fmt: skip
def test_first_token_logprobs_with_images_equal_transformers(qwen: dict[str, Any], names: list[str]) -> None:
    """The text model reading the tower's rows at their M-RoPE positions gives transformers' first-token
    distribution: top-1 identical, max |Δ logprob| <= 2e-3; then a generated token (text after the image, its
    positions shifted) agrees too."""
    pieces, grids = _prompt(qwen, names, 8)
    input_ids, pixels, thw, mm = _hf_inputs(qwen, names, pieces, grids)
    with torch.no_grad():
        ref = qwen["model"](input_ids=input_ids, pixel_values=pixels, image_grid_thw=thw, mm_token_type_ids=mm)
    ref_lp = _log_softmax(ref.logits[0, -1].numpy())
    lm = qwen["lm"]
    with lm.new_sequence() as seq:
        seq.append(pieces[0], logits="none")
        for name, grid, piece in zip(names, grids, pieces[1:], strict=True):
            seq.append_embeddings(qwen["enc"].encode(IMAGES[name]), image_grid=grid)
            last = seq.append(piece)
        lp = _log_softmax(last)
        assert lp.argmax() == ref_lp.argmax() and np.abs(lp - ref_lp).max() <= 2e-3
        # one decode step after the prompt: transformers continues with its cached rope deltas
        nxt = int(ref_lp.argmax())
        with torch.no_grad():
            ref2 = qwen["model"](input_ids=torch.tensor([[nxt]]), cache=ref.past_key_values,
                                 mm_token_type_ids=torch.zeros((1, 1), dtype=torch.int))  # fmt: skip
        lp2, ref_lp2 = _log_softmax(seq.append([nxt])), _log_softmax(ref2.logits[0, -1].numpy())
        assert lp2.argmax() == ref_lp2.argmax() and np.abs(lp2 - ref_lp2).max() <= 2e-3


def test_image_positions_matter(qwen: dict[str, Any]) -> None:
    """Without M-RoPE positions (the rows in sequence, as LLaVA runs them) the logprobs move far from
    transformers': the equality above checks the positions."""
    pieces, grids = _prompt(qwen, ["coffee"], 8)
    input_ids, pixels, thw, mm = _hf_inputs(qwen, ["coffee"], pieces, grids)
    with torch.no_grad():
        ref = qwen["model"](input_ids=input_ids, pixel_values=pixels, image_grid_thw=thw, mm_token_type_ids=mm)
    with qwen["lm"].new_sequence() as seq:
        seq.append(pieces[0], logits="none")
        seq.append_embeddings(np.array(qwen["enc"].encode(IMAGES["coffee"])))  # plain rows: no grid
        lp = _log_softmax(seq.append(pieces[1]))
    assert np.abs(lp - _log_softmax(ref.logits[0, -1].numpy())).max() > 1e-2


def test_image_span_read_at_another_position_is_exact(qwen: dict[str, Any]) -> None:
    """An image span (and the text after it) computed by one sequence and read by reference by another at a
    different position is rotated to the reader's M-RoPE positions: its first layer's keys (which depend on nothing
    before them) equal those of computing it there, and the reader's text after it goes on at the image's
    positions (its first-layer keys equal too). Deeper layers differ by what the span attended to, which the
    sharing methods correct."""
    lm, grid = qwen["lm"], qwen["enc"].grid(*IMAGES["coffee"].size)
    feats = qwen["enc"].encode(IMAGES["coffee"])
    rng = np.random.default_rng(9)
    first, other = rng.integers(0, 390, 3).tolist(), rng.integers(0, 390, 11).tolist()
    after, question = [VISION_END, *rng.integers(0, 390, 4).tolist()], rng.integers(0, 390, 6).tolist()
    n = len(feats) + len(after)
    with lm.new_sequence() as src, lm.new_sequence() as reader, lm.new_sequence() as fresh:
        src.append([*first, VISION_START], logits="none")
        src.append_embeddings(feats, image_grid=grid)
        src.append(after, logits="none")
        span = src.share(len(first) + 1, n)
        reader.append([*other, VISION_START], logits="none")
        reader.append_shared(span)
        assert reader.rope_delta == src.rope_delta == max(grid) - grid[0] * grid[1]
        fresh.append([*other, VISION_START], logits="none")
        fresh.append_embeddings(feats, image_grid=grid)
        fresh.append(after, logits="none")
        reader.append(question, logits="none")
        fresh.append(question, logits="none")
        k_read, v_read = reader.kv(len(other) + 1, n + len(question))
        k_fresh, v_fresh = fresh.kv(len(other) + 1, n + len(question))
        assert np.abs(k_read[0] - k_fresh[0]).max() <= 1e-5 and np.abs(v_read[0] - v_fresh[0]).max() <= 1e-6
        unshifted = src.kv(len(first) + 1, n)[0][0]
        assert np.abs(unshifted - k_fresh[0, :n]).max() > 1e-2  # the shift is not nothing
        fork = reader.fork()  # a fork goes on from the same positions; a truncation before the image forgets it
        assert fork.rope_delta == reader.rope_delta
        fork.truncate(len(other) + 1)
        assert fork.rope_delta == 0
        fork.close()


def test_an_image_in_several_appends_takes_the_same_positions(qwen: dict[str, Any]) -> None:
    """image_pos (row k of a rows x cols image per vector) lets chunked prefill split an image: the logits equal
    appending it whole."""
    lm, grid = qwen["lm"], qwen["enc"].grid(*IMAGES["coffee"].size)
    feats = qwen["enc"].encode(IMAGES["coffee"])
    n = len(feats)
    info = np.stack([np.arange(n), np.full(n, grid[0]), np.full(n, grid[1])], axis=1)
    head, tail = [1, 2, VISION_START], [VISION_END, 5, 6, 7]
    with lm.new_sequence() as whole, lm.new_sequence() as split:
        whole.append(head, logits="none")
        whole.append_embeddings(feats, image_grid=grid)
        split.append(head, logits="none")
        for a, b in ((0, 100), (100, 101), (101, n)):
            split.append_embeddings(feats[a:b], image_pos=info[a:b])
        assert split.rope_delta == whole.rope_delta
        assert np.abs(whole.append(tail) - split.append(tail)).max() <= 1e-4


@pytest.fixture(scope="module")
def qwen_chat(qwen: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A Qwen2.5-VL checkpoint with a tokenizer and chat template (SmolLM2's, vocabulary 49,152) for agents."""
    tok_dir = REPO / "models" / "generated" / "hf-tokenizer-smollm2"
    if not (tok_dir / "tokenizer.json").is_file():
        pytest.skip("the SmolLM2 tokenizer files are not installed")
    root = tmp_path_factory.mktemp("qwen25vl-chat")
    config = _config()
    config.text_config.vocab_size = 49152
    torch.manual_seed(1)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    randomize_weights(model, 12)
    model.model.visual.load_state_dict(qwen["model"].model.visual.state_dict())  # the tower of qwen["enc"]
    folder = root / "ck"
    model.save_pretrained(folder)
    for f in tok_dir.iterdir():
        if f.name != "SOURCE":
            (folder / f.name).write_bytes(f.read_bytes())
    text = root / "text.gguf"
    _run("convert", str(folder), "-o", str(text), "--outtype", "f32")
    return {"model": model, "lm": kvcmas_cpp.Model(text, n_threads=2)}


@pytest.mark.slow
def test_agents_share_an_image_with_mrope(qwen: dict[str, Any], qwen_chat: dict[str, Any]) -> None:
    """AgentSession.share(image=...) on Qwen2.5-VL: the image's rows take their M-RoPE positions in the agents'
    prompts; the first agent generates transformers' greedy tokens from the same prompt, and the team encodes the
    image once."""
    from kvcmas_cpp.agents import AgentSession

    lm, enc = qwen_chat["lm"], qwen["enc"]
    photo, count0 = IMAGES["coffee"], enc.encode_count
    enc.clear_cache()
    with AgentSession(lm, "nonshared", vision=enc) as team:
        agents = [team.agent("a", system="You describe pictures."), team.agent("b", system="You count things.")]
        team.share(image=photo, text="What is in this picture?", label="Question")
        replies = [ag.respond(max_tokens=4) for ag in agents]
        prompt = list(team._state.prompts[0])
    assert enc.encode_count == count0 + 1
    n = sum(1 for t in prompt if t < 0)
    assert n == enc.n_image_tokens(*photo.size) and IMAGE_TOKEN not in prompt
    input_ids = torch.tensor([[IMAGE_TOKEN if t < 0 else t for t in prompt]])
    out = qwen["ip"](images=[photo], return_tensors="pt")
    mm = (input_ids == IMAGE_TOKEN).int()
    hf, ids = qwen_chat["model"], []
    with torch.no_grad():
        step = hf(input_ids=input_ids, pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
                  mm_token_type_ids=mm)  # fmt: skip
        for _ in range(4):
            ids.append(int(step.logits[0, -1].argmax()))
            step = hf(input_ids=torch.tensor([[ids[-1]]]), cache=step.past_key_values,
                      mm_token_type_ids=torch.zeros((1, 1), dtype=torch.int))  # fmt: skip
    assert replies[0].ids == ids


def test_the_servers_segments_carry_the_image_positions(qwen: dict[str, Any]) -> None:
    """The encoder's rows know their grid (ImageFeatures), so the server's prompt segments (text ids and image rows,
    prefilled in chunks that split the image) give the logits of appending the image with its grid."""
    from kvcmas_cpp.server.backend import prefill_segments

    feats = qwen["enc"].encode(IMAGES["coffee"])
    assert feats.grid == qwen["enc"].grid(*IMAGES["coffee"].size) and image_pos_of(feats[:5]) is None
    head, tail = [1, 2, VISION_START], [VISION_END, 5, 6, 7]
    done = prefill_segments(qwen["lm"], [head, feats, tail], chunk_tokens=40)
    with qwen["lm"].new_sequence() as seq:
        seq.append(head, logits="none")
        seq.append_embeddings(np.array(feats), image_grid=feats.grid)
        ref = seq.append(tail)
    try:
        assert done.seq.rope_delta == seq.rope_delta != 0 and np.abs(done.logits - ref).max() <= 1e-4
    finally:
        done.close()


def test_bad_inputs_are_refused_with_their_reason(qwen: dict[str, Any], tmp_path: Path) -> None:
    """Wrong grids, offsets for a model with one position, and a checkpoint M-RoPE cannot represent give errors
    that say what is wrong (nothing crashes)."""
    from kvcmas_convert.errors import ConvertError
    from kvcmas_convert.models import model_class_for

    enc, lm = qwen["enc"], qwen["lm"]
    patches, (gh, gw) = enc.preprocess(IMAGES["tiny"])
    with pytest.raises(kvcmas_cpp.KvcmasError, match="multiple of the merge size"):
        enc.encode_pixels(patches[: (gh - 1) * gw], (gh - 1, gw))
    with pytest.raises(kvcmas_cpp.KvcmasError, match="expected patches"):
        enc.encode_pixels(patches[:, :100], (gh, gw))
    bad = patches.copy()
    bad[0, 0] = np.nan
    with pytest.raises(kvcmas_cpp.KvcmasError, match="not finite"):
        enc.encode_pixels(bad, (gh, gw))
    with lm.new_sequence() as seq, pytest.raises(ValueError, match="does not hold"):
        seq.append_embeddings(enc.encode(IMAGES["tiny"]), image_grid=(3, 3))
    plain = kvcmas_cpp.Model(kvcmas_cpp.model.default_model_path(), n_threads=1)
    with pytest.raises(kvcmas_cpp.KvcmasError, match="M-RoPE offsets"):
        plain.forward(np.zeros(1, np.int32), np.ones(1, np.int32), np.ones(1, np.uint8),
                           rope_offsets=np.zeros((1, 3), np.int32))  # fmt: skip
    config = json.loads((qwen["folder"] / "config.json").read_text())
    config["text_config"]["rope_parameters"]["mrope_section"] = [2, 3, 2]  # 7 pairs of 8
    with pytest.raises(ConvertError, match="mrope_section"):
        model_class_for(config, "config.json")


QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _qwen_tokenizer() -> Any:
    """A byte-level BPE tokenizer holding Qwen2.5-VL's image tokens at the fixture config's ids (395, 396, 397)."""
    corpus = ["User: what is in this picture? A cup of coffee, a rocket, a cat.\nAssistant: it is a cup.\n"] * 20
    marked = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok = byte_bpe(corpus, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], VISION_START, marked)
    ids = [tok.token_to_id(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")]
    assert ids == [VISION_START, VISION_END, IMAGE_TOKEN] and tok.get_vocab_size() <= VOCAB
    extra = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "vision_start_token": "<|vision_start|>",
             "vision_end_token": "<|vision_end|>"}  # fmt: skip
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", extra_special_tokens=extra,
        chat_template=QWEN_TEMPLATE,
    )  # fmt: skip


def test_agent_session_puts_the_vision_tokens_around_a_shared_image(qwen: dict[str, Any], tmp_path: Path) -> None:
    """AgentSession.share(image=...) on Qwen2.5-VL: the span is what Qwen2_5_VLProcessor writes for
    "<|vision_start|><|image_pad|><|vision_end|>" + text (the boundary tokens as token ids, the image's rows where
    its <|image_pad|> run is), and the agent's first-token logprobs equal transformers' on that prompt."""
    import shutil

    folder = tmp_path / "ck"
    shutil.copytree(qwen["folder"], folder)
    tok = _qwen_tokenizer()
    tok.save_pretrained(folder)
    text_gguf = tmp_path / "text.gguf"
    _run("convert", str(folder), "-o", str(text_gguf), "--outtype", "f32")
    lm, enc, photo = kvcmas_cpp.Model(text_gguf, n_threads=2), qwen["enc"], IMAGES["coffee"]
    ids, logits = shared_image_prompt(lm, enc, photo, "What is in this picture?", IMAGE_TOKEN)
    # Qwen2_5_VLProcessor's text (it needs torchvision's video processor, missing here): each <|image_pad|> repeated
    # image_grid_thw.prod() / merge^2 times, tokenized by the transformers tokenizer
    ref = _image_processor()(images=[photo], return_tensors="pt")
    n = int(ref["image_grid_thw"].prod()) // 4
    span = "<|vision_start|>" + "<|image_pad|>" * n + "<|vision_end|>What is in this picture?"
    want = tok(span)["input_ids"]
    at = ids.index(VISION_START)
    assert ids[at : at + len(want)] == want and ids.count(IMAGE_TOKEN) == want.count(IMAGE_TOKEN)
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = qwen["model"](input_ids=input_ids, pixel_values=ref["pixel_values"], image_grid_thw=ref["image_grid_thw"],
                            mm_token_type_ids=(input_ids == IMAGE_TOKEN).int()).logits  # fmt: skip
    hf = torch.log_softmax(out[0, -1].double(), -1).numpy()
    got = _log_softmax(logits)
    assert int(got.argmax()) == int(hf.argmax()) and float(np.abs(got - hf).max()) <= 2e-3
