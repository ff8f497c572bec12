"""The model side of the Codex end-to-end test: a scripted agent that makes
Codex run shell commands turn after turn, with large outputs, and then
answer.

The script has STEPS calls of Codex's exec_command tool. The step to take
is read from the request itself, never from how many requests came before
(Codex retries, and condense may drop old turns): the call ids are
"call_step_NN", so the highest one among the function_call_output items of
the input names the step just done. The latest turn is never compacted, so
that id survives.

Requests that are not the main loop (no exec_command tool, or not our task)
get a short text answer.
"""

import re

import mock_responses as m

TASK_MARKER = "CONDENSE-CODEX-E2E-TASK"
FINAL_TEXT = "All steps done. FINAL-ANSWER-condense-codex-e2e"
SIDE_TEXT = "Side request answer."
STEPS = 20
# Each generated file is ~13 KB (~5k o200k tokens: numbers and paths), and
# `seq 1 3000` prints ~14 KB.
LINES_PER_FILE = 150
SEQ = 3000
# The first request for this step gets a 500 server_error, as the API
# sometimes answers: Codex retries it, and the script must not lose its place.
SERVER_ERROR_STEP = 6


def write_workdir(path):
    """Creates the files the steps cat."""
    (path / "logs").mkdir()
    (path / "notes").mkdir()
    for i in range(STEPS):
        for folder, name in (("logs", "run_%02d.log" % i), ("notes", "part_%02d.txt" % i)):
            lines = ["%s %02d line %04d: the build step compiled module_%d and wrote %d bytes to target/out_%d.o"
                     % (name, i, n, n % 37, 1000 + n * 7, n) for n in range(LINES_PER_FILE)]
            (path / folder / name).write_text("\n".join(lines) + "\n")


def step_command(step):
    """The shell command of a step (run in the working directory)."""
    kind = step % 3
    if kind == 0:
        return "seq 1 %d" % SEQ
    if kind == 1:
        return "cat logs/run_%02d.log" % step
    return "cat notes/part_%02d.txt" % step


def step_output_lines(step, workdir):
    """Lines the function_call_output of a step must contain in full."""
    cmd = step_command(step)
    if cmd.startswith("seq "):
        return [str(n) for n in range(1, SEQ + 1)]
    return (workdir / cmd[4:]).read_text().splitlines()


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
    steps = [int(mt.group(1)) for it in m.input_items(body) if it.get("type") == "function_call_output"
             for mt in [re.match(r"call_step_(\d+)$", it.get("call_id", ""))] if mt]
    return max(steps) if steps else None


def responder():
    """The responder for mock_responses.start()."""
    failed = []

    def respond(request):
        body = request["body"]
        if not is_main_loop(body):
            return [m.message(SIDE_TEXT)]
        done = done_step(body)
        step = 0 if done is None else done + 1
        if step == SERVER_ERROR_STEP and not failed:
            failed.append(step)
            return m.Error(500, "The server had an error while processing your request. Sorry about that!",
                           "server_error")
        if step >= STEPS:
            return [m.message(FINAL_TEXT)]
        return [m.reasoning("Step %d: next I run a command." % step, "gAAAAB-codex-step-%02d==" % step),
                m.message("Step %d." % step),
                m.function_call("call_step_%02d" % step, "exec_command", {"cmd": step_command(step)})]
    return respond
