"""bench/agent_pipeline.py's own logic, without a server: its tools, its task file, the tool call's JSON schema, the
agent program's loop (against a scripted stand-in for the server), the transcript comparison and the tables and
goals drawn from a run's passes (the runs themselves are benchmarks)."""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import pytest
from helpers.scripts import load_script
from helpers.testing import smollm2_or_skip

ROOT = Path(__file__).resolve().parent.parent




@pytest.fixture(scope="module")
def ap():
    return load_script("agent_pipeline")


@pytest.fixture(scope="module")
def world(ap):
    return ap.load_tasks()[1]


@pytest.fixture(scope="module")
def tasks(ap):
    return ap.load_tasks()[0]


# --- the tools ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("expression, value", [
    ("3 * 4.25 + 2 * 8.5", "29.75"), ("2 + 3 * 4", "14"), ("(2 + 3) * 4", "20"), ("(8.5 + 4.25 + 6.75) / 3", "6.5"),
    ("0.15 * 240 + 18", "54"), ("-(2 - 5) * 2", "6"), ("1 / 3", "0.333333"), (".5 + 1", "1.5"), ("10 - 4 - 3", "3"),
    ("12 / 4 / 3", "1"), ("1200 - (186.40 + 312.00 + 450.00 + 96.35)", "155.25"), ("- -3", "3")])
def test_the_calculator_answers_arithmetic_exactly(ap, expression, value):
    assert ap.calculate(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('echo hi')", "unexpected '_'"), ("2 ** 10", "unexpected '\\*'"),
    ("1 / 0", "division by zero"), ("1 / (2 - 2)", "division by zero"), ("(1 + 2", "not closed"),
    ("1 + 2)", "unexpected '\\)'"), ("", "empty"), ("1 +", "ends where a number"), ("3 x 4", "unexpected 'x'"),
    ("9" * 16, "more than 15 digits"), ("(" * 30 + "1" + ")" * 30, "nested"), ("1 + " * 60 + "1", "longer than"),
    ("99999999999999 * 99999999999999", "too large"), ("2e3", "unexpected 'e'"), ("[1]", "unexpected '\\['")])
def test_the_calculator_refuses_what_is_not_arithmetic_with_a_message(ap, expression, message):
    with pytest.raises(ap.ToolError, match=message) as e:
        ap.calculate(expression)
    assert str(e.value).startswith("calculator: ")


def test_the_calculator_evaluates_nothing_as_python(ap, monkeypatch):
    """No eval or exec anywhere on its path (both made to fail here), and Python syntax that eval would take is
    refused."""
    def boom(*a, **k):
        raise AssertionError("eval/exec called")

    monkeypatch.setattr(builtins, "eval", boom)
    monkeypatch.setattr(builtins, "exec", boom)
    assert ap.calculate("(1 + 2) * 3 / 4") == "2.25"
    for python in ("abs(-3)", "1 if 1 else 2", "True + 1", "0x10", "1_000"):
        with pytest.raises(ap.ToolError):
            ap.calculate(python)


def test_the_table_lookup_answers_known_items_and_names_them_for_unknown_ones(ap, world):
    assert ap.table_lookup(world, "notebook") == "notebook: price_eur 4.25, in_stock 120, weight_kg 0.3"
    assert ap.table_lookup(world, "  Desk   LAMP ") == ap.table_lookup(world, "desk lamp")
    assert "price_eur 27.9" in ap.table_lookup(world, "desk lamp")
    with pytest.raises(ap.ToolError, match=r"table_lookup: no item 'notebooks'; the items are notebook, stapler"):
        ap.table_lookup(world, "notebooks")
    with pytest.raises(ap.ToolError, match="no item ''"):
        ap.table_lookup(world, "")


def test_the_calendar_lists_a_days_meetings_in_order_and_refuses_what_is_not_a_date(ap, world):
    day = ap.calendar(world, "2026-03-04")
    assert day.startswith("3 meetings on 2026-03-04: 1. 09:00 Standup with the team, room Orion; 2. 11:30 Budget "
                          "review with Dana, room Vega; 3. 15:00 1:1 with Sam, room Lyra"), day
    assert ap.calendar(world, "2026-03-06") == "no meetings on 2026-03-06"   # a day without meetings: an answer
    for bad in ("tomorrow", "2026-3-4", "2026-13-01", "2026-02-30", "04.03.2026", "2026-03-04T09:00", ""):
        with pytest.raises(ap.ToolError, match="calendar: .* is not a date of the form YYYY-MM-DD"):
            ap.calendar(world, bad)


