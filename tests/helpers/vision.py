"""Random weights for the vision towers the tests build with transformers, and the images they encode."""

from __future__ import annotations

from typing import Any


def randomize_weights(model: Any, seed: int) -> None:
    """Weights far from transformers' near-zero init, so every part of the network moves the output."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def sample_images() -> dict[str, Any]:
    """scikit-image's photos and synthetic images of the sizes and shapes vision tests need: landscape 451 x 300,
    portrait 300 x 451, 512 x 512, 600 x 400, tiny 10 x 7, tall 90 x 700."""
    from pathlib import Path

    import numpy as np
    import skimage.data
    from PIL import Image

    photos = Path(skimage.data.__file__).parent
    chelsea = Image.open(photos / "chelsea.png").convert("RGB")
    rng = np.random.default_rng(3)
    return {
        "landscape": chelsea,
        "portrait": chelsea.transpose(Image.Transpose.ROTATE_90),
        "astronaut": Image.open(photos / "astronaut.png").convert("RGB"),
        "coffee": Image.open(photos / "coffee.png").convert("RGB"),
        "tiny": Image.fromarray(rng.integers(0, 256, (7, 10, 3), dtype=np.uint8)),
        "tall": Image.fromarray(rng.integers(0, 256, (700, 90, 3), dtype=np.uint8)),
    }


def byte_bpe(corpus: list[str], specials: list[str], n_before: int, marked: list[str]) -> Any:
    """A byte-level BPE tokenizers.Tokenizer trained on corpus with the special tokens `specials`, padded with
    <unusedN> tokens to n_before ids, then the `marked` special tokens at ids n_before, n_before + 1, ... (a model's
    image tokens at its config's ids)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=n_before, special_tokens=specials,
                                                        initial_alphabet=alphabet))  # fmt: skip
    tok.add_tokens([AddedToken(f"<unused{i}>", special=True) for i in range(n_before - tok.get_vocab_size())])
    tok.add_special_tokens(marked)
    assert [tok.token_to_id(t) for t in marked] == list(range(n_before, n_before + len(marked)))
    return tok


def shared_image_prompt(lm: Any, enc: Any, image: Any, text: str, image_token: int) -> tuple[list[int], Any]:
    """(prompt ids, last logits) of the first agent of a nonshared AgentSession after share(image=, text=): the
    image's rows stand as image_token ids, as the processor writes them."""
    import numpy as np

    from kvcmas_cpp.agents import AgentSession

    with AgentSession(lm, "nonshared", vision=enc) as team:
        agent = team.agent("a", system="You describe pictures.")
        team.share(image=image, text=text, label="Question")
        p = team.prefill_agent(agent)
        try:
            tokens, logits = list(p.seq.tokens), np.asarray(p.logits)
        finally:
            p.close()
    return [image_token if t < 0 else t for t in tokens], logits
