"""The model side of the Claude Code end-to-end test: a scripted model
(scripted_model.Script) that makes Claude Code run tools turn after turn,
with large outputs, writing a sentence before most calls as Claude does,
calling condense_recall once condense offers it, and finally answering
with a fact from an early tool output.

The script has STEPS tool calls (Bash and Read); the tool_use ids are
"toolu_step_NN" (and "toolu_recall_NN_K" for condense_recall), so the step
to take is read off the highest step whose tool_result is in the request.
Every answer starts with a thinking block, as Claude's adaptive thinking
does.

The working directory has a CLAUDE.md, so Claude Code's first user message
carries it in a <system-reminder> block next to its other ones.

Requests that are not the main loop (no Bash tool, or not our task, e.g. a
title or topic request on a small model) get a short text answer.
"""

from pathlib import Path

import mock_anthropic as m
import scripted_model

TASK_MARKER = "CONDENSE-E2E-TASK"
TASK = (TASK_MARKER + ": run the numbered steps, then report the release codename that the first "
        "build log names.")
FINAL_MARKER = "FINAL-ANSWER-condense-e2e"
SIDE_TEXT = "Side request answer."
STEPS = 24
# Generated in the working directory by write_workdir(): each file is about
# 15 KB (~6k o200k tokens: numbers and paths), and so is the seq output.
LINES_PER_FILE = 160
OVERLOADED_STEP = 5
# Step 0 cats logs/run_00.log, whose line 12 names the codename: a line
# without a path or an error word, so a masked placeholder does not keep it,
# and near the start of what a checkpoint's recall gives back (the oldest
# turns first, cut in the middle when they do not fit).
FACT_STEP = 0
CODENAME = "velvet-otter-5821"
FACT_LINE = 12
FACT = r"release codename is ([a-z]+-[a-z]+-\d{4})"
# condense offers condense_recall once it masks (from about the 8th request
# at this test's window); the model calls it first thing at this step.
RECALL_STEP = 14
QUIET = (4, 11, 19)
CLAUDE_MD = """# Project notes for agents

- Build logs live in logs/, module notes in notes/.
- Report findings in plain sentences.
"""


def write_workdir(path):
    """Creates the files the steps read or cat, and CLAUDE.md."""
    (path / "logs").mkdir()
    (path / "notes").mkdir()
    (path / "CLAUDE.md").write_text(CLAUDE_MD)
    for i in range(STEPS):
        for folder, name in (("logs", "run_%02d.log" % i), ("notes", "part_%02d.txt" % i)):
            lines = ["%s %02d line %04d: the build step compiled module_%d and wrote %d bytes to target/out_%d.o"
                     % (name, i, n, n % 37, 1000 + n * 7, n) for n in range(LINES_PER_FILE)]
            if folder == "logs" and i == FACT_STEP:
                lines[FACT_LINE] = "%s %02d line %04d: the release codename is %s" % (name, i, FACT_LINE, CODENAME)
            (path / folder / name).write_text("\n".join(lines) + "\n")


def step_call(step, workdir):
    """The tool call of a step (Bash commands with large output, and
    Reads), and the sentence Claude writes before it."""
    kind = step % 3
    if kind == 0:
        return ("Bash", {"command": "cat logs/run_%02d.log" % step, "description": "Show build log %d" % step},
                "Let me look at build log %d to see what that step compiled." % step)
    if kind == 1:
        return ("Read", {"file_path": str(workdir / "notes" / ("part_%02d.txt" % step))},
                "Next I'll read notes/part_%02d.txt for the module notes." % step)
    return ("Bash", {"command": "seq 1 1800 | sed 's/^/row /'", "description": "Print rows"},
            "I'll print the row listing to check how many rows there are.")


def step_output_lines(step, workdir):
    """Lines the tool result of a step must contain in full."""
    name, args, _ = step_call(step, workdir)
    if name == "Read":
        return Path(args["file_path"]).read_text().splitlines()
    if args["command"].startswith("cat "):
        return (workdir / args["command"][4:]).read_text().splitlines()
    return ["row %d" % n for n in range(1, 1801)]


def final(fact):
    return "All steps done. %s: the release codename is %s." % (FINAL_MARKER, fact)


def script(workdir):
    return scripted_model.Script(
        steps=STEPS, step_call=lambda step: step_call(step, workdir), prefix="toolu_", fact=FACT,
        fact_step=FACT_STEP, recall_step=RECALL_STEP, final=final, quiet=QUIET,
        thinking=lambda step: scripted_model.think("Step %d: what next." % step))


def is_main_loop(body):
    """Claude Code's agent loop on our task: it offers the Bash tool, and
    either the task is in the conversation or a tool result of one of our
    steps is (the task may have been summarized away by then)."""
    tools = {t.get("name") for t in body.get("tools") or []}
    if "Bash" not in tools:
        return False
    users = [msg for msg in body.get("messages", []) if msg.get("role") == "user"]
    return done_step(body) is not None or any(TASK_MARKER in m.request_text(msg) for msg in users)


def done_step(body):
    """The highest step whose tool_result is in the conversation, or None."""
    return m.prompt_of(body).done_step()


def responder(workdir):
    """The responder for mock_anthropic.start(). The first request for step
    OVERLOADED_STEP gets a 529 overloaded_error, as the real API sometimes
    answers: Claude Code retries it, and the script must not lose its place.
    Each answer's parts are recorded in the request as "parts"."""
    overloaded = []
    model = script(workdir)

    def respond(request):
        body = request["body"]
        if not is_main_loop(body):
            return m.reply([m.text(SIDE_TEXT)])
        prompt = m.prompt_of(body)
        if model.next_step(prompt) == OVERLOADED_STEP and not overloaded:
            overloaded.append(OVERLOADED_STEP)
            return m.Error(529, "overloaded_error", "Overloaded")
        request["parts"] = model.decide(prompt)
        return m.reply(m.content_of(request["parts"]))
    return respond