def test_read_file_answers_the_folders_files_and_cannot_leave_the_folder(ap, world, tmp_path):
    assert ap.read_file(world, "notes.txt") == (ap.FILES / "notes.txt").read_text()
    assert "Travel budget for March: 1200 EUR" in ap.read_file(world, " budget.txt ")
    with pytest.raises(ap.ToolError, match=r"read_file: no file 'secret.txt'; the files are budget.txt, "
                                           r"meeting_notes.txt, notes.txt"):
        ap.read_file(world, "secret.txt")
    escapes = ["../agent_tasks.json", "/etc/passwd", str(ap.FILES / "notes.txt"), "../../pyproject.toml",
               "sub/../../agent_tasks.json", "..", ".", "", "notes.txt\x00", "..\\agent_tasks.json",
               "./../agent_tasks.json"]
    for path in escapes:
        with pytest.raises(ap.ToolError, match="read_file: no file"):
            ap.read_file(world, path)
    # a link inside the folder that leads out of it is refused too; one that stays inside is read
    inside = tmp_path / "files"
    inside.mkdir()
    (inside / "a.txt").write_text("inside")
    (tmp_path / "secret.txt").write_text("outside")
    (inside / "leak.txt").symlink_to(tmp_path / "secret.txt")
    (inside / "alias.txt").symlink_to(inside / "a.txt")
    (inside / "up").symlink_to(tmp_path)
    here = ap.World({}, {}, inside)
    assert ap.read_file(here, "a.txt") == ap.read_file(here, "alias.txt") == "inside"
    for path in ("leak.txt", "up/secret.txt"):
        with pytest.raises(ap.ToolError, match="read_file: no file"):
            ap.read_file(here, path)


def test_call_tool_dispatches_cuts_long_answers_and_refuses_unknown_tools_and_missing_arguments(ap, world, tmp_path):
    assert ap.call_tool(world, "calculator", {"expression": "1 + 1"}) == "2"
    assert ap.call_tool(world, "calendar", {"date": "2026-03-11"}).startswith("1 meetings on 2026-03-11")
    with pytest.raises(ap.ToolError, match="no tool 'shell'; the tools are calculator, table_lookup"):
        ap.call_tool(world, "shell", {"command": "ls"})
    with pytest.raises(ap.ToolError, match="no tool 'final_answer'"):   # not a tool that answers
        ap.call_tool(world, "final_answer", {})
    with pytest.raises(ap.ToolError, match="calculator: missing argument expression"):
        ap.call_tool(world, "calculator", {"item": "1 + 1"})
    (tmp_path / "long.txt").write_text("x" * 1000)
    long = ap.call_tool(ap.World({}, {}, tmp_path), "read_file", {"path": "long.txt"})
    assert long == "x" * ap.RESULT_CHARS + " [cut]"


def test_respond_turns_each_generated_call_into_the_next_turn(ap, world):
    """A tool's result or error as the next user turn, as real tools answer; final_answer ends the loop."""
    call = json.dumps({"tool": "table_lookup", "arguments": {"item": "stapler"}})
    assert ap.respond(world, call) == ("table_lookup", "table_lookup result: stapler: price_eur 8.5, in_stock 35, "
                                       "weight_kg 0.4", True)
    assert ap.respond(world, '{"tool": "final_answer", "arguments": {}}') == ("final_answer", "", True)
    tool, text, ok = ap.respond(world, '{"tool": "calculator", "arguments": {"expression": "1 / 0"}}')
    assert (tool, ok) == ("calculator", False) and text == "error: calculator: division by zero at position 2"
    tool, text, ok = ap.respond(world, '{"tool": "calculator", "arguments": {"expre', cut=True)
    assert (tool, ok) == (None, False) and "not valid JSON (it was cut off at the token limit)" in text
    tool, text, ok = ap.respond(world, '{"tool": "calculator"} trailing')
    assert (tool, ok) == (None, False) and "not valid JSON (Extra data at character" in text
    for shape in ('["calculator"]', '{"tool": 3, "arguments": {}}', '{"tool": "calendar"}',
                  '{"tool": "calendar", "arguments": "2026-03-04"}'):
        assert ap.respond(world, shape) == (None, 'error: a tool call is {"tool": NAME, "arguments": {...}}', False)


