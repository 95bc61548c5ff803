"""GPU check of `vllm serve` with ddtree, started as the README says, used through the OpenAI client.

    python tests/gpu/vllm_serve_e2e.py --pair tests/fixtures/models --out DIR [--budget 64]
        [--engines ddtree,plain] [--clients 64] [--soak-s 60] [--port 8011] [--start-timeout 480]
        [--scheduling asynchronous|synchronous] [--structured-outputs served|refused]

Not collected by pytest (it needs a GPU): run it directly. Each engine is one `vllm serve` process with vLLM's
defaults (no --max-num-seqs, no --max-num-batched-tokens, CUDA graphs on), the README's flags for a Qwen3.5 hybrid
target (`--language-model-only`, the Triton GDN prefill); `plain` is the same server without speculation. Checks,
each written to DIR/vllm_serve_e2e.json as soon as it is done (a run cut short keeps what finished):

  scheduling     (ddtree) the engine scheduled as --scheduling says (default asynchronous: ddtree's default with
                 one GPU), from its start-up log line
  completions    greedy completions of the pair's held-out prompts (token-id prompts)
  chat           a chat completion (the pair's tokenizer has a chat template)
  stream         a streamed greedy completion equals the same request unstreamed
  n_seed         n=2 at temperature 0.8 with a seed, twice: the same two choices both times
  logprobs       5 top logprobs per token; at temperature 0 the chosen token is the top one
  stop           a stop string taken from a greedy output ends the text right before it (finish_reason "stop")
  disconnect     a client that closes a stream after 3 chunks: the server frees the request and keeps serving
  soak           --clients concurrent clients for --soak-s seconds: no error; afterwards no request running
                 and the KV cache empty
  refusals       an oversized max_tokens: 400; structured output: 200 (400 from ddtree under
                 --structured-outputs refused, its server started without DDTREE_STRUCTURED_OUTPUTS=1); no
                 traceback in the server log
  structured     greedy chat completions under a JSON schema, a regex and a choice (--structured-outputs served):
                 the regex's and the choice's ended by their grammars and valid under them, the JSON valid unless
                 it ran to max_tokens (free whitespace); (ddtree) trees verified while they ran, and no "grammar
                 rejected tokens" in the server log
  metrics        (ddtree) vllm:spec_decode_ddtree_* present and consistent with vLLM's own counters
  what_if        (ddtree) the log's "DDTree what-if" line: what the trees say about vLLM's chain

Then `compare`: ddtree's greedy completions against plain's (equal, or the first differing token index), and its
structured outputs against plain's (equal texts).
The servers' logs are kept as DIR/serve_<engine>.log.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Callable, Dict, List, Optional

MODEL_NAME = "pair"


# ---- pure helpers (tested on CPU: tests/vllm_adapter/test_gpu_helpers.py) ---------------------------------
def metric_value(text: str, name: str, labels: Optional[Dict[str, str]] = None) -> Optional[float]:
    """Sum of a Prometheus metric's samples (``name`` or ``name_total``) whose labels include ``labels``."""
    total, seen = 0.0, False
    pattern = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+([-+0-9.eEnaNIf]+)$")
    for line in text.splitlines():
        match = pattern.match(line.strip())
        if not match or match.group(1) not in (name, name + "_total"):
            continue
        found = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', match.group(3) or ""))
        if labels and any(found.get(k) != v for k, v in labels.items()):
            continue
        total += float(match.group(4))
        seen = True
    return total if seen else None


def stop_string_from(text: str, start: int = 12, length: int = 4) -> Optional[str]:
    """A stop string cut from a greedy output: ``length`` characters from ``start`` on whose first occurrence is
    at ``start`` itself (so the expected text is unambiguous); None when the text has none."""
    for begin in range(start, max(start, len(text) - length) + 1):
        candidate = text[begin : begin + length]
        if len(candidate) == length and candidate.strip() and text.find(candidate) == begin:
            return candidate
    return None


