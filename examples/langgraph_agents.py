"""Three agents as a LangGraph graph (langchain-openai's ChatOpenAI) against kvcmas-server: planner -> critic ->
writer over one MessagesState, each node calling the model with its role as the system prompt and the conversation
so far (the task, then the earlier agents' replies). Prints the reuse the server reported.

    pip install langgraph langchain-openai
    kvcmas-server --model SmolLM2-135M-Instruct.Q4_1.gguf &
    python examples/langgraph_agents.py --base-url http://127.0.0.1:8080/v1
"""

from __future__ import annotations

from typing import Any

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, MessagesState, StateGraph

from shared import ROLES, TASK, ReuseMeter, arguments


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    llm = ChatOpenAI(
        model=args.model, base_url=args.base_url, api_key=args.api_key, max_completion_tokens=args.max_tokens
    )
    meter = ReuseMeter(args, "LangGraph")

    def node(name: str, role: str) -> Any:
        def run(state: MessagesState) -> dict[str, Any]:
            reply = llm.invoke([SystemMessage(role), *state["messages"]])
            reply.name = name
            print(f"--- {name}\n{str(reply.content).strip()}\n")
            meter.first_done()
            return {"messages": [reply]}

        return run

    graph = StateGraph(MessagesState)
    previous = START
    for name, role in ROLES:
        graph.add_node(name, node(name, role))
        graph.add_edge(previous, name)
        previous = name
    graph.add_edge(previous, END)
    graph.compile().invoke({"messages": [HumanMessage(TASK)]})
    meter.report()


if __name__ == "__main__":
    main()