def test_success_needs_every_expected_phrase_as_a_whole(ap):
    assert ap.solved("The total is 29.75 EUR.", ("29.75",))
    assert not ap.solved("The total is 29.755 EUR.", ("29.75",))
    assert not ap.solved("You have meetings on 2026-03-05.", (("5", "five"),))   # not the 5 of a date
    assert ap.solved("Five meetings.", (("5", "five"),)) and ap.solved("5.", (("5", "five"),))
    assert not ap.solved("It weighs 1.2 kg", (("1", "1.0"),))
    assert ap.solved("The backpack (1.2 kg) beats 1 kg.", ("backpack", "1.2", ("1", "1.0")))
    assert not ap.solved("The backpack.", ("backpack", "1.2"))
    assert not ap.solved("anything", ())


# --- the task file -----------------------------------------------------------------------------------------------

def test_the_task_file_has_at_least_12_distinct_tasks_of_3_to_8_turns_that_its_tools_can_solve(ap, tasks, world):
    """Each task's scripted solution is a run of valid calls under the schema, each answered without error, with
    room for final_answer within the turn limit, and what a correct answer must mention is in their results."""
    jsonschema = pytest.importorskip("jsonschema")
    assert len(tasks) >= 12
    goals = [" ".join(t.goal.lower().split()) for t in tasks]
    assert len(set(goals)) == len(goals) and len({t.id for t in tasks}) == len(tasks)
    schema = ap.tool_schema()
    for t in tasks:
        assert 3 <= t.limit <= 8, t.id
        assert t.solution and len(t.solution) + 1 <= t.limit, t.id   # the calls, then final_answer
        assert t.expect, t.id
        results = []
        for tool, arguments in t.solution:
            assert tool in ap.TOOLS and tool != ap.FINAL, (t.id, tool)
            jsonschema.validate({"tool": tool, "arguments": arguments}, schema)
            results.append(ap.call_tool(world, tool, arguments))
        assert ap.solved(" ".join(results), t.expect), (t.id, results)
        assert not ap.solved(t.goal, t.expect), t.id   # the goal does not give the answer away
    used = {tool for t in tasks for tool, _ in t.solution}
    assert used == set(ap.TOOLS) - {ap.FINAL}   # every tool is needed somewhere
    names = {p.name for p in ap.FILES.iterdir()}
    assert {a["path"] for t in tasks for tool, a in t.solution if tool == "read_file"} <= names


def test_the_tasks_are_held_out_from_the_other_prompt_sets(tasks):
    """Written for this benchmark: no goal appears in the measurement set or the development set's tool calls."""
    others = "\n".join((ROOT / "bench" / "workloads" / f).read_text() for f in ("measure.json", "tool_calls.json"))
    assert not [t.id for t in tasks if t.goal in others]


def test_a_malformed_task_file_gets_a_clear_error(ap, tmp_path):
    spec = json.loads(ap.TASK_FILE.read_text())
    spec["tasks"][0]["solution"][0]["tool"] = "shell"
    bad = tmp_path / "tasks.json"
    bad.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="t01-order-total names unknown tool.*shell"):
        ap.load_tasks(bad)
    del spec["tasks"][0]["limit"]
    bad.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="t01-order-total.*'limit'"):
        ap.load_tasks(bad)


def test_pick_tasks_takes_the_first_n_or_ids(ap, tasks):
    assert [t.id for t in ap.pick_tasks(tasks, "2")] == [tasks[0].id, tasks[1].id]
    assert [t.id for t in ap.pick_tasks(tasks, "t10-percent,t02-second-room")] == ["t10-percent", "t02-second-room"]
    with pytest.raises(ValueError, match="between 1 and"):
        ap.pick_tasks(tasks, "0")
    with pytest.raises(ValueError, match="unknown task.*nope"):
        ap.pick_tasks(tasks, "t10-percent,nope")


