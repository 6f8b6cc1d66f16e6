"""The serving harness (benchmarks/harness.py): its outputs' structure, never its timings.

The end-to-end test runs ``troupe bench`` on the tiny random model with tiny settings, both
servers and the in-process ceiling included (about 15 s), and checks the JSON, Markdown and
PNG it writes. The unit tests pin the statistics the goals are judged by.
"""

from __future__ import annotations

import importlib.util
import json
import struct
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


def load_harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location("harness", REPO / "benchmarks" / "harness.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["harness"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


harness = load_harness()

LEVEL_KEYS = {"tokens_per_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "errors",
              "requests", "tokens", "wall_s"}


@pytest.fixture(scope="module")
def bench_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    subprocess.run(
        [sys.executable, "-m", "troupe.api.cli", "bench", "--model", str(tiny_model_dir),
         "--concurrency", "1,2", "--max-tokens", "4", "--long-tokens", "64", "--streams", "2",
         "--warm-chunks", "3", "--stream-tokens", "256", "--reps", "1", "--out", str(out)],
        cwd=REPO, check=True, timeout=240, capture_output=True,
    )
    return out


def test_troupe_bench_writes_json_with_every_server_level_and_scenario(bench_run: Path) -> None:
    report: dict[str, Any] = json.loads((bench_run / "harness.json").read_text())
    med = report["median"]
    for name in ("mlx-troupe", "mlx_lm.server", "in-process"):
        assert set(med[name]["serving"]) == {"1", "2"}
        for level in med[name]["serving"].values():
            assert set(level) == LEVEL_KEYS
            assert level["errors"] == 0 and level["tokens"] > 0
            assert level["tokens_per_s"] > 0 and level["ttft_p50"] > 0
    for name in ("mlx-troupe", "mlx_lm.server"):
        prefix = med[name]["prefix"]
        assert prefix["cold"] > 0 and prefix["repeat"] > 0 and prefix["new_ending"] > 0
        assert prefix["prompt_tokens"] >= 64
        interference = med[name]["interference"]
        assert interference["errors"] == 0 and interference["long_ttft"] > 0
        assert interference["itl_p50_before"] is not None
        assert interference["itl_p99_during"] is not None
    assert set(report["ratios"]) == {"1", "2"}
    assert len(report["reps"]) == 1
    assert report["meta"]["reps"] == 1 and report["meta"]["concurrency"] == [1, 2]
    holds = {g["goal"]: g["holds"] for g in report["goals"]}
    # Levels this run did not measure are reported as such, not as passed or failed.
    assert holds["tok/s vs mlx_lm.server at c=16 ≥ 1.3x"] is None
    assert holds["tok/s vs mlx_lm.server at c=1 ≥ 1.0x"] in (True, False)


def test_troupe_bench_writes_markdown_tables_for_servers_ratios_and_goals(bench_run: Path) -> None:
    md = (bench_run / "harness.md").read_text()
    assert "| server | concurrency | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) " in md
    for row in ("| mlx-troupe | 1 |", "| mlx-troupe | 2 |", "| mlx_lm.server | 2 |",
                "| in-process runner (ceiling) | 1 |"):
        assert row in md
    assert "| concurrency | troupe / mlx_lm.server tok/s |" in md
    assert "prompt TTFT: cold (s) | repeated (s) | new ending (s) |" in md
    assert "during the long prefill" in md
    assert "| goal | measured | holds |" in md and "not measured" in md


def test_troupe_bench_writes_a_png_plot(bench_run: Path) -> None:
    png = (bench_run / "harness.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk
    assert width > height > 100
    assert (bench_run / "mlx-troupe-rep0.log").exists()
    assert (bench_run / "mlx_lm.server-rep0.log").exists()


def test_from_json_rewrites_the_report_without_running_anything(bench_run: Path,
                                                                 tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "harness.py"), "--from-json",
         str(bench_run / "harness.json"), "--out", str(tmp_path)],
        cwd=REPO, check=True, timeout=120, capture_output=True,
    )
    assert (tmp_path / "harness.md").read_text() == (bench_run / "harness.md").read_text()
    assert (tmp_path / "harness.png").stat().st_size > 0


