"""What every example shares: the command line, one ~400-token task, three role prompts, and the reuse report read
from kvcmas-server's /metrics (no kvcmas-specific request fields: the frameworks run unchanged).

The report separates the first agent (it computes everything; nobody has shared anything yet) from the later agents,
whose prompts repeat the task and earlier replies: how many of their prompt tokens the server read from spans other
agents computed (kvcmas_span_tokens_total), how many came from the exact prefix cache
(kvcmas_prefix_cached_tokens_total), and the hops that computed their shared spans instead, with the reason
(kvcmas_dense_hops_total{reason}). The figures are differences of server-wide counters, so run one example at a time
against a server nobody else is using.
"""

from __future__ import annotations

import argparse
import json
import re
import urllib.request
from dataclasses import dataclass, field
from typing import Any

TASK = """\
Our city library wants to replace its paper sign-up sheets for study rooms with a small booking service. There are
twelve rooms on three floors; four of them have a screen and a whiteboard, two are accessible by wheelchair, and one
is reserved for staff meetings on weekday mornings. Members book a room for one to three hours, at most twice a week,
and may book up to fourteen days ahead. A booking that nobody checks in to within fifteen minutes is released so that
walk-in visitors can take the room. Staff must be able to block rooms for events and maintenance, see who booked which
room, and export a weekly usage report for the city council. Members sign in with their library card number and a
PIN; about forty percent of them are over sixty, and many use the public computers at the library rather than their
own phones. The service must work on those old computers with a plain browser, must keep members' names private from
other members, and must still allow walk-ins when the network is down, since the building's connection fails a few
times a month. The library has a budget for one part-time developer for three months and a small virtual server; the
city's IT department will run backups but will not maintain custom software afterwards. The council expects the
service to open before the autumn term starts, in eleven weeks, and wants a short written justification of the design
that a non-technical reader can follow. Complaints about the paper sheets so far: rooms are blocked by people who
never come, the sheets go missing, staff cannot tell how busy the rooms are, and members who cannot come to the
library in person cannot book at all. Two members of the council have asked whether an existing commercial product
could be used instead of building something, and the union of library staff wants to know whether the new service
will add to their workload at the front desk during the busy exam weeks in December and May.
"""

ROLES = (
    (
        "planner",
        "You are the Planner. Read the task and write a numbered plan of at most six concrete steps that a small team "
        "can follow. Be specific about what is built first.",
    ),
    (
        "critic",
        "You are the Critic. Read the task and the plan before you. Name the two biggest risks or gaps in the plan and "
        "say how to fix each one, in a few sentences.",
    ),
    (
        "writer",
        "You are the Writer. Read the task, the plan and the critique. Write the short justification the council "
        "asked for, in plain words, taking the critique into account.",
    ),
)


def arguments(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--base-url", default="http://127.0.0.1:8080/v1", help="kvcmas-server's OpenAI base URL")
    p.add_argument("--api-key", default="none", help="the server's --api-key, if it has one")
    p.add_argument("--model", default=None, help="model id (default: the first one the server lists)")
    p.add_argument("--max-tokens", type=int, default=96, help="most tokens per reply (keeps the run short)")
    p.add_argument("--json", action="store_true", help="print the reuse report as one JSON line as well")
    args = p.parse_args()
    args.base_url = args.base_url.rstrip("/")
    if not args.base_url.endswith("/v1"):
        args.base_url += "/v1"
    if args.model is None:
        args.model = _get(args, "/v1/models", json_body=True)["data"][0]["id"]
    return args


def _get(args: argparse.Namespace, path: str, json_body: bool = False) -> Any:
    root = args.base_url[: -len("/v1")]
    req = urllib.request.Request(root + path, headers={"Authorization": f"Bearer {args.api_key}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    return json.loads(text) if json_body else text


_SAMPLE = re.compile(r"^(kvcmas_[a-z_]+)(\{[^}]*\})? (\S+)$")


@dataclass
class Counters:
    """The sharing counters of one /metrics scrape."""

    prompt: float = 0.0
    reused: float = 0.0
    span: float = 0.0
    prefix_cached: float = 0.0
    requests: float = 0.0
    dense: dict[str, float] = field(default_factory=dict)

    def __sub__(self, other: Counters) -> Counters:
        reasons = set(self.dense) | set(other.dense)
        return Counters(
            self.prompt - other.prompt,
            self.reused - other.reused,
            self.span - other.span,
            self.prefix_cached - other.prefix_cached,
            self.requests - other.requests,
            {r: self.dense.get(r, 0.0) - other.dense.get(r, 0.0) for r in reasons},
        )


def scrape(args: argparse.Namespace) -> Counters:
    c = Counters()
    for line in _get(args, "/metrics").splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "kvcmas_prompt_tokens_total":
            c.prompt = value
        elif name == "kvcmas_reused_tokens_total":
            c.reused = value
        elif name == "kvcmas_span_tokens_total":
            c.span = value
        elif name == "kvcmas_prefix_cached_tokens_total":
            c.prefix_cached = value
        elif name == "kvcmas_requests_total" and 'endpoint="/v1/chat/completions"' in labels:
            c.requests += value
        elif name == "kvcmas_dense_hops_total":
            c.dense[labels.split('"')[1]] = value
    return c


class ReuseMeter:
    """Scrapes /metrics at the start, after the first agent's reply and at the end of a run."""

    def __init__(self, args: argparse.Namespace, framework: str) -> None:
        self.args, self.framework = args, framework
        self.start = scrape(args)
        self.after_first: Counters | None = None

    def first_done(self) -> None:
        """Call once the first agent has replied (its generation is counted by then)."""
        if self.after_first is None:
            self.after_first = scrape(self.args)

    def report(self) -> dict[str, Any]:
        end = scrape(self.args)
        first = (self.after_first or end) - self.start
        later = end - (self.after_first or end)
        share = later.span / later.prompt if later.prompt else 0.0
        dense_hops = {r: int(n) for r, n in sorted(later.dense.items()) if n}
        out = {
            "framework": self.framework,
            "requests": int((end - self.start).requests),
            "first_prompt_tokens": int(first.prompt),
            "later_prompt_tokens": int(later.prompt),
            "later_span_tokens": int(later.span),
            "later_prefix_cached_tokens": int(later.prefix_cached),
            "later_span_share": round(share, 3),
            "dense_hops": dense_hops,
        }
        print(f"\n== reuse reported by kvcmas-server /metrics ({self.framework}) ==")
        print(f"requests: {out['requests']}; first agent's prompt: {out['first_prompt_tokens']} tokens")
        print(f"later agents' prompts:        {out['later_prompt_tokens']} tokens")
        print(f"  from other agents' spans:   {out['later_span_tokens']} ({share:.0%})")
        print(f"  from the exact prefix cache: {out['later_prefix_cached_tokens']}")
        dense = ", ".join(f"{r}: {n}" for r, n in dense_hops.items()) or "none"
        print(f"  hops that computed their shared spans (reason): {dense}")
        if self.args.json:
            print(json.dumps(out))
        return out
