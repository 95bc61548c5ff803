"""Every CUDA event the adapter records per step names its stream.

``torch.cuda.Event.record()`` without a stream looks the current stream up through torch, which builds a Stream
object each call: 9 us with the device idle and 29 us behind a deep launch queue on an H100, against 2 and 7 us
with the stream given (``benches/results/gpu-h100-event-stream-33a1deb``). The engine's queue is deep, and the
batch-1 step records about one event a step, so the adapter records on vLLM's ``current_stream()`` (kept by vLLM
as it sets streams) and hands that function to the torch-only helpers (``StepStaging``, ``PathRing``).
"""

import ast
import pathlib

import ddtree.vllm

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
