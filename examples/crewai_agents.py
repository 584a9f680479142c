"""Three agents as a CrewAI crew against kvcmas-server: planner, critic and writer run as a sequential process, each
task stating the shared task (kickoff input) and taking the earlier tasks' outputs as its context. Prints the reuse
the server reported.

    pip install crewai
    kvcmas-server --model SmolLM2-135M-Instruct.Q4_1.gguf &
    python examples/crewai_agents.py --base-url http://127.0.0.1:8080/v1
"""

from __future__ import annotations

import os

os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")  # no calls home from a local run
os.environ.setdefault("OTEL_SDK_DISABLED", "true")

from crewai import LLM, Agent, Crew, Process, Task  # noqa: E402

from shared import ROLES, TASK, ReuseMeter, arguments  # noqa: E402

GOALS = {
    "planner": "Write a numbered plan of at most six concrete steps for the task below.\n\n{task}",
    "critic": "Name the two biggest risks or gaps in the plan for the task below and how to fix each.\n\n{task}",
    "writer": "Write the short justification the council asked for in the task below, taking the critique into "
    "account.\n\n{task}",
}


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    # litellm's OpenAI-compatible provider: "openai/<model id>" at the server's base URL.
    llm = LLM(model=f"openai/{args.model}", base_url=args.base_url, api_key=args.api_key, max_tokens=args.max_tokens)
    meter = ReuseMeter(args, "CrewAI")
    tasks: list[Task] = []
    for name, role in ROLES:
        agent = Agent(role=name, goal=f"Do the {name}'s part of the task well.", backstory=role, llm=llm)
        tasks.append(
            Task(
                description=GOALS[name],
                expected_output=f"The {name}'s answer, in plain text.",
                agent=agent,
                context=list(tasks),
                callback=lambda _output: meter.first_done(),
            )
        )
    result = Crew(agents=[t.agent for t in tasks], tasks=tasks, process=Process.sequential).kickoff(
        inputs={"task": TASK}
    )
    for t in result.tasks_output:
        print(f"--- {t.agent}\n{t.raw.strip()}\n")
    meter.report()


if __name__ == "__main__":
    main()
