"""scripts/bench.py's protocol: compared runs back to back, ratios taken within a round; its
--shape runs, as scripts/gpu_session.sh stages them."""
import json
import os
import subprocess
import sys

from conftest import ROOT
from scripts.bench import engine_jobs, round_order, summarize


class Args:
    engines, dtypes, quantized, llama_quants = ["ours", "llama"], ["float32", "bfloat16"], ["int8"], ["Q8_0"]


def test_compared_runs_are_back_to_back_and_take_turns_first():
    jobs = engine_jobs(Args, llama_ok=True)
    firsts = set()
    for rnd in range(4):
        order = round_order(jobs, rnd)
        assert sorted(order) == sorted(jobs)
        for ours, peer in (("float32", "F32"), ("bfloat16", "BF16"), ("int8", "Q8_0")):
            i, j = order.index(("ours", ours)), order.index(("llama", peer))
            assert abs(i - j) == 1
            firsts.add((ours, i < j))
    assert len(firsts) == 6  # each pair has had each engine first


def run(engine, dtype, rnd, tok_s, ttft):
    sample = {"decode_tokens_per_s": tok_s, "ttft_s": ttft, "new_tokens": 8}
    return {"engine": engine, "dtype": dtype, "round": rnd, "runs": {"short": [sample], "long": [sample]}}


def test_ratio_is_the_median_of_each_rounds_ratio():
    # the machine is three times as fast in round 1: the ratio of the medians (11 / 12) would
    # hide that ours won two rounds of three
    raw = [run("ours", "float32", 0, 10, 1.0), run("llama", "F32", 0, 12, 1.2),
           run("llama", "F32", 1, 20, 0.5), run("ours", "float32", 1, 30, 0.4),
           run("ours", "float32", 2, 11, 0.9), run("llama", "F32", 2, 10, 1.8)]
    rows = {r["engine"]: r for r in summarize(raw, [{"gb_s": 30.0}], 8)}
    assert rows["llama"]["ours_decode_ratio"] == 11 / 10
    assert rows["llama"]["ours_ttft_short_speedup"] == 1.25
    assert rows["ours"]["ours_decode_ratio"] is None
    assert rows["ours"]["decode_tokens_per_s"] == 11


def write_gguf(path, names):
    import gguf
    import numpy as np
    w = gguf.GGUFWriter(str(path), "llama")
    for name in names:
        w.add_tensor(name, np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_ab_decode_reports_the_median_round_ratio_and_its_interval():
    """scripts.ab_decode: per weight setting, the median of the rounds' after/before ratios, the
    rounds where after was ahead (lower is better for TTFT), and a bootstrap interval around it."""
    from scripts.ab_decode import summary
    rounds = [{"weights": "int8", "after": {"decode": a, "ttft_ms": 10.0}, "before": {"decode": 100.0, "ttft_ms": t}}
              for a, t in ((90.0, 8.0), (105.0, 12.0), (110.0, 12.0), (98.0, 9.0), (102.0, 11.0))]
    rounds.append({"weights": "float32", "after": {"decode": 1.0, "ttft_ms": 1.0}, "before": {"decode": 9.0, "ttft_ms": 1.0}})
    decode = summary(rounds, "int8", "decode", True)
    assert decode["median_ratio"] == 1.02 and decode["rounds"] == 5 and decode["rounds_after_ahead"] == 3
    assert 0.9 <= decode["ci95"][0] <= 1.02 <= decode["ci95"][1] <= 1.1
    ttft = summary(rounds, "int8", "ttft_ms", False)
    assert ttft["rounds_after_ahead"] == 3 and abs(ttft["median_ratio"] - 10 / 11) < 1e-12


def test_ab_paired_inverts_the_latency_ratio_and_brackets_it():
    """scripts.ab_paired: decode speed after/before is median(before latency) / median(after
    latency), its interval from resampling each side around it (one round)."""
    from scripts.ab_paired import rounds_ratio
    after, before = [7.0, 7.1, 7.2, 6.9, 7.0, 9.0], [6.9, 7.0, 6.8, 7.0, 6.9, 6.5]
    ratio, (low, high) = rounds_ratio([(after * 5, before * 5)])
    assert abs(ratio - 6.9 / 7.05) < 1e-12  # the medians: 6.9 before, 7.05 after
    assert low <= ratio <= high and high - low < 0.1


def test_ab_paired_rounds_take_the_geometric_mean_and_widen_by_their_spread():
    """scripts.ab_paired --rounds: two rounds at 0.9 and 1.1 give their geometric mean, and an
    interval as wide as the rounds disagree, however tight each round's samples are."""
    from scripts.ab_paired import rounds_ratio
    rounds = [([10.0] * 20, [9.0] * 20), ([10.0] * 20, [11.0] * 20)]
    ratio, (low, high) = rounds_ratio(rounds)
    assert abs(ratio - (0.9 * 1.1) ** 0.5) < 1e-12
    assert abs(low - 0.9) < 1e-9 and abs(high - 1.1) < 1e-9


def test_peer_bytes_count_an_untied_embedding_table_as_one_row(tmp_path):
    from scripts.bench_peers import gguf_tensor_bytes
    tied = write_gguf(tmp_path / "tied.gguf", ["token_embd.weight", "blk.0.ffn_up.weight"])
    untied = write_gguf(tmp_path / "untied.gguf", ["token_embd.weight", "output.weight", "blk.0.ffn_up.weight"])
    assert gguf_tensor_bytes(tied) == 2 * 128  # the table is the head: read whole
    assert gguf_tensor_bytes(untied) == 2 * 128  # the head and the layer; one row of the table, not counted


def test_gpu_session_shapes_stage_rehearses_on_the_cpu(tmp_path):
    """scripts/gpu_session.sh's 7B stage, end to end on the CPU with the tiny shape: every process
    builds, compiles side by side, times in turn and reports; the profiles come back in one file."""
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, DEVICE="cpu", SHAPES="tiny", DTYPE="float32",
               QUANT="int8,int4-g32", BATCHES="1,2", NEW="8")
    r = subprocess.run(["bash", "scripts/gpu_session.sh", "shapes:300"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads((tmp_path / "shapes.json").read_text())["rows"]
    assert [(row["precision"], row["batch_size"]) for row in rows] == \
        [("float32", 1), ("int8", 1), ("int4-g32", 1), ("float32", 2)]
    assert all(row["decode_tokens_per_s"] > 0 and row["bandwidth_fraction"] > 0 and len(row["samples"]) == 4
               and all(s["new_tokens"] == 8 * row["batch_size"] for s in row["samples"]) for row in rows), rows
    profiles = (tmp_path / "profiles.txt").read_text()
    assert profiles.count("=== tiny-") == 4 and "q4_linear" in profiles
