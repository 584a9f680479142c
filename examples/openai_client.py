"""Three agents with the plain `openai` client against kvcmas-server: each gets its role as the system prompt, the
shared task, and the earlier agents' replies as they came back. Prints the reuse the server reported.

    kvcmas-server --model SmolLM2-135M-Instruct.Q4_1.gguf &
    python examples/openai_client.py --base-url http://127.0.0.1:8080/v1
"""

from __future__ import annotations

from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

from shared import ROLES, TASK, ReuseMeter, arguments


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    meter = ReuseMeter(args, "openai client")
    earlier: list[ChatCompletionMessageParam] = []
    for name, role in ROLES:
        messages: list[ChatCompletionMessageParam] = [
            {"role": "system", "content": role},
            {"role": "user", "content": TASK},
            *earlier,
        ]
        out = client.chat.completions.create(model=args.model, messages=messages, max_tokens=args.max_tokens)
        reply = out.choices[0].message.content or ""
        print(f"--- {name}\n{reply.strip()}\n")
        earlier.append({"role": "user", "content": reply})
        meter.first_done()
    meter.report()


if __name__ == "__main__":
    main()
