"""Registers and spills of ddtree's Triton kernels on an H200 (sm_90a), read without a GPU.

    python benches/ptxas_report.py [--json FILE]

Each kernel is compiled by Triton for ``GPUTarget("cuda", 90, 32)`` at the constants a Qwen3.6-27B step (or the
test pair's, where it differs) gives it, and Triton's own ``ptxas -v`` reports its registers per thread and the bytes
it spills. A spill is local memory on the step's critical path; the tree build's budget-255 cliff (14 ms,
``gpu-h200-device-tree-e9e09b0``) was one. Not a timing: a GPU decides what is faster; this says where to look and
checks that a change did not start spilling. Pointer dtypes are the engine's (bf16 activations, fp32 states); integer
arguments are compiled as int32 without the launcher's divisibility hints, so the code is close to, not identical
with, what a launch compiles.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Dict, List

import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))

from ddtree.kernels import draft_top_k, gdn_triton, paged_attention_triton, tree_build_triton  # noqa: E402
from ddtree.kernels import tree_layout_triton  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def _signature(pointers: Dict[str, str], ints: List[str], constants: List[str]) -> Dict[str, str]:
    return {**pointers, **{name: "i32" for name in ints}, **{name: "constexpr" for name in constants}}


BUILD = _signature(
    {"log_probs_ptr": "*fp32", "token_ids_ptr": "*i32", "parents_ptr": "*i64", "depths_ptr": "*i64",
     "tokens_ptr": "*i64", "scores_ptr": "*fp64", "ranks_ptr": "*i64"},
    ["budget", "num_depths", "top_k", "lp_request_stride", "lp_depth_stride", "token_request_stride",
     "token_depth_stride", "out_stride"],
    ["BLOCK_N", "KEY_WORDS", "KEY_BITS", "RANKS_PER_WORD"],
)  # fmt: skip
LAYOUT = _signature(
    {**{name: "*i64" for name in ("parents_ptr", "depths_ptr", "tokens_ptr", "starts_ptr", "query_starts_ptr",
                                  "logit_starts_ptr", "token_index_ptr", "logit_rows_ptr", "positions_ptr")},
     "bits_ptr": "*i32", "conv_ptr": "*i64", "node_depths_ptr": "*i64", "root_index_ptr": "*i64",
     "node_parents_ptr": "*i64", "node_tree_ptr": "*i64", "node_local_ptr": "*i64", "node_tokens_ptr": "*i64",
     "draft_step_ptr": "*i64", "draft_tokens_ptr": "*i32"},
    ["num_trees", "nodes_per_tree", "words", "max_depth"],
    ["BLOCK_N", "WORDS", "WINDOW"],
)  # fmt: skip
PACK = _signature(
    {"logits_ptr": "*bf16", "values_ptr": "*bf16", "ids_ptr": "*i64", "out_ptr": "*fp32", "out_ids_ptr": "*i32"},
    ["vocab", "k", "logits_stride", "values_stride", "ids_stride", "out_stride"],
    ["BLOCK_V", "BLOCK_K"],
)  # fmt: skip
GDN_FWD = _signature(
    {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "g_ptr": "*bf16", "beta_ptr": "*bf16", "a_log_ptr": "*fp32",
     "dt_bias_ptr": "*bf16", "bits_ptr": "*i32", "num_words": "i32", "node_offsets_ptr": "*i32", "state_ptr": "*fp32",
     "state_indices_ptr": "*i32", "stride_state_slot": "i32", "stride_state_head": "i32", "stride_state_k": "i32",
     "stride_state_v": "i32", "o_ptr": "*bf16", "u_ptr": "*fp32", "cum_ptr": "*fp32", "scale": "fp32"},
    [],
    ["NUM_K_HEADS", "NUM_V_HEADS", "HEAD_K_DIM", "HEAD_V_DIM", "BT", "BC", "BK", "BKC", "BV", "PRECISION",
     "RAW_GATING", "L2NORM"],
)  # fmt: skip
GDN_COMMIT = _signature(
    {"k_ptr": "*bf16", "u_ptr": "*fp32", "cum_ptr": "*fp32", "node_offsets_ptr": "*i32", "paths_ptr": "*i32",
     "path_lengths_ptr": "*i32", "max_path": "i32", "src_ptr": "*fp32", "src_indices_ptr": "*i32", "dst_ptr": "*fp32",
     "dst_indices_ptr": "*i32"},
    ["stride_src_slot", "stride_src_head", "stride_src_k", "stride_src_v", "stride_dst_slot", "stride_dst_head",
     "stride_dst_k", "stride_dst_v"],
    ["NUM_K_HEADS", "NUM_V_HEADS", "HEAD_K_DIM", "HEAD_V_DIM", "BP", "BK", "BV", "PRECISION", "L2NORM"],
)  # fmt: skip
ATTENTION = _signature(
    {"out_ptr": "*bf16", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32", "q_ptr": "*bf16",
     "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "block_table_ptr": "*i32", "query_start_ptr": "*i32",
     "seq_lens_ptr": "*i32", "row_start_ptr": "*i32", "bits_ptr": "*i32", "scale": "fp32"},
    ["stride_q_tok", "stride_q_head", "stride_o_tok", "stride_o_head", "stride_k_blk", "stride_k_slot",
     "stride_k_head", "stride_v_blk", "stride_v_slot", "stride_v_head", "stride_bt", "stride_bits", "num_tokens",
     "num_splits"],
    ["NUM_HEADS", "QUERIES_PER_KV", "HEAD_SIZE", "HEAD_PAD", "PAGE", "BLOCK_Q", "BLOCK_M", "TILE", "SPLIT"],
)  # fmt: skip

#: The 27B shape's GDN constants (16 key and 48 value heads, 128 x 128 state) and its defaults' block sizes.
GDN_27B = dict(NUM_K_HEADS=16, NUM_V_HEADS=48, HEAD_K_DIM=128, HEAD_V_DIM=128)

#: (name, kernel, signature, constants, compile options): what a step runs, at its sizes, and the variants a sweep
#: would try.
CASES = [
    *[
        (f"tree build, {n} nodes ({w} warps)", tree_build_triton._best_first_kernel, BUILD,
         dict(BLOCK_N=n, KEY_WORDS=2, KEY_BITS=7, RANKS_PER_WORD=9), dict(num_warps=w))
        for n in (64, 128, 256) for w in (4, 1)
    ],
    *[
        (f"tree layout, {n} nodes, conv window 3", tree_layout_triton._tree_layout_kernel, LAYOUT,
         dict(BLOCK_N=n, WORDS=max(1, n // 32), WINDOW=3), dict(num_warps=4))
        for n in (64, 128, 256)
    ],
    ("draft top-K pack, K 64", draft_top_k._pack_top_k_kernel, PACK, dict(BLOCK_V=2048, BLOCK_K=64), dict(num_warps=4)),
    *[
        (f"tree GDN verify, 27B, block_c {bc}, block_v {bv}, {w} warps, {s} stages", gdn_triton._tree_gdn_fwd_kernel,
         GDN_FWD,
         dict(GDN_27B, BT=16, BC=bc, BK=128, BKC=32, BV=bv, PRECISION="tf32x3", RAW_GATING=True, L2NORM=True),
         dict(num_warps=w, num_stages=s))
        for bc, bv, w, s in ((32, 64, 4, 2), (32, 128, 4, 2), (64, 64, 4, 2), (64, 128, 4, 2), (64, 64, 8, 3),
                             (64, 128, 8, 3))
    ],
    ("tree GDN commit, 27B, block_v 32", gdn_triton._tree_gdn_commit_kernel, GDN_COMMIT,
     dict(GDN_27B, BP=16, BK=128, BV=32, PRECISION="tf32x3", L2NORM=True), dict(num_warps=4)),
    *[
        (f"paged tree attention, 27B, page {page}, split {split}", paged_attention_triton._paged_tree_attention_kernel,
         ATTENTION, dict(NUM_HEADS=24, QUERIES_PER_KV=6, HEAD_SIZE=256, HEAD_PAD=256, PAGE=page, BLOCK_Q=2,
                         BLOCK_M=16, TILE=16, SPLIT=split), dict(num_warps=4))
        for page in (16, 64) for split in (False, True)
    ],
]  # fmt: skip


def ptxas_report(kernel, signature: Dict[str, str], constants: dict, options: dict) -> dict:
    """Registers and spilled bytes of ``kernel`` compiled for sm_90a."""
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constants)
    compiled = triton.compile(source, target=TARGET, options=options)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as ptx:
        ptx.write(compiled.asm["ptx"])
    try:
        result = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", ptx.name, "-o", os.devnull], capture_output=True, text=True, timeout=300
        )
    finally:
        os.unlink(ptx.name)
    if result.returncode:
        raise RuntimeError(result.stderr[-2000:])
    numbers = {key: int(value) for value, key in re.findall(r"(\d+) bytes (spill stores|spill loads)", result.stderr)}
    registers = re.search(r"Used (\d+) registers", result.stderr)
    return {
        "registers": int(registers.group(1)) if registers else None,
        "spill_store_bytes": numbers.get("spill stores", 0),
        "spill_load_bytes": numbers.get("spill loads", 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    print(f"triton {triton.__version__}, target sm_90a", flush=True)
    rows = []
    for name, kernel, signature, constants, options in CASES:
        row = {"kernel": name, **ptxas_report(kernel, signature, constants, options)}
        rows.append(row)
        print(
            f"{name}: {row['registers']} registers, spills {row['spill_store_bytes']} B stored / "
            f"{row['spill_load_bytes']} B loaded a thread",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "target": "sm_90a", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
