"""The agent-session replay (benchmarks/sessions.py): its report's structure and what the
cache did, never its timings.

The end-to-end test replays two tiny sessions of three turns against ``troupe serve`` on the
tiny random model (about 15 s): a restart after the first turn, and the second session idle
before its last turn while RAM is tight enough to evict it. The unit tests pin the scripted
workload and the streaming client's bookkeeping.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import sessions  # noqa: E402
import sessions_workload  # noqa: E402

TURN_KEYS = {"session", "turn", "kind", "message_tokens", "ttft", "duration", "sent", "cached",
             "computed", "completion_tokens", "tool_calls", "at", "error", "phase", "alone"}


@pytest.fixture(scope="module")
def replay(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sessions")
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "sessions.py"), "--model",
         str(tiny_model_dir), "--servers", "troupe", "--sessions", "2", "--turns", "3",
         "--restart-after", "1", "--tools", "1", "--system-tokens", "800",
         "--context-tokens", "1400", "--message-tokens", "40,120", "--max-tokens", "4",
         "--out", str(out)],
        cwd=REPO, check=True, timeout=240, capture_output=True,
    )
    return out


@pytest.fixture(scope="module")
def run(replay: Path) -> dict[str, Any]:
    report = json.loads((replay / "sessions.json").read_text())
    (only,) = report["runs"]
    return only


def test_every_session_plays_every_turn_without_errors(run: dict[str, Any]) -> None:
    assert run["server"] == "mlx-troupe" and run["sessions"] == 2
    assert [(r["session"], r["turn"]) for r in run["turns"]] == [
        (s, t) for s in (0, 1) for t in (1, 2, 3)]
    for r in run["turns"]:
        assert set(r) == TURN_KEYS
        assert r["error"] is None and r["ttft"] > 0 and r["sent"] > 0
    assert run["summary"]["errors"] == 0 and run["summary"]["cached_tokens_reported"]


def test_later_turns_take_the_conversation_from_the_cache(run: dict[str, Any]) -> None:
    first = [r for r in run["turns"] if r["turn"] == 1]
    # The first session's first turn is cold (a later one may find the shared system prompt).
    assert max(r["computed"] for r in first) >= first[0]["sent"] - 1
    for r in run["turns"]:
        if r["turn"] > 1:
            # Everything but the new message (and a partial block) comes from the cache.
            assert r["cached"] > r["sent"] / 2 and r["computed"] == r["sent"] - r["cached"]


def test_after_the_restart_the_cache_hits_from_disk(run: dict[str, Any]) -> None:
    assert run["restart_s"] > 0
    restart_turn = [r for r in run["turns"] if r["turn"] == 2]
    assert {r["phase"] for r in restart_turn} == {"post"}
    # A fresh process has nothing in RAM: what it takes from the cache it read from disk,
    # whole blocks of the previous turn's prompt (the tail of a block stays in RAM only).
    for r in restart_turn:
        first = next(p for p in run["turns"] if p["session"] == r["session"] and p["turn"] == 1)
        assert r["cached"] >= (first["sent"] // 64 - 1) * 64


def test_the_idle_session_was_evicted_from_ram_and_read_back_from_disk(
        run: dict[str, Any]) -> None:
    idle = run["idle"]
    assert idle["session"] == 1 and idle["turn"] == 3
    assert idle["evicted"] is True and idle["disk_blocks_read"] > 0
    assert idle["cached"] > idle["sent"] / 2  # read back, not recomputed
    assert run["cache_ram_max"] > 0
    lone = [r for r in run["turns"] if r["alone"]]
    assert [(r["session"], r["turn"]) for r in lone] == [(1, 3)]


def test_the_report_has_summary_per_turn_tables_goals_and_a_plot(replay: Path,
                                                                  run: dict[str, Any]) -> None:
    summary = run["summary"]
    assert set(summary["per_turn"]) == {"1", "2", "3"}
    assert summary["tokens_computed"] < summary["tokens_sent"]
    assert summary["ttft_median"] > 0 and summary["restart_turn_ttft"] > 0
    md = (replay / "sessions.md").read_text()
    assert "| sessions | server | turn 1 TTFT (s) | median TTFT, turns 2-3 (s) |" in md
    assert "| 2 (restart) |" in md and "| 2 | mlx-troupe | 3 |" in md
    assert "| goal | measured | holds |" in md
    png = (replay / "sessions.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert width > height > 100
    assert (replay / "mlx-troupe-n2.log").exists()


def test_from_json_rewrites_the_report_without_running_anything(replay: Path,
                                                                tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "sessions.py"), "--from-json",
                    str(replay / "sessions.json"), "--out", str(tmp_path)],
                   cwd=REPO, check=True, timeout=120, capture_output=True)
    assert (tmp_path / "sessions.md").read_text() == (replay / "sessions.md").read_text()


def test_workload_is_the_same_for_a_seed_and_sessions_differ_after_the_system_prompt(
        tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    kw = {"sessions": 3, "turns": 4, "system_tokens": 800, "context_tokens": 1500,
          "message_tokens": (40, 120), "max_tokens": 4, "tools": 1}
    a = sessions_workload.make_workload(tok, seed=7, **kw)
    b = sessions_workload.make_workload(tok, seed=7, **kw)
    c = sessions_workload.make_workload(tok, seed=8, **kw)
    assert [s.turns for s in a.sessions] == [s.turns for s in b.sessions]
    assert [s.turns for s in a.sessions] != [s.turns for s in c.sessions]
    firsts = [s.turns[0].messages[0]["content"] for s in a.sessions]
    assert len({f[:20] for f in firsts}) == 3  # each its own from the first words on
    assert all(f.startswith(f"Session {s.tag}.") for f, s in zip(firsts, a.sessions,
                                                                  strict=True))
    for s in a.sessions:
        assert s.turns[0].kind == "user"
        for turn in s.turns:
            assert 40 <= turn.tokens <= 120
            if turn.kind == "tool":
                call, result = turn.messages
                assert call["tool_calls"][0]["id"] == result["tool_call_id"]


def test_message_sizes_stay_in_bounds_and_add_up_to_the_budget() -> None:
    import random

    sizes = sessions_workload.message_sizes(random.Random(0), 12, 100, 600, 4000)
    assert len(sizes) == 12 and all(100 <= n <= 600 for n in sizes)
    assert abs(sum(sizes) - 4000) <= 12


def test_streamed_tool_call_deltas_fold_into_whole_calls_and_get_answered() -> None:
    calls: dict[int, dict[str, Any]] = {}
    for delta in ({"index": 0, "id": "c1", "function": {"name": "grep", "arguments": ""}},
                  {"index": 0, "function": {"arguments": '{"pattern": '}},
                  {"index": 0, "function": {"arguments": '"x"}'}}):
        sessions.merge_call(calls, delta)
    assert calls[0]["function"] == {"name": "grep", "arguments": '{"pattern": "x"}'}
    answer = sessions.Answer(sent=0.0, tool_calls=[calls[0]])
    kept = sessions.history_after(answer)
    assert kept[0]["tool_calls"][0]["id"] == "c1" and kept[1]["tool_call_id"] == "c1"
    assert sessions.history_after(sessions.Answer(sent=0.0, content="hi")) == [
        {"role": "assistant", "content": "hi"}]


def test_peers_get_the_tools_as_troupe_writes_them_and_troupe_gets_openai_tools() -> None:
    tools = sessions_workload.TOOLS[:2]
    work = sessions_workload.Workload({"role": "system", "content": "Be brief."}, tools, [], 0)
    messages = [work.system, {"role": "user", "content": "find it"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "grep", "arguments": '{"pattern": "x"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "a.py:1"}]
    assert sessions.request_prompt(sessions.TROUPE, messages, work) == {
        "messages": messages, "tools": tools}
    peer = sessions.request_prompt(sessions.LLAMACPP, messages, work)
    assert set(peer) == {"messages"}
    system, user, call, result = peer["messages"]
    assert system["content"].startswith("Be brief.")
    assert all(t["function"]["name"] in system["content"] for t in tools)
    assert call == {"role": "assistant",
                    "content": '<tool_call>\n{"name": "grep", "arguments": {"pattern": "x"}}'
                               '\n</tool_call>'}
    assert result == {"role": "user", "content": "<tool_response>\na.py:1\n</tool_response>"}


def test_the_control_without_a_restart_reports_the_same_split_as_no_goal(
        replay: Path, tmp_path: Path) -> None:
    saved = json.loads((replay / "sessions.json").read_text())
    meta = {**saved["meta"], "no_restart": True}
    report = sessions.write_report(tmp_path, meta, saved["runs"])
    (split,) = [g for g in report["goals"] if "after" in g["goal"]]
    assert split["control"] and split["holds"] is None
    md = (tmp_path / "sessions.md").read_text()
    assert "no restart (the control): the sessions wait for each other after turn 1" in md
    assert "| 2 (barrier) |" in md and "before the barrier, 2-1" in md
    assert "(the control) |" in md and "≤ 1.5x" not in md
    assert sessions.parse_args(["--no-restart"]).no_restart
