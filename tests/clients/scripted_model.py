"""How the scripted mock models of the agent tests play: like a real model
reading its prompt, not like a tape.

Shared by the agent tests (Claude Code, Codex, the OpenAI Agents SDK,
opencode). Each agent's script names its steps (which of its agent's tools
it calls, with what arguments, and the sentence it writes first) and each
mock turns its API's request into a `Prompt` and the `Part`s decided here
into its API's answer. What to do next is read off the prompt alone, never
off how many requests came before (agents retry, send side requests, and
condense rewrites old turns and sends rounds of its own):

- The step to take is the one after the highest step whose result is in
  the prompt (call ids end in "step_NN"; the latest result is never
  compacted, so that id survives).
- Before (almost) every tool call the model writes a sentence saying what
  it does next, streamed as its own text, as Claude and GPT models do; a
  step in `quiet` goes straight to the call. Claude's thinking and Codex's
  reasoning come first, as `think` parts.
- Once condense offers `condense_recall` (older outputs were masked and
  their placeholders carry `recall key: K`), at `recall_step` the model
  calls it first thing, no text before, with the latest key in its prompt.
  When the original comes back (the request ends with that recall's
  result) it writes a sentence and makes the step's call.
- After the last step the task wants a fact from an early tool output (the
  release codename in the file read at `fact_step`). The model answers
  with it only when the codename is in its prompt: in that output itself,
  or in a recall result condense sent back. Otherwise, when it is offered
  `condense_recall`, it writes a sentence and then calls it (text BEFORE
  the call): with the key of the placeholder that replaced that output, or
  when the output went into a checkpoint, the checkpoint's key. Still
  nothing found: the next key, up to MAX_RECALLS, with no text; then it
  answers "UNKNOWN".

Recall ids are "<prefix>recall_<step>_<n>", so a request condense sends
with a recall's result is told apart from the client's.
"""

import json
import re
from dataclasses import dataclass, field

RECALL_TOOL = "condense_recall"
KEY = re.compile(r"recall key: ([A-Za-z0-9_-]{6,64})(?![A-Za-z0-9_-])")
STEP_ID = re.compile(r"step_(\d+)$")
RECALL_ID = re.compile(r"recall_(\d+)_(\d+)$")
# condense answers at most compaction.max_recalls (3 by default) recalls
# within one client request; the model stops asking before that.
MAX_RECALLS = 3
UNKNOWN = "UNKNOWN"


@dataclass
class Entry:
    """One piece of the prompt: "text" (a message's text, any role),
    "call" (a tool call the model made: call_id, name, args) or "result"
    (a tool result: call_id, text)."""
    kind: str
    text: str = ""
    call_id: str = ""
    name: str = ""
    args: dict = field(default_factory=dict)


@dataclass
class Part:
    """One piece of the answer: "think" (thinking or reasoning), "text",
    or "call" (call_id, name, args)."""
    kind: str
    text: str = ""
    call_id: str = ""
    name: str = ""
    args: dict = field(default_factory=dict)


def think(s):
    return Part("think", s)


def text(s):
    return Part("text", s)


def call(call_id, name, args):
    return Part("call", call_id=call_id, name=name, args=args)


