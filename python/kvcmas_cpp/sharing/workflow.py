"""Agents as role templates with placeholders, the GSM8K roster of the spec, and GSM8K loading.

A template is a chat (system = role prompt, user = text with placeholders) rendered by the model's chat template.
Text pieces between placeholders are tokenized separately (as the reference code does), so no BPE merge crosses a
placeholder and dense and shared prompts hold exactly the same ids.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..model import Model

# Same placeholder grammar as the reference code (spec §2.2).
PLACEHOLDER_RE = re.compile(r"\{((?:agent|condition)_\w+_(?:current|history)|user_question)\}")
QUESTION = "user_question"


def response_placeholder(agent_index: int) -> str:
    """The placeholder name that relays agent `agent_index`'s output."""
    return f"agent_{agent_index}_current"


@dataclass(frozen=True)
class Agent:
    """A role: system prompt and a user template with placeholders ({user_question}, {agent_<i>_current})."""

    name: str
    role: str
    user_template: str


@dataclass
class Template:
    """An agent's prompt cut at its placeholders: texts[0] is the prefix (seg0), texts[i + 1] the text after
    placeholder i; standins[i] are the ids of the literal placeholder text (used for the once-per-agent template
    prefill whose tails the rotate-only mode reuses)."""

    texts: list[list[int]]
    placeholders: list[str]
    standins: list[list[int]] = field(default_factory=list)

    def prompt_ids(self, spans: dict[str, list[int]]) -> list[int]:
        """seg0 ++ Σ_i (span_i ++ tail_i)."""
        ids = list(self.texts[0])
        for i, ph in enumerate(self.placeholders):
            ids += spans[ph] + self.texts[i + 1]
        return ids


def build_template(model: Model, agent: Agent) -> Template:
    """Renders the agent's chat (system = role, user = its template) and cuts it at the placeholders."""
    messages = [{"role": "system", "content": agent.role}, {"role": "user", "content": agent.user_template}]
    return template_from_messages(model, messages, agent.name)


def template_from_messages(
    model: Model,
    messages: list[dict[str, str]],
    name: str = "agent",
    placeholder_re: re.Pattern[str] = PLACEHOLDER_RE,
) -> Template:
    """Renders chat messages whose contents hold placeholders ({user_question}, {agent_<i>_current},
    {condition_<k>_current}) with the model's chat template and the generation prompt, and tokenizes the text
    pieces between placeholders separately. Raises ValueError when the rendering breaks the alternation the method
    needs (non-empty prefix, non-empty text after every placeholder).

    placeholder_re: what marks a placeholder (one group: its name). Operator templates use the spec's grammar;
    client messages use an unguessable per-call marker (AgentSession.prefill), so client text is never a template."""
    text = model.apply_chat_template(messages, add_generation_prompt=True)
    tok = model.tokenizer
    pieces = placeholder_re.split(text)  # text, name, text, name, ..., text
    texts_str, names = pieces[0::2], pieces[1::2]
    texts: list[list[int]] = []
    for i, piece in enumerate(texts_str):
        ids = tok.encode(piece, add_special=(i == 0), parse_special=True)
        if not ids:
            where = "before the first placeholder" if i == 0 else f"after placeholder {{{names[i - 1]}}}"
            raise ValueError(f"agent {name!r}: the template has no text {where}")
        texts.append(ids)
    standins = [tok.encode("{" + n + "}", add_special=False, parse_special=False) for n in names]
    return Template(texts, list(names), standins)


@dataclass(frozen=True)
class Workflow:
    """Agents in execution order (a DAG in topological order); the last one is the decision agent."""

    name: str
    agents: tuple[Agent, ...]
    lead_in: str = "Q:\n"


_GSM8K_ROLES = (
    (
        "Math Solver",
        "You are a math expert. You will be given a math problem and hints from other agents. Give "
        "your own solving process step by step based on the hints. The last line of your output contains only the "
        "final result, for example: The answer is 140.",
    ),
    (
        "Mathematical Analyst",
        "You are a mathematical analyst. You will be given a math problem, analysis and code "
        "from other agents. First analyze the problem-solving process step by step, representing the variables by "
        "letters. Then substitute the values to compute the result.",
    ),
    (
        "Programming Expert",
        "You are a programming expert. You will be given a math problem, analysis and code from "
        "other agents. Integrate step-by-step reasoning and Python code to solve the problem: write a function "
        "solution() that returns the answer.",
    ),
)
_DECISION_ROLE = (
    "You are the top decision-maker. You are good at analyzing and summarizing mathematical problems, "
    "judging other people's solutions, and giving final answers to math problems."
)


