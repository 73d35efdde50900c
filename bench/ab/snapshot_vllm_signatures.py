"""Write tests/data/vllm_signatures.json from the vLLM installed in this interpreter.

Run with vLLM's venv and the repository on the path:
    PYTHONPATH=. .venv-vllm/bin/python bench/ab/snapshot_vllm_signatures.py
"""

from __future__ import annotations

import json
import os
import sys

from scute.compat.signatures import api_records, engine_arg_defaults

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "..", "tests", "data", "vllm_signatures.json")


def main() -> None:
    import vllm
    from vllm import LLM, LLMEngine, SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.lora.request import LoRARequest
    from vllm.outputs import CompletionOutput, RequestOutput

    classes = {"LLM": LLM, "LLMEngine": LLMEngine, "SamplingParams": SamplingParams, "LoRARequest": LoRARequest, "RequestOutput": RequestOutput,
                   "CompletionOutput": CompletionOutput}
    snapshot = {
        "vllm_version": vllm.__version__,
        "signatures": api_records(classes),
        "engine_args": engine_arg_defaults(EngineArgs),
    }
    out = sys.argv[1] if len(sys.argv) > 1 else OUT
    with open(out, "w") as f:
        json.dump(snapshot, f, indent=1, sort_keys=False)
        f.write("\n")
    print(f"wrote {os.path.normpath(out)} (vLLM {vllm.__version__})")


if __name__ == "__main__":
    main()