class Prompt:
    """A request as the model reads it: the tools it is offered and its
    conversation as entries, in order."""

    def __init__(self, tools, entries):
        self.tools = set(tools)
        self.entries = list(entries)

    @property
    def offers_recall(self):
        return RECALL_TOOL in self.tools

    def all_text(self):
        return "\n".join(e.text for e in self.entries if e.kind in ("text", "result"))

    def results(self):
        return {e.call_id: e.text for e in self.entries if e.kind == "result"}

    def done_step(self):
        """The highest step whose result is in the prompt, or None."""
        steps = [int(m.group(1)) for e in self.entries if e.kind == "result"
                 for m in [STEP_ID.search(e.call_id)] if m]
        return max(steps) if steps else None

    def recall_results(self):
        """(key, result text) of each recall answered in this prompt: only
        condense's own rounds hold them (the client never sees one)."""
        keys = {e.call_id: e.args.get("key") for e in self.entries
                if e.kind == "call" and e.name == RECALL_TOOL}
        return [(keys.get(e.call_id), e.text) for e in self.entries
                if e.kind == "result" and RECALL_ID.search(e.call_id)]

    def ends_with_recall(self):
        """Whether the latest result is one of a recall: condense sent this
        round with the original the model asked for."""
        last = [e for e in self.entries if e.kind == "result"]
        return bool(last) and RECALL_ID.search(last[-1].call_id) is not None

    def keys(self):
        """The recall keys in the prompt, in order of first appearance."""
        seen = []
        for e in self.entries:
            for k in KEY.findall(e.text):
                if k not in seen:
                    seen.append(k)
        return seen


class Script:
    """A scripted model for one agent.

    steps: how many tool steps the task takes before the final answer.
    step_call(step) -> (tool name, args, sentence): the step's call in the
      agent's tools, and what the model says before it.
    prefix: the agent's call-id prefix ("toolu_", "call_").
    fact: a regex whose group 1 is the fact the final answer must hold.
    fact_step: the step whose output holds the fact.
    recall_step: the step at which the model calls condense_recall first.
    quiet: steps whose call comes without a sentence before it.
    final(fact): the final answer, for the fact found or UNKNOWN.
    thinking(step): a think part before the step's output, or None.
    """

    def __init__(self, *, steps, step_call, prefix, fact, fact_step, recall_step, final,
                 quiet=(), thinking=None):
        self.steps, self.step_call, self.prefix = steps, step_call, prefix
        self.fact, self.fact_step, self.recall_step = re.compile(fact), fact_step, recall_step
        self.final, self.quiet = final, set(quiet)
        self.thinking = thinking or (lambda step: None)

    def step_id(self, step):
        return "%sstep_%02d" % (self.prefix, step)

    def recall_id(self, step, n):
        return "%srecall_%02d_%d" % (self.prefix, step, n)

    def next_step(self, prompt):
        done = prompt.done_step()
        return 0 if done is None else done + 1

    def found(self, prompt):
        m = self.fact.search(prompt.all_text())
        return m.group(1) if m else None

    def decide(self, prompt):
        """The parts of the model's answer to this prompt."""
        step = self.next_step(prompt)
        recalled = prompt.recall_results()
        before = [p for p in [self.thinking(step)] if p is not None]
        if step < self.steps:
            if step == self.recall_step and prompt.offers_recall and not recalled and prompt.keys():
                # Recall first: no text before the call.
                return before + [call(self.recall_id(step, 1), RECALL_TOOL, {"key": prompt.keys()[-1]})]
            name, args, sentence = self.step_call(step)
            if recalled:
                key, got = recalled[-1]
                sentence = "The output under recall key %s is back (%d lines); I can go on. %s" % (
                    key, len(got.splitlines()), sentence)
            parts = [] if step in self.quiet and not recalled else [text(sentence)]
            return before + parts + [call(self.step_id(step), name, args)]
        fact = self.found(prompt)
        if fact is None and prompt.offers_recall and len(recalled) < MAX_RECALLS:
            key = self.key_to_recall(prompt, {k for k, _ in recalled})
            if key is not None:
                ask = call(self.recall_id(step, len(recalled) + 1), RECALL_TOOL, {"key": key})
                if recalled:
                    return before + [ask]
                # Recall after text: the sentence goes out before the call.
                return before + [text("The codename is in an early file whose output was cut from my "
                                      "context; let me recall it."), ask]
        return before + [text(self.final(fact or UNKNOWN))]

    def key_to_recall(self, prompt, recalled):
        """The key that most likely gives the fact step's output back: the
        one in that output's placeholder; else the keys of condense's own
        messages (a checkpoint or digest of the oldest turns), then the
        other keys, in prompt order."""
        own = KEY.findall(prompt.results().get(self.step_id(self.fact_step), ""))
        spans = [k for e in prompt.entries if e.kind == "text" for k in KEY.findall(e.text)]
        for k in own + spans + prompt.keys():
            if k not in recalled:
                return k
        return None


