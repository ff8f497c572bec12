"""The model side of the opencode end-to-end test: a scripted model
(scripted_model.Script) that makes opencode run its bash and read tools
turn after turn, with large outputs, writing a sentence before most calls
(content deltas, then the tool call, as GPT models stream them), calling
condense_recall once condense offers it, and finally answering with a fact
from an early tool output.

The call ids are "call_step_NN" (and "call_recall_NN_K" for
condense_recall), so the step to take is read off the highest step whose
tool message is in the request. Chat completions has no standard place
for reasoning, so the model writes none.

The working directory has an AGENTS.md, which opencode puts in its system
prompt.

Requests that are not the main loop (no bash tool, or not our task, e.g. a
title request) get a short text answer.
"""

from pathlib import Path

import mock_chat as m
import scripted_model

TASK_MARKER = "CONDENSE-OPENCODE-E2E-TASK"
TASK = (TASK_MARKER + ": run the numbered steps, then report the release codename that the first "
        "build log names.")
FINAL_MARKER = "FINAL-ANSWER-condense-opencode-e2e"
SIDE_TEXT = "Side request answer."
STEPS = 24
LINES_PER_FILE = 160
SEQ = 1800
FACT_STEP = 0
CODENAME = "cobalt-finch-9152"
FACT_LINE = 12
FACT = r"release codename is ([a-z]+-[a-z]+-\d{4})"
RECALL_STEP = 14
QUIET = (4, 11, 19)
AGENTS_MD = """# Instructions for agents in this directory

- Build logs are in logs/, module notes in notes/.
- Do not change any file.
"""


def write_workdir(path):
    """Creates the files the steps read or cat, and AGENTS.md."""
    (path / "logs").mkdir()
    (path / "notes").mkdir()
    (path / "AGENTS.md").write_text(AGENTS_MD)
    for i in range(STEPS):
        for folder, name in (("logs", "run_%02d.log" % i), ("notes", "part_%02d.txt" % i)):
            lines = ["%s %02d line %04d: the build step compiled module_%d and wrote %d bytes to target/out_%d.o"
                     % (name, i, n, n % 37, 1000 + n * 7, n) for n in range(LINES_PER_FILE)]
            if folder == "logs" and i == FACT_STEP:
                lines[FACT_LINE] = "%s %02d line %04d: the release codename is %s" % (name, i, FACT_LINE, CODENAME)
            (path / folder / name).write_text("\n".join(lines) + "\n")


def step_call(step, workdir):
    """The tool call of a step (bash commands with large output, and
    reads), and the sentence the model writes before it."""
    kind = step % 3
    if kind == 0:
        return ("bash", {"command": "cat logs/run_%02d.log" % step},
                "Let me look at build log %d." % step)
    if kind == 1:
        return ("read", {"filePath": str(workdir / "notes" / ("part_%02d.txt" % step))},
                "Now I'll read the notes of step %d." % step)
    return ("bash", {"command": "seq 1 %d" % SEQ},
            "I'll count the rows with seq.")


def step_output_lines(step, workdir):
    """Lines the tool result of a step must contain in full."""
    name, args, _ = step_call(step, workdir)
    if name == "read":
        return Path(args["filePath"]).read_text().splitlines()
    if args["command"].startswith("cat "):
        return (workdir / args["command"][4:]).read_text().splitlines()
    return [str(n) for n in range(1, SEQ + 1)]


def final(fact):
    return "All steps done. %s: the release codename is %s." % (FINAL_MARKER, fact)


def script(workdir):
    return scripted_model.Script(
        steps=STEPS, step_call=lambda step: step_call(step, workdir), prefix="call_", fact=FACT,
        fact_step=FACT_STEP, recall_step=RECALL_STEP, final=final, quiet=QUIET)


def is_main_loop(body):
    """opencode's agent loop on our task: it offers bash, and either the
    task is in the conversation or a tool result of one of our steps is."""
    tools = {(t.get("function") or {}).get("name") for t in body.get("tools") or []}
    if "bash" not in tools:
        return False
    users = [msg for msg in body.get("messages") or [] if msg.get("role") == "user"]
    return done_step(body) is not None or any(TASK_MARKER in m.text_of(msg.get("content")) for msg in users)


def done_step(body):
    return m.prompt_of(body).done_step()


def responder(workdir):
    """The responder for mock_chat.start(); each answer's parts are
    recorded in the request as "parts"."""
    model = script(workdir)

    def respond(request):
        body = request["body"]
        if not is_main_loop(body):
            return {"role": "assistant", "content": SIDE_TEXT}
        request["parts"] = model.decide(m.prompt_of(body))
        return m.message_of(request["parts"])
    return respond