# --- the tool call's schema --------------------------------------------------------------------------------------

def test_the_tool_call_schema_is_json_schema_that_names_every_tool_and_fixes_its_arguments(ap):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(json.dumps(ap.tool_schema()))
    jsonschema.Draft202012Validator.check_schema(schema)
    enums = [b["properties"]["tool"]["enum"] for b in schema["anyOf"]]
    assert sorted(x for e in enums for x in e) == sorted(ap.TOOLS) and all(len(e) == 1 for e in enums)
    ok = [{"tool": "calculator", "arguments": {"expression": "1 + 2"}}, {"tool": "final_answer", "arguments": {}},
          {"tool": "calendar", "arguments": {"date": "2026-03-04"}}, {"tool": "read_file", "arguments": {"path": "a"}}]
    bad = [{"tool": "shell", "arguments": {}}, {"tool": "calculator", "arguments": {"item": "x"}},
           {"tool": "calculator", "arguments": {"expression": "1", "extra": 2}}, {"tool": "calculator"},
           {"tool": "table_lookup", "arguments": {"item": "x" * 41}}, {"tool": "final_answer", "arguments": {"a": 1}}]
    for call in ok:
        jsonschema.validate(call, schema)
    for call in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(call, schema)


def test_sglang_and_xgrammar_accept_the_tool_call_schema(ap):
    """SGLang's own check of what xgrammar enforces passes, and xgrammar's grammar takes a valid call and refuses
    an unknown tool or another tool's arguments."""
    xgrammar = pytest.importorskip("xgrammar")
    text = json.dumps(ap.tool_schema())
    grammar = xgrammar.Grammar.from_json_schema(text)
    try:
        from sglang.srt.constrained.json_schema_validation import validate_xgrammar_json_schema
    except ImportError:
        validate_xgrammar_json_schema = None
    if validate_xgrammar_json_schema is not None:
        validate_xgrammar_json_schema(ap.tool_schema())
    accepts = getattr(__import__("xgrammar.testing").testing, "_is_grammar_accept_string", None)
    if accepts is None:
        pytest.skip("this xgrammar has no string matcher to test with")
    assert accepts(grammar, '{"tool": "calculator", "arguments": {"expression": "3 * 4.25"}}')
    assert accepts(grammar, '{"tool": "final_answer", "arguments": {}}')
    assert not accepts(grammar, '{"tool": "shell", "arguments": {}}')
    assert not accepts(grammar, '{"tool": "calendar", "arguments": {"item": "stapler"}}')
    assert not accepts(grammar, '{"tool": "calendar", "arguments": {"date": "2026-13-45"}}')


# --- the agent program, against a scripted stand-in for the server ----------------------------------------------

def scripted_backend(replies=None, meta=None):
    """A frontend backend that answers each generation from `replies` in order (or, without them, final_answer
    to a tool call and "Done." to the final answer) and records what it was asked."""
    pytest.importorskip("sglang")
    from sglang.lang.backend.base_backend import BaseBackend
    from sglang.lang.chat_template import get_chat_template

    class Scripted(BaseBackend):
        def __init__(self):
            super().__init__()
            self.chat_template = get_chat_template("chatml")
            self.asked = []
            self.replies = list(replies) if replies is not None else None

        def generate(self, s, sampling_params):
            self.asked.append((s.text_, sampling_params.json_schema, sampling_params.temperature,
                               sampling_params.max_new_tokens))
            if self.replies is not None:
                text = self.replies.pop(0)
            else:
                text = '{"tool": "final_answer", "arguments": {}}' if sampling_params.json_schema else "Done."
            return text, dict(meta or {"prompt_tokens": 100, "cached_tokens": 40, "completion_tokens": 10,
                                       "spec_verify_ct": 4, "spec_accept_length": 2.5,
                                       "finish_reason": {"type": "stop"}})

    return Scripted()


