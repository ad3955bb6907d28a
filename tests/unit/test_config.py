"""Recipe loading: YAML + dotted overrides -> typed config, with errors naming the key."""

from __future__ import annotations

import pathlib

import pytest

from focus_pretrain.config import Config, load_config, save_config

ROOT = pathlib.Path(__file__).parents[2]
RECIPE = ROOT / "configs" / "7b.yaml"


def test_recipe_and_overrides_are_typed():
    config = load_config(
        RECIPE,
        [
            "run.output_dir=runs/x",
            "model.focus.window=256",
            "model.rotary_base=500000",
            "model.num_layers=4",
            "model.focus.normalize=false",
            "run.name=seven b",
        ],
    )
    assert isinstance(config, Config)
    assert config.run.output_dir == "runs/x" and config.run.name == "seven b"
    assert config.model.family == "mistral" and config.model.num_layers == 4
    assert config.model.focus.window == 256 and config.model.focus.num_groups == 4
    assert config.model.rotary_base == 500000.0 and isinstance(config.model.rotary_base, float)
    assert config.model.focus.normalize is False
    assert load_config(None) == Config()


@pytest.mark.parametrize(
    "override, error",
    [
        ("model.focus.windw=3", r"unknown key\(s\) model.focus.windw; allowed keys: enabled"),
        ("trian.steps=3", r"unknown key\(s\) trian; allowed keys: run, model"),
        ("model.num_layers=abc", r"model.num_layers must be int, got 'abc'"),
        ("model.num_layers=2.5", r"model.num_layers must be int, got 2.5"),
        ("model.focus.normalize=1", r"model.focus.normalize must be bool, got 1"),
        ("model.focus.window=-1", r"focus.window must be >= 0, got -1"),
        ("model.family=bert", r"model.family must be one of 'gpt2'"),
        ("model.num_layers", r"override 'model.num_layers' must look like section.key=value"),
        ("model.num_layers.x=1", r"model.num_layers is a value, not a section"),
        ("model=3", r"model must be a mapping, got 3"),
        ("model.focus.training_mode=sparse", r"focus.training_mode must be one of 'soft', 'hard'"),
        (
            "model.focus.soft_warmup_steps=5",
            r"soft_warmup_steps=5 warms up sparse training .*"
            r"set model.focus.training_mode=hard",
        ),
    ],
)
def test_bad_overrides_name_the_key(override, error):
    with pytest.raises(ValueError, match=error):
        load_config(RECIPE, [override])


@pytest.mark.parametrize(
    "overrides, error",
    [
        (["train.objective=kd"],
         r"train.objective must be one of 'lm', 'distill', 'mix', 'attention_mass'"),
        (["train.objective=distill"], r"train.objective=distill learns from the frozen original"
         r", so it needs train.freeze=retrofit or centroids \(got scratch\)"),
        (["train.objective=attention_mass"], r"train.objective=attention_mass learns from the "
         r"frozen original, so it needs train.freeze=retrofit or centroids \(got scratch\)"),
        (["train.objective=attention_mass", "train.freeze=retrofit",
          "model.focus.gate_form=dot"],
         r"train.objective=attention_mass needs model.focus.gate_form=sigmoid .*got dot"),
        (["train.objective=attention_mass", "train.freeze=retrofit",
          "parallel.context_parallel_size=2"],
         r"train.objective=attention_mass does not run under context parallelism "
         r"\(parallel.context_parallel_size=2\)"),
        (["train.objective=attention_mass", "train.freeze=retrofit", "model.recompute=full"],
         r"model.recompute=full runs without gradients; use model.recompute=selective"),
        (["train.objective=attention_mass", "train.freeze=retrofit", "model.hidden_dropout=0.1"],
         r"model.hidden_dropout=0.1 would perturb; set it to 0"),
        (["train.objective=mix", "train.freeze=two_phase", "train.router_only_steps=2"],
         r"needs train.freeze=retrofit or centroids \(got two_phase\)"),
        (["train.distill_weight=1.5"], r"train.distill_weight must be in \[0, 1\], got 1.5"),
        (["train.distill_weight=.nan"], r"train.distill_weight must be in \[0, 1\]"),
        (["train.distill_temperature=0"], r"train.distill_temperature must be > 0"),
    ],
)  # fmt: skip
def test_distillation_is_refused_where_there_is_no_frozen_original(overrides, error):
    with pytest.raises(ValueError, match=error):
        load_config(RECIPE, overrides)


