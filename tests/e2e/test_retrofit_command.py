"""``focus-pretrain retrofit HF_DIR --data ...``: a whole retrofit in one command on tiny
HuggingFace models built here (GPT-2 trained in bf16, Llama in fp32): recipe, run, export,
adapter and report; the export's original weights equal the checkpoint's bit for bit (dtype
included) and its logits those of the original model with the adapter attached. A checkpoint
without a tokenizer is refused before any work."""

from __future__ import annotations

import json
import math
import pathlib
import shutil
import sys

import pytest
import torch
import yaml

from tests.e2e.runs import run
from tests.e2e.test_train import _hf_gpt2_with_tokenizer

pytestmark = [pytest.mark.e2e, pytest.mark.hf]
COMMAND = [sys.executable, "-m", "focus_pretrain.cli", "retrofit"]
SMALL = [
    "--data", "demo:80", "--steps", "3", "--groups", "4", "--window", "16",
    "--report-samples", "2", "--set", "train.micro_batch_size=2",
    "--set", "train.global_batch_size=2", "--set", "train.eval_iters=1",
    "--set", "train.recall_docs=0", "--set", "train.save_interval=3",
]  # fmt: skip


def _hf_llama_with_tokenizer(root: pathlib.Path) -> pathlib.Path:
    """A tiny random HF Llama (GQA) plus its own byte-level BPE tokenizer."""
    import transformers

    from focus_pretrain.data import demo_documents
    from tests.helpers import make_hf_tokenizer

    path = make_hf_tokenizer(root / "hf-llama", demo_documents(200, seed=1234), vocab_size=400)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, vocab_size=400, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "family, precision, objective, key_groups",
    [
        ("gpt2", "bf16", "lm", "own"),
        ("llama", "fp32", "mix", "own_and_previous"),  # the export carries the keys' rule
        ("llama", "fp32", "attention_mass", "own"),
    ],
)
def test_one_command_retrofit(tmp_path, family, precision, objective, key_groups):
    import transformers

    from focus_pretrain.config import load_config
    from focus_pretrain.convert import attach_focus_adapter
    from focus_pretrain.convert.hf_import import load_hf_tensors

    build = {"gpt2": _hf_gpt2_with_tokenizer, "llama": _hf_llama_with_tokenizer}[family]
    hf, out = build(tmp_path), tmp_path / "out"
    sets = ["--set", f"train.precision={precision}", "--set", f"data.cache_dir={tmp_path / 'c'}"]
    sets += ["--set", f"train.objective={objective}"]  # mix: distils from the frozen original
    sets += ["--set", f"model.focus.key_groups={key_groups}"]
    done = run([*COMMAND, str(hf), *SMALL, *sets, "--out", str(out)])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    for name in ("report.md", "loss.png", "loss_by_position.png", "export/config.json",
                 "groups/report.md"):  # fmt: skip
        assert (out / name).is_file(), name
    recipe = yaml.safe_load((out / "recipe.yaml").read_text())
    assert recipe["defaults"].endswith("focus_pretrain/recipes/retrofit.yaml")  # the shipped
    config = load_config(out / "recipe.yaml")  # rerunnable as it stands
    assert config.train.init_from_hf == str(hf) and config.train.freeze == "retrofit"
    assert config.data.tokenizer == str(hf) and config.train.precision == precision  # --set
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").open()]
    (start,) = [r for r in records if r.get("event") == "start"]
    assert start["objective"] == objective == config.train.objective
    assert f"objective {objective} (" in (out / "report.md").read_text()
    losses = [r["loss"] for r in records if r.get("split") == "train" and "loss" in r]
    assert losses and all(math.isfinite(x) and x > 0 for x in losses)
    report = json.loads((out / "report.json").read_text())
    variants = ["original (dense)", "retrofit, soft", "retrofit, hard"]
    assert list(report["evaluations"]) == variants
    assert all(math.isfinite(report["evaluations"][v]["loss"]) for v in variants)
    assert 0 < report["evaluations"]["retrofit, hard"]["kept_pairs"] < 1
    assert len(report["groups"]) == 2 and "| retrofit, hard |" in (out / "report.md").read_text()
    by_position = report["evaluations"]["original (dense)"]["loss_by_position"]
    assert list(by_position) == ["0-16", "16-32", "32-64", "64-128"]  # window 16, 128 tokens
    assert "## Loss by position" in (out / "report.md").read_text()
    retrieval = f"`focus-pretrain ruler {out / 'export'} --tasks niah_single_1 --lengths"
    assert retrieval in (out / "report.md").read_text()  # loss does not measure needles
    quality, evaluations = report["quality"], report["evaluations"]  # the hard model's gap
    gap = evaluations["retrofit, hard"]["loss"] - evaluations["original (dense)"]["loss"]
    assert quality["gap"]["loss"] == pytest.approx(gap) and quality["threshold"] == 0.05
    far = quality["gap"]["loss_far_evidence"]  # None: no far-evidence token in validation
    assert quality["far_threshold"] == 0.1
    assert quality["too_large"] == (gap > 0.05 or (far is not None and far > 0.1))
    verdict = "not good enough" if quality["too_large"] else "within --max-hard-gap 0.05"
    assert verdict in done.stdout.splitlines()[-1] and verdict in (out / "report.md").read_text()
    rule = key_groups != "own"  # the levers leave out what the run already does
    assert ("key_groups=own_and_previous" in quality["levers"]) == (not rule)
    assert ("keys own and previous" in (out / "report.md").read_text()) == rule

    originals, exported = load_hf_tensors(hf), load_hf_tensors(out / "export")
    for key, original in originals.items():
        assert exported[key].dtype == original.dtype and torch.equal(exported[key], original), key
    model_class = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM}
    original = model_class[family].from_pretrained(hf).eval()
    attach_focus_adapter(original, out / "adapter")
    export = transformers.AutoModelForCausalLM.from_pretrained(
        out / "export", trust_remote_code=True
    ).eval()
    x = torch.randint(0, 400, (2, 100), generator=torch.Generator().manual_seed(0))
    assert export.config.focus["key_groups"] == key_groups == original.config.focus["key_groups"]
    groups = json.loads((out / "groups" / "report.json").read_text())
    assert groups["settings"]["key_groups"] == key_groups  # kept pairs count the keys' rule
    with torch.no_grad():
        torch.testing.assert_close(export(x).logits, original(x).logits, rtol=1e-5, atol=1e-5)
    routers = {k: v for k, v in exported.items() if ".router." in k and "balance" not in k}
    trained = {"bf16": "the optimizer's fp32 masters, not bf16 copies", "fp32": "fp32"}[precision]
    assert all(r.dtype == torch.float32 for r in routers.values()), trained
    if precision == "bf16":
        assert all(not torch.equal(r, r.bfloat16().float()) for r in routers.values()), trained
    _refuses_another_source(out / "run", original.config)
    if family == "gpt2":  # once: a crash after training costs the report, not the training
        _resumes(hf, out, sets)