def first_difference(a: List[int], b: List[int]) -> Optional[int]:
    """Index of the first differing token (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def expected_refusal_statuses(engine: str, structured_served: bool = True) -> Dict[str, int]:
    """What each refusal check must answer: a plain server serves structured outputs (200), a ddtree server too
    when started with DDTREE_STRUCTURED_OUTPUTS=1 and refuses them otherwise (400); both refuse an oversized
    max_tokens (400)."""
    refused = engine == "ddtree" and not structured_served
    return {"structured_output": 400 if refused else 200, "max_tokens": 400}


#: Greedy structured-output requests, each bounded so that the grammar ends it: a JSON schema (short string, small
#: integer, no other key), a regex of a few words and a choice.
ITEM_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "count": {"type": "integer", "maximum": 999}},
    "required": ["name", "count"],
    "additionalProperties": False,
}
WORDS_REGEX = r"[a-z]{1,8}( [a-z]{1,8}){2,4}\."
CHOICES = ["recursion", "iteration", "memoization"]
STRUCTURED_REQUESTS = {
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "item", "schema": ITEM_SCHEMA}}},
    "regex": {"extra_body": {"structured_outputs": {"regex": WORDS_REGEX}}},
    "choice": {"extra_body": {"structured_outputs": {"choice": CHOICES}}},
}


def structured_output_valid(kind: str, text: str) -> bool:
    """Whether ``text`` is what ``STRUCTURED_REQUESTS[kind]`` allows."""
    if kind == "regex":
        return re.fullmatch(WORDS_REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (
        isinstance(value, dict)
        and set(value) == {"name", "count"}
        and isinstance(value["name"], str)
        and len(value["name"]) <= 16
        and type(value["count"]) is int
        and value["count"] <= 999
    )


def tracebacks_after(log_text: str, marker: str) -> int:
    """Tracebacks the server logged after ``marker`` (a line this script wrote into the log's stream)."""
    index = log_text.find(marker)
    return log_text[index:].count("Traceback (most recent call last)") if index >= 0 else -1


def scheduling_in_log(log_text: str) -> Optional[str]:
    """ "asynchronous" or "synchronous": how the ddtree engine scheduled, from its start-up line (None: no line)."""
    found = re.search(r"DDTree: budget .*?(asynchronous|synchronous) scheduling \(DDTREE_ASYNC_SCHEDULING\)", log_text)
    return found.group(1) if found else None


def what_if_in_log(log_text: str) -> Optional[Dict[str, float]]:
    """The last "DDTree what-if" line of a server log: trees, their acceptance length and the chain's (None: none)."""
    found = re.findall(
        r"DDTree what-if over (\d+) trees: acceptance length ([\d.]+); vLLM's DFlash chain from the same states "
        r"([\d.]+)",
        log_text,
    )
    if not found:
        return None
    trees, own, chain = found[-1]
    return {"trees": int(trees), "acceptance_length": float(own), "chain_acceptance_length": float(chain)}


# ---- the server -----------------------------------------------------------------------------------------------
def serve_environment(engine: str, structured_served: bool) -> Dict[str, str]:
    """The server's environment: this process's, with ddtree's structured outputs switched on where served."""
    environ = dict(os.environ)
    if engine == "ddtree" and structured_served:
        environ["DDTREE_STRUCTURED_OUTPUTS"] = "1"
    return environ


def serve_command(pair: str, engine: str, budget: int, port: int) -> List[str]:
    """The README's `vllm serve` command for the pair (vLLM's defaults otherwise)."""
    command = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", os.path.join(pair, "target"),
        "--served-model-name", MODEL_NAME, "--port", str(port), "--language-model-only",
        "--additional-config", json.dumps({"gdn_prefill_backend": "triton"}),
    ]  # fmt: skip
    if engine == "ddtree":
        spec = {"method": "ddtree", "model": os.path.join(pair, "drafter"), "ddtree_budget": budget}
        command += ["--speculative-config", json.dumps(spec)]
    return command