def test_distillation_settings_load():
    overrides = ["train.objective=mix", "train.freeze=retrofit", "train.distill_weight=0.25"]
    config = load_config(RECIPE, [*overrides, "train.distill_temperature=2"])
    assert (config.train.objective, config.train.distill_weight) == ("mix", 0.25)
    assert config.train.distill_temperature == 2.0
    assert load_config(RECIPE).train.objective == "lm"
    mass = load_config(RECIPE, ["train.objective=attention_mass", "train.freeze=centroids"])
    assert mass.train.objective == "attention_mass"


def test_sparse_training_needs_a_backend_that_trains_on_the_hard_pattern():
    """``training_mode: hard`` trains on the gated hard pattern: the model's training mode, and
    a backend that does not compute it at the recipe's top_k (triton: top-1 only) is refused
    naming those that do."""
    config = load_config(RECIPE, ["model.focus.training_mode=hard", "model.focus.backend=flex"])
    assert config.model.focus.training_pattern == "hard_gated"
    assert load_config(RECIPE).model.focus.training_pattern == "soft"
    warm = ["model.focus.training_mode=hard", "model.focus.soft_warmup_steps=3"]
    warm = load_config(RECIPE, warm)
    patterns = [warm.model.focus.training_pattern_at(step) for step in range(5)]
    assert patterns == ["soft"] * 3 + ["hard_gated"] * 2
    sparse_triton = ["model.focus.training_mode=hard", "model.focus.backend=triton"]
    assert load_config(RECIPE, sparse_triton).model.focus.backend == "triton"  # top-1
    refusal = (
        r"'triton' does not train with model.focus.training_mode='hard' \(it computes the soft "
        r"pattern, hard top-1 attention and gated hard top-1 attention\); use 'auto' or one of "
        r"\['reference', 'flex'\]"
    )
    with pytest.raises(ValueError, match=refusal):
        load_config(RECIPE, [*sparse_triton, "model.focus.top_k=2"])


def test_the_ring_refuses_a_triton_backend_on_the_hard_pattern():
    """The ring's triton step runs the soft gate and sliding windows: triton for sparse
    training or hard inference is refused under the ring before training, with the fix;
    soft training through triton, and sparse training through auto, run there."""
    ring = ["parallel.context_parallel_size=2", "parallel.cp_mode=ring"]
    cases = {
        "backend 'triton' runs the 'hard_gated' pattern": [
            "model.focus.backend=triton", "model.focus.training_mode=hard"
        ],
        "inference_backend 'triton' runs the 'hard' pattern": [
            "model.focus.inference_backend=triton"
        ],
    }  # fmt: skip
    for message, overrides in cases.items():
        with pytest.raises(ValueError, match=rf"{message} .* or parallel.cp_mode 'a2a'"):
            load_config(RECIPE, ring + overrides)
        assert load_config(RECIPE, overrides)  # without the ring: fine
    assert load_config(RECIPE, [*ring, "model.focus.backend=triton"])
    assert load_config(RECIPE, [*ring, "model.focus.training_mode=hard"])


def test_the_resolved_config_is_an_ordinary_readable_file(tmp_path):
    """Written atomically through a private temp file, it ends with the umask's mode (0644
    under 022), not 0600."""
    import os

    from focus_pretrain.config import save_config

    umask = os.umask(0o022)
    try:
        path = save_config(load_config(RECIPE), tmp_path / "config.yaml")
    finally:
        os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o644


def test_a_recipe_builds_on_base_recipes(tmp_path):
    """``defaults:`` names base recipes (relative to the recipe, or the working directory),
    merged in order, then the recipe's own sections key by key; overrides come last. A
    missing base and a cycle are refused naming the recipe."""
    (tmp_path / "base.yaml").write_text(
        "train: {steps: 7, lr: 0.5}\nmodel: {focus: {num_groups: 8, window: 32}}\n"
    )
    (tmp_path / "mid.yaml").write_text("defaults: base.yaml\ntrain: {steps: 9}\n")
    recipe = tmp_path / "run.yaml"
    recipe.write_text(f"defaults: [mid.yaml, {RECIPE}]\nmodel: {{focus: {{window: 16}}}}\n")
    config = load_config(recipe, ["train.lr=0.25"])
    reference = load_config(RECIPE)
    assert config.model.focus.window == 16  # the recipe's own
    assert config.model.focus.num_groups == reference.model.focus.num_groups  # 7b.yaml: later
    assert config.train.steps == reference.train.steps and config.train.lr == 0.25
    assert config.model.num_layers == reference.model.num_layers
    (tmp_path / "only.yaml").write_text("defaults: mid.yaml\n")
    assert load_config(tmp_path / "only.yaml").train.steps == 9  # mid over base
    (tmp_path / "loop.yaml").write_text("defaults: loop2.yaml\n")
    (tmp_path / "loop2.yaml").write_text("defaults: loop.yaml\n")
    with pytest.raises(ValueError, match="in a cycle"):
        load_config(tmp_path / "loop.yaml")
    (tmp_path / "gone.yaml").write_text("defaults: nowhere.yaml\n")
    with pytest.raises(FileNotFoundError, match=r"gone.yaml: its defaults recipe nowhere.yaml"):
        load_config(tmp_path / "gone.yaml")


