"""Export: a training checkpoint becomes an HF directory whose model (remote code, offline)
gives our logits with Focus on, in both patterns, generates the same greedy tokens, and whose
tokenizer encodes like ours."""

from __future__ import annotations

import json
import math
import os
import pathlib

import pytest
import torch

from focus_pretrain.convert import export_hf
from focus_pretrain.convert.hf_modeling.configuration_focus import FOCUS_DEFAULTS
from focus_pretrain.convert.hf_modeling.focus_cache import cache_kwargs
from tests.distributed import run_workers
from tests.e2e.runs import launch, overrides
from tests.helpers import require_packages

pytestmark = [pytest.mark.e2e, pytest.mark.hf]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, cache):
    root = tmp_path_factory.mktemp("export")
    run = launch(overrides(root / "run", cache, "train.steps=4"))
    assert run.returncode == 0, run.stderr[-3000:]
    out = export_hf(root / "run", root / "hf", max_shard_size="100KB")
    return root, out


def test_export_layout(exported):
    _, out = exported
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "focus_llama" and config["focus"]["num_groups"] == 4
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_focus.FocusLlamaForCausalLM"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    assert "model.layers.1.self_attn.router.centroids" in index["weight_map"]
    for name in (
        "modeling_focus.py",
        "configuration_focus.py",
        "tokenizer.json",
        "generation_config.json",
    ):
        assert (out / name).is_file(), name
    assert config["pad_token_id"] == config["eos_token_id"] is not None  # batched generate


def test_an_export_never_mixes_with_an_existing_directory(exported, tmp_path):
    """A non-empty target is refused (stale shards or another tokenizer would mix in), and
    ``overwrite=True`` (``--force``) too unless the target is an earlier export (its
    ``focus_export.json``), which it replaces whole, stale shards of that export included."""
    from focus_pretrain.errors import InputError

    root, _ = exported
    target = tmp_path / "hf"
    target.mkdir()
    (target / "model-00009-of-00009.safetensors").write_bytes(b"stale")
    with pytest.raises(InputError, match=r"exists and is not empty: .* pass --force"):
        export_hf(root / "run", target)
    with pytest.raises(InputError, match=r"replaces only an earlier export .*focus_export.json"):
        export_hf(root / "run", target, overwrite=True)
    assert (target / "model-00009-of-00009.safetensors").read_bytes() == b"stale"
    (target / "focus_export.json").write_text("{}")  # an export from before files were listed
    out = export_hf(root / "run", target, overwrite=True)
    assert not (out / "model-00009-of-00009.safetensors").exists()
    assert (out / "config.json").is_file()


