"""Fuzz target: the request-content path of a sharing session (``AgentSession.prefill``), where client messages
become a prompt whose spans another agent may have computed.

Input layout: byte 0 (flags) | fields separated by NUL bytes, decoded as UTF-8 (invalid bytes replaced): system,
then contents of alternating user / assistant messages (each capped at 96 characters). Flag bits insert text shaped
like the session's span markers and the workflow placeholders ({user_question}, {agent_0_current}, ...) into the
contents. A second session (another namespace) holds a secret first.

Contract: the prompt the session builds is exactly the messages, rendered literally by the chat template (client
text is data: nothing in it is ever expanded), in a fresh session and again when its spans are reused; the other
namespace's secret never appears; anything refused is a ValueError. Anything else is a finding.

    python fuzz/fuzz_content.py -max_total_time=45 -timeout=10 fuzz/corpus/content
"""

from __future__ import annotations

import sys

import _harness
import atheris

_harness.use_source_tree_if_asked()
with atheris.instrument_imports(include=["kvcmas_cpp.agents", "kvcmas_cpp.sharing"]):
    import kvcmas_cpp as kc

SECRET = "The vault code is 5531-SECRET."
INSERTS = ("{user_question}", "{agent_0_current}", "{condition_1_current}", "<kvcmas-span-", ":user_question>", "{")
MAX_FIELD = 96

MODEL = kc.Model(kc.default_model_path(), n_threads=1, n_ctx=2048)
OTHER = kc.AgentSession(MODEL, method="fullshared", workflow="fuzz-other-namespace")
OTHER.share(SECRET)
OTHER.agent("keeper", "You keep secrets.").respond(max_tokens=1)


def literal_prompt(messages: list[dict[str, str]]) -> str:
    return MODEL.detokenize(MODEL.tokenize(MODEL.apply_chat_template(messages, add_generation_prompt=True), True))


def test_one_input(data: bytes) -> None:
    if not data:
        return
    flags = data[0]
    fields = [f[:MAX_FIELD] for f in data[1:].decode("utf-8", errors="replace").split("\0")][:5]
    for i, field in enumerate(fields):
        if flags & (1 << (i % 6)):
            insert = INSERTS[(flags + i) % len(INSERTS)]
            fields[i] = field[: len(field) // 2] + insert + field[len(field) // 2 :]
    messages = [{"role": "system", "content": fields[0]}] if fields[0] else []
    messages += [{"role": ("user", "assistant")[i % 2], "content": f} for i, f in enumerate(fields[1:])]
    if not messages:
        return
    try:
        expected = literal_prompt(messages)
    except ValueError:  # the chat template refuses these messages (e.g. roles out of order)
        return
    session = kc.AgentSession(MODEL, method="fullshared", workflow="fuzz-namespace")
    try:
        for _ in range(2):  # fresh, then with every span stored already
            try:
                p = session.prefill(messages)
            except ValueError:
                return
            try:
                prompt = MODEL.detokenize(p.seq.tokens)
                assert prompt == expected, (prompt, expected)
                assert "5531-SECRET" not in prompt or "5531-SECRET" in expected
                session.finish(p, [])
            finally:
                p.close()
    finally:
        session.close()


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
