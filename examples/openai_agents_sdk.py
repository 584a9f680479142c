"""Three agents with the OpenAI Agents SDK in chat-completions mode against kvcmas-server: planner, critic and writer
run one after the other, each on the conversation the previous run left (`result.to_input_list()`: the task and the
earlier replies). Prints the reuse the server reported.

    pip install openai-agents
    kvcmas-server --model SmolLM2-135M-Instruct.Q4_1.gguf &
    python examples/openai_agents_sdk.py --base-url http://127.0.0.1:8080/v1
"""

from __future__ import annotations

import asyncio
from typing import Any

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from openai import AsyncOpenAI

from shared import ROLES, TASK, ReuseMeter, arguments


async def run() -> None:
    args = arguments(__doc__.splitlines()[0])
    set_tracing_disabled(True)  # traces would go to OpenAI's servers
    client = AsyncOpenAI(base_url=args.base_url, api_key=args.api_key)
    model = OpenAIChatCompletionsModel(model=args.model, openai_client=client)
    settings = ModelSettings(max_tokens=args.max_tokens)
    meter = ReuseMeter(args, "OpenAI Agents SDK")
    conversation: Any = TASK
    for name, role in ROLES:
        agent = Agent(name=name, instructions=role, model=model, model_settings=settings)
        result = await Runner.run(agent, conversation)
        print(f"--- {name}\n{str(result.final_output).strip()}\n")
        meter.first_done()
        conversation = result.to_input_list()
    meter.report()


if __name__ == "__main__":
    asyncio.run(run())
