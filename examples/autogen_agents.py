"""Three agents in an AutoGen AgentChat round-robin team (autogen-ext's OpenAIChatCompletionClient) against
kvcmas-server: the task goes to the team, planner, critic and writer answer in turn, each seeing the task and the
earlier replies. Prints the reuse the server reported.

    pip install autogen-agentchat "autogen-ext[openai]"
    kvcmas-server --model SmolLM2-135M-Instruct.Q4_1.gguf &
    python examples/autogen_agents.py --base-url http://127.0.0.1:8080/v1
"""

from __future__ import annotations

import asyncio

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.base import ChatAgent, Team
from autogen_agentchat.conditions import MaxMessageTermination
from autogen_agentchat.messages import TextMessage
from autogen_agentchat.teams import RoundRobinGroupChat
from autogen_ext.models.openai import OpenAIChatCompletionClient

from shared import ROLES, TASK, ReuseMeter, arguments


async def run() -> None:
    args = arguments(__doc__.splitlines()[0])
    client = OpenAIChatCompletionClient(
        model=args.model,
        base_url=args.base_url,
        api_key=args.api_key,
        max_tokens=args.max_tokens,
        # A model AutoGen does not know needs its capabilities stated.
        model_info={
            "vision": False,
            "function_calling": False,
            "json_output": False,
            "structured_output": False,
            "family": "unknown",
        },
    )
    agents: list[ChatAgent | Team] = [
        AssistantAgent(name, model_client=client, system_message=role) for name, role in ROLES
    ]
    team = RoundRobinGroupChat(agents, termination_condition=MaxMessageTermination(len(agents) + 1))
    meter = ReuseMeter(args, "AutoGen AgentChat")
    async for message in team.run_stream(task=TASK):
        if isinstance(message, TextMessage) and message.source != "user":
            print(f"--- {message.source}\n{message.content.strip()}\n")
            meter.first_done()
    await client.close()
    meter.report()


if __name__ == "__main__":
    asyncio.run(run())
