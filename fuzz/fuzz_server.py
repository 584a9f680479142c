"""Fuzz target: the server's request path before any engine work (``kvcmas_cpp.server.validation.parse_request``).

Arbitrary bytes are a POST body of /v1/chat/completions or /v1/completions (the first byte picks which), parsed with
small limits (4 KiB body, 64 new tokens, 2 images). Contract: a ParsedRequest whose fields are consistent (validated
sampling settings, at most 4 non-empty stops, max_tokens within the limit, images within the limit), or an ApiError
with a 4xx status and an OpenAI-style error body. Anything else (another exception, a crash, a hang) is a finding.
No model is loaded.

    python fuzz/fuzz_server.py -max_total_time=45 fuzz/corpus/server
"""

from __future__ import annotations

import json
import sys

import _harness
import atheris

_harness.use_source_tree_if_asked()
with atheris.instrument_imports(include=["kvcmas_cpp.server", "pydantic"]):
    from kvcmas_cpp.server.schemas import ChatCompletionRequest, CompletionRequest
    from kvcmas_cpp.server.validation import ApiError, Limits, ParsedRequest, error_body, parse_request

LIMITS = Limits(max_body_bytes=4096, max_tokens=64, max_images=2)


def check(kind: str, raw: bytes) -> None:
    """Runs one body through the request path and checks the contract."""
    try:
        parsed = parse_request("chat" if kind == "chat" else "completion", raw, LIMITS)
    except ApiError as e:
        assert 400 <= e.status < 500, (e.status, e.message)
        assert isinstance(e.message, str) and e.message
        body = error_body(e.status, e.message, e.code, e.param)
        json.dumps(body)  # the error must serialise as the response body
        return
    assert isinstance(parsed, ParsedRequest)
    schema = ChatCompletionRequest if kind == "chat" else CompletionRequest
    assert isinstance(parsed.body, schema)
    parsed.sampling.validate()
    assert len(parsed.stops) <= 4 and all(parsed.stops)
    assert parsed.max_tokens is None or 1 <= parsed.max_tokens <= LIMITS.max_tokens
    assert len(parsed.images) <= LIMITS.max_images
    if isinstance(parsed.body, ChatCompletionRequest):
        messages = parsed.body.plain_messages(lambda url: "<image>")
        assert messages and all(isinstance(m["content"], str) for m in messages)


def test_one_input(data: bytes) -> None:
    if not data:
        return
    check("chat" if data[0] % 2 == 0 else "completion", data[1:])


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
