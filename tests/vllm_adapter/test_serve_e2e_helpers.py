"""The pure parts of tests/gpu/vllm_serve_e2e.py (the served check runs only on a GPU)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
import vllm_serve_e2e as serve  # noqa: E402

PAIR = Path(__file__).resolve().parents[1] / "fixtures" / "models"

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="pair"} 0.0
vllm:spec_decode_ddtree_num_trees_total{engine="0",model_name="pair"} 54.0
vllm:spec_decode_ddtree_num_accepted_tokens_per_depth_total{depth="1",engine="0",model_name="pair"} 44.0
vllm:spec_decode_ddtree_num_accepted_tokens_per_depth_total{depth="2",engine="0",model_name="pair"} 24.0
vllm:kv_cache_usage_perc{engine="0",model_name="pair"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="pair"} 0.5
"""


def test_metric_values_are_read_by_name_and_labels():
    assert serve.metric_value(METRICS, "vllm:num_requests_running") == 0.0
    assert serve.metric_value(METRICS, "vllm:spec_decode_ddtree_num_trees") == 54.0  # the _total sample
    per_depth = "vllm:spec_decode_ddtree_num_accepted_tokens_per_depth"
    assert serve.metric_value(METRICS, per_depth, {"depth": "2"}) == 24.0
    assert serve.metric_value(METRICS, per_depth) == 68.0
    assert serve.metric_value(METRICS, "vllm:kv_cache_usage_perc") == 0.75  # summed over engines
    assert serve.metric_value(METRICS, "vllm:num_requests_waiting") is None


def test_a_stop_string_is_cut_where_it_first_occurs():
    text = "abcabcabcabc: return x + y\n"
    assert serve.stop_string_from(text) == ": re"  # from character 12 on, its first occurrence
    assert serve.stop_string_from("abcdefghijklabcdxyzw") == "bcdx"  # "abcd" at 12 also starts the text
    assert serve.stop_string_from("aaaaaaaaaaaaaaaaaaaa") is None  # every window occurs earlier too


def test_first_difference_and_tracebacks_after_a_marker():
    assert serve.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert serve.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert serve.first_difference([1, 2], [1, 2, 3]) == 2
    log = "Traceback (most recent call last)\n[vllm_serve_e2e] refusals-1\nINFO 400 Bad Request\n"
    assert serve.tracebacks_after(log, "refusals-1") == 0
    assert serve.tracebacks_after(log + "Traceback (most recent call last)\n", "refusals-1") == 1
    assert serve.tracebacks_after(log, "missing") == -1


def test_the_served_command_is_the_readmes_with_vllms_defaults():
    command = serve.serve_command("/pair", "ddtree", 64, 8011)
    assert command[command.index("serve") + 1] == "/pair/target"
    spec = json.loads(command[command.index("--speculative-config") + 1])
    assert spec == {"method": "ddtree", "model": "/pair/drafter", "ddtree_budget": 64}
    assert "--language-model-only" in command
    assert not any(flag in command for flag in ("--max-num-seqs", "--max-num-batched-tokens", "--enforce-eager"))
    assert "--speculative-config" not in serve.serve_command("/pair", "plain", 64, 8011)
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert '"method": "ddtree"' in readme and "--language-model-only" in readme


def test_the_pairs_tokenizer_has_a_chat_template():
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(PAIR / "target"))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "def fibonacci(n):"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "# user:\ndef fibonacci(n):\n# assistant:\n"


def test_refusals_expected_differ_by_engine():
    # Plain vLLM serves structured outputs; a ddtree server only with DDTREE_STRUCTURED_OUTPUTS=1. Both refuse an
    # oversized max_tokens.
    assert serve.expected_refusal_statuses("ddtree") == {"structured_output": 200, "max_tokens": 400}
    assert serve.expected_refusal_statuses("ddtree", False) == {"structured_output": 400, "max_tokens": 400}
    assert serve.expected_refusal_statuses("plain", False) == {"structured_output": 200, "max_tokens": 400}
    assert serve.serve_environment("ddtree", True)["DDTREE_STRUCTURED_OUTPUTS"] == "1"
    assert "DDTREE_STRUCTURED_OUTPUTS" not in serve.serve_environment("plain", True)


@pytest.mark.parametrize(
    "kind, text, valid",
    [
        ("json_schema", '{"name": "fib", "count": 3}', True),
        ("json_schema", '{"name": "fib", "count": 3.5}', False),
        ("json_schema", '{"name": "fib"}', False),
        ("json_schema", '{"name": "fib", "count": 3', False),
        ("json_schema", '{"name": "a name longer than sixteen", "count": 1}', False),
        ("regex", "return the value.", True),
        ("regex", "return the value", False),
        ("regex", "Return the value.", False),
        ("choice", "memoization", True),
        ("choice", "memo", False),
    ],
)
def test_structured_outputs_are_checked_against_their_grammars(kind, text, valid):
    assert serve.structured_output_valid(kind, text) is valid


def test_the_scheduling_mode_is_read_from_the_engines_start_up_line():
    line = (
        "INFO 12-02 10:01:03 [runner.py:297] DDTree: budget 64, drafter depth 15, top-K 64; tree walk on the device "
        "(DDTREE_DEVICE_ACCEPT), trees built at the next verification (DDTREE_LATE_TREES), {} scheduling "
        "(DDTREE_ASYNC_SCHEDULING)\n"
    )
    assert serve.scheduling_in_log("noise\n" + line.format("asynchronous")) == "asynchronous"
    assert serve.scheduling_in_log(line.format("synchronous")) == "synchronous"
    assert serve.scheduling_in_log("INFO no ddtree line here\n") is None
    # The runner still writes the line this check reads.
    runner_source = (Path(__file__).resolve().parents[2] / "python" / "ddtree" / "vllm" / "runner.py").read_text()
    assert '"at %s (DDTREE_LATE_TREES), %s scheduling (DDTREE_ASYNC_SCHEDULING)"' in runner_source


def test_the_what_if_line_is_read_from_the_server_log():
    from ddtree.vllm.what_if import WhatIfAcceptance

    what_if = WhatIfAcceptance()
    what_if.chain_trees, what_if.chain_accepted_own, what_if.chain_accepted = 10, 25, 12
    log = f"INFO [runner.py:1030] {what_if.log_line()}\nnoise\n"  # the runner's own line
    assert serve.what_if_in_log(log) == {"trees": 10, "acceptance_length": 3.5, "chain_acceptance_length": 2.2}
    assert serve.what_if_in_log("INFO nothing here\n") is None
