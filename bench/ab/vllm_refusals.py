"""What vLLM says when handed one original adapter of the A/B workload (run in vLLM's venv).

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python bench/ab/vllm_refusals.py out/ab/tiny/workload.json dora

One adapter per process: in vLLM 0.32 a refused adapter kills the engine (EngineDeadError) for every request.
The root cause is the worker's ValueError, printed in vLLM's log above the EngineDeadError.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    with open(sys.argv[1]) as f:
        wl = json.load(f)
    llm = LLM(model=wl["model"], **wl["llm_options"], **wl["vllm"]["llm_options"])
    sp = SamplingParams(temperature=0, max_tokens=2)
    for i, (name, path) in enumerate(sorted(wl["scute"]["adapters"].items())):
        if name != sys.argv[2]:
            continue
        try:
            llm.generate([{"prompt_token_ids": wl["prompts"][0]}], sp, lora_request=LoRARequest(name, i + 1, path),
                         use_tqdm=False)
            print(f"REFUSAL {name}: served")
        except Exception as e:  # noqa: BLE001 - reporting whatever vLLM raises
            print(f"REFUSAL {name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")


if __name__ == "__main__":
    main()
