"""scripts/bench_speculative.py --set: the committed prompt set's shape and the per-category figures."""
import json

from conftest import ROOT
from scripts.bench_speculative import (CASES, load_prompt_set, missing_checkpoint, print_set_table,
                                       summarise_runs)

PROMPT_SET = ROOT / "data" / "speculative_prompts.json"


def test_the_prompt_set_has_six_categories_of_at_least_five_prompts():
    categories = json.loads(PROMPT_SET.read_text())["categories"]
    assert {"summarise", "edit_code", "document_qa", "multi_turn", "story", "unfollowed"} <= set(categories)
    for name, entry in categories.items():
        assert len(entry["prompts"]) >= 5, name
        for chat in entry["prompts"]:
            if isinstance(chat, list):  # a conversation ends on the user's turn, which the model answers
                assert [m["role"] for m in chat][-1] == "user" and all(m["content"] for m in chat)
            else:
                assert isinstance(chat, str) and chat
    assert len(load_prompt_set(PROMPT_SET, 2)) == 2 * len(categories)


def spec(tokens, s):
    return dict(identical=True, tokens=tokens, s=s, tokens_per_target_forward=1.0, histogram=[1, 0],
                plain_steps=0, proposed=1)


def test_the_lowest_prompt_ratio_sums_each_prompts_rounds():
    # prompt b is slower than plain in round 0 only; over both rounds a is the slower one
    runs = [dict(prompt="a", plain_tokens=10, plain_s=1.0, adaptive=spec(9, 1.0)),
            dict(prompt="a", plain_tokens=10, plain_s=1.0, adaptive=spec(9, 1.0)),
            dict(prompt="b", plain_tokens=10, plain_s=1.0, adaptive=spec(8, 1.0)),
            dict(prompt="b", plain_tokens=10, plain_s=1.0, adaptive=spec(12, 1.0)),
            dict(prompt="c", plain_tokens=0, plain_s=0.0, adaptive=spec(0, 0.0))]  # one token: no rate
    x = summarise_runs(runs, {"adaptive": True}, 1)["adaptive"]
    assert x["min_prompt"] == "a" and abs(x["min_prompt_ratio"] - 0.9) < 1e-9
    assert abs(x["speedup"] - 38 / 40) < 1e-9


def test_a_technique_without_its_checkpoints_is_reported_unavailable(capsys):
    assert "missing" in missing_checkpoint(dict(CASES["qwen"], target="no-such-model"))
    print_set_table([{"case": "qwen", "unavailable": "checkpoints/x is missing"}])
    assert "| all | qwen | unavailable: checkpoints/x is missing |" in capsys.readouterr().out