class Server:
    def __init__(self, engine: str, command: List[str], port: int, log_path: str, env: Optional[Dict[str, str]] = None):
        self.engine, self.port, self.log_path = engine, port, log_path
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_ready(self, timeout: float) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode} (see {self.log_path})")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5) as response:
                    if response.status == 200:
                        return time.monotonic() - started
            except OSError:
                pass
            time.sleep(2)
        raise TimeoutError(f"server not ready after {timeout:.0f} s (see {self.log_path})")

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url("/metrics"), timeout=30) as response:
            return response.read().decode()

    def mark(self, text: str) -> None:
        self.log.write(f"\n[vllm_serve_e2e] {text}\n")
        self.log.flush()

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


def make_client(server: Server):
    from openai import OpenAI

    return OpenAI(base_url=server.url("/v1"), api_key="EMPTY", timeout=300, max_retries=0)


def wait_idle(server: Server, timeout: float = 60.0) -> Dict[str, Optional[float]]:
    """Waits until no request runs or waits and the KV cache is empty; returns the last readings."""
    deadline, reading = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        text = server.metrics()
        reading = {
            "running": metric_value(text, "vllm:num_requests_running"),
            "waiting": metric_value(text, "vllm:num_requests_waiting"),
            "kv_cache_usage": metric_value(text, "vllm:kv_cache_usage_perc"),
        }
        if reading["running"] == 0 and reading["waiting"] == 0 and reading["kv_cache_usage"] == 0:
            return dict(reading, idle=True)
        time.sleep(1)
    return dict(reading, idle=False)


# ---- checks ---------------------------------------------------------------------------------------------------
def check_completions(client, server, data, args) -> Dict:
    outputs = []
    for ids in data["prompts"][: args.prompts]:
        response = client.completions.create(
            model=MODEL_NAME, prompt=ids, max_tokens=args.max_tokens, temperature=0, logprobs=1
        )
        choice = response.choices[0]
        outputs.append({"text": choice.text, "tokens": choice.logprobs.tokens, "finish": choice.finish_reason})
    return {"ok": all(o["text"] for o in outputs), "outputs": outputs}


def check_chat(client, server, data, args) -> Dict:
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "def fibonacci(n):"}], max_tokens=48, temperature=0
    )
    choice = response.choices[0]
    return {"ok": bool(choice.message.content), "text": choice.message.content, "finish": choice.finish_reason}


def check_stream(client, server, data, args) -> Dict:
    ids = data["prompts"][0]
    whole = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=args.max_tokens, temperature=0)
    chunks = client.completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=args.max_tokens, temperature=0, stream=True
    )
    streamed = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    return {"ok": streamed == whole.choices[0].text, "streamed": streamed, "whole": whole.choices[0].text}


def check_n_seed(client, server, data, args) -> Dict:
    def run():
        response = client.completions.create(
            model=MODEL_NAME, prompt=data["prompts"][1], max_tokens=32, temperature=0.8, n=2, seed=1234
        )
        return [c.text for c in response.choices]

    first, second = run(), run()
    return {"ok": len(first) == 2 and first == second, "first": first, "second": second}


def check_logprobs(client, server, data, args) -> Dict:
    response = client.completions.create(
        model=MODEL_NAME, prompt=data["prompts"][2], max_tokens=24, temperature=0, logprobs=5
    )
    lp = response.choices[0].logprobs
    tops = lp.top_logprobs or []
    widths = [len(t or {}) for t in tops]
    chosen_is_top = [
        t is not None and chosen is not None and chosen >= max(t.values()) - 1e-4
        for chosen, t in zip(lp.token_logprobs, tops)
    ]
    ok = bool(tops) and all(1 <= w <= 5 for w in widths) and all(chosen_is_top)
    return {"ok": ok, "widths": widths, "chosen_is_top": chosen_is_top}