def test_the_agent_calls_tools_under_the_schema_feeds_results_back_and_answers_in_free_text(ap, tasks, world):
    task = next(t for t in tasks if t.id == "t01-order-total")
    replies = ['{"tool": "table_lookup", "arguments": {"item": "notebook"}}',
               '{"tool": "table_lookup", "arguments": {"item": "staplers"}}',
               '{"tool": "calculator", "arguments": {"expression": "3 * 4.25 + 2 * 8.5"}}',
               '{"tool": "final_answer", "arguments": {}}', "The total price is 29.75 EUR."]
    backend = scripted_backend(replies)
    run = ap.run_task(ap.agent_program(), backend, task, world, task.limit, 40)
    assert run.transcript == tuple(replies) and run.turns == 5
    assert run.tools == ("table_lookup", "table_lookup", "calculator", "final_answer")
    assert (run.errors, run.finished, run.solved) == (1, True, True)
    assert (run.tokens, run.prompt_tokens, run.cached_tokens, run.verify_steps, run.accepted) == (50, 500, 200, 20,
                                                                                                    50.0)
    schema = json.dumps(ap.tool_schema())
    assert [a[1] for a in backend.asked] == [schema] * 4 + [None]   # the final answer: free text
    assert all(a[2] == 0.0 and a[3] == 40 for a in backend.asked)   # greedy, the token limit given
    first, last = backend.asked[0][0], backend.asked[-1][0]
    assert first.startswith("<|im_start|>system\nYou solve the user's task with tools.")
    assert first.endswith(f"<|im_start|>user\n{task.goal}<|im_end|>\n<|im_start|>assistant\n")
    assert ("<|im_start|>user\ntable_lookup result: notebook: price_eur 4.25, in_stock 120, weight_kg 0.3<|im_end|>"
            in last)
    assert "<|im_start|>user\nerror: table_lookup: no item 'staplers'" in last
    assert "<|im_start|>user\ncalculator result: 29.75<|im_end|>" in last
    assert last.endswith(f"<|im_start|>user\n{ap.FINAL_PROMPT}<|im_end|>\n<|im_start|>assistant\n")
    assert backend.asked[2][0].startswith(backend.asked[1][0])   # each turn's prompt extends the last (radix cache)


def test_the_agent_stops_at_its_turn_limit_and_still_answers(ap, tasks, world):
    task = next(t for t in tasks if t.id == "t10-percent")
    call = '{"tool": "calculator", "arguments": {"expression": "0.15 * 240"}}'
    backend = scripted_backend([call] * 3 + ["It is 36."], meta={"prompt_tokens": 7, "completion_tokens": 3,
                                                                 "finish_reason": {"type": "length"}})
    run = ap.run_task(ap.agent_program(), backend, task, world, 3, 16)
    assert run.turns == 4 and run.tools == ("calculator",) * 3
    assert (run.finished, run.solved, run.errors, run.verify_steps, run.cached_tokens) == (False, False, 0, 0, 0)
    assert backend.asked[-1][0].endswith(f"<|im_start|>user\n{ap.OUT_OF_TURNS}<|im_end|>\n<|im_start|>assistant\n")


def test_agents_run_all_tasks_concurrently_and_return_them_in_order(ap, tasks, world):
    lines = []
    backend = scripted_backend()
    wall, runs = ap.run_agents(ap.agent_program(), backend, tasks[:5], world, 3, 8, 16, lines.append, "x")
    assert [r.id for r in runs] == [t.id for t in tasks[:5]] and wall > 0
    assert all(r.transcript == ('{"tool": "final_answer", "arguments": {}}', "Done.") and r.finished for r in runs)
    assert len(lines) == 5 and lines[-1].startswith("  x: 5/5 tasks done")
    assert len(backend.asked) == 10


# --- transcripts, tables, goals ----------------------------------------------------------------------------------

def runs_of(ap, texts: dict[str, tuple[str, ...]], seconds=1.0, solved=False):
    return tuple(ap.TaskRun(tid, seconds, tuple(t), ("final_answer",), 0, True, solved, 10 * len(t), 100, 60,
                            4 if len(t) > 1 else 0, 8.0 if len(t) > 1 else 0.0) for tid, t in texts.items())


