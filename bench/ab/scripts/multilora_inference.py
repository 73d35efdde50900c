"""vLLM's examples/offline_inference/multilora_inference.py (vLLM 0.32) with its model and adapter made local:
``python multilora_inference.py MODEL_FOLDER LORA_FOLDER`` in place of "meta-llama/Llama-2-7b-hf" and
``snapshot_download(repo_id="yard1/llama-2-7b-sql-lora-test")``. Everything else is the example's: two base
requests (one greedy with prompt logprobs, one sampled with a presence penalty), then the same SQL prompt on the
adapter under two ids, ``max_loras=1``, one request added per step, finished outputs printed.
"""

import sys
from typing import Optional

from vllm import EngineArgs, LLMEngine, RequestOutput, SamplingParams
from vllm.lora.request import LoRARequest

SQL = ("[user] Write a SQL query to answer the question based on the table schema.\n\n context: CREATE TABLE "
       "table_name_74 (icao VARCHAR, airport VARCHAR)\n\n question: Name the ICAO for lilongwe international "
       "airport [/user] [assistant]")


def create_test_prompts(lora_path: str) -> list[tuple[str, SamplingParams, Optional[LoRARequest]]]:
    """2 base requests, then 2 on the adapter (two ids, one folder); with max_loras=1 the second id waits for
    the first one's requests to finish."""
    return [
        ("A robot may not injure a human being",
         SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1, max_tokens=128), None),
        ("To be or not to be,",
         SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2, max_tokens=128), None),
        (SQL, SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1, max_tokens=128, stop_token_ids=[32003]),
         LoRARequest("sql-lora", 1, lora_path)),
        (SQL, SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1, max_tokens=128, stop_token_ids=[32003]),
         LoRARequest("sql-lora2", 2, lora_path)),
    ]


def process_requests(engine: LLMEngine, test_prompts: list[tuple[str, SamplingParams, Optional[LoRARequest]]]):
    """Add one request per step until none is left; print every finished output."""
    request_id = 0
    print("-" * 50)
    while test_prompts or engine.has_unfinished_requests():
        if test_prompts:
            prompt, sampling_params, lora_request = test_prompts.pop(0)
            engine.add_request(str(request_id), prompt, sampling_params, lora_request=lora_request)
            request_id += 1
        request_outputs: list[RequestOutput] = engine.step()
        for request_output in request_outputs:
            if request_output.finished:
                print(request_output)
                print("-" * 50)


def initialize_engine(model: str) -> LLMEngine:
    """max_loras: adapters per batch; max_lora_rank: the largest rank served; max_cpu_loras: the CPU cache."""
    engine_args = EngineArgs(model=model, enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=2,
                             max_num_seqs=256)
    return LLMEngine.from_engine_args(engine_args)


def main():
    engine = initialize_engine(sys.argv[1])
    lora_path = sys.argv[2]
    test_prompts = create_test_prompts(lora_path)
    process_requests(engine, test_prompts)


if __name__ == "__main__":
    main()
