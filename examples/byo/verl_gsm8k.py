"""Write examples/byo's GSM8K-style rows as verl keeps them: OUT/train.parquet and OUT/test.parquet, the layout of
verl's examples/data_preprocess/gsm8k.py (the ground truth nested under reward_model, data_source, ability and
extra_info beside it).

    python examples/byo/verl_gsm8k.py data/verl_gsm8k

Needs pyarrow (pip install 'glmlight[datasets]').
"""

import json
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq

HERE = os.path.dirname(os.path.abspath(__file__))
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'  # verl's gsm8k.py


def verl_row(row: dict, split: str, index: int) -> dict:
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"{row['question']} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": row["answer"]},
        "extra_info": {"split": split, "index": index, "question": row["question"]},
    }


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    for split, name in (("train", "gsm8k.jsonl"), ("test", "gsm8k_test.jsonl")):
        with open(os.path.join(HERE, name)) as f:
            rows = [verl_row(json.loads(line), split, i) for i, line in enumerate(f) if line.strip()]
        pq.write_table(pa.Table.from_pylist(rows), os.path.join(out, f"{split}.parquet"))
        print(f"{os.path.join(out, split + '.parquet')}: {len(rows)} rows")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "data/verl_gsm8k")
