"""min_tokens for tree steps, from the engine's counts (``ddtree.vllm.min_tokens``)."""

import numpy as np

from ddtree.vllm.min_tokens import MinTokensRequests


def _pending(requests, computed, scheduled, prompt, rows):
    index = {"tree": 0, "plain": 1, "prefill": 2}
    return requests.pending(index, 3, np.array(computed), np.array(scheduled), np.array(prompt), rows)


def test_what_each_request_still_needs_follows_its_token_counts():
    requests = MinTokensRequests()
    for req_id in ("tree", "plain", "prefill"):
        requests.add(req_id, 10, {7, 2})
    # "tree": 20-token prompt, 24 computed, a tree of 1 + 6 scheduled tokens sampled at its 7 rows: 5 generated
    # (the root is the last of them). "plain": 5 generated, sampled at its one scheduled token. "prefill": the
    # last chunk of a 30-token prompt, whose row samples the first output.
    got = _pending(requests, [24, 14, 20], [7, 1, 10], [20, 10, 30], [7, 1, 1])
    assert got == [(0, 5, (2, 7)), (1, 5, (2, 7)), (2, 10, (2, 7))]
    # A prompt chunk before the last samples nothing that counts: it still needs all of them.
    assert _pending(requests, [24, 14, 10], [7, 1, 10], [20, 10, 30], [7, 1, 1])[2] == (2, 10, (2, 7))


def test_a_request_leaves_once_it_has_generated_its_min_tokens():
    requests = MinTokensRequests()
    requests.add("tree", 5, [3])
    assert _pending(requests, [23, 0, 0], [7, 0, 0], [20, 0, 0], [7, 1, 1]) == [(0, 1, (3,))]  # 4 generated
    assert _pending(requests, [24, 0, 0], [7, 0, 0], [20, 0, 0], [7, 1, 1]) == []  # 5 generated
    assert len(requests) == 0


def test_only_requests_that_need_it_are_kept_and_finished_ones_go():
    requests = MinTokensRequests()
    requests.add("none", 0, [3])
    requests.add("no-stops", 4, set())
    requests.add("kept", 4, [3])
    assert len(requests) == 1
    # Not in this step (preempted): kept, not reported.
    assert requests.pending({}, 3, np.zeros(3), np.zeros(3), np.zeros(3), [1, 1, 1]) == []
    assert len(requests) == 1
    requests.discard(["kept", "unknown"])
    assert len(requests) == 0


def test_counts_stay_exact_where_vllms_output_lists_are_inflated_under_asynchronous_scheduling():
    """Under asynchronous scheduling vLLM extends a request's output list by the previous step's drafts (a whole
    tree) before its processor looks, and corrects ``num_computed_tokens_cpu`` after the forward launch. The
    count here reads the corrected computed tokens only: 3 generated of 24 needs 21, whatever the list says."""
    requests = MinTokensRequests()
    requests.add("tree", 24, range(2, 12))
    inflated_output_list = [5, 6, 7] + [-1] * 64  # what vLLM's processor would measure: 67 >= 24, dropped
    assert len(inflated_output_list) >= 24
    got = requests.pending({"tree": 0}, 1, np.array([102]), np.array([65]), np.array([100]), [65])
    assert got == [(0, 21, tuple(range(2, 12)))]
