"""Every CUDA event the adapter records per step names its stream.

``torch.cuda.Event.record()`` without a stream looks the current stream up through torch, which builds a Stream
object each call: 9 us with the device idle and 29 us behind a deep launch queue on an H100, against 2 and 7 us
with the stream given (``benches/results/gpu-h100-event-stream-33a1deb``). The engine's queue is deep, and the
batch-1 step records about one event a step, so the adapter records on ``ddtree.vllm.streams.current_stream()``
(vLLM's kept stream, stored first from torch's in a thread where nothing set one) and hands that function to the
torch-only helpers (``StepStaging``, ``PathRing``).
"""

import ast
import pathlib
import threading

import torch

import ddtree.vllm
from ddtree.vllm import streams

ADAPTER = pathlib.Path(ddtree.vllm.__file__).parent
#: The torch-only helpers that record events: they take the stream lookup as ``current_stream``.
RECORDING_HELPERS = {"StepStaging", "PathRing"}


def _calls(tree: ast.AST):
    return (node for node in ast.walk(tree) if isinstance(node, ast.Call))


def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _sources():
    for path in sorted(ADAPTER.glob("*.py")):
        yield path.name, ast.parse(path.read_text(), filename=str(path))


def test_no_record_call_in_the_adapter_leaves_the_stream_to_torch():
    bare = [
        f"{name}:{call.lineno}"
        for name, tree in _sources()
        for call in _calls(tree)
        if isinstance(call.func, ast.Attribute) and call.func.attr == "record" and not call.args and not call.keywords
    ]
    assert bare == [], f"Event.record() without a stream (give it current_stream()): {bare}"


def test_no_record_call_in_the_adapter_asks_torch_for_the_stream():
    slow = [
        f"{name}:{call.lineno}"
        for name, tree in _sources()
        for call in _calls(tree)
        if isinstance(call.func, ast.Attribute)
        and call.func.attr == "record"
        and any("torch.cuda.current_stream" in ast.unparse(arg) for arg in call.args)
    ]
    assert slow == [], f"Event.record(torch.cuda.current_stream()) is the slow lookup: {slow}"


def test_only_the_streams_module_takes_vllms_lookup_itself():
    # vLLM's current_stream() makes a new stream current in a thread where nothing set one (an eager engine's
    # first step): ddtree.vllm.streams stores torch's present stream first.
    direct = [
        f"{name}:{node.lineno}"
        for name, tree in _sources()
        if name != "streams.py"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and node.module == "vllm.utils.torch_utils"
        and any(alias.name == "current_stream" for alias in node.names)
    ]
    assert direct == [], f"import current_stream from ddtree.vllm.streams instead: {direct}"


def test_the_first_lookup_in_a_thread_stores_torchs_present_stream_for_vllm(monkeypatch):
    """Without it vLLM's lookup would make a new stream current mid-step: the work queued before it on torch's
    stream would not be ordered before what follows (found in review; an eager engine sets no stream before)."""
    stored = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: "torch's present stream")
    monkeypatch.setattr(torch.cuda, "set_stream", stored.append)  # (vLLM's patch stands here on an engine)
    monkeypatch.setattr(streams, "_vllm_current_stream", lambda: stored[-1] if stored else "a new stream")
    monkeypatch.setattr(streams, "_synced", threading.local())
    assert streams.current_stream() == "torch's present stream"
    assert streams.current_stream() == "torch's present stream" and stored == ["torch's present stream"]
    other = []
    thread = threading.Thread(target=lambda: other.append(streams.current_stream()))
    thread.start()
    thread.join()
    assert other == ["torch's present stream"] and len(stored) == 2  # each thread stores its own once


def test_the_adapter_gives_its_recording_helpers_vllms_stream_lookup():
    made = [
        (name, call.lineno, {keyword.arg for keyword in call.keywords})
        for name, tree in _sources()
        for call in _calls(tree)
        if _name(call.func) in RECORDING_HELPERS
    ]
    assert made, "no StepStaging or PathRing is made in the adapter: this test lost what it checks"
    without = [f"{name}:{line}" for name, line, keywords in made if "current_stream" not in keywords]
    assert without == [], f"made without current_stream= (torch's lookup would be used): {without}"
