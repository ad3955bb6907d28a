"""Every bad input to every ``focus-pretrain`` subcommand ends the command with one line on
stderr, ``focus-pretrain CMD: error: <what is wrong and the fix>``, and status 2, before any
output is written (issue 40). A table: one list of rows per command, each row the argv and a
substring the error line must hold; ``{in}`` is a directory of prepared inputs (not an export,
a fake run, a fake export, an empty corpus...; files only, nothing trained) and ``{out}`` the
row's own empty directory, where every output path points and which must stay empty. The
rows run in this process through :func:`focus_pretrain.cli.main` (PyTorch imported once), a
few through the installed console script to show the real process does the same."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from focus_pretrain import cli

ROOT = Path(__file__).parents[2]
CONSOLE = Path(sys.executable).parent / "focus-pretrain"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# -- the table: rows per command (train, export and retrofit rows go in lists of their own) --


def rows(command: str | None, *cases: tuple[list[str], str, str]) -> list:
    """The rows of ``focus-pretrain COMMAND`` (``None``: the top-level parser): each case is
    ``(ARGS, a substring of the error line, a name)``."""
    head = [command] if command else []
    return [
        pytest.param([*head, *args], substring, id=f"{command or 'top'}-{name}")
        for args, substring, name in cases
    ]


TOP = rows(
    None,
    (["nope"], "unknown command 'nope'; choose from train, retrofit", "unknown"),
    (["genrate", "x"], "did you mean 'generate'?", "misspelt"),
    (["--nope"], "unknown option '--nope'; give a command first", "option"),
    (["-v", "generate"], "unknown option '-v'", "short-option"),
)

IMPORT_HF = rows(
    "import-hf",
    (["{in}/missing"], "config.json does not exist", "missing"),
    (["{in}/hf_no_weights"], "has no model.safetensors", "weights"),
    (["{in}/hf_unknown"], "unsupported HuggingFace architecture", "unknown"),
    (
        ["{in}/hf_no_weights", "--groups", "0"],
        "argument --groups: must be an integer >= 1, got 0",
        "groups-0",
    ),
    (
        ["{in}/hf_no_weights", "--groups", "65"],
        "focus.num_groups must be <= 64, got 65",
        "groups-65",
    ),
    (
        ["{in}/hf_no_weights", "--window", "-1"],
        "argument --window: must be an integer >= 0",
        "window",
    ),
    ([], "the following arguments are required: hf_dir", "no-dir"),
    (["{in}/bad_json"], "config.json is not valid JSON", "bad-json"),
    (["{in}/hf_no_heads"], "lacks 'num_attention_heads', which its architecture needs", "field"),
)

EVALUATE = rows(
    "evaluate",
    (
        ["--checkpoint", "{in}/missing", "--out", "{out}/e.json"],
        "is neither a checkpoint",
        "missing",
    ),
    ([], "the following arguments are required: --checkpoint", "none"),
    (
        ["--checkpoint", "{in}/run", "--set", "train.stepz=3", "--out", "{out}/e"],
        "unknown key(s) train.stepz; allowed keys:",
        "unknown-key",
    ),
    (
        ["--checkpoint", "{in}/run", "--set", "model.focus.top_k=9"],
        "focus.top_k must be <= num_groups (4), got 9",
        "bad-value",
    ),
    (
        ["--checkpoint", "{in}/run", "--set", "top_k"],
        "override 'top_k' must look like section.key=value",
        "bad-override",
    ),
    (
        ["--checkpoint", "{in}/run", "--out", "{out}/e.json"],
        "is gone; pass --set data.tokenizer=PATH",
        "tokenizer-gone",
    ),
    (["--checkpoint", "{in}/run", "--out", "{in}"], "argument --out: ", "out-is-a-directory"),
)

GENERATE = rows(
    "generate",
    (
        ["{in}/not_export", "--prompt", "x", "--json", "{out}/g.json"],
        "config.json does not exist: give a directory written by `focus-pretrain export",
        "not-an-export",
    ),
    (
        ["{in}/run", "--prompt", "x"],
        "is a training run or checkpoint, not an export: export it first",
        "a-run",
    ),
    (
        ["{in}/adapter", "--prompt", "x"],
        "holds the routers alone (export --adapter-only)",
        "an-adapter",
    ),
    (["{in}/export_no_tokenizer", "--prompt", "x"], "has no tokenizer.json", "no-tokenizer"),
    (
        ["{in}/export_edited", "--prompt", "x"],
        "modeling_focus.py is not the file the export wrote (its sha256 differs",
        "edited-code",
    ),
    (
        ["{in}/export", "--prompt", "", "--json", "{out}/g.json"],
        '--prompt "" is empty',
        "empty-prompt",
    ),
    (["{in}/export"], "give at least one --prompt", "no-prompt"),
    (
        ["{in}/export", "--prompt", "x", "--json", "{in}/export/config.json"],
        "--json {in}/export/config.json is inside the export {in}/export: write it elsewhere",
        "json-into-the-export",
    ),
    (
        ["{in}/export", "--prompts-file", "{in}/prompts.txt", "--json", "{in}/prompts.txt"],
        "--json {in}/prompts.txt is the --prompts-file: write it elsewhere",
        "json-over-the-prompts",
    ),
    (["{in}/export", "--prompt", "x", "--device", "tpu"], "'tpu' is not a device", "device"),
    (
        ["{in}/export", "--prompt", "x", "--max-new-tokens", "-3"],
        "argument --max-new-tokens: must be an integer >= 1, got -3",
        "negative-count",
    ),
    (
        ["{in}/export", "--prompts-file", "{in}/missing.txt"],
        "missing.txt does not exist",
        "missing-prompts-file",
    ),
    (
        ["{in}/export", "--prompts-file", "{in}/blank.txt"],
        "blank.txt holds no prompt",
        "blank-prompts-file",
    ),
    (
        ["{in}/export", "--prompt", "x", "--top-p", "1.5"],
        "argument --top-p: must be a number in (0, 1], got 1.5",
        "top-p",
    ),
    (
        ["{in}/export", "--prompt", "x", "--sample", "--temperature", "0"],
        "argument --temperature: must be a number > 0",
        "temperature",
    ),
    (
        ["{in}/export", "--prompt", "x", "--backend", "nope"],
        "--backend nope: focus.inference_backend must be one of",
        "backend",
    ),
    (
        ["{in}/plain_hf", "--prompt", "x", "--mode", "soft"],
        "without a focus section in config.json, not a Focus export",
        "mode-of-a-plain-model",
    ),
    (
        ["{in}/export", "--prompt", "x", "--focus", "top_k"],
        "--focus 'top_k': give KEY=VALUE, e.g. --focus top_k=2",
        "focus-without-value",
    ),
    (
        ["{in}/export", "--prompt", "x", "--focus", "num_groups=2"],
        "--focus num_groups=2: 'num_groups' is not an inference setting (what the routers were "
        "trained with); choose from enabled, window_only,",
        "focus-learned-key",
    ),
    (
        [
            "{in}/export",
            "--prompt",
            "x",
            "--mode",
            "soft",
            "--focus",
            "inference_backend=decomposed",
        ],
        "--mode soft --focus inference_backend=decomposed: focus.inference_backend 'decomposed' "
        "computes "
        "hard top-1 attention only, got top_k=1, inference_mode='soft'",
        "focus-with-mode",
    ),
    (
        ["{in}/plain_hf", "--prompt", "x", "--focus", "enabled=false"],
        "without a focus section in config.json, not a Focus export",
        "focus-of-a-plain-model",
    ),
)

RULER = rows(
    "ruler",
    (
        ["{in}/run", "--lengths", "512", "--json", "{out}/r.json"],
        "is a training run or checkpoint, not an export",
        "a-run",
    ),
    (
        ["{in}/not_export", "--markdown", "{out}/r.md"],
        "config.json does not exist",
        "not-an-export",
    ),
    (["{in}/export_no_tokenizer"], "has no tokenizer.json", "no-tokenizer"),
    (
        ["{in}/export", "--tasks", "niah_single_9"],
        "unknown RULER task(s) niah_single_9; choose from",
        "unknown-task",
    ),
    (
        ["{in}/export", "--lengths", "100"],
        "length 100 leaves no room for a RULER prompt",
        "short-length",
    ),
    (["{in}/export", "--samples", "0"], "argument --samples: must be an integer >= 1", "samples"),
    (
        ["{in}/export", "--tasks", "niah_single_2"],
        "no task to run: niah_single_2: its generator downloads",
        "offline",
    ),
    (["{in}/export", "--dtype", "fp8"], "invalid choice: 'fp8'", "dtype"),
    (["{in}/bad_json"], "config.json is not valid JSON", "bad-json"),
    (
        ["{in}/export", "--focus", "top_k=99", "--json", "{out}/r.json"],
        "--focus top_k=99: focus.top_k must be <= num_groups",
        "focus-top-k",
    ),
    (
        ["{in}/export", "--focus", "enabled=maybe"],
        "--focus enabled=maybe: focus.enabled must be true or false, got 'maybe'",
        "focus-flag",
    ),
    (
        ["{in}/export", "--focus", "tau=0.5"],
        "'tau' is not an inference setting (what the routers were trained with)",
        "focus-learned-key",
    ),
    (
        ["{in}/export", "--focus", "top_k=--2"],
        "--focus top_k=--2: focus.top_k must be an integer, got '--2'",
        "focus-not-a-number",
    ),
    (
        ["{in}/export", "--focus", "sink=4"],
        "--focus sink=4: 'sink' is not an inference setting; choose from enabled,",
        "focus-unknown-key",
    ),
)

INSPECT = rows(
    "inspect",
    (
        ["--checkpoint", "{in}/missing", "--corpus", "demo:5", "--out", "{out}/g"],
        "does not exist: pass a run directory",
        "missing",
    ),
    (
        ["--checkpoint", "{in}/not_export", "--corpus", "demo:5", "--out", "{out}/g"],
        "is neither a checkpoint",
        "not-a-checkpoint",
    ),
    (
        ["--checkpoint", "{in}/plain_hf", "--corpus", "demo:5", "--out", "{out}/g"],
        "without a focus section",
        "not-focus",
    ),
    (
        ["--checkpoint", "{in}/export", "--out", "{out}/g"],
        "give either --text FILE [FILE ...] or --corpus SOURCE",
        "no-text",
    ),
    (
        ["--checkpoint", "{in}/export", "--text", "{in}/missing.txt", "--out", "{out}"],
        "--text {in}/missing.txt does not exist",
        "missing-text",
    ),
    (
        ["--checkpoint", "{in}/export", "--corpus", "demo:0", "--out", "{out}/g"],
        "demo:0: N in demo:N must be a positive integer",
        "demo-0",
    ),
    (
        ["--checkpoint", "{in}/export", "--corpus", "{in}/missing.jsonl", "--out", "x"],
        "corpus file {in}/missing.jsonl does not exist",
        "missing-corpus",
    ),
    (
        ["--checkpoint", "{in}/export", "--corpus", "demo:5", "--samples", "0"],
        "argument --samples: must be an integer >= 1",
        "samples",
    ),
    (
        ["--checkpoint", "{in}/export", "--corpus", "demo:5", "--out", "{in}/blank.txt"],
        "blank.txt is a file: give a directory for the report",
        "out-is-a-file",
    ),
    (
        [
            "--checkpoint",
            "{in}/export",
            "--corpus",
            "demo:5",
            "--tokenizer",
            "{in}/x",
            "--out",
            "{out}/g",
        ],
        "--tokenizer {in}/x does not exist",
        "missing-tokenizer",
    ),
)

PREPROCESS = rows(
    "preprocess",
    (
        ["--input", "{in}/empty.jsonl", "--output", "{out}/s", "--train-tokenizer"],
        "empty.jsonl: empty input file (no records); remove it from the inputs",
        "empty-file",
    ),
    (
        [
            "--input",
            "{in}/empty.jsonl",
            "--output-prefix",
            "{out}/p/x",
            "--train-tokenizer",
            "--skip-bad-records",
        ],
        "hold no records: give a corpus with some text",
        "empty-corpus",
    ),
    (
        ["--input", "{in}/empty_dir", "--output", "{out}/s", "--train-tokenizer"],
        "holds no .json/.jsonl/.parquet/.txt files",
        "empty-directory",
    ),
    (
        ["--input", "{in}/missing.jsonl", "--output", "{out}/s", "--train-tokenizer"],
        "corpus file {in}/missing.jsonl does not exist",
        "missing-input",
    ),
    (
        ["--input", "{in}/corpus.csv", "--output", "{out}/s", "--train-tokenizer"],
        "unknown kind of input file",
        "unknown-kind",
    ),
    (
        ["--input", "demo:10", "--output", "{out}/s", "--tokenizer", "{in}/t.model"],
        "tokenizer model {in}/t.model does not exist",
        "missing-tokenizer",
    ),
    (
        ["--input", "demo:10", "--output", "{out}/s", "--tokenizer", "{in}/empty_dir"],
        "is a directory without tokenizer.json",
        "tokenizer-directory",
    ),
    (
        ["--input", "demo:10", "--output", "{out}/s", "--train-tokenizer", "--vocab-size", "100"],
        "vocab_size=100 is less than the 259 pieces",
        "vocab-size",
    ),
    (
        ["--input", "demo:10", "--output-prefix", "{in}/dataset", "--tokenizer", "x.model"],
        "{in}/dataset.bin, {in}/dataset.idx exist: pass --overwrite to replace them",
        "prefix-exists",
    ),
    (
        ["--input", "demo:0", "--output-prefix", "{out}/p", "--train-tokenizer"],
        "demo:0: N in demo:N must be a positive integer",
        "demo-0",
    ),
    (
        ["--input", "demo:10", "--output", "{out}/s", "--train-tokenizer", "--workers", "0"],
        "argument --workers: must be an integer >= 1, got 0",
        "workers",
    ),
    (
        ["--input", "demo:10", "--output", "{out}/s"],
        "give exactly one of --tokenizer MODEL or --train-tokenizer",
        "no-tokenizer",
    ),
    (
        ["--input", "demo:10", "--train-tokenizer"],
        "one of the arguments --output --output-prefix is required",
        "no-output",
    ),
    (
        ["--input", "demo:9", "--output", "{in}/blank.txt", "--train-tokenizer"],
        "blank.txt is a file: give a directory for the shards",
        "output-is-a-file",
    ),
)

BENCH = rows(
    "bench",
    (
        ["--seq", "0", "--json", "{out}/b.json"],
        "argument --seq: must be an integer >= 1, got 0",
        "seq",
    ),
    (
        ["--device", "cpu", "--heads", "6", "--heads-kv", "4", "--json", "{out}/b"],
        "--heads 6 is not a multiple of --heads-kv 4",
        "heads",
    ),
    (
        ["--device", "cpu", "--groups", "2", "--top-k", "3"],
        "every --top-k (3) is above every --groups (2)",
        "top-k",
    ),
    (["--device", "cpu", "--groups", "65"], "--groups 65 is more than 64", "groups"),
    (
        ["--device", "cpu", "--backends", "flex", "nope"],
        "--backends: unknown backend(s) nope; choose from auto,",
        "backend",
    ),
    (["--device", "cpu", "--no-hard"], "add --train", "nothing-to-run"),
    (["--device", "gpu0"], "argument --device: 'gpu0' is not a device", "device"),
    (["--dtype", "fp64"], "invalid choice: 'fp64'", "dtype"),
    (
        ["--markdown", "{in}/blank.txt/b.md"],
        "blank.txt is a file, not a directory",
        "output-below-a-file",
    ),
)

TINY = str(ROOT / "configs" / "tiny.yaml")
RING = ["--set", "parallel.cp_mode=ring"]
NO_RING_STEP = ["--set", "model.focus.inference_backend=decomposed"]  # no per-block form
EMPTY_LATEST = "run.output_dir={in}/run_empty_latest"
TRAIN = rows(  # refused before the trainer starts (the trainer's own: test_checkpoint_faults)
    "train",
    (["--config", "{in}/missing.yaml"], "config file {in}/missing.yaml does not exist", "recipe"),
    (["--config", TINY, "--set", "train.stepz=3"], "unknown key(s) train.stepz", "unknown-key"),
    (["--config", TINY, "--set", "train.steps=-1"], "train.steps must be >= 1", "bad-value"),
    (["--config", TINY, "--set", "steps"], "must look like section.key=value", "bad-override"),
    (
        ["--config", TINY, "--set", "data.seq_length=256"],
        "model.max_seq_length (128) must be >= data.seq_length (256)",
        "too-long",
    ),
    (["--config", "{in}/blank.txt"], "blank.txt is empty: give a recipe", "empty-recipe"),
    (
        ["--config", TINY, "--set", "data.copy_spans=4", "--set", "data.copy_min_distance=100"],
        "data.copy_spans=4 of data.copy_span_tokens=32 at data.copy_min_distance=100 need "
        "samples of at least 260 tokens",
        "copies-too-long",
    ),
    (
        ["--config", TINY, "--set", "parallel.tensor_parallel_size=3"],
        "num_attention_heads (4) must be divisible by",
        "tp",
    ),
    (
        ["--config", TINY, "--set", "parallel.context_parallel_size=3", *RING],
        "data.seq_length (128) must be divisible by 2 x parallel.context_parallel_size",
        "cp-ring",
    ),
    (
        ["--config", TINY, "--set", "parallel.context_parallel_size=8"],
        "parallel.cp_mode 'a2a' splits each tensor-parallel rank's heads (4 / 1 = 4)",
        "cp-a2a",
    ),
    (
        ["--config", TINY, "--set", "parallel.context_parallel_size=2", *RING, *NO_RING_STEP],
        "model.focus.inference_backend 'decomposed' cannot run inside the ring",
        "ring-backend",
    ),
    ([], "the following arguments are required: --config", "no-recipe"),
)
if not _cuda():
    TRAIN += rows(
        "train",
        (["--config", TINY, "--set", "train.precision=fp16"], "fp16 needs a GPU", "fp16-cpu"),
    )

EXPORT = rows(  # nothing is read past the checks: the runs are fakes with empty weights
    "export",
    (["{in}/missing", "{out}/hf"], "is neither a checkpoint", "missing"),
    (
        ["{in}/run_empty_latest", "{out}/hf"],
        "checkpoints/latest is empty (checkpoints present: step_00000002)",
        "empty-latest",
    ),
    (
        ["{in}/run_dangling_latest", "{out}/hf"],
        "latest names step_00000009, which does not exist (checkpoints present: step_00000002)",
        "dangling-latest",
    ),
    (["{in}/run", "{out}/hf"], "tokenizer", "tokenizer-gone"),
    (["{in}/run", "{in}/blank.txt", "--force", "--no-tokenizer"], "is a file", "onto-a-file"),
    (
        ["{in}/run", "{in}/user_files", "--force", "--no-tokenizer"],
        "replaces only an earlier export (a directory with focus_export.json or "
        "focus_adapter.json)",
        "onto-user-files",
    ),
    (["{in}/run", "{in}/run", "--force", "--no-tokenizer"], "holds the checkpoint", "onto-run"),
    (
        ["{in}/run", "{in}/run/checkpoints/step_00000002", "--force", "--no-tokenizer"],
        "is the checkpoint",
        "onto-checkpoint",
    ),
    (["{in}/run", "{out}/hf", "--tokenizer", "{in}/missing.model"], "does not exist", "tok"),
    (
        ["{in}/run", "{out}/hf", "--max-shard-size", "abc"],
        "argument --max-shard-size: 'abc' is not a shard size: give a positive number with a "
        "unit KB, MB, GB or TB",
        "shard-size",
    ),
    (["{in}/run", "{out}/hf", "--max-shard-size", "0GB"], "'0GB' is not a shard size", "zero"),
    (["{in}/run", "{out}/hf", "--max-shard-size", "5"], "'5' is not a shard size", "no-unit"),
    (
        ["{in}/run", "{out}/hf", "--tokenizer", "x", "--no-tokenizer"],
        "give --tokenizer or --no-tokenizer, not both",
        "tok-both",
    ),
)

RETROFIT = rows(  # every input is checked before --out is touched
    "retrofit",
    (["{in}/missing", "--data", "demo:10", "--out", "{out}/r"], "is not a directory", "no-model"),
    (
        ["{in}/hf_no_weights", "--data", "{in}/missing.jsonl", "--out", "{out}/r"],
        "corpus file {in}/missing.jsonl does not exist",
        "no-data",
    ),
    (["{in}/hf_no_weights", "--data", "demo:10", "--out", "{in}/blank.txt"], "is a file", "file"),
    (
        ["{in}/hf_no_weights", "--data", "demo:10", "--out", "{in}/user_files", "--force"],
        "replaces only an earlier retrofit output (a directory with focus_retrofit.json)",
        "force-user-files",
    ),
    (
        ["{in}/hf_no_weights", "--data", "demo:10", "--out", "{in}/user_files"],
        "exists and is not empty",
        "not-empty",
    ),
    (
        ["{in}/hf_no_weights", "--data", "demo:10", "--out", "{in}", "--force"],
        "holds the model",
        "out-holds-model",
    ),
    (
        ["{in}/hf_no_weights", "--data", "demo:10", "--out", "{out}/r", "--steps", "0"],
        "--steps must be at least 1",
        "steps",
    ),
    (
        ["{in}/hf_no_weights", "--data", "demo:10", "--out", "{out}/r", "--max-hard-gap", "-1"],
        "--max-hard-gap must be a number >= 0, got -1.0",
        "max-hard-gap",
    ),
    (
        ["{in}/hf_no_weights", "--data", "demo:10", "--out", "{out}/r", "--max-far-gap", "nan"],
        "--max-far-gap must be a number >= 0, got nan",
        "max-far-gap",
    ),
    (
        ["{in}/hf_no_weights", "--data", "demo:10", "--out", "{out}/r"],
        "has no model.safetensors",
        "no-weights",
    ),
    (["{in}/hf_no_weights", "--out", "{out}/r"], "required: --data", "data-required"),
    (
        ["{in}/hf_no_weights", "--data", "demo:10", "--out", "{in}/user_files", "--resume"],
        "--resume continues an earlier retrofit, but {in}/user_files holds none",
        "resume-user-files",
    ),
    (
        ["{in}/hf_no_weights", "--data", "demo:10", "--out", "{out}/r", "--resume"],
        "--resume continues an earlier retrofit, but {out}/r holds none",
        "resume-nothing",
    ),
)

ROWS = [
    *TOP,
    *TRAIN,
    *EXPORT,
    *RETROFIT,
    *IMPORT_HF,
    *EVALUATE,
    *GENERATE,
    *RULER,
    *INSPECT,
    *PREPROCESS,
    *BENCH,
]


# -- the inputs ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """Files that are wrong in one way each: a directory that is no export, a run whose
    checkpoint holds a recipe but no weights (its tokenizer is gone), fake exports (the files
    an export has, empty: nothing gets as far as reading them), an empty corpus..."""
    root = tmp_path_factory.mktemp("bad-inputs")
    (root / "not_export").mkdir()
    (root / "not_export" / "notes.txt").write_text("some text\n")
    (root / "empty_dir").mkdir()
    (root / "empty.jsonl").write_text("")
    (root / "blank.txt").write_text("\n  \n")
    (root / "prompts.txt").write_text("the user's prompt\n")
    (root / "corpus.csv").write_text("text\nsome text\n")
    _fake_run(root / "run")
    for name, pointer in (("run_empty_latest", ""), ("run_dangling_latest", "step_00000009")):
        shutil.copytree(root / "run", root / name)
        (root / name / "checkpoints" / "latest").write_text(pointer)
    for suffix in (".bin", ".idx"):  # a dataset of the user's at an --output-prefix
        (root / f"dataset{suffix}").write_bytes(b"the user's tokens")
    (root / "user_config").mkdir()
    (root / "user_config" / "config.yaml").write_text("# the user's notes\nfoo: 1\n")
    (root / "user_files").mkdir()
    (root / "user_files" / "notes.txt").write_text("the user's, never deleted\n")
    focus = {"num_groups": 4, "window": 8, "top_k": 1}
    _fake_export(root / "export", {"focus": focus}, tokenizer=True)
    _fake_export(root / "export_no_tokenizer", {"focus": focus}, tokenizer=False)
    _fake_export(root / "export_edited", {"focus": focus}, tokenizer=True)
    record = {"remote_code_sha256": {"modeling_focus.py": "0" * 64}}  # not the file's
    (root / "export_edited" / "focus_export.json").write_text(json.dumps(record))
    _fake_export(root / "plain_hf", {}, tokenizer=True)
    (root / "bad_json").mkdir()
    (root / "bad_json" / "config.json").write_text("{not json")
    (root / "adapter").mkdir()
    (root / "adapter" / "focus_adapter.json").write_text("{}")
    llama = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    llama.update(num_attention_heads=4, num_key_value_heads=2, vocab_size=320, rms_norm_eps=1e-5)
    llama.update(max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=False)
    llama.update(hidden_act="silu", architectures=["LlamaForCausalLM"])
    no_heads = {k: v for k, v in llama.items() if k != "num_attention_heads"}
    hf_configs = (("hf_no_weights", llama), ("hf_unknown", {"model_type": "weird"}))
    for name, config in (*hf_configs, ("hf_no_heads", no_heads)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
    return root


def _fake_run(run: Path) -> None:
    """A run directory whose latest checkpoint has the tiny recipe and an empty weights file
    (its tokenizer, in a data cache that is not there, is gone)."""
    from focus_pretrain.config import config_to_dict, load_config

    recipe = yaml.safe_dump(config_to_dict(load_config(ROOT / "configs" / "tiny.yaml")))
    step = run / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (step / "config.yaml").write_text(recipe)
    (step / "mp_rank_00_model_states.pt").write_bytes(b"")
    (run / "checkpoints" / "latest").write_text("step_00000002")
    (run / "config.yaml").write_text(recipe)


def _fake_export(out: Path, extra: dict, tokenizer: bool) -> None:
    """The files of an export (``focus`` in ``extra``: a Focus one, with its code), empty."""
    out.mkdir()
    config = {"model_type": "llama", "max_position_embeddings": 2048, **extra}
    if "focus" in extra:
        config["model_type"] = "focus_llama"
        config["auto_map"] = {
            "AutoConfig": "configuration_focus.FocusLlamaConfig",
            "AutoModelForCausalLM": "modeling_focus.FocusLlamaForCausalLM",
        }
        for name in ("configuration_focus.py", "modeling_focus.py"):
            (out / name).write_text("")
    (out / "config.json").write_text(json.dumps(config))
    (out / "model.safetensors").write_bytes(b"")
    if tokenizer:
        (out / "tokenizer.json").write_text("{}")


def _argv(row: list[str], inputs: Path, out: Path) -> list[str]:
    return [a.replace("{in}", str(inputs)).replace("{out}", str(out)) for a in row]


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _check_one_line(argv: list[str], code: object, err: str, substring: str) -> None:
    prefix = f"focus-pretrain {argv[0]}" if argv[0] in cli.COMMANDS else "focus-pretrain"
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err[-3000:]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"{prefix}: error: "), lines[0]
    assert substring in lines[0], lines[0]


# -- the tests -------------------------------------------------------------------------------


@pytest.mark.parametrize("row, substring", ROWS)
def test_bad_input_is_one_line_and_status_2(row, substring, inputs, tmp_path, monkeypatch, capfd):
    """In this process, through ``focus_pretrain.cli.main``: one line, status 2, nothing
    written (the working directory is the row's empty ``{out}`` too, so that a file written
    at a relative path would show)."""
    out = tmp_path / "out"
    out.mkdir()
    argv, substring = _argv(row, inputs, out), _argv([substring], inputs, out)[0]
    before = _files(inputs)
    monkeypatch.chdir(out)
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # cli.main sets the script's argv
    monkeypatch.setattr(cli, "_program", None)
    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    _, err = capfd.readouterr()
    _check_one_line(argv, done.value.code, err, substring)
    assert _files(out) == [], "an output was written before the input was refused"
    assert _files(inputs) == before


@pytest.mark.parametrize(
    "row, substring",
    [
        pytest.param(
            [
                "preprocess",
                "--input",
                "{in}/empty.jsonl",
                "--output",
                "{out}/s",
                "--train-tokenizer",
                "--skip-bad-records",
            ],
            "hold no records: give a corpus with some text",
            id="preprocess-empty-corpus",
        ),
        pytest.param(
            ["train", "--config", "{in}/run_empty_latest/config.yaml", "--set", EMPTY_LATEST],
            "checkpoints/latest is empty (checkpoints present: step_00000002)",
            id="train-empty-latest",
        ),
        pytest.param(
            ["generate", "{in}/export", "--prompt", "", "--json", "{out}/g.json"],
            '--prompt "" is empty',
            id="generate-empty-prompt",
        ),
        pytest.param(  # the user's config.yaml there is kept (tests/unit/test_resume.py)
            ["train", "--config", TINY, "--set", "run.output_dir={in}/user_config"],
            "user_config/config.yaml is not a recipe this program wrote",
            id="train-user-config-yaml",
        ),
        pytest.param(
            ["train", "--config", TINY, "--set", "run.output_dir={in}/blank.txt/run"],
            "blank.txt/run cannot be a run directory: it or a folder above it is a file",
            id="train-output-below-a-file",
        ),
        pytest.param(  # refused inside the trainer: the run directory it made is gone again
            [
                "train",
                "--config",
                TINY,
                "--set",
                "run.output_dir={out}/runs/tiny",
                "--set",
                "data.tokenizer={in}/blank.txt",
            ],
            "blank.txt is not a SentencePiece model",
            id="train-tokenizer-not-sentencepiece",
        ),
    ],
)
def test_the_console_script_prints_one_line_and_exits_2(row, substring, inputs, tmp_path):
    """The real process (``focus-pretrain``, the installed console script): no warning, no
    traceback, one line."""
    script = CONSOLE if CONSOLE.is_file() else shutil.which("focus-pretrain")
    if script is None:
        if os.environ.get("CI"):  # make setup installs it: its absence is a broken set-up
            pytest.fail(f"{CONSOLE} is not installed; make setup installs the console script")
        pytest.skip("the focus-pretrain console script is not installed (make setup)")
    out = tmp_path / "out"
    out.mkdir()
    argv = _argv(row, inputs, out)
    done = subprocess.run(
        [str(script), *argv], capture_output=True, text=True, timeout=300, cwd=out
    )
    _check_one_line(argv, done.returncode, done.stderr, substring)
    assert done.stdout == "" and _files(out) == []