def check_stop(client, server, data, args) -> Dict:
    ids = data["prompts"][3]
    text = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=64, temperature=0).choices[0].text
    stop = stop_string_from(text)
    if stop is None:
        return {"ok": False, "reason": "no usable stop string in the greedy output", "text": text}
    choice = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=64, temperature=0, stop=[stop]).choices[
        0
    ]
    expected = text[: text.find(stop)]
    return {"ok": choice.text == expected and choice.finish_reason == "stop", "stop": stop, "text": choice.text}


def check_disconnect(client, server, data, args) -> Dict:
    stream = client.completions.create(
        model=MODEL_NAME, prompt=data["prompts"][4], max_tokens=1000, temperature=0, stream=True
    )
    received = 0
    for _ in stream:
        received += 1
        if received == 3:
            break
    stream.close()
    idle = wait_idle(server, timeout=60)
    after = client.completions.create(model=MODEL_NAME, prompt=data["prompts"][0], max_tokens=8, temperature=0)
    return {"ok": received == 3 and idle["idle"] and bool(after.choices[0].text), "chunks": received, **idle}


def check_soak(client, server, data, args) -> Dict:
    stop_at = time.monotonic() + args.soak_s
    counts = {"requests": 0, "errors": 0, "tokens": 0}
    errors: List[str] = []
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng, user = random.Random(seed), make_client(server)  # one client per simulated user
        while time.monotonic() < stop_at:
            try:
                response = user.completions.create(
                    model=MODEL_NAME,
                    prompt=rng.choice(data["prompts"]),
                    max_tokens=rng.randint(16, 128),
                    temperature=rng.choice([0.0, 0.7]),
                )
                with lock:
                    counts["requests"] += 1
                    counts["tokens"] += response.usage.completion_tokens
            except Exception as error:  # every failure is counted and reported
                with lock:
                    counts["errors"] += 1
                    errors.append(f"{type(error).__name__}: {error}"[:300])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    idle = wait_idle(server, timeout=120)
    ok = counts["errors"] == 0 and counts["requests"] > 0 and idle["idle"]
    return {"ok": ok, **counts, "tokens_per_s": counts["tokens"] / args.soak_s, "first_errors": errors[:5], **idle}


def check_refusals(client, server, data, args) -> Dict:
    import openai

    marker = f"refusals-{time.time()}"
    server.mark(marker)
    answers = {}
    attempts = {
        "structured_output": lambda: client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "a JSON object"}],
            max_tokens=16,
            response_format={"type": "json_object"},
        ),
        "max_tokens": lambda: client.completions.create(
            model=MODEL_NAME, prompt=data["prompts"][0], max_tokens=10**7, temperature=0
        ),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            answers[name] = {"status": 200}
        except openai.APIStatusError as error:
            answers[name] = {"status": error.status_code, "message": str(error)[:300]}
    time.sleep(2)  # let the server flush its log
    with open(server.log_path) as handle:
        tracebacks = tracebacks_after(handle.read(), marker)
    expected = expected_refusal_statuses(server.engine, args.structured_outputs == "served")
    statuses_ok = all(answers[name]["status"] == status for name, status in expected.items())
    return {
        "ok": statuses_ok and tracebacks == 0,
        "answers": answers,
        "expected": expected,
        "tracebacks_in_log": tracebacks,
    }


