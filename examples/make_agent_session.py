"""Writes agent-session.json and agent-session.probes.json: a coding-agent
conversation written for condense's offline demo and tests (not a recording).

A tool-using agent fixes a bug in a small invented project ("inkwell", a
Markdown-to-HTML converter): it lists files, reads code, runs failing tests,
edits, and re-runs them. Tool outputs are long and realistic in shape (file
listings, source, pytest output with tracebacks), so the conversation needs
compaction at small windows. Deterministic: the same script writes the same
files.

    python3 examples/make_agent_session.py
"""

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))

SYSTEM = ("You are a software engineering agent working in a repository at /work/inkwell. "
          "Use the tools to inspect files, run commands and edit code. Explain briefly what you do.")
TASK = ("Bug report: `inkwell render` crashes on documents whose headings contain inline code, e.g. "
        "'## The `render()` function'. Expected: a heading with a <code> element. Actual: "
        "TypeError: can only concatenate str (not \"NoneType\") to str. Please fix it and make sure the tests pass.")

TOOLS = [
    {"type": "function", "function": {"name": "run", "description": "Run a shell command in the repository.",
                                      "parameters": {"type": "object", "properties": {
                                          "command": {"type": "string", "description": "The command line."}},
                                          "required": ["command"]}}},
    {"type": "function", "function": {"name": "edit_file", "description": "Replace text in a file.",
                                      "parameters": {"type": "object", "properties": {
                                          "path": {"type": "string", "description": "File to edit."},
                                          "old": {"type": "string", "description": "Exact text to replace."},
                                          "new": {"type": "string", "description": "Replacement text."}},
                                          "required": ["path", "old", "new"]}}},
]

MODULES = ["cli", "parser", "inline", "blocks", "render", "escape", "toc", "config", "plugins", "cache"]


def listing():
    lines = ["/work/inkwell:", "README.md  pyproject.toml  inkwell  tests  docs", "", "/work/inkwell/inkwell:"]
    lines.append("  ".join(m + ".py" for m in MODULES) + "  __init__.py")
    lines += ["", "/work/inkwell/tests:"]
    lines.append("  ".join("test_" + m + ".py" for m in MODULES) + "  conftest.py  fixtures")
    lines += ["", "/work/inkwell/tests/fixtures:"]
    lines.append("  ".join("case_%02d.md" % i for i in range(40)))
    lines += ["", "/work/inkwell/docs:", "index.md  syntax.md  plugins.md  changelog.md"]
    return "\n".join(lines)


def source(module, n):
    out = ['"""inkwell.%s: part of the Markdown converter."""' % module, "", "import re", "from .escape import escape_html", ""]
    for i in range(n):
        out += [
            "def %s_step_%d(text, ctx):" % (module, i),
            '    """Step %d of %s: normalise one construct."""' % (i, module),
            "    if not text:",
            "        return text",
            "    parts = re.split(r'(`[^`]*`)', text)",
            "    return ''.join(ctx.apply(p, level=%d) for p in parts)" % (i % 4),
            "",
        ]
    return "\n".join("%4d  %s" % (k + 1, line) for k, line in enumerate(out))


def inline_source():
    body = source("inline", 14).split("\n")
    body.insert(30, "  31  def render_code_span(token):\n  32      # BUG: returns None for spans inside headings\n  33      if token.parent == 'heading':\n  34          return None\n  35      return '<code>' + escape_html(token.text) + '</code>'")
    return "\n".join(body)


def pytest_output(failing, passed):
    lines = ["============================= test session starts ==============================",
             "platform linux -- Python 3.11.7, pytest-8.3.2", "rootdir: /work/inkwell", "collected %d items" % (failing + passed), ""]
    for m in MODULES:
        lines.append("tests/test_%s.py %s" % (m, "." * 12))
    if failing:
        lines += ["", "=================================== FAILURES ===================================",
                  "______________________ test_heading_with_inline_code ______________________", "",
                  "    def test_heading_with_inline_code():",
                  ">       html = render('## The `render()` function')", "",
                  "tests/test_render.py:88: ",
                  "_ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _",
                  "inkwell/render.py:142: in render_heading",
                  "    return '<h%d>' % level + text + '</h%d>' % level",
                  "E   TypeError: can only concatenate str (not \"NoneType\") to str",
                  "FAILED tests/test_render.py::test_heading_with_inline_code - TypeError: can only concatenate str (not \"NoneType\") to str"]
    lines.append("========================= %s ==========================" % (
        ("%d failed, %d passed in 1.42s" % (failing, passed)) if failing else ("%d passed in 1.38s" % passed)))
    return "\n".join(lines)


