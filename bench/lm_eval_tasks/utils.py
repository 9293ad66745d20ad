"""lm-eval tasks on the demo model (worker/demo_model): 24 held-out problems (8 each of sort, reverse and add; none
drawn by its training run), each with its answer and three candidates. Read from beside this file, so
``--include_path`` works from any folder, offline. Tasks: dllm_demo_gen (generate_until), dllm_demo_mc
(multiple_choice), dllm_demo_ll (loglikelihood); docs/api.md has the commands."""
import json
from pathlib import Path


def load(**kwargs):
    import datasets
    rows = [json.loads(line) for line in (Path(__file__).parent / "demo_problems.jsonl").read_text().splitlines()]
    return {"test": datasets.Dataset.from_list(rows)}
