"""kvcmas-server's `usage` counts each family's image rows: a Qwen2.5-VL and a Gemma 3 checkpoint (random weights,
tiny widths, the real structure; bench.vision_families) served with their mmproj; `prompt_tokens` is the prompt's
text ids plus the model's own image tokens plus the encoder's rows, with and without `detail`."""

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

    # the prompt without the image, and the ids the family writes around its rows
    before, after = model.apply_chat_template([{"role": "user", "content": "Look: @IMG@ What is it?"}]).split("@IMG@")
    tok = model.tokenizer
    text_ids = len(tok.encode(before, add_special=False, parse_special=True))
    text_ids += len(tok.encode(after, add_special=False, parse_special=True))
    text_ids += int(tok.add_bos and tok.bos_id is not None)
    marks = ("<start_of_image>", "<end_of_image>") if family == "gemma3" else enc.image_tokens
    assert all(len(tok.encode(m, add_special=False, parse_special=True)) == 1 for m in marks)

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
    # Gemma 3 also writes a blank line on each side of the image, which may merge with the neighbouring text's ids
    slack = 4 if family == "gemma3" else 0
    for detail, n in counts.items():
        assert text_ids + rows + 2 <= n <= text_ids + rows + 2 + slack, (detail, n, text_ids, rows)
    assert len(set(counts.values())) == 1  # one view per image: "low" and "high" change nothing for these families