def test_transcripts_are_compared_with_plain_entmtps_first_pass_at_the_same_agents(ap):
    from entmtp_sglang.bench.sglang_benchmark import PLAIN_ENTMTP, STOCK, STOCK_BF16

    specs = {s.name: s for s in (STOCK, STOCK_BF16, PLAIN_ENTMTP, ap.ENTMTP)}
    same = {"a": ("x", "y"), "b": ("z",)}
    other = {"a": ("x", "y2"), "b": ("z",)}
    reference = {}
    done = {n: ap.Pass(n, 0, 0, 1, 2.0, runs_of(ap, other if n == "entmtp" else same)) for n in specs}
    out = ap.compare_round(done, specs, reference)
    assert reference == {(1, "a"): ("x", "y"), (1, "b"): ("z",)}
    assert (out["plain-entmtp"].equal_to_plain, out["plain-entmtp"].compared) == (None, 0)   # made the reference
    assert (out["plain-stock-bf16"].equal_to_plain, out["plain-stock-bf16"].compared) == (None, 0)   # its own dtype
    assert (out["plain-stock"].equal_to_plain, out["plain-stock"].compared) == (2, 2)
    assert (out["entmtp"].equal_to_plain, out["entmtp"].compared) == (1, 2)
    again = ap.compare_round({n: ap.Pass(n, 0, 1, 1, 2.0, runs_of(ap, same)) for n in specs}, specs, reference)
    assert (again["plain-entmtp"].equal_to_plain, again["entmtp"].equal_to_plain) == (2, 2)   # now compared
    four = ap.compare_round({"entmtp": ap.Pass("entmtp", 0, 0, 4, 1.0, runs_of(ap, same))}, specs, reference)
    assert four["entmtp"].equal_to_plain is None   # no reference at 4 agents yet: not compared with 1 agent's
    assert ap.transcripts_equal(runs_of(ap, same), reference, 1) == (2, 2)
    assert ap.transcripts_equal(runs_of(ap, {"a": ("x",), "c": ("q",)}), reference, 1) == (0, 1)


def synthetic_run(ap):
    """Two waves, three repeats: the baselines in both, ENTMTP in the first, NGRAM in the second."""
    times = {  # (system, agents) -> seconds per repeat, per wave
        ("plain-stock-bf16", 1): [[30.0, 33.0, 36.0], [30.0, 30.0, 30.0]],
        ("plain-entmtp", 1): [[15.0, 16.0, 18.0], [15.0, 15.0, 15.0]],
        ("plain-stock", 1): [[20.0, 20.0, 20.0], [20.0, 20.0, 20.0]],
        ("entmtp", 1): [[10.0, 8.0, 12.0], None],
        ("ngram", 1): [None, [14.0, 15.0, 16.0]],
        ("plain-stock-bf16", 8): [[12.0] * 3, [12.0] * 3],
        ("plain-entmtp", 8): [[10.0] * 3, [10.0] * 3],
        ("plain-stock", 8): [[11.0] * 3, [11.0] * 3],
        ("entmtp", 8): [[8.0] * 3, None],
        ("ngram", 8): [None, [9.0] * 3],
    }
    passes = []
    for (system, agents), by_wave in times.items():
        for w, secs in enumerate(by_wave):
            for rep, s in enumerate(secs or []):
                texts = {"t1": ("a", "b"), "t2": ("c", "d", "e")}
                if system == "entmtp" and agents == 8 and rep == 2:
                    texts = {"t1": ("a", "b"), "t2": ("c", "d", "DIFFERENT")}
                runs = runs_of(ap, texts, seconds=s / 2, solved=system == "entmtp")
                compared = 0 if system in ("plain-stock-bf16",) or (system == "plain-entmtp" and (w, rep) == (0, 0)) \
                    else 2
                equal = None if not compared else (1 if "DIFFERENT" in runs[1].transcript else 2)
                passes.append(ap.Pass(system, w, rep, agents, s, runs, equal, compared))
    return passes