def _export_outputs(out, tokens: torch.Tensor, new_tokens: int):
    """The export at ``out`` loaded offline: ``(model, hard logits, soft logits, greedy
    tokens of the first row)``, the model left in hard mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    with torch.no_grad():
        hard = model(tokens).logits
        model.config.focus["inference_mode"] = "soft"
        soft = model(tokens).logits
        model.config.focus["inference_mode"] = "hard"
        greedy = model.generate(tokens[:1], max_new_tokens=new_tokens, do_sample=False)
    return model, hard, soft, greedy


def test_exported_model_matches_ours(exported, monkeypatch):

    root, out = exported
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokens = torch.randint(3, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    ckpt = next((root / "run" / "checkpoints").glob("step_00000004"))
    (ours,) = run_workers("tests.e2e.workers_train:checkpoint_logits", 1, str(ckpt), tokens, 8)
    _, hard, soft, greedy = _export_outputs(out, tokens, 8)
    vocab = hard.shape[-1]
    assert not torch.allclose(ours["soft"], ours["hard"])  # the two patterns differ here
    torch.testing.assert_close(hard, ours["hard"][..., :vocab], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(soft, ours["soft"][..., :vocab], rtol=1e-4, atol=1e-4)
    assert greedy.tolist() == ours["greedy"].tolist()


@pytest.mark.parametrize(
    "edit", [dict(sinks=3), dict(sinks=2, gate_form="dot")], ids=["sinks", "dot-gate-sinks"]
)
def test_export_with_sinks_matches_ours(exported, tmp_path, monkeypatch, edit):
    """Attention sinks and the gate form (``model.focus.sinks``, ``model.focus.gate_form``:
    settings without weights: the trained checkpoint with them set in its config.yaml) go into
    the export's and the router adapter's focus section; the export gives our logits in both
    patterns, and its greedy tokens (sparse KV-cache steps that read the sinks) are ours by full
    recomputation."""
    import shutil

    import yaml

    from focus_pretrain.convert import export_router_adapter

    root, _ = exported
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ckpt = tmp_path / "step_00000004"
    shutil.copytree(root / "run" / "checkpoints" / "step_00000004", ckpt)
    config = yaml.safe_load((ckpt / "config.yaml").read_text())
    config["model"]["focus"].update(edit)
    (ckpt / "config.yaml").write_text(yaml.safe_dump(config))
    out = export_hf(ckpt, tmp_path / "hf")
    exported_focus = json.loads((out / "config.json").read_text())["focus"]
    adapter = export_router_adapter(ckpt, tmp_path / "adapter")
    adapter_focus = json.loads((adapter / "focus_adapter.json").read_text())["focus"]
    assert {key: exported_focus[key] for key in edit} == edit
    assert {key: adapter_focus[key] for key in edit} == edit
    tokens = torch.randint(3, 300, (2, 40), generator=torch.Generator().manual_seed(2))
    (ours,) = run_workers("tests.e2e.workers_train:checkpoint_logits", 1, str(ckpt), tokens, 12)
    model, hard, soft, greedy = _export_outputs(out, tokens, 12)
    vocab = hard.shape[-1]
    torch.testing.assert_close(hard, ours["hard"][..., :vocab], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(soft, ours["soft"][..., :vocab], rtol=1e-4, atol=1e-4)
    assert greedy.tolist() == ours["greedy"].tolist()
    for key in edit:  # each setting matters here
        model.config.focus[key] = FOCUS_DEFAULTS[key]
        with torch.no_grad():
            plain = model(tokens).logits
        model.config.focus[key] = edit[key]
        assert (plain - hard).abs().max() > 1e-3, key


def test_sparse_decode_of_the_trained_export_equals_full_recomputation(exported, monkeypatch):
    """200 greedy tokens through the KV cache (one-token steps read only the window and the
    same-group keys) are the tokens of recomputing the whole sequence at every step, and each
    step read exactly the keys the hard pattern keeps."""
    from transformers import AutoModelForCausalLM, DynamicCache

    _, out = exported
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    prompt = torch.randint(3, 300, (1, 24), generator=torch.Generator().manual_seed(1))
    steps, focus = 200, model.config.focus
    kwargs = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    with torch.no_grad():
        sparse = model.generate(prompt, **kwargs)
        recomputed = model.generate(prompt, use_cache=False, **kwargs)
        cache = DynamicCache(config=model.config)
        model(sparse, **cache_kwargs(model, cache))  # the routing of every token, in one forward
    assert sparse.tolist() == recomputed.tolist()
    n = sparse.shape[1]
    for i, layer in enumerate(model.model.layers):
        members = cache.layers[i].focus_members[0]  # [n]
        kept = 0
        for p in range(prompt.shape[1], n - 1):  # the one-token steps' query positions
            distance = p - torch.arange(p + 1)
            kept += int(
                ((distance <= focus["window"]) | ((members[: p + 1] & members[p]) != 0)).sum()
            )
        assert layer.self_attn.focus_keys_read == kept
        assert kept < 0.7 * sum(range(prompt.shape[1] + 1, n))  # fewer than the dense cache


def test_generate_tool_batches_prompts_like_one_by_one(exported, tmp_path, monkeypatch):
    """tools/generate.py (left-padded batch, KV cache) completes each prompt as greedy
    generation of that prompt alone does."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, out = exported
    prompts = ["The key of the", "Once", "A value is kept in the box of"]
    args = [sys.executable, "tools/generate.py", str(out), "--max-new-tokens", "12"]
    args += [a for p in prompts for a in ("--prompt", p)] + ["--json", str(tmp_path / "g.json")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "g.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    for prompt, completion in zip(prompts, result["completions"], strict=True):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            alone = model.generate(ids, max_new_tokens=12, do_sample=False)
        assert tokenizer.decode(alone[0, ids.shape[1] :], skip_special_tokens=True) == completion
    assert result["new_tokens"] == 36 and result["focus_keys_read"] > 0
    assert result["cache"] == "dynamic" and result["focus_layers"] > 0
    # the static cache (in process: the tool's main) completes the same batch the same way
    from transformers.generation.utils import GenerationMixin

    from focus_pretrain.commands import generate

    caches, plain_generate = [], GenerationMixin.generate

    def recording_generate(self, *a, **kw):
        caches.append(kw.get("cache_implementation"))
        return plain_generate(self, *a, **kw)

    monkeypatch.setattr(GenerationMixin, "generate", recording_generate)
    generate.main([*args[2:-1], str(tmp_path / "static.json"), "--cache", "static"])
    assert caches == ["static"]
    static = json.loads((tmp_path / "static.json").read_text())
    assert static["completions"] == result["completions"]
    assert static["cache"] == "static" and static["focus_keys_read"] is None
    assert static["focus_layers"] == result["focus_layers"]


def test_generate_tool_infers_with_the_focus_settings_given(exported, tmp_path):
    """``--focus KEY=VALUE`` changes how the export infers, not only what it reports: on a
    prompt past the window, the window alone (``window_only=true``) and the original dense
    model (``enabled=false``) each complete as the export loaded with that setting does, and
    that model's logits differ from the export's own pattern's."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from focus_pretrain.data import demo_documents

    _, out = exported
    tokenizer = AutoTokenizer.from_pretrained(out)
    own = json.loads((out / "config.json").read_text())["focus"]
    ids = tokenizer(" ".join(demo_documents(30, seed=5)))["input_ids"][: 3 * own["window"]]
    prompt = tokenizer.decode(ids)
    batch = tokenizer(prompt, return_tensors="pt")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    results, logits = {}, {}
    for name, key, value in ((None, None, None), ("window", "window_only", True),
                             ("dense", "enabled", False)):  # fmt: skip
        model = AutoModelForCausalLM.from_pretrained(
            out, trust_remote_code=True, focus={**own, key: value} if key else own
        ).eval()
        with torch.no_grad():
            logits[name] = model(**batch).logits
            expected = model.generate(**batch, max_new_tokens=6, do_sample=False)
        args = [sys.executable, "tools/generate.py", str(out), "--max-new-tokens", "6"]
        args += ["--prompt", prompt, "--json", str(tmp_path / f"{name}.json")]
        args += ["--focus", f"{key}={str(value).lower()}"] if key else []
        run = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
        assert run.returncode == 0, run.stderr[-3000:]
        results[name] = json.loads((tmp_path / f"{name}.json").read_text())
        assert results[name]["focus"] == ({**own, key: value} if key else own)
        completion = expected[0, batch["input_ids"].shape[1] :]  # [new]
        text = tokenizer.decode(completion, skip_special_tokens=True)
        assert results[name]["completions"] == [text]
        if key:
            assert not torch.allclose(logits[name], logits[None], atol=1e-4), name
    assert results[None]["focus_keys_read"] > 0  # its routed layers decode sparsely
    assert results["window"]["focus_layers"] == results["dense"]["focus_layers"] == 0


def test_exported_tokenizer_encodes_like_ours(exported, cache):
    from transformers import AutoTokenizer

    from focus_pretrain.data import Tokenizer, demo_documents

    _, out = exported
    ours = Tokenizer(next(pathlib.Path(cache).glob("tokenizer-*.model")))
    theirs = AutoTokenizer.from_pretrained(out)
    specials = "an HTML <s>strike</s> and <unk> spelled out, as training read them"
    texts = [*demo_documents(20, seed=77), "Unseen: ünïcödé ☃ text\twith  spaces\n", specials]
    for text in texts:
        assert theirs(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    assert theirs.decode(theirs(specials, add_special_tokens=False)["input_ids"]) == specials
    assert Tokenizer(out).encode(specials) == ours.encode(specials)  # our reader of an export
    assert (theirs.bos_token_id, theirs.eos_token_id) == (ours.bos, ours.eod)
    assert os.environ.get("HF_HUB_OFFLINE") in (None, "1")


def test_export_refuses_a_tokenizer_larger_than_the_vocabulary(exported, tmp_path):
    """The checkpoint's own tokenizer copy is what an export ships; another one named with
    ``--tokenizer`` (``tokenizer=``) that does not fit the embeddings is refused."""
    from focus_pretrain.data import demo_documents
    from tests.helpers import make_hf_tokenizer

    root, _ = exported
    ckpt = root / "run" / "checkpoints" / "step_00000004"
    assert (ckpt / "tokenizer.model").is_file()  # the run's, copied at save time
    other = make_hf_tokenizer(tmp_path / "tok", demo_documents(50), 400)
    with pytest.raises(ValueError, match=r"has 400 tokens but the model only 320 embeddings"):
        export_hf(ckpt, tmp_path / "out", tokenizer=other)
    assert not (tmp_path / "out").exists()


def test_export_finds_the_tokenizer_from_any_directory(exported, tmp_path, monkeypatch):
    """A checkpoint carries its tokenizer: exporting from another working directory, with
    the run's relative ``data.cache_dir`` gone, still ships it (it was dropped silently)."""
    import shutil

    from focus_pretrain.checkpoint.read import checkpoint_config

    root, _ = exported
    ckpt = tmp_path / "step_00000004"
    shutil.copytree(root / "run" / "checkpoints" / "step_00000004", ckpt)
    cache_dir = checkpoint_config(ckpt).data.cache_dir
    monkeypatch.chdir(tmp_path)
    out = export_hf(ckpt, tmp_path / "hf")
    assert (out / "tokenizer.json").is_file()
    # a checkpoint from before the copy, trained with the shipped recipes' relative cache
    (ckpt / "tokenizer.model").unlink()
    (ckpt / "checkpoint.json").unlink()
    recipe = ckpt / "config.yaml"
    recipe.write_text(recipe.read_text().replace(f"cache_dir: {cache_dir}", "cache_dir: data/c"))
    missing = r"tokenizer .* is not found, relative to the current directory .*--no-tokenizer"
    with pytest.raises(FileNotFoundError, match=missing):
        export_hf(ckpt, tmp_path / "hf2")
    assert not (export_hf(ckpt, tmp_path / "hf3", with_tokenizer=False) / "tokenizer.json").exists()


def _edited_checkpoint(exported, tmp_path, **focus):
    """A copy of the trained checkpoint whose config.yaml says other Focus values."""
    import shutil

    import yaml

    root, _ = exported
    ckpt = tmp_path / "step_00000004"
    shutil.copytree(root / "run" / "checkpoints" / "step_00000004", ckpt)
    config = yaml.safe_load((ckpt / "config.yaml").read_text())
    config["model"]["focus"].update(focus)
    (ckpt / "config.yaml").write_text(yaml.safe_dump(config))
    return ckpt


def test_the_export_tool_refuses_routers_its_config_does_not_describe(exported, tmp_path):
    """A checkpoint whose config.yaml was edited after training (more groups than the routers
    have, ``top_k`` past them): one line naming the tensor and the fields to restore, status 2,
    no traceback (it was a bare size-mismatch RuntimeError); fewer groups likewise."""
    import subprocess
    import sys

    from focus_pretrain.errors import InputError
    from tests.e2e.runs import ROOT

    ckpt = _edited_checkpoint(exported, tmp_path, num_groups=8, top_k=5)
    for extra in ([], ["--adapter-only"]):
        tool = [sys.executable, str(ROOT / "tools" / "convert_to_hf.py"), str(ckpt)]
        done = subprocess.run(
            [*tool, str(tmp_path / "out"), *extra], capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 2, done.stderr[-2000:]
        assert "Traceback" not in done.stderr
        (line,) = [x for x in done.stderr.splitlines() if x.startswith("convert_to_hf.py: error:")]
        assert "router.centroids is [4, 16] but its config.yaml describes [8, 16]" in line
        assert "restore its num_groups, group_dim to the trained values" in line
    fewer = _edited_checkpoint(exported, tmp_path / "fewer", num_groups=2)
    with pytest.raises(InputError, match=r"centroids is \[4, 16\] but .* describes \[2, 16\]"):
        export_hf(fewer, tmp_path / "out")


def test_export_of_a_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"neither a checkpoint .* nor a run directory"):
        export_hf(tmp_path, tmp_path / "out")


@pytest.mark.multiprocess
def test_export_of_tensor_parallel_and_zero3_runs(tmp_path, monkeypatch, layout_run):
    """A TP=2 run's shards are merged (its exported model gives the TP=2 model's logits);
    ZeRO-3 runs are consolidated, at DP=2 and at TP=2 (their exports give the same logits as
    the run of the same layout whose parameters are not partitioned: ZeRO-2 at DP=2, ZeRO-1
    at TP=2). The runs are the session's layout runs (``tests/e2e/conftest.py``)."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokens = torch.randint(3, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    results = {}
    for name in ("tp2", "dp2", "dp2-zero3", "tp2-zero3"):
        _, run = layout_run(name)
        out = export_hf(run, tmp_path / f"hf-{name}")
        model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
        with torch.no_grad():
            results[name] = model(tokens).logits
    _, tp2 = layout_run("tp2")
    ckpt = str(tp2 / "checkpoints" / "step_00000003")
    ours = run_workers("tests.e2e.workers_train:sharded_checkpoint_logits", 2, ckpt, tokens)
    torch.testing.assert_close(results["tp2"], ours[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(results["dp2-zero3"], results["dp2"], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(results["tp2-zero3"], results["tp2"], rtol=1e-3, atol=1e-3)


def test_lm_eval_perplexity_task_on_the_export(exported, tmp_path, monkeypatch):
    """lm-evaluation-harness (when installed) evaluates the export as an ``hf`` model on the
    shipped offline task; its word perplexity equals one computed directly."""
    require_packages("lm_eval", extra="eval")
    import re

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from focus_pretrain.data import demo_documents
    from focus_pretrain.eval.lm_eval_task import evaluate_perplexity

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, out = exported
    docs = ["\n".join(d.split("\n")[:4]) for d in demo_documents(6, seed=99)]  # < 128 tokens
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    result = evaluate_perplexity(out, data, tmp_path / "tasks", batch_size=1)
    batched = evaluate_perplexity(out, data, tmp_path / "tasks8", batch_size=8)
    assert batched["word_perplexity,none"] == pytest.approx(
        result["word_perplexity,none"], rel=1e-5
    )
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    total, words = 0.0, 0
    for doc in docs:
        ids = [tokenizer.bos_token_id, *tokenizer(doc, add_special_tokens=False)["input_ids"]]
        assert len(ids) <= model.config.max_position_embeddings
        x = torch.tensor([ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(x).logits.double(), dim=-1)
        total += float(logp[0, :-1].gather(1, x[0, 1:, None]).sum())
        words += len(re.split(r"\s+", doc))
    assert result["word_perplexity,none"] == pytest.approx(math.exp(-total / words), rel=1e-4)


def test_ruler_needles_through_lm_evals_generator_offline(exported, monkeypatch):
    """``focus-pretrain ruler``: lm-eval's own RULER generator builds each task's samples at
    each length with the export's tokenizer, offline; the export answers through lm-eval's
    ``hf`` model and lm-eval scores it. The tasks that download their text are skipped with
    the reason; every sample is counted at its length, its prompt sized for that length (the
    tiny model extrapolates past its 128 positions), and each score is the share of the
    needles' values in the answer."""
    require_packages("lm_eval", "wonderwords", "nltk", extra="eval")
    from focus_pretrain.eval.ruler import run_ruler

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, out = exported
    tasks, lengths = ["niah_single_1", "niah_multikey_2", "niah_single_2"], [704, 896]
    result = run_ruler(out, tasks, lengths, samples=2, max_new_tokens=12)
    assert list(result["skipped"]) == ["niah_single_2"]
    assert "Paul Graham essays" in result["skipped"]["niah_single_2"]
    assert result["samples"] == {task: {"704": 2, "896": 2} for task in tasks[:2]}
    for task in tasks[:2]:
        for length in lengths:
            fewest, most = result["prompt_tokens"][task][str(length)]
            assert length // 2 < fewest <= most <= length, (task, length, fewest, most)
    for record in result["records"]:
        answer = record["response"].strip().lower()
        found = sum(value.lower() in answer for value in record["answers"])
        assert record["score"] == found / len(record["answers"])
        assert all(value.isdigit() and len(value) == 7 for value in record["answers"])
    for task in tasks[:2]:
        for length in lengths:
            mine = [r["score"] for r in result["records"] if r["task"] == task
                    and r["length"] == length]  # fmt: skip
            assert result["scores"][task][str(length)] == sum(mine) / len(mine)
    assert result["focus"] == json.loads((out / "config.json").read_text())["focus"]


def test_ruler_infers_with_the_focus_settings_given(exported, monkeypatch):
    """``focus-pretrain ruler --focus KEY=VALUE``: the result records the settings, and
    lm-eval's model is the export loaded with them: the original dense model
    (``enabled=false``: no router) and top-2 give the logits of the export loaded with those
    settings directly, which differ from its own pattern's on a sequence past the window."""
    require_packages("lm_eval", "wonderwords", "nltk", extra="eval")
    from transformers import AutoModelForCausalLM

    from focus_pretrain.eval.ruler import lm_eval_model, run_ruler

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, out = exported
    own = json.loads((out / "config.json").read_text())["focus"]
    result = run_ruler(out, ["niah_single_1"], [512], samples=1, max_new_tokens=4,
                       focus=["enabled=false", "sinks=2"])  # fmt: skip
    assert result["focus"] == {**own, "enabled": False, "sinks": 2}
    assert result["samples"] == {"niah_single_1": {"512": 1}}
    ids = torch.randint(3, 200, (1, 4 * own["window"]))
    with torch.no_grad():
        mine = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)(ids).logits
        for key, value in (("enabled", False), ("top_k", 2)):
            settings = {**own, key: value}
            model = lm_eval_model(out, settings, max_length=1024).model
            routers = [m for m in model.modules() if hasattr(m, "router")]
            assert bool(routers) == settings["enabled"], key
            direct = AutoModelForCausalLM.from_pretrained(
                out, trust_remote_code=True, focus=settings
            )
            theirs = model(ids).logits
            torch.testing.assert_close(theirs, direct(ids).logits)
            assert not torch.allclose(theirs, mine, atol=1e-4), key