def main():
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    n = 0

    def call(text, name, args, result):
        nonlocal n
        n += 1
        cid = "call_%03d" % n
        messages.append({"role": "assistant", "content": text, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]})
        messages.append({"role": "tool", "tool_call_id": cid, "content": result})

    call("Let me look at the repository layout first.", "run", {"command": "ls -R /work/inkwell"}, listing())
    call("Let me reproduce the failure with the test suite.", "run", {"command": "cd /work/inkwell && python -m pytest -q"},
         pytest_output(1, 119))
    for m in ["render", "parser", "blocks"]:
        call("Reading inkwell/%s.py to follow the heading path." % m, "run", {"command": "cat -n inkwell/%s.py" % m}, source(m, 12))
    call("The heading text goes through the inline renderer; reading inkwell/inline.py.", "run",
         {"command": "cat -n inkwell/inline.py"}, inline_source())
    call("Wait, render_code_span returns None when the parent is a heading. That explains the NoneType. "
         "Let me check where token.parent is set before changing it.", "run",
         {"command": "grep -rn \"parent\" inkwell/"},
         "\n".join("inkwell/%s.py:%d:    token.parent = %r" % (m, 10 + i, "heading" if m == "blocks" else "paragraph")
                   for i, m in enumerate(MODULES)))
    for m in ["escape", "toc"]:
        call("Checking inkwell/%s.py, which headings also use." % m, "run", {"command": "cat -n inkwell/%s.py" % m}, source(m, 10))
    call("Fixing render_code_span so code spans render the same inside headings.", "edit_file",
         {"path": "/work/inkwell/inkwell/inline.py",
          "old": "    if token.parent == 'heading':\n        return None\n",
          "new": ""},
         "Edited /work/inkwell/inkwell/inline.py: removed 2 lines (31-34 now render_code_span without the heading case).")
    call("Running the tests again.", "run", {"command": "cd /work/inkwell && python -m pytest -q"}, pytest_output(0, 120))
    call("Let me double-check the table of contents, which slugifies heading text.", "run",
         {"command": "cd /work/inkwell && python -m inkwell render tests/fixtures/case_07.md | head -40"},
         "\n".join("<h2 id=\"section-%d\">Section %d with <code>code_%d()</code></h2>\n<p>Paragraph %d of the fixture.</p>" % (i, i, i, i)
                   for i in range(20)))
    call("The TOC slugs keep the code text. Adding a regression test.", "edit_file",
         {"path": "/work/inkwell/tests/test_render.py", "old": "# end of heading tests\n",
          "new": "def test_heading_code_span_slug():\n    assert render('## Use `x()`') == '<h2 id=\"use-x\">Use <code>x()</code></h2>'\n\n# end of heading tests\n"},
         "Edited /work/inkwell/tests/test_render.py: added test_heading_code_span_slug.")
    call("Final test run.", "run", {"command": "cd /work/inkwell && python -m pytest -q"}, pytest_output(0, 121))

    body = {"model": "gpt-4o", "messages": messages, "tools": TOOLS}
    with open(os.path.join(HERE, "agent-session.json"), "w") as f:
        json.dump(body, f, indent=1)
        f.write("\n")

    probes = []

    def probe(text, kind):
        first = next(i for i, m in enumerate(messages)
                     if text in json.dumps(m, ensure_ascii=False) or text in (m.get("content") or ""))
        probes.append({"text": text, "kind": kind, "first_message_index": first})

    probe("inkwell render", "task_statement")
    probe("TypeError: can only concatenate str (not \"NoneType\") to str", "error_message")
    probe("tests/test_render.py::test_heading_with_inline_code", "test_id")
    probe("inkwell/render.py:142: in render_heading", "error_location")
    probe("/work/inkwell/inkwell/inline.py", "path")
    probe("def render_code_span(token):", "def_or_class_edited")
    probe("test_heading_code_span_slug", "def_or_class_edited")
    probe("120 passed", "count")
    with open(os.path.join(HERE, "agent-session.probes.json"), "w") as f:
        json.dump(probes, f, indent=1)
        f.write("\n")
    print("wrote", len(messages), "messages,", len(probes), "probes")


if __name__ == "__main__":
    main()