def test_a_shipped_recipe_is_found_by_name_from_anywhere(tmp_path, monkeypatch):
    """``--config tiny`` (or ``tiny.yaml``) names a recipe shipped in the package, from any
    working directory; a file of that name there wins; a base named like its recipe
    (``retrofit.yaml`` on ``defaults: retrofit.yaml``) is the shipped one, not a cycle."""
    from focus_pretrain.config import RECIPES_DIR, resolve_recipe, shipped_recipes

    monkeypatch.chdir(tmp_path)
    assert {"tiny", "7b", "retrofit"} <= set(shipped_recipes())
    assert resolve_recipe("tiny") == resolve_recipe("tiny.yaml") == RECIPES_DIR / "tiny.yaml"
    assert (
        load_config("tiny").model.num_layers
        == load_config(RECIPES_DIR / "tiny.yaml").model.num_layers
    )
    (tmp_path / "tiny.yaml").write_text("train: {steps: 5}\n")
    assert resolve_recipe("tiny.yaml") == pathlib.Path("tiny.yaml")  # the local file
    assert resolve_recipe("sub/tiny") == pathlib.Path("sub/tiny")  # a path stays a path
    (tmp_path / "retrofit.yaml").write_text("defaults: retrofit.yaml\ntrain: {steps: 3}\n")
    sets = ['data.sources=["demo:10"]', "data.seq_length=64"]  # the base leaves them open
    own, shipped = load_config(tmp_path / "retrofit.yaml", sets), load_config("retrofit", sets)
    assert own.train.steps == 3 and own.train.lr == shipped.train.lr
    with pytest.raises(FileNotFoundError, match=r"shipped recipe's name \(1b-8k-dense, "):
        load_config("no-such-recipe")


def test_missing_recipe_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config file .*nope.yaml does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match=r"must hold a mapping of sections, got list"):
        load_config(bad)


def test_optional_fields_take_null():
    config = load_config(RECIPE, ["model.num_query_groups=null"])
    assert config.model.num_query_groups is None and config.model.kv_heads == 32


def test_resolved_config_round_trips(tmp_path):
    config = load_config(RECIPE, ["model.focus.top_k=2"])
    path = save_config(config, tmp_path / "run" / "config.yaml")
    text = path.read_text()
    assert "gate_lambda: 10.0" in text  # every default is written out
    assert load_config(path) == config
    assert not list(path.parent.glob(".config.yaml.*"))  # no temporary file left behind


def test_1b_8k_recipe_and_its_dense_twin():
    """configs/1b-8k.yaml (~1.2B Llama-style, Focus, 8K on one GPU) and configs/1b-8k-dense.yaml
    differ only in name, directory and Focus; the size is the dry run's meta-device count."""
    focus = load_config(ROOT / "configs" / "1b-8k.yaml")
    dense = load_config(ROOT / "configs" / "1b-8k-dense.yaml")
    twin = ["run.name=1b-8k-dense", "run.output_dir=runs/1b-8k-dense", "model.focus.enabled=false"]
    assert load_config(ROOT / "configs" / "1b-8k.yaml", twin) == dense
    m, f = focus.model, focus.model.focus
    assert (f.enabled, f.num_groups, f.top_k, f.window, f.check_finite) == (True, 8, 1, 128, False)
    assert focus.data.seq_length == m.max_seq_length == 8192 and m.family == "llama"
    assert focus.data.vocab_size <= m.vocab_size and not m.tied
    assert (focus.train.micro_batch_size, focus.parallel.gpus) == (1, 1)
    h, d = m.hidden_size, m.kv_channels
    layer = h * (m.num_attention_heads + 2 * m.kv_heads) * d + m.num_attention_heads * d * h
    layer += 3 * h * m.ffn_hidden_size + 2 * h  # SwiGLU, two RMSNorms
    routers = m.num_layers * (h * f.group_dim + f.num_groups * f.group_dim)
    total = 2 * m.vocab_size * h + m.num_layers * layer + h + routers
    assert total == 1_214_092_288  # launchers/pretrain.py --dry-run (meta device) counts this
    assert 0.9e9 < total < 1.4e9