def test_the_table_pairs_each_pass_with_the_baselines_beside_it_and_states_the_goals(ap):
    passes = synthetic_run(ap)
    text = ap.table(passes)
    lines = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in text.splitlines()[2:]}
    # ENTMTP at 1 agent: over bf16 30/10, 36/12 = 3.0 and 33/8 = 4.125; over plain 1.5, 2.0, 1.5
    ent = lines[("1", "entmtp")]
    assert "| 10.0 | 5.0 |" in ent and "| 3.00x [3.00-4.12] | 1.50x [1.50-2.00] |" in ent, ent
    assert "| 60% | 2.00 | 6/6 | 2/2 |" in ent, ent
    # a baseline in both waves pairs with the other baseline of each wave: six ratios
    plain = lines[("1", "plain-entmtp")]
    assert "| 2.00x [2.00-" in plain and "] |  |" in plain and "| 10/10 |" in plain, plain
    bf16 = lines[("1", "plain-stock-bf16")]   # its own ratio left blank, its transcripts compared with nothing
    assert "| 30.0 | 15.0 |" in bf16 and "|  | 0.50x [0.49-0.50] |" in bf16 and "| - | 0/2 |" in bf16, bf16
    assert "| 15.0 |" in lines[("1", "ngram")] and "| 2.00x [" in lines[("1", "ngram")]
    assert list(lines)[:5] == [("1", n) for n in ("plain-stock", "plain-stock-bf16", "plain-entmtp", "entmtp",
                                                  "ngram")]
    said = ap.goals(passes)
    assert "`entmtp` at least 2.5x `plain-stock-bf16` with 1 agent: 3.00x [3.00-4.12] met" in said
    assert "`entmtp` at least 1.5x `plain-entmtp` with 1 agent: 1.50x [1.50-2.00] met" in said
    assert "`entmtp` at least 1.3x `plain-entmtp` with 8 agents: 1.25x [1.25-1.25] **NOT met**" in said
    assert "`entmtp`'s transcripts equal to `plain-entmtp`'s: 11/12 **NOT met**" in said
    assert "entmtp-cross" not in said   # not in the run: no goals for it
    one = [p for p in passes if p.agents == 1]
    assert "with 8 agents: not measured" in ap.goals(one) and "transcripts equal to `plain-entmtp`'s: 6/6 met" in \
        ap.goals(one)
    slow = [p if p.system != "entmtp" else ap.Pass(p.system, p.wave, p.repeat, p.agents, p.seconds * 2, p.runs,
                                                   p.equal_to_plain, p.compared) for p in one]
    assert "with 1 agent: 1.50x [1.50-2.06] **NOT met**" in ap.goals(slow)


def test_the_report_is_drawn_again_from_the_runs_json_lines(ap, tmp_path):
    passes = synthetic_run(ap)
    config = {"model": "smollm2-135m-instruct", "task_set": [{"id": "t1", "goal": "Goal one?", "limit": 3},
                                                             {"id": "t2", "goal": "Goal two?", "limit": 4}],
              "max_turns": 8, "max_new_tokens": 96, "seed": 0, "repeats": 3}
    ap.write(passes, tmp_path, config)
    again, meta = ap.read(tmp_path / "agent_pipeline.jsonl.gz")
    assert again == passes
    assert meta["model"] == "smollm2-135m-instruct" and meta["commit"] and "pass" not in meta
    md = (tmp_path / "agent_pipeline.md").read_text()
    assert md == ap.report(again, meta) + "\n"
    assert "3 repeat(s)" in md and "2 agent tasks" in md and ap.table(passes) in md and ap.goals(passes) in md
    assert "| t1: Goal one? | 10.0 s, 2 turns |" in md and "| 5.0 s, 2 turns, solved |" in md, md
    (tmp_path / "empty.jsonl").write_text(json.dumps({"kind": "config"}) + "\n")
    with pytest.raises(ValueError, match="no passes"):
        ap.read(tmp_path / "empty.jsonl")


def test_the_headline_gives_each_system_its_time_and_paired_gains_at_each_number_of_agents(ap):
    passes = synthetic_run(ap)
    text = ap.headline(passes, {"task_set": [{"id": "t1"}, {"id": "t2"}], "commit": "abcdef0123"})
    intro, table = text.split("\n\n")
    assert intro.startswith("2 agent tasks") and "with 1 and 8 agents at once, commit abcdef0" in intro
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
    assert list(rows)[:3] == ["plain-stock", "plain-stock-bf16", "plain-entmtp"]
    # ENTMTP with 1 agent: 10 s, 1.50x plain (paired medians), 3.00x stock bfloat16; 11 of 12 transcripts equal
    assert rows["entmtp"].startswith("| entmtp | 10.0 s **1.50x** (3.00x) | ") and rows["entmtp"].endswith(
        " | 11/12 |"), rows["entmtp"]
    assert "**1.00x**" in rows["plain-entmtp"] and rows["plain-stock-bf16"].endswith(" | - |")


