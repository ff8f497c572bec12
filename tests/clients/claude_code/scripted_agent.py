"""The model side of the Claude Code end-to-end test: a scripted agent that
makes Claude Code run tools turn after turn, with large outputs, and then
answer.

The script has STEPS tool calls. The step to take is read from the request
itself, never from how many requests came before (Claude Code retries, and
sends side requests): the tool_use ids are "toolu_step_NN", so the
tool_result in the last user message names the step just done. That id
survives whatever condense does to older turns, since the last turn is
never compacted.

Requests that are not the main loop (no Bash tool, or not our task, e.g. a
title or topic request on a small model) get a short text answer.
"""

import re
from pathlib import Path

import mock_anthropic as m

TASK_MARKER = "CONDENSE-E2E-TASK"
FINAL_TEXT = "All steps done. FINAL-ANSWER-condense-e2e"
SIDE_TEXT = "Side request answer."
STEPS = 22
# Generated in the working directory by write_workdir(): each file is about
# 15 KB (~6k o200k tokens: numbers and paths), and so is the seq output.
LINES_PER_FILE = 160
OVERLOADED_STEP = 5


def write_workdir(path):
    """Creates the files the steps read or cat."""
    (path / "logs").mkdir()
    (path / "notes").mkdir()
    for i in range(STEPS):
        for folder, name in (("logs", "run_%02d.log" % i), ("notes", "part_%02d.txt" % i)):
            lines = ["%s %02d line %04d: the build step compiled module_%d and wrote %d bytes to target/out_%d.o"
                     % (name, i, n, n % 37, 1000 + n * 7, n) for n in range(LINES_PER_FILE)]
            (path / folder / name).write_text("\n".join(lines) + "\n")


def step_call(step, workdir):
    """The tool call of a step: Bash commands with large output, and Reads."""
    kind = step % 3
    if kind == 0:
        return "Bash", {"command": "cat logs/run_%02d.log" % step, "description": "Show build log %d" % step}
    if kind == 1:
        return "Read", {"file_path": str(workdir / "notes" / ("part_%02d.txt" % step))}
    return "Bash", {"command": "seq 1 1800 | sed 's/^/row /'", "description": "Print rows"}


def step_output_lines(step, workdir):
    """Lines the tool result of a step must contain in full."""
    name, args = step_call(step, workdir)
    if name == "Read":
        return Path(args["file_path"]).read_text().splitlines()
    if args["command"].startswith("cat "):
        return (workdir / args["command"][4:]).read_text().splitlines()
    return ["row %d" % n for n in range(1, 1801)]


def is_main_loop(body):
    """Claude Code's agent loop on our task: it offers the Bash tool, and
    either the task is in the conversation or the last message answers one
    of our steps (the task may have been summarized away by then)."""
    tools = {t.get("name") for t in body.get("tools") or []}
    if "Bash" not in tools:
        return False
    users = [msg for msg in body.get("messages", []) if msg.get("role") == "user"]
    return done_step(body) is not None or any(TASK_MARKER in m.request_text(msg) for msg in users)


def done_step(body):
    """The step whose tool_result ends the conversation, or None."""
    last_user = next((msg for msg in reversed(body["messages"]) if msg.get("role") == "user"), None)
    content = last_user.get("content") if last_user else None
    if not isinstance(content, list):
        return None
    ids = [b.get("tool_use_id", "") for b in content if b.get("type") == "tool_result"]
    steps = [int(mt.group(1)) for mt in map(re.compile(r"toolu_step_(\d+)$").match, ids) if mt]
    return max(steps) if steps else None


def responder(workdir):
    """The responder for mock_anthropic.start(). The first request for step
    OVERLOADED_STEP gets a 529 overloaded_error, as the real API sometimes
    answers: Claude Code retries it, and the script must not lose its place."""
    overloaded = []

    def respond(request):
        body = request["body"]
        if not is_main_loop(body):
            return m.reply([m.text(SIDE_TEXT)])
        done = done_step(body)
        step = 0 if done is None else done + 1
        if step == OVERLOADED_STEP and not overloaded:
            overloaded.append(step)
            return m.Error(529, "overloaded_error", "Overloaded")
        if step >= STEPS:
            return m.reply([m.text(FINAL_TEXT)])
        name, args = step_call(step, workdir)
        return m.reply([m.thinking("Step %d: next I use %s." % (step, name)),
                        m.text("Step %d." % step),
                        m.tool_use("toolu_step_%02d" % step, name, args)])
    return respond
