"""`ddtree` on the command line.

    ddtree demo [--input FILE.npz] [--budget 64] [--width K] [--seed 0]

builds a draft tree from per-position distributions (a file with `log_probs`
and `token_ids` arrays of shape [L, K], or a synthetic drafter's), compiles it,
walks a simulated target through it, and prints the tree, the timings and the
expected acceptance length.

    ddtree demo --pair tests/fixtures/models [--prompts 1] [--new-tokens 64] [--budgets 16,64]

then decodes held-out prompts with the trained test pair (needs torch and
transformers): greedy autoregressive, the DFlash chain and DDTree, with each
mode's tokens per step and whether its output equals autoregressive decoding.

    ddtree generate --target DIR [--drafter DIR] --prompt TEXT|--prompt-file F|--prompt-ids 1,2,3
                    [--mode ar|chain|ddtree] [--budget 64] [--max-new-tokens N]
                    [--temperature T] [--top-p P] [--top-k K] [--seed S] [--device cpu|cuda]
                    [--regex R | --json-schema JSON]

generates with the reference engine (``ddtree.engine``, needs torch and
transformers) and prints the text and per-request statistics; under ``--regex`` or
``--json-schema`` (xgrammar) every output follows the grammar.
"""

from __future__ import annotations

import argparse
import sys
import time
import zipfile
import zlib
from typing import Sequence

import numpy as np

import ddtree
from ddtree.errors import DDTreeError

DEFAULT_DEPTH = 15