def test_the_readme_agent_lines_are_the_committed_agent_run(ap):
    """README's agent table is what `bench/agent_pipeline.py --render ... --headline` draws from the committed run."""
    passes, meta = ap.read(ROOT / "bench" / "results" / "agent_pipeline" / "agent_pipeline.jsonl.gz")
    text = ap.headline(passes, meta)
    assert passes and "| entmtp |" in text
    assert text in (ROOT / "README.md").read_text(), "README's agent lines are not the committed run's:\n" + text


def test_the_kv_pool_holds_every_agents_conversation(ap):
    assert ap.kv_tokens(1, 3, 48) == 6000
    big = ap.kv_tokens(8, 8, 96)
    assert big % 1024 == 0 and big >= 8 * (ap.SYSTEM_BUDGET + 8 * (96 + ap.TURN_BUDGET) + 96)
    assert ap.kv_tokens(8, 8, 96) > ap.kv_tokens(4, 8, 96) > ap.kv_tokens(4, 3, 96)


def test_the_systems_are_the_issues_and_the_baselines_run_in_every_wave(ap):
    from entmtp_sglang.bench.sglang_benchmark import waves

    assert [s.name for s in ap.systems_for(["entmtp"])] == ["plain-stock", "plain-stock-bf16", "plain-entmtp",
                                                            "entmtp"]
    specs = ap.systems_for([s.name for s in ap.SYSTEMS])
    assert dict(ap.ENTMTP_CROSS.env) == {"ENTMTP_CROSS_SPANS": "1"} and ap.ENTMTP_CROSS.speculative == "ENTMTP"
    plan = waves(specs, ap.AT_ONCE, ap.EVERY_WAVE)
    assert [[s.name for s in w] for w in plan] == [
        ["plain-stock", "plain-stock-bf16", "plain-entmtp", "entmtp", "entmtp-cross"],
        ["plain-stock", "plain-stock-bf16", "plain-entmtp", "ngram"]]
    assert [s.dtype for s in specs] == [None, "bfloat16", None, None, None, None]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2's tokenizer, the one the bench's servers use (skipped where the model is not prepared)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_or_skip()))


def test_the_token_budgets_of_the_kv_pool_hold_the_prompts_and_the_tools_answers(ap, tasks, world,
                                                                                  smollm2_tokenizer):
    def tokens(turns, **kw):
        text = smollm2_tokenizer.apply_chat_template(turns, tokenize=False, **kw)
        return len(smollm2_tokenizer(text, add_special_tokens=False)["input_ids"])

    for t in tasks:
        head = [{"role": "system", "content": ap.system_prompt(world)}, {"role": "user", "content": t.goal}]
        n = tokens(head, add_generation_prompt=True)
        assert 200 < n <= ap.SYSTEM_BUDGET, (t.id, n)
    for p in ap.FILES.iterdir():
        answer = ap.respond(world, json.dumps({"tool": "read_file", "arguments": {"path": p.name}}))[1]
        n = tokens([{"role": "user", "content": answer}], add_generation_prompt=True)
        assert 20 < n <= ap.TURN_BUDGET, (p.name, n)


def test_a_failing_generation_stops_the_agent_with_a_clear_error(ap, tasks, world):
    """A server error (say an HTTP 400) is the benchmark's failure, not a tool error for the model to read."""
    backend = scripted_backend()

    def fail(s, sampling_params):
        raise RuntimeError("HTTP 400: the schema is not served")

    backend.generate = fail
    with pytest.warns(UserWarning), pytest.raises(ap.AgentError, match=r"t01-order-total: generation call0 failed: "
                                                                      r".*HTTP 400: the schema is not served"):
        ap.run_task(ap.agent_program(), backend, tasks[0], world, 3, 16)
