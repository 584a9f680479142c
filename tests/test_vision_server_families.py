"""kvcmas-server's `usage` counts each family's image rows: a Qwen2.5-VL and a Gemma 3 checkpoint (random weights,
tiny widths, the real structure; bench.vision_families) served with their mmproj; `prompt_tokens` is the prompt's
ids of the processor's text (the model's own image tokens, one per encoder row), with and without `detail`."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("fastapi")
skimage_data = pytest.importorskip("skimage.data")

import kvcmas_cpp  # noqa: E402
from kvcmas_cpp.bench.vision_families import build_family  # noqa: E402
from kvcmas_cpp.vision import VisionEncoder  # noqa: E402


@pytest.mark.parametrize("family", ["qwen2.5vl", "gemma3"])
def test_usage_counts_the_image_rows(family: str, tmp_path: Path) -> None:
    from fastapi.testclient import TestClient
    from PIL import Image

    from kvcmas_cpp.server.app import Server, ServerConfig

    built = build_family(family, tmp_path, size="tiny", outtype="f32")
    photo = Image.open(Path(skimage_data.__file__).parent / "coffee.png").convert("RGB")
    buf = io.BytesIO()
    photo.save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    enc = VisionEncoder(built.mmproj, n_threads=1)
    rows = enc.n_image_tokens(*photo.size)
    model = kvcmas_cpp.Model(built.text, n_threads=2)
    server = Server(ServerConfig(str(built.text), mmproj=str(built.mmproj), threads=2), model)

    # the processor's text: the template's, with the image as the family's tokens around one image token per row
    # (Gemma3Processor also puts a blank line on each side), tokenized once by the checkpoint's transformers tokenizer
    import transformers

    text = model.apply_chat_template([{"role": "user", "content": "Look: @IMG@ What is it?"}])
    if family == "gemma3":
        image_text = "\n\n<start_of_image>" + "<image_soft_token>" * rows + "<end_of_image>\n\n"
    else:
        image_text = "<|vision_start|>" + "<|image_pad|>" * rows + "<|vision_end|>"
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / family)
    want = len(hf_tok(text.replace("@IMG@", image_text), add_special_tokens=False)["input_ids"])
    want += int(model.tokenizer.add_bos and model.tokenizer.bos_id is not None)

    def ask(c: Any, detail: str | None) -> dict[str, Any]:
        image = {"type": "image_url", "image_url": {"url": url, **({"detail": detail} if detail else {})}}
        parts = [{"type": "text", "text": "Look: "}, image, {"type": "text", "text": " What is it?"}]
        body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 2, "temperature": 0}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return dict(r.json())

    try:
        with TestClient(server.app, base_url="http://127.0.0.1") as c:
            counts = {d: ask(c, d)["usage"]["prompt_tokens"] for d in (None, "low", "high")}
    finally:
        server.scheduler.stop()
    assert counts == {None: want, "low": want, "high": want}  # one view per image: "detail" changes nothing here