def check_structured(client, server, data, args) -> Dict:
    """Greedy chat completions under each of ``STRUCTURED_REQUESTS``: each ended by its grammar ("stop") and valid
    under it; on a ddtree server, trees verified while they ran (its tree counter grew: the requests decoded with
    trees, not one token a step) and no grammar refusal of an emitted token in its log."""
    if args.structured_outputs != "served":
        return {"ok": True, "skipped": "--structured-outputs refused"}
    marker = f"structured-{time.time()}"
    server.mark(marker)
    trees_before = metric_value(server.metrics(), "vllm:spec_decode_ddtree_num_trees") or 0.0
    outputs = {}
    for kind, extra in STRUCTURED_REQUESTS.items():
        messages = [{"role": "user", "content": f"def fibonacci(n):  # answer as {kind}"}]
        response = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=256, temperature=0, **extra
        )
        choice = response.choices[0]
        text = choice.message.content or ""
        outputs[kind] = {"text": text, "finish": choice.finish_reason, "valid": structured_output_valid(kind, text)}
    trees = (metric_value(server.metrics(), "vllm:spec_decode_ddtree_num_trees") or 0.0) - trees_before
    time.sleep(2)  # let the server flush its log
    with open(server.log_path) as handle:
        logged = handle.read()
    after = logged[logged.find(marker) :]
    rejected = after.count("grammar rejected tokens")
    # The regex and the choice end by their grammars; a JSON schema under vLLM's default free whitespace may run to
    # max_tokens (the trained pair indents without end when greedy), so it must be valid only where it ended.
    ended = all(outputs[kind]["finish"] == "stop" and outputs[kind]["valid"] for kind in ("regex", "choice"))
    json_ok = outputs["json_schema"]["valid"] or outputs["json_schema"]["finish"] == "length"
    ok = ended and json_ok and rejected == 0
    if server.engine == "ddtree":
        ok = ok and trees > 0
    return {"ok": ok, "outputs": outputs, "trees": trees, "grammar_rejections_in_log": rejected}


def check_scheduling(client, server, data, args) -> Dict:
    """The ddtree server scheduled as expected (vLLM's asynchronous scheduling, the default with one GPU, unless
    --scheduling says otherwise), read from its start-up log line."""
    server.log.flush()
    with open(server.log_path) as handle:
        found = scheduling_in_log(handle.read())
    return {"ok": found == args.scheduling, "scheduling": found, "expected": args.scheduling}


def check_what_if(client, server, data, args) -> Dict:
    """The ddtree server logged what its trees say about vLLM's chain (on vLLM's statistics interval, after the
    soak's traffic), with the chain's acceptance length at most the trees'."""
    server.log.flush()
    with open(server.log_path) as handle:
        found = what_if_in_log(handle.read())
    ok = found is not None and found["trees"] > 0 and found["chain_acceptance_length"] <= found["acceptance_length"]
    return {"ok": ok, "what_if": found}


def check_metrics(client, server, data, args) -> Dict:
    text = server.metrics()
    trees = metric_value(text, "vllm:spec_decode_ddtree_num_trees")
    nodes = metric_value(text, "vllm:spec_decode_ddtree_num_tree_nodes")
    drafts = metric_value(text, "vllm:spec_decode_num_drafts")
    draft_tokens = metric_value(text, "vllm:spec_decode_num_draft_tokens")
    budget = metric_value(text, "vllm:spec_decode_ddtree_budget")
    depth1 = metric_value(text, "vllm:spec_decode_ddtree_num_accepted_tokens_per_depth", {"depth": "1"})
    ok = (
        bool(trees)
        and trees == drafts
        and nodes == draft_tokens
        and budget == args.budget
        and 1 <= nodes / trees <= args.budget
        and depth1 is not None
        and depth1 <= trees
    )
    return {"ok": ok, "trees": trees, "nodes": nodes, "drafts": drafts, "budget": budget, "accepted_depth1": depth1}


CHECKS: Dict[str, Callable] = {
    "scheduling": check_scheduling,
    "completions": check_completions,
    "chat": check_chat,
    "stream": check_stream,
    "n_seed": check_n_seed,
    "logprobs": check_logprobs,
    "stop": check_stop,
    "disconnect": check_disconnect,
    "soak": check_soak,
    "refusals": check_refusals,
    "structured": check_structured,
    "metrics": check_metrics,
    "what_if": check_what_if,
}


