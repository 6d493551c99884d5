"""The conversation bench's smoke run (tiny preset, 2 short turns): each way reports every turn, only the
way that keeps the prompt KV reuses positions, on the second turn."""

from loadtest.conversation_bench import WAYS, main


def test_the_smoke_run_reports_each_way_and_only_all_kept_reuses(tmp_path):
    report = main(["--turns", "2", "--clip-s", "1", "--repeats", "1", "--max-tokens", "2", "--out",
                   str(tmp_path / "c.json")])  # fmt: skip
    by_way = report["by_way"]
    assert set(by_way) == set(WAYS) and all(len(rows) == 2 for rows in by_way.values())
    assert [row["reused_positions"] for row in by_way["all_kept"]][1] > 100
    assert all(row["reused_positions"] == 0 for way in ("nothing_kept", "clips_kept") for row in by_way[way])
    assert (tmp_path / "c.json").exists()