def synthetic_distribution(rng, depth: int, width: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """A drafter that grows less sure with depth, as DFlash drafters do."""
    logits = rng.standard_normal((depth, vocab)) * np.linspace(4.0, 1.5, depth)[:, None]
    log_probs = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    order = np.argsort(-log_probs, axis=1)[:, :width]
    return np.take_along_axis(log_probs, order, 1).astype(np.float32), order.astype(np.int64)


class DemoInputError(DDTreeError, ValueError):
    """A demo input the demo cannot use; the message is the one line the user sees."""


def load_distribution(path: str) -> tuple[np.ndarray, np.ndarray]:
    """``log_probs`` and ``token_ids`` from an ``.npz`` archive; any unreadable file is a DemoInputError."""
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
        raise DemoInputError(f"{path}: cannot read it as an .npz archive ({error})") from None
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise DemoInputError(f"{path}: a single array, not an .npz archive with log_probs and token_ids [L, K]")
    with data:
        missing = {"log_probs", "token_ids"} - set(data.files)
        if missing:
            raise DemoInputError(f"{path}: missing arrays {sorted(missing)}; expected log_probs and token_ids [L, K]")
        try:
            log_probs, token_ids = data["log_probs"], data["token_ids"]
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as error:
            raise DemoInputError(f"{path}: a damaged archive member ({error})") from None
    if log_probs.dtype.kind != "f" or token_ids.dtype.kind not in "iu":
        raise DemoInputError(
            f"{path}: log_probs must hold floats and token_ids integers, got {log_probs.dtype} and {token_ids.dtype}"
        )
    return np.ascontiguousarray(log_probs, np.float32), np.ascontiguousarray(token_ids)


#: Largest synthetic distribution the demo makes (depth x vocabulary values).
MAX_SYNTHETIC_VALUES = 1 << 26


def check_synthetic_sizes(args: argparse.Namespace) -> None:
    for name in ("depth", "vocab", "width"):
        if getattr(args, name) < 0:
            raise DemoInputError(f"--{name} must be >= 0, got {getattr(args, name)}")
    if args.depth * args.vocab > MAX_SYNTHETIC_VALUES:
        raise DemoInputError(
            f"--depth x --vocab must be at most {MAX_SYNTHETIC_VALUES}, got {args.depth} x {args.vocab}"
        )


def render_tree(tree: ddtree.Tree, limit: int) -> list[str]:
    """The tree as indented lines, children in best-first order."""
    children: dict[int, list[int]] = {}
    for node in range(1, len(tree)):
        children.setdefault(int(tree.parents[node]), []).append(node)
    lines: list[str] = []

    def visit(node: int, indent: int) -> None:
        for child in children.get(node, []):
            if len(lines) >= limit:
                return
            prob = float(np.exp(tree.scores[child]))
            lines.append(f"{'  ' * indent}#{child:<4} token {int(tree.tokens[child - 1]):>7}  p(prefix) = {prob:.4f}")
            visit(child, indent + 1)

    visit(0, 0)
    return lines


def simulate_target(tree: ddtree.Tree, log_probs: np.ndarray, token_ids: np.ndarray, rng) -> np.ndarray:
    """A target that samples each position from the drafter's own distribution."""
    probs = np.exp(log_probs.astype(np.float64))
    out = np.empty(len(tree), dtype=np.int64)
    for node in range(len(tree)):
        depth = int(tree.depths[node])
        total = probs[depth].sum() if depth < len(probs) else 0.0
        if not np.isfinite(total) or total <= 0.0:  # past the drafter's depth, no candidates, or all -inf
            out[node] = -1  # a token no draft carries: the walk stops here
            continue
        row = probs[depth] / total
        out[node] = token_ids[depth, rng.choice(len(row), p=row)]
    return out


def demo(args: argparse.Namespace) -> int:
    try:
        return run_demo(args)
    except (DemoInputError, ValueError, TypeError) as error:  # the core's errors name the argument
        print(f"ddtree demo: {error}", file=sys.stderr)
        return 2


def run_demo(args: argparse.Namespace) -> int:
    rng = np.random.default_rng(args.seed)
    if not args.input:
        check_synthetic_sizes(args)
    if args.input:
        log_probs, token_ids = load_distribution(args.input)
        source = args.input
    else:
        width = args.width or min(args.budget, args.vocab)
        log_probs, token_ids = synthetic_distribution(rng, args.depth, width, args.vocab)
        source = f"synthetic drafter (L={args.depth}, vocab={args.vocab}, seed={args.seed})"

    tree = ddtree.build_tree(log_probs, token_ids, args.budget)
    compiled = ddtree.compile_tree(tree, start=args.start, window=args.window)
    target = simulate_target(tree, log_probs, token_ids, rng)
    path, bonus = ddtree.accept(tree, target)
    timings = {
        "build": mean_microseconds(lambda: ddtree.build_tree(log_probs, token_ids, args.budget)),
        "compile": mean_microseconds(lambda: ddtree.compile_tree(tree, start=args.start, window=args.window)),
        "accept": mean_microseconds(lambda: ddtree.accept(tree, target)),
    }

    print(f"distributions: {source}, log_probs {list(log_probs.shape)}")
    print(f"tree: {tree.num_draft_nodes} draft nodes (budget {args.budget}), depth {tree.max_depth}")
    for line in render_tree(tree, args.show):
        print("  " + line)
    if tree.num_draft_nodes > args.show:
        print(f"  ... {tree.num_draft_nodes - args.show} more nodes (--show N to print more)")
    print(
        f"compiled: positions {compiled.positions.min()}..{compiled.positions.max()}, "
        f"ancestor bits {list(compiled.ancestor_bits.shape)} uint32, conv windows {list(compiled.windows.shape)}"
    )
    tokens = [int(tree.tokens[p - 1]) for p in path[1:]]
    print(
        f"simulated target (samples the drafter's own distribution): accepted {len(path) - 1} draft tokens "
        f"{tokens}, bonus {bonus}"
    )
    src, dst = ddtree.kv_move_plan(path)
    print(f"KV moves: {list(zip(src.tolist(), dst.tolist()))}")
    print(
        f"expected acceptance length (accepted + bonus, under the drafter's distribution): "
        f"{tree.expected_acceptance():.3f}; a chain of the same depth: {chain_expected(log_probs):.3f}"
    )
    print(
        "timings (mean of 200 calls, Python call overhead included): "
        + ", ".join(f"{name} {us:.1f} us" for name, us in timings.items())
    )
    return pair_demo(args) if args.pair else 0


def pair_demo(args: argparse.Namespace) -> int:
    try:
        budgets = [int(b) for b in args.budgets.split(",") if b]
    except ValueError:
        print(f"ddtree demo: --budgets must be comma-separated integers, got {args.budgets!r}", file=sys.stderr)
        return 2
    if args.prompts < 1 or args.new_tokens < 1 or any(b < 1 for b in budgets):
        print("ddtree demo: --prompts, --new-tokens and every budget must be >= 1", file=sys.stderr)
        return 2
    from ddtree.engine.pair_demo import run_pair_demo
    from ddtree.engine.validation import EngineInputError

    print()
    try:
        return run_pair_demo(args.pair, args.prompts, args.new_tokens, budgets, args.device)
    except EngineInputError as error:
        print(f"ddtree demo: {error}", file=sys.stderr)
        return 2


def mean_microseconds(fn, calls: int = 200) -> float:
    fn()  # the first call pays one-off set-up
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e6 * (time.perf_counter() - start) / calls


def chain_expected(log_probs: np.ndarray) -> float:
    """Expected acceptance of the greedy chain (the DFlash baseline)."""
    if log_probs.size == 0:
        return 1.0
    return 1.0 + float(np.exp(np.cumsum(log_probs[:, 0].astype(np.float64))).sum())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddtree", description="DDTree speculative decoding tools")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("demo", help="build, compile and accept one draft tree, with timings")
    p.add_argument("--input", help=".npz file with log_probs [L, K] float32 and token_ids [L, K]")
    p.add_argument("--budget", type=int, default=64, help="draft nodes in the tree (default 64)")
    p.add_argument("--depth", type=int, default=DEFAULT_DEPTH, help="draft positions L (synthetic; default 15)")
    p.add_argument(
        "--width", type=int, default=0, help="top-K kept per position (synthetic; default min(budget, vocab))"
    )
    p.add_argument("--vocab", type=int, default=1000, help="synthetic vocabulary size (default 1000)")
    p.add_argument("--start", type=int, default=0, help="position of the root token")
    p.add_argument("--window", type=int, default=3, help="conv window of a hybrid target (width - 1; default 3)")
    p.add_argument("--show", type=int, default=24, help="tree nodes to print (default 24)")
    p.add_argument("--seed", type=int, default=0)
    pair = p.add_argument_group("real decoding with a trained pair (torch, transformers)")
    pair.add_argument("--pair", help="directory with target/, drafter/ and prompts.json (tests/fixtures/models)")
    pair.add_argument("--prompts", type=int, default=1, help="held-out prompts to decode (default 1)")
    pair.add_argument("--new-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    pair.add_argument("--budgets", default="16,64", help="DDTree budgets to compare with the chain (default 16,64)")
    pair.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.set_defaults(run=demo)
    add_generate_parser(commands)
    return parser


def add_generate_parser(commands) -> None:
    """``generate``'s arguments; the command itself (torch, transformers) is imported only when run."""
    p = commands.add_parser("generate", help="generate with the reference engine (ar, DFlash chain or DDTree)")
    p.add_argument("--target", required=True, help="transformers checkpoint directory of the target")
    p.add_argument("--drafter", help="DFlash drafter directory (config.json + safetensors); not needed for --mode ar")
    prompts = p.add_argument_group("prompts (repeat for a batch)")
    prompts.add_argument(
        "--prompt", action="append", default=[], help="prompt text, tokenised with the target's tokenizer"
    )
    prompts.add_argument("--prompt-file", action="append", default=[], help="a file whose whole content is one prompt")
    prompts.add_argument(
        "--prompt-ids", action="append", default=[], help="comma-separated token ids (no tokenizer needed)"
    )
    p.add_argument("--mode", choices=["ar", "chain", "ddtree"], default="ddtree")
    p.add_argument("--budget", type=int, default=64, help="draft tree nodes per step (ddtree; default 64)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 disables")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float16", "float32"],
        default="auto",
        help="weights dtype (default: the checkpoint's)",
    )
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the tokenizer's EOS token")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    structured = p.add_argument_group("structured output (xgrammar; every verified node masked by the grammar)")
    grammar = structured.add_mutually_exclusive_group()
    grammar.add_argument("--regex", help="every output matches this regular expression")
    grammar.add_argument("--json-schema", help="every output is a JSON document of this schema (its JSON text)")
    p.set_defaults(run=generate)


def generate(args: argparse.Namespace) -> int:
    from ddtree.engine.command import run

    return run(args)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.budget < 0:
        print("ddtree: --budget must be >= 0", file=sys.stderr)
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