#: Checks of what only a ddtree server has.
DDTREE_ONLY_CHECKS = ("scheduling", "metrics", "what_if")


def run_engine(engine: str, args, data, results: Dict, save: Callable[[], None]) -> None:
    entry = results["engines"].setdefault(engine, {"checks": {}})
    command = serve_command(args.pair, engine, args.budget, args.port)
    entry["command"] = command
    environ = serve_environment(engine, args.structured_outputs == "served")
    server = Server(engine, command, args.port, os.path.join(args.out, f"serve_{engine}.log"), environ)

    try:
        entry["start_seconds"] = round(server.wait_ready(args.start_timeout), 1)
        save()
        client = make_client(server)
        for name, check in CHECKS.items():
            if name in DDTREE_ONLY_CHECKS and engine != "ddtree":
                continue
            started = time.monotonic()
            try:
                outcome = check(client, server, data, args)
            except Exception as error:  # a failed check is reported, the others still run
                outcome = {"ok": False, "error": f"{type(error).__name__}: {error}"[:500]}
            outcome["seconds"] = round(time.monotonic() - started, 1)
            entry["checks"][name] = outcome
            print(f"[{engine}] {name}: {'ok' if outcome['ok'] else 'FAILED'} ({outcome['seconds']} s)", flush=True)
            save()
    except Exception as error:
        entry["error"] = f"{type(error).__name__}: {error}"[:500]
        print(f"[{engine}] {entry['error']}", flush=True)
    finally:
        server.stop()
        save()


def compare(results: Dict) -> Optional[Dict]:
    engines = results["engines"]
    try:
        mine = engines["ddtree"]["checks"]["completions"]["outputs"]
        theirs = engines["plain"]["checks"]["completions"]["outputs"]
    except KeyError:
        return None
    differences = [first_difference(a["tokens"], b["tokens"]) for a, b in zip(mine, theirs)]
    found = {"equal": sum(d is None for d in differences), "of": len(differences), "first_difference": differences}
    mine_structured = engines["ddtree"]["checks"].get("structured", {}).get("outputs")
    theirs_structured = engines["plain"]["checks"].get("structured", {}).get("outputs")
    if mine_structured and theirs_structured:
        found["structured_equal"] = {
            kind: mine_structured[kind]["text"] == theirs_structured[kind]["text"] for kind in mine_structured
        }
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pair", default=os.path.join(os.path.dirname(__file__), "..", "fixtures", "models"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--engines", default="ddtree,plain")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--soak-s", type=float, default=60.0)
    parser.add_argument("--start-timeout", type=float, default=480.0)
    parser.add_argument(
        "--scheduling",
        choices=("asynchronous", "synchronous"),
        default="asynchronous",
        help="how the ddtree server must schedule (its default with one GPU: asynchronous)",
    )
    parser.add_argument(
        "--structured-outputs",
        choices=("served", "refused"),
        default="served",
        help="whether the ddtree server serves structured outputs (DDTREE_STRUCTURED_OUTPUTS=1) or refuses them",
    )
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.pair, "prompts.json")) as handle:
        data = json.load(handle)
    results: Dict = {"pair": args.pair, "budget": args.budget, "engines": {}}
    path = os.path.join(args.out, "vllm_serve_e2e.json")

    def save() -> None:
        results["compare"] = compare(results)
        with open(path, "w") as handle:
            json.dump(results, handle, indent=1)

    for engine in args.engines.split(","):
        run_engine(engine, args, data, results, save)
    save()
    failed = [
        f"{engine}.{name}"
        for engine, entry in results["engines"].items()
        for name, outcome in entry["checks"].items()
        if not outcome["ok"]
    ] + [f"{engine}: {entry['error']}" for engine, entry in results["engines"].items() if "error" in entry]
    print("FAILED: " + ", ".join(failed) if failed else "ALL-PASS", flush=True)
    print(f"compare: {results['compare']}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
