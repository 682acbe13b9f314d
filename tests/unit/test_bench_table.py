import pytest

from dilocox.bench.harness import compare, format_table, load_bench


def summary(loss, tps, wan, equiv, hidden=None, tokens=1000):
    return {
        "final_eval_loss": loss, "tokens_per_s": tps, "wan_bytes_total": wan, "allreduce_equiv_bytes": equiv,
        "hidden_comm_fraction": hidden, "tokens": tokens, "wall_s": 10.0, "flavor": "tiny", "num_params": 5,
        "num_clusters": 2, "dp_degree": 1, "pp_degree": 1, "bandwidth": "1Gbps", "latency": "10ms",
    }  # fmt: skip


def test_compare_against_the_baseline():
    base = summary(4.0, 100.0, 8000, 8000)
    row = compare(summary(4.1, 250.0, 80, 8000, hidden=0.95), base)
    assert row["gap_to_baseline_pct"] == pytest.approx(2.5)
    assert row["speedup_vs_baseline"] == pytest.approx(2.5)
    assert row["compression_vs_allreduce"] == pytest.approx(100)
    assert row["wan_bytes_per_token"] == pytest.approx(0.08)
    assert compare(base, base)["gap_to_baseline_pct"] == 0
    assert compare(base, None)["speedup_vs_baseline"] is None


def test_table_has_a_row_per_run_with_the_columns():
    base = summary(4.0, 100.0, 8000, 8000)
    runs = []
    for name, s in (("allreduce", base), ("dilocox", summary(4.1, 250.0, 80, 8000, hidden=0.95))):
        runs.append({"name": name, "label": name, "summary": s, **compare(s, base)})
    table = format_table(
        {
            "bench": "t",
            "source": "x.toml",
            "date": "2026-11-21",
            "baseline": "allreduce",
            "base_config": "c.toml",
            "common_overrides": [],
            "runs": runs,
        }
    )
    lines = table.splitlines()
    assert lines[0].startswith("| run | eval loss | gap to allreduce | tokens/s |")
    assert lines[2] == "| allreduce | 4.0000 | 0.00% | 100 | 1.00x | 8.0 | 1/1 | - | 10.0 |"
    assert lines[3] == "| dilocox | 4.1000 | +2.50% | 250 | 2.50x | 0.1 | 1/100 | 95% | 10.0 |"
    assert "tiny (5 params), 2 clusters" in table


def test_bench_file_errors(tmp_path):
    path = tmp_path / "b.toml"
    path.write_text("[bench]\nbase = 'x.toml'\n")
    with pytest.raises(ValueError, match="no \\[\\[runs\\]\\]"):
        load_bench(path)
    path.write_text("[bench]\nbase = 'x.toml'\nbaseline = 'ar'\n[[runs]]\nname = 'diloco'\n")
    with pytest.raises(ValueError, match="baseline 'ar' is not one of the runs"):
        load_bench(path)
    path.write_text("[bench]\nbase = 'x.toml'\ncolour = 1\n[[runs]]\nname = 'a'\n")
    with pytest.raises(ValueError, match="unknown keys"):
        load_bench(path)
    with pytest.raises(ValueError, match="no such file"):
        load_bench(tmp_path / "missing.toml")