def _resumes(hf: pathlib.Path, out: pathlib.Path, sets: list[str]) -> None:
    """``--resume`` continues the earlier retrofit: a changed model or other data is refused
    with one line before anything is touched; a retrofit whose training ended (at its step-3
    checkpoint) but not its report trains nothing again and writes the export and the report
    (a larger ``--steps`` resumes the training further: the trainer's own resume)."""
    args = [*COMMAND, str(hf), *SMALL, *sets, "--out", str(out), "--resume"]
    done = run(args)  # OUT holds a file the retrofit did not write: refused, as --force is
    assert done.returncode == 2 and "did not write (other)" in done.stderr, done.stderr[-2000:]
    shutil.rmtree(out / "other")  # _refuses_another_source's
    recipe, report = (out / "recipe.yaml").read_text(), (out / "report.json").read_text()
    refusals = [
        (["--groups", "8"], "refusing to resume from", "model.focus.num_groups: 4 in the"),
        (["--data", "demo:60"], "--resume: ", "give the same model and --data"),
        (["--force"], "not allowed with argument", "--force"),
    ]
    for extra, *said in refusals:  # the last --groups / --data given wins (argparse)
        done = run([*args, *extra])
        assert done.returncode == 2, done.stderr[-2000:]
        assert all(text in done.stderr for text in said), done.stderr[-2000:]
        assert (out / "recipe.yaml").read_text() == recipe
        assert (out / "report.json").read_text() == report
    (out / "report.json").unlink()  # as if the first run had crashed in its report
    shutil.rmtree(out / "export")
    done = run(args)  # its training is done: nothing is trained again
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").open()]
    starts = [i for i, r in enumerate(records) if r.get("event") == "start"]
    assert [records[i]["resumed"] for i in starts] == [False, True]
    assert not [r for r in records[starts[1] :] if r.get("split") == "train" and "loss" in r]
    assert json.loads((out / "report.json").read_text())["meta"]["steps"] == 3
    assert (out / "export" / "config.json").is_file() and (out / "groups" / "report.md").is_file()