TOPOLOGIES = ("full", "chain")


def team_workflow(
    name: str,
    roles: Sequence[tuple[str, str]],
    decision: tuple[str, str],
    lead_in: str,
    n_agents: int = 4,
    *,
    follow_up: str = "",
    final_instruction: str = "",
    topology: str = "full",
) -> Workflow:
    """Role agents plus a final decision agent. topology 'full': the spec's FullConnected DAG (agent i reads agents
    0..i-1; the decision agent reads every role agent); 'chain': agent i reads agent i-1, the decision agent the last
    role agent. Templates: `lead_in{user_question}`, each upstream output under "<name>'s output:", then `follow_up`
    (agents after the first) or `final_instruction` (decision agent).

    roles: (name, system prompt) cycled over the n_agents - 1 role agents; n_agents counts the decision agent."""
    if n_agents < 2:
        raise ValueError(f"a workflow needs at least one role agent and the decision agent, got n_agents={n_agents}")
    if not roles:
        raise ValueError(f"workflow {name!r}: no roles given")
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {topology!r}; choose from {', '.join(TOPOLOGIES)}")

    def reads(i: int) -> range:
        return range(i) if topology == "full" else range(max(i - 1, 0), i)

    def upstream(i: int) -> str:
        return "".join(f"\n\n{agents[j].name}'s output:\n{{{response_placeholder(j)}}}" for j in reads(i))

    question = lead_in + "{user_question}"
    agents: list[Agent] = []
    for i in range(n_agents - 1):
        role_name, role = roles[i % len(roles)]
        agents.append(Agent(role_name, role, question + upstream(i) + (follow_up if i else "")))
    agents.append(Agent(decision[0], decision[1], question + upstream(n_agents - 1) + final_instruction))
    return Workflow(name, tuple(agents), lead_in=lead_in)


def gsm8k_workflow(n_agents: int = 4, topology: str = "full") -> Workflow:
    """The spec's GSM8K roster (Math Solver, Mathematical Analyst, Programming Expert) plus FinalRefer."""
    return team_workflow(
        "gsm8k",
        _GSM8K_ROLES,
        ("Decision Maker", _DECISION_ROLE),
        "Q:\n",
        n_agents,
        follow_up="\n\nSolve it.",
        final_instruction="\n\nGive the final answer.",
        topology=topology,
    )


def gsm8k_path() -> Path:
    """GSM8K's test split (MIT, OpenAI), shipped with the package in kvcmas_cpp/data/gsm8k/."""
    return Path(__file__).resolve().parents[1] / "data" / "gsm8k" / "test.jsonl"


def load_gsm8k(start: int, count: int, path: str | Path | None = None) -> list[str]:
    """Questions of lines [start, start + count) of the GSM8K test split."""
    p = Path(path) if path is not None else gsm8k_path()
    if not p.is_file():
        raise FileNotFoundError(f"GSM8K test split not found at {p}")
    out: list[str] = []
    with p.open() as f:
        for i, line in enumerate(f):
            if i >= start + count:
                break
            if i >= start:
                out.append(json.loads(line)["question"])
    if len(out) < count:
        raise ValueError(f"{p} has only {start + len(out)} lines, asked for [{start}, {start + count})")
    return out


def gsm8k_contexts(model: Model, tokens: int, count: int) -> list[str]:
    """count shared contexts of at least `tokens` tokens each: GSM8K questions (lines 100-1099) joined by newlines,
    each context its own questions. ValueError when the split runs out."""
    contexts: list[str] = []
    picked: list[str] = []
    for question in load_gsm8k(100, 1000):
        picked.append(question)
        if len(model.tokenize("\n".join(picked), add_special=False)) >= tokens:
            contexts.append("\n".join(picked))
            picked = []
            if len(contexts) == count:
                return contexts
    raise ValueError(f"not enough GSM8K text for {count} contexts of {tokens} tokens")
