"""An offline lm-evaluation-harness task: perplexity of an exported model on local text.

    python -c "from focus_pretrain.eval.lm_eval_task import write_perplexity_task as w; \\
               w('eval.jsonl', 'lm_eval_tasks')"
    lm_eval --model hf --model_args pretrained=exports/tiny,trust_remote_code=True \\
        --tasks focus_local_perplexity --include_path lm_eval_tasks --device cpu --batch_size 8

``eval.jsonl`` holds one ``{"text": ...}`` per line; the task reports word and byte perplexity
and bits per byte (``loglikelihood_rolling``). Needs ``pip install lm_eval accelerate``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

TASK_NAME = "focus_local_perplexity"
_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""


def write_perplexity_task(
    text_jsonl: str | os.PathLike, task_dir: str | os.PathLike, name: str = TASK_NAME
) -> Path:
    """Write the task YAML (pointing at ``text_jsonl`` by absolute path) into ``task_dir``."""
    data = Path(text_jsonl).resolve()
    if not data.is_file():
        raise FileNotFoundError(f"{data} does not exist (one JSON object with 'text' per line)")
    directory = Path(task_dir)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.yaml").write_text(_TASK.format(name=name, data=data))
    return directory


def evaluate_perplexity(
    export_dir: str | os.PathLike,
    text_jsonl: str | os.PathLike,
    task_dir: str | os.PathLike,
    batch_size: int = 8,
) -> dict[str, Any]:
    """Run the task on an exported model (CPU, fp32, padded batches of ``batch_size``);
    lm_eval's ``results`` entry."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError as error:
        raise ImportError(
            "evaluation needs lm-evaluation-harness: pip install lm_eval accelerate"
        ) from error
    write_perplexity_task(text_jsonl, task_dir)
    results = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={Path(export_dir).resolve()},trust_remote_code=True,dtype=float32",
        tasks=[TASK_NAME],
        task_manager=TaskManager(include_path=str(task_dir)),
        batch_size=batch_size,
        device="cpu",
    )
    return results["results"][TASK_NAME]
