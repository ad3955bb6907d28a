"""The shipped modeling code across transformers releases: the tested range it warns outside of,
the releases it refuses, and finding the KV cache whatever transformers calls it."""

from __future__ import annotations

import importlib.util
import inspect
import sys
import warnings

import pytest
import torch
from transformers import DynamicCache

from focus_pretrain.convert.hf_export import MODELING_DIR, _shipped_configuration, load_modeling
from focus_pretrain.convert.hf_modeling.focus_cache import cache_kwargs, returned_cache
from tests.unit.test_hf_generation import focus_model

pytestmark = pytest.mark.hf
configuration = _shipped_configuration()
modeling = load_modeling()


def version_warnings(caught) -> list:
    return [
        w for w in caught if issubclass(w.category, configuration.FocusTransformersVersionWarning)
    ]


def test_a_version_outside_the_tested_range_warns_once(monkeypatch):
    monkeypatch.setattr(configuration, "_WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert configuration.check_transformers_version()  # the installed one: inside
        monkeypatch.setattr(configuration.transformers, "__version__", "5.99.1")
        assert not configuration.check_transformers_version()
        assert not configuration.check_transformers_version()  # once
        assert not configuration.check_transformers_version(">=5.0,<5.3")  # another range
    messages = [str(w.message) for w in version_warnings(caught)]
    assert len(messages) == 2
    assert "transformers 5.99.1" in messages[0] and configuration.TESTED_TRANSFORMERS in messages[0]
    assert "pip install 'transformers>=5.0,<5.3'" in messages[1]


def test_loading_a_config_checks_the_range_it_records(monkeypatch):
    """An export's ``focus_transformers`` record (not the code's own constant) decides."""
    monkeypatch.setattr(configuration, "_WARNED", set())
    installed = configuration.transformers.__version__
    record = {"tested": f">=4.0,<{installed}", "exported_with": "4.0"}  # excludes the installed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = modeling.FocusLlamaConfig(focus_transformers=record, num_hidden_layers=1)
        modeling.FocusLlamaConfig(num_hidden_layers=1)  # built in code: the code's own range
    assert config.focus_transformers == record
    (warning,) = version_warnings(caught)
    assert f"transformers {configuration.transformers.__version__}" in str(warning.message)
    assert f">=4.0,<{installed}" in str(warning.message)


@pytest.mark.parametrize("version", ["4.57.1", "4.0.0"])
def test_a_release_before_5_is_refused_on_import(monkeypatch, version):
    # (transformers replaces its own module object in sys.modules on some imports)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", version)
    spec = importlib.util.spec_from_file_location(
        "focus_old_configuration", MODELING_DIR / "configuration_focus.py"
    )
    module = importlib.util.module_from_spec(spec)
    with pytest.raises(ImportError, match=rf"needs transformers >= 5.0 .* {version} is installed"):
        spec.loader.exec_module(module)
    sys.modules.pop("focus_old_configuration", None)


def test_the_kv_cache_is_found_by_what_it_is_not_by_its_keyword():
    inputs = sys.modules[modeling.capture_input.__module__]  # the shipped focus_inputs
    cache = DynamicCache()
    hidden = torch.randn(1, 2, 4)
    for args, kwargs in [
        ((hidden,), {"past_key_values": cache}),  # transformers <= 5.23
        ((hidden,), {"cache": cache}),  # 5.24
        ((hidden, None, cache), {}),  # positional
        ((hidden,), {"layer_past": cache, "use_cache": True}),
    ]:
        assert inputs.passed_cache(args, kwargs) is cache
    assert inputs.passed_cache((hidden,), {"past_key_values": None, "use_cache": True}) is None


def test_the_model_level_cache_keyword_is_the_models_own():
    model = focus_model()
    parameters = inspect.signature(model.forward).parameters
    (keyword,) = cache_kwargs(model, None)
    assert keyword in parameters and keyword in ("cache", "past_key_values")
    ids = torch.randint(1, 50, (1, 6))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache = returned_cache(out)
        assert cache.get_seq_length() == 6
        cache_kwargs(model, cache)
        step = model(ids[:, :1], use_cache=True, **cache_kwargs(model, cache))
    assert returned_cache(step) is cache and cache.get_seq_length() == 7
    full = torch.cat([ids, ids[:, :1]], dim=1)
    with torch.no_grad():
        expected = model(full, use_cache=False).logits[:, -1]
    torch.testing.assert_close(step.logits[:, -1], expected, rtol=1e-5, atol=1e-5)