def test_training_recipes_leave_the_nan_debugging_knob_off():
    """``model.focus.check_finite`` costs a device sync per router and attention call on GPU;
    training skips bad steps instead (train/bad_steps.py), so every shipped recipe leaves it
    off and keeps the bad-step limit."""
    recipes = [p for p in sorted(ROOT.glob("configs/*.yaml")) if p.name != "focus-defaults.yaml"]
    assert len(recipes) >= 7
    filled = {"retrofit.yaml": ['data.sources=["demo:10"]', "data.seq_length=512"]}  # a base
    for path in recipes:
        config = load_config(path, filled.get(path.name, []))
        assert not config.model.focus.check_finite, path.name
        assert config.train.max_consecutive_bad_steps >= 1, path.name


@pytest.mark.parametrize(
    "overrides, error",
    [
        (["data.split=0,100,0"], r"data.split '0,100,0' gives the training split no documents"),
        (["data.split=0,0,0"], r"gives the training split no documents: give its first number"),
        (
            ["data.split=100,0,0"],
            r"gives the validation split no documents, but the run validates .*"
            r"or set train.eval_interval=0",
        ),
        (["parallel.context_parallel_size=2", "data.seq_length=37", "model.max_seq_length=37"],
         r"data.seq_length \(37\) must be divisible by 2 x parallel.context_parallel_size"),
    ],
)  # fmt: skip
def test_a_split_or_length_the_run_cannot_use_is_refused_at_load(overrides, error):
    """Refused when the recipe loads, not at the first validation (or inside Megatron)."""
    with pytest.raises(ValueError, match=error):
        load_config(RECIPE, overrides)


def test_what_the_split_and_length_checks_let_through():
    """No validation share is fine for a run that does not validate; any length is fine
    without context parallelism (nothing is split)."""
    for off in ("train.eval_interval=0", "train.eval_iters=0"):
        assert load_config(RECIPE, ["data.split=100,0,0", off]).data.split == "100,0,0"
    odd = load_config(RECIPE, ["data.seq_length=37", "model.max_seq_length=37"])
    assert odd.data.seq_length == 37


def test_validation_is_never_due_with_eval_iters_or_interval_zero():
    from types import SimpleNamespace

    from focus_pretrain.train.validate import Validator

    due = [
        s for s in range(1, 9) if Validator.due(SimpleNamespace(interval=3, iters=2, steps=8), s)
    ]
    assert due == [3, 6, 8]
    for interval, iters in ((3, 0), (0, 2)):
        validator = SimpleNamespace(interval=interval, iters=iters, steps=8)
        assert not any(Validator.due(validator, s) for s in range(1, 9))


def test_an_evaluation_of_nothing_is_refused():
    from focus_pretrain.errors import InputError
    from focus_pretrain.train.evaluate import check_evaluation

    check_evaluation(load_config(RECIPE))
    with pytest.raises(InputError, match=r"train.eval_iters=0 evaluates no batch: give it >= 1"):
        check_evaluation(load_config(RECIPE, ["train.eval_iters=0"]))
    no_valid = load_config(RECIPE, ["data.split=100,0,0", "train.eval_interval=0"])
    with pytest.raises(InputError, match=r"gives the validation split no documents: nothing"):
        check_evaluation(no_valid)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.focus.top_k=9", "model.focus.top_k must be <= num_groups (4), got 9"),
        (
            "model.focus.soft_warmup_steps=3",
            "model.focus.soft_warmup_steps=3 warms up sparse training with the soft gate: set "
            "model.focus.training_mode=hard",
        ),
    ],
)
def test_a_nested_sections_refusal_names_its_keys_as_the_recipe_spells_them(override, message):
    """``FocusConfig`` validates itself as ``focus.*``; in a recipe it is ``model.focus``."""
    from focus_pretrain.errors import InputError

    with pytest.raises(InputError) as refused:
        load_config(ROOT / "configs" / "tiny.yaml", [override])
    assert str(refused.value).startswith(message), str(refused.value)
    assert "model.model." not in str(refused.value)


def test_a_value_that_looks_like_a_key_is_kept_as_typed():
    """Only the section's own key names are qualified: a value repeated in the refusal,
    or a path, stays as the user wrote it."""
    from focus_pretrain.errors import InputError

    with pytest.raises(InputError) as refused:
        load_config(ROOT / "configs" / "tiny.yaml", ["model.focus.backend=focus.top_k"])
    assert str(refused.value).startswith("model.focus.backend must be one of"), refused.value
    assert "'focus.top_k'" in str(refused.value) and "'model.focus.top_k'" not in str(refused.value)