# --- what the tests read off the recorded requests -------------------------------


def recall_calls(parts):
    return [p for p in parts if p.kind == "call" and p.name == RECALL_TOOL]


def text_before_recall(parts):
    """Whether the answer writes text and then calls condense_recall."""
    seen_text = False
    for p in parts:
        if p.kind == "text":
            seen_text = True
        if p.kind == "call" and p.name == RECALL_TOOL:
            return seen_text
    return False


# --- condense's summarizer ---------------------------------------------------------

def is_summary_call(body):
    """Whether a request is condense's summarizer call: one user message
    asking for a checkpoint of the <conversation> it quotes, no tools (chat
    completions and Messages: `messages`; Responses: `input`)."""
    return summary_prompt(body) is not None


def summary_prompt(body):
    """The prompt of condense's summarizer call, or None."""
    if not isinstance(body, dict) or body.get("tools"):
        return None
    items = body.get("messages") or body.get("input")
    if not isinstance(items, list) or not items or not isinstance(items[0], dict):
        return None
    content = items[0].get("content")
    if isinstance(content, str) and "<conversation>" in content and "## Task intent" in content:
        return content
    return None


def checkpoint(prompt):
    """A summarizer's checkpoint of the conversation quoted in `prompt`,
    with every section condense asks for. Like a real summary it keeps the
    paths it saw and loses the details inside the outputs (the codename
    among them), which only a recall gives back."""
    paths = []
    for p in re.findall(r"[\w.-]+/[\w./-]+\.(?:log|txt)\b", prompt):
        if p not in paths:
            paths.append(p)
    files = "\n".join("- %s: read" % p for p in paths[:12]) or "none"
    return ("## Task intent\nRun the numbered steps, then report.\n"
            "## Files and artifacts\n%s\n"
            "## Decisions\nnone\n"
            "## Errors and blockers\nnone\n"
            "## Current state\nThe earlier steps ran and printed their output.\n"
            "## Next steps\nRun the remaining steps, then report.\n"
            "## Critical identifiers\n%s\n" % (files, ", ".join(paths[:12]) or "none"))


def raw_list(raw, key):
    """The exact JSON text of each element of the array `key` at the top
    level of a JSON object body (bytes), to compare items byte for byte
    across the proxy; None when the body has no such array."""
    s = raw.decode()
    dec = json.JSONDecoder()

    def ws(i):
        while s[i] in " \t\r\n":
            i += 1
        return i

    i = ws(0)
    if s[i] != "{":
        return None
    i += 1
    while True:
        i = ws(i)
        if s[i] == "}":
            return None
        if s[i] == ",":
            i = ws(i + 1)
        name, i = dec.raw_decode(s, i)
        i = ws(i)
        i = ws(i + 1)  # the colon
        if name == key and s[i] == "[":
            items, i = [], i + 1
            while True:
                i = ws(i)
                if s[i] == "]":
                    return items
                if s[i] == ",":
                    i = ws(i + 1)
                _, j = dec.raw_decode(s, i)
                items.append(s[i:j])
                i = j
        _, i = dec.raw_decode(s, i)


def dump(path, requests):
    """Writes the recorded requests to `path`, one JSON object a line (raw
    bytes as text, parts as objects): what a failed run is read from."""
    def default(o):
        if isinstance(o, bytes):
            return o.decode("utf-8", "replace")
        return o.__dict__ if hasattr(o, "__dict__") else str(o)
    with open(path, "w") as f:
        for q in requests:
            f.write(json.dumps(q, default=default) + "\n")
