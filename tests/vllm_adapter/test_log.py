"""ddtree's info lines reach vLLM's log handler (a logger outside vLLM's ``vllm`` tree would lose them)."""

import logging

import pytest

pytest.importorskip("vllm")

from ddtree.vllm.log import get_logger  # noqa: E402


def test_info_lines_reach_the_handler_vllm_configured():
    import vllm.logger  # noqa: F401  (configures the "vllm" logger, as in every vLLM process)

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    parent = logging.getLogger("vllm")
    handler, level = Keep(level=logging.INFO), parent.level
    parent.addHandler(handler)
    parent.setLevel(logging.INFO)
    try:
        log = get_logger("ddtree.vllm.patches")
        log.info("DDTree: %s=%r (%s)", "max_num_seqs", 32, "why")
    finally:
        parent.removeHandler(handler)
        parent.setLevel(level)
    assert log.name == "vllm.ddtree.patches"
    assert [r.getMessage() for r in records] == ["DDTree: max_num_seqs=32 (why)"]
