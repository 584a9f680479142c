"""Which replica serves a request: the routing key and rendezvous hashing over stable replica ranks (no Ray here).

The routing key (`routing_key`), first that applies:
  1. `kvcmas.workflow` in a chat request body: every agent that names the workflow reaches its replica;
  2. the `x-session-id` header (any client that can set a header but not the body);
  3. derived from content all agents of one unmodified workflow send alike: a chat request's first message after
     its leading system message(s) (the task every agent reads), with the request's `cache_salt`; a completion's
     first PROMPT_KEY_CHARS characters of prompt.
Limits of 3: two workflows that start with the same task share a replica (correct, only less spread); an agent that
rewrites the task, or a workflow whose agents send different first messages, is split over replicas (each answer is
still right, later hops reuse less); a request with no non-system message keys on its system prompt.

Replica choice (`rendezvous_order`): highest-random-weight hashing of (key, rank) over the ranks 0..N-1. A rank is a
stable name for a replica slot, not a process: a replaced replica keeps its rank, so only its own workflows move
while it is down; adding a rank moves about 1/(N+1) of the keys (those whose new weight beats all others); removing
one moves only its keys. The order is also the failover order: the next rank is where a key goes when its owner is
down.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

PROMPT_KEY_CHARS = 1024  # of a completion's prompt: its routing key when nothing else names the session
SESSION_HEADER = "x-session-id"


def _weight(key: str, rank: int) -> int:
    digest = hashlib.blake2b(f"{rank}\x00{key}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(key: str, ranks: Iterable[int]) -> list[int]:
    """The ranks by decreasing weight for key: [owner, first fallback, ...]. Deterministic across processes."""
    return sorted(ranks, key=lambda r: (-_weight(key, r), r))


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def routing_key(body: Any, headers: Mapping[str, str]) -> str:
    """The routing key of a request (see the module docstring). body: the parsed JSON body (None or anything else
    for a body that is not a JSON object); headers: lower-case names. Never raises: a malformed body still gets a
    key, and the replica answers it with its own 400."""
    if isinstance(body, dict):
        options = body.get("kvcmas")
        if isinstance(options, dict) and isinstance(options.get("workflow"), str) and options["workflow"]:
            return workflow_key(options["workflow"])
    session = headers.get(SESSION_HEADER)
    if session:
        return "session:" + session
    if not isinstance(body, dict):
        return "body:"
    salt = body.get("cache_salt")
    salt = salt if isinstance(salt, str) else ""
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        rest = [m for m in messages if not (isinstance(m, dict) and m.get("role") in ("system", "developer"))]
        first = rest[0] if rest else messages[0]
        content = first.get("content") if isinstance(first, dict) else first
        return "content:" + hashlib.sha256(_canonical([salt, content]).encode("utf-8", "surrogatepass")).hexdigest()
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0] if isinstance(prompt[0], str) else prompt[:PROMPT_KEY_CHARS]
    text = _canonical([salt, prompt[:PROMPT_KEY_CHARS] if isinstance(prompt, str) else prompt])
    return "prompt:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def workflow_key(workflow: str) -> str:
    """The key of a named workflow: what its requests and its DELETE route by."""
    return "workflow:" + workflow
