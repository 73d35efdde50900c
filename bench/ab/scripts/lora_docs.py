"""An `LLM` script in the style of vLLM's LoRA docs (docs/features/lora.md: `LLM(model, enable_lora=True)`,
`llm.generate(prompts, sampling_params, lora_request=LoRARequest("sql_adapter", 1, sql_lora_path))`), with a
presence penalty, prompt logprobs, `llm.chat` and n=2 added. Model and adapter are local folders:
``python lora_docs.py MODEL_FOLDER LORA_FOLDER``. Prints one ``SECTION request.sample: ...`` line per completion.
"""

import sys

from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest

prompts = [
    "[user] Write a SQL query to answer the question based on the table schema.\n\n context: CREATE TABLE "
    "table_name_74 (icao VARCHAR, airport VARCHAR)\n\n question: Name the ICAO for lilongwe international airport "
    "[/user] [assistant]",
    "[user] Write a SQL query to answer the question based on the table schema.\n\n context: CREATE TABLE "
    "table_name_11 (nationality VARCHAR, elector VARCHAR)\n\n question: When Anchero Pantaleone was the elector "
    "what is under nationality? [/user] [assistant]",
]
messages = [
    {"role": "system", "content": "You write SQL."},
    {"role": "user", "content": "Name the ICAO for lilongwe international airport."},
]


def show(section, outputs):
    for i, output in enumerate(outputs):
        prompt_logprobs = None if output.prompt_logprobs is None else len(output.prompt_logprobs)
        for c in output.outputs:
            print(f"{section} {i}.{c.index}: finish={c.finish_reason} prompt_logprobs={prompt_logprobs} "
                  f"token_ids={list(c.token_ids)} text={c.text!r}")


def main():
    model_path, sql_lora_path = sys.argv[1], sys.argv[2]
    llm = LLM(model=model_path, enable_lora=True)
    lora = LoRARequest("sql_adapter", 1, sql_lora_path)

    # The docs' call: greedy, a stop string.
    sampling_params = SamplingParams(temperature=0, max_tokens=256, stop=["[/assistant]"])
    show("docs", llm.generate(prompts, sampling_params, lora_request=lora))

    # Greedy with a presence penalty and the prompt's logprobs.
    penalised = SamplingParams(temperature=0, max_tokens=64, presence_penalty=0.2, prompt_logprobs=1)
    show("penalty", llm.generate(prompts, penalised, lora_request=lora))

    # A conversation through the tokenizer's chat template.
    show("chat", llm.chat(messages, SamplingParams(temperature=0, max_tokens=64), lora_request=lora))

    # Two samples per prompt.
    two = SamplingParams(n=2, temperature=0.8, top_p=0.95, seed=0, max_tokens=32)
    show("n2", llm.generate(prompts, two, lora_request=lora))


if __name__ == "__main__":  # vLLM starts its engine core by spawning: the script is imported there
    main()
