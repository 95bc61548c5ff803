"""Load the trained pair in vLLM 0.25.1 on the H200 and compare greedy outputs with the fp32 CPU reference.

    python3 benches/check_pair_vllm.py MODELS_DIR METRICS_JSON     (MODELS_DIR holds target/ and drafter/)

Needs vLLM 0.25.1 and VLLM_USE_FLASHINFER_SAMPLER=0. Runs the target plain
and with vLLM's own DFlash ({"method": "dflash", num_speculative_tokens 15}), bf16, eager, and prints per
prompt the common prefix with the reference and vLLM's acceptance counters. Not run yet (written CPU-side).
"""

import json
import sys


def main(models: str, metrics_path: str) -> None:
    from vllm import LLM, SamplingParams

    with open(metrics_path) as handle:
        metrics = json.load(handle)
    reference = metrics["eval"]["reference_outputs"]
    prompts = [p for p in metrics["eval"].get("prompt_ids", [])]
    if not prompts:
        raise SystemExit("metrics.json has no eval.prompt_ids; pass a metrics.json from this version of the run")
    sampling = SamplingParams(temperature=0.0, max_tokens=len(reference[0]), ignore_eos=True)
    for name, spec in (
        ("plain", None),
        ("dflash", {"method": "dflash", "model": f"{models}/drafter", "num_speculative_tokens": 15}),
    ):
        kwargs = dict(
            model=f"{models}/target",
            dtype="bfloat16",
            enforce_eager=True,
            max_model_len=1024,
            language_model_only=True,
            gpu_memory_utilization=0.3,
            seed=0,
            additional_config={"gdn_prefill_backend": "triton"},
        )
        if spec:
            kwargs["speculative_config"] = spec
        llm = LLM(**kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
        common = []
        for out, ref in zip(outs, reference):
            ids = list(out.outputs[0].token_ids)
            n = next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), min(len(ids), len(ref)))
            common.append(n)
        print(f"{name}: common prefix with fp32 CPU reference {common}; >= 128: {sum(c >= 128 for c in common)}")
        try:
            print(f"{name}: metrics", [m for m in llm.get_metrics() if "spec_decode" in m.name])
        except Exception as error:  # counters' API differs between versions
            print(f"{name}: no spec-decode metrics ({error!r})")
        del llm


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