def test_percentile_interpolates_and_is_none_without_values() -> None:
    assert harness.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert harness.percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert harness.percentile([], 50) is None


def test_median_tree_takes_medians_leafwise_and_skips_missing_values() -> None:
    reps = [{"a": {"x": 1.0, "y": None}, "s": "first"},
            {"a": {"x": 5.0, "y": 2.0}, "s": "second"},
            {"a": {"x": 3.0, "y": 4.0}, "s": "third"}]
    assert harness.median_tree(reps) == {"a": {"x": 3.0, "y": 3.0}, "s": "first"}


def test_a_stall_spanning_the_long_prefill_counts_as_during_it() -> None:
    steady = harness.Stream(sent=0.0, chunk_times=[1.0, 2.0, 3.0, 10.0, 11.0])
    late = harness.Stream(sent=0.0, chunk_times=[1.5, 2.5, 3.2, 3.4, 11.0])
    before, during = harness.split_gaps([steady, late], arrived=3.5, prefilled=9.0)
    # Before: gaps after both streams decode (from t=1.5) that ended by the arrival.
    assert sorted(before) == pytest.approx([0.2, 0.7, 1.0, 1.0])
    # During: the 3.0 -> 10.0 and 3.4 -> 11.0 stalls span the prefill; 10 -> 11 is after it.
    assert sorted(during) == pytest.approx([7.0, 7.6])


def test_an_answer_ended_by_its_first_token_still_has_a_first_token_time() -> None:
    """A random-weight model's greedy answer can be end-of-sequence at once: no content chunk,
    only the finish chunk. Its first token came then (the peer's late prompt in the
    interference scenario had a TTFT of None, and the run's structure check failed)."""
    empty = harness.Stream(sent=10.0, answered=10.5)
    assert empty.first_token == 10.5 and empty.ttft == 0.5
    spoken = harness.Stream(sent=10.0, chunk_times=[10.25, 10.3], answered=10.4)
    assert spoken.first_token == 10.25 and spoken.ttft == 0.25
    assert harness.Stream(sent=10.0).ttft is None


def test_a_baseline_commit_gets_its_own_ratios_to_the_peer_and_its_own_rows() -> None:
    """--baseline serves another checkout beside troupe in the same run: before and after are
    each compared with the peer of that run, and the tables name the baseline's commit."""
    def level(tps: float, p99: float) -> dict[str, float]:
        return {"tokens_per_s": tps, "ttft_p50": p99 / 2, "ttft_p99": p99, "itl_p50": 0.1,
                "itl_p99": 0.2, "errors": 0.0}

    rep = {harness.TROUPE: {"serving": {"4": level(30.0, 1.0)}},
           harness.BASELINE: {"serving": {"4": level(24.0, 2.0)}},
           harness.PEER: {"serving": {"4": level(20.0, 4.0)}}}
    ratios = harness.serving_ratios(rep)["4"]
    assert ratios["tokens_per_s_vs_peer"] == pytest.approx(1.5)
    assert ratios["baseline_tokens_per_s_vs_peer"] == pytest.approx(1.2)
    assert ratios["baseline_ttft_p99_vs_peer"] == pytest.approx(0.5)
    assert "baseline_tokens_per_s_vs_peer" not in harness.serving_ratios(
        {k: v for k, v in rep.items() if k != harness.BASELINE})["4"]
    meta = {"model": "m", "blas": "b", "cpus": 2, "cpu": "c", "loadavg_start": 1.0,
            "loadavg_end": 1.0, "reps": 1, "requests_per_client": 2, "max_tokens": 64,
            "wall_s": 60.0, "streams": 8, "baseline_rev": "abc1234"}
    md = harness.markdown({"median": rep, "meta": meta, "ratios": {"4": ratios},
                           "ratios_per_rep": [{"4": ratios}], "goals": []})
    assert "| mlx-troupe at abc1234 (baseline) | 4 | 24.0 |" in md
    assert "| 4 | 1.50 | 1.20 | 0.25 | 0.50 |" in md
