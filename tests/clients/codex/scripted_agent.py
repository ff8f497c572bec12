"""The model side of the Codex end-to-end test: a scripted model
(scripted_model.Script) that makes Codex run shell commands turn after
turn, with large outputs, writing a sentence before most commands as GPT
models do (a message item, then the function_call), calling
condense_recall once condense offers it, and finally answering with a fact
from an early command output.

The script has STEPS calls of Codex's exec_command tool; the call ids are
"call_step_NN" (and "call_recall_NN_K" for condense_recall), so the step to
take is read off the highest step whose function_call_output is in the
input. Every answer starts with a reasoning item whose encrypted_content
Codex must send back unchanged.

The working directory has an AGENTS.md, so Codex sends its instructions as
a user message of their own next to <environment_context>.

Requests that are not the main loop (no exec_command tool, or not our task)
get a short text answer.
"""

import mock_responses as m
import scripted_model

TASK_MARKER = "CONDENSE-CODEX-E2E-TASK"
TASK = (TASK_MARKER + ": run the numbered steps, then report the release codename that the first "
        "build log names.")
FINAL_MARKER = "FINAL-ANSWER-condense-codex-e2e"
SIDE_TEXT = "Side request answer."
STEPS = 24
# Each generated file is ~13 KB (~5k o200k tokens: numbers and paths), and
# `seq 1 3000` prints ~14 KB.
LINES_PER_FILE = 150
SEQ = 3000
# The first request for this step gets a 500 server_error, as the API
# sometimes answers: Codex retries it, and the script must not lose its place.
SERVER_ERROR_STEP = 6
# Step 0 cats logs/run_00.log, whose line 12 names the codename: a line
# without a path or an error word, so a masked placeholder does not keep it.
FACT_STEP = 0
CODENAME = "amber-heron-3307"
FACT_LINE = 12
FACT = r"release codename is ([a-z]+-[a-z]+-\d{4})"
# condense offers condense_recall once it masks (from about the 10th
# request at this test's window); the model calls it first thing here.
RECALL_STEP = 15
QUIET = (5, 13, 20)
AGENTS_MD = """# Instructions for agents in this directory

- Build logs are in logs/, module notes in notes/.
- Run commands from this directory; do not change any file.
"""


def write_workdir(path):
    """Creates the files the steps cat, and AGENTS.md."""
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


def step_command(step):
    """The shell command of a step (run in the working directory)."""
    kind = step % 3
    if kind == 0:
        return "cat logs/run_%02d.log" % step
    if kind == 1:
        return "cat notes/part_%02d.txt" % step
    return "seq 1 %d" % SEQ


def step_call(step):
    cmd = step_command(step)
    sentence = {0: "I'll print build log %d to see what that step compiled." % step,
                1: "Now the module notes of step %d." % step,
                2: "Let me count the rows with seq to compare."}[step % 3]
    return "exec_command", {"cmd": cmd}, sentence


def step_output_lines(step, workdir):
    """Lines the function_call_output of a step must contain in full."""
    cmd = step_command(step)
    if cmd.startswith("seq "):
        return [str(n) for n in range(1, SEQ + 1)]
    return (workdir / cmd[4:]).read_text().splitlines()


def final(fact):
    return "All steps done. %s: the release codename is %s." % (FINAL_MARKER, fact)


SCRIPT = scripted_model.Script(
    steps=STEPS, step_call=step_call, prefix="call_", fact=FACT, fact_step=FACT_STEP,
    recall_step=RECALL_STEP, final=final, quiet=QUIET,
    thinking=lambda step: scripted_model.think("Step %d: next I run a command." % step))


def is_main_loop(body):
    """Codex's agent loop on our task: it offers exec_command, and either
    the task is in the input or the input answers one of our steps."""
    tools = {t.get("name") for t in body.get("tools") or []}
    if "exec_command" not in tools:
        return False
    users = [it for it in m.input_items(body) if it.get("role") == "user"]
    return done_step(body) is not None or any(TASK_MARKER in m.item_text(it) for it in users)


def done_step(body):
    """The latest step whose function_call_output is in the input, or None."""
    return m.prompt_of(body).done_step()


def responder():
    """The responder for mock_responses.start(); each answer's parts are
    recorded in the request as "parts"."""
    failed = []

    def respond(request):
        body = request["body"]
        if not is_main_loop(body):
            return [m.message(SIDE_TEXT)]
        prompt = m.prompt_of(body)
        step = SCRIPT.next_step(prompt)
        if step == SERVER_ERROR_STEP and not failed:
            failed.append(step)
            return m.Error(500, "The server had an error while processing your request. Sorry about that!",
                           "server_error")
        request["parts"] = SCRIPT.decide(prompt)
        return m.output_of(request["parts"], "gAAAAB-codex-step-%02d==" % step)
    return respond