def _refuses_another_source(run_dir: pathlib.Path, hf_config) -> None:
    """The export's originals come from train.init_from_hf only when they are what the run
    froze: a directory holding other weights, or none, is refused naming the key."""
    import transformers

    from focus_pretrain.checkpoint.read import checkpoint_config, resolve_checkpoint
    from focus_pretrain.convert.hf_export import hf_state_dict, with_retrofit_originals
    from focus_pretrain.errors import InputError, MissingInputError

    ckpt = resolve_checkpoint(run_dir)
    other = run_dir.parent / "other"
    transformers.AutoModelForCausalLM.from_config(hf_config).save_pretrained(other)
    state = torch.load(ckpt / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    for path, error in ((other, InputError), (run_dir.parent / "gone", MissingInputError)):
        config = checkpoint_config(ckpt, [f"train.init_from_hf={path}"])
        tensors = hf_state_dict([state], config.model)
        with pytest.raises(error, match=r"train\.init_from_hf"):
            with_retrofit_originals(tensors, config, ckpt)


def test_a_checkpoint_without_its_tokenizer_is_refused_before_any_work(tmp_path):
    hf = _hf_gpt2_with_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (hf / name).unlink()
    done = run([*COMMAND, str(hf), *SMALL, "--out", str(tmp_path / "out")])
    assert done.returncode == 2
    assert "ships no tokenizer and data.tokenizer is not set" in done.stderr
    assert not (tmp_path / "out" / "run").exists()
    shutil.rmtree(tmp_path / "out", ignore_errors=True)


def test_a_retrofit_the_export_cannot_reproduce_is_evaluated_and_reported(tmp_path):
    """``model.focus.balance=sinkhorn`` (routing balanced over the whole sequence, which an
    export, routing each token on its own, cannot reproduce): the retrofit trains, evaluates
    and reports, and says in one line why it wrote no export or adapter."""
    hf, out = _hf_llama_with_tokenizer(tmp_path), tmp_path / "out"
    sets = ["--set", f"data.cache_dir={tmp_path / 'c'}", "--set", "train.precision=fp32"]
    sets += ["--set", "model.focus.balance=sinkhorn"]
    done = run([*COMMAND, str(hf), *SMALL, *sets, "--out", str(out)])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    said = [line for line in done.stdout.splitlines() if "no export or adapter" in line]
    assert len(said) == 1 and "model.focus.balance=sinkhorn" in said[0], said
    assert not (out / "export").exists() and not (out / "adapter").exists()
    report = json.loads((out / "report.json").read_text())
    assert "export" not in report["meta"] and "no export" in report["meta"]
    assert "focus-pretrain ruler" not in (out / "report.md").read_text()  # no export to score
    hard = report["evaluations"]["retrofit, hard"]
    assert math.isfinite(hard["loss"]) and 0 < hard["kept_pairs"] < 1
    assert (out / "groups" / "report.json").is_file()
    from focus_pretrain.config import load_config

    assert load_config(out / "recipe.yaml").model.focus.balance == "sinkhorn"
