"""Write the exports of :mod:`tests.compat.cases` with this package, and what they give.

``python -m tests.compat.write_exports OUT`` (``tools/hf_compat.py`` runs it with the locked
environment): for each case, a tiny random HF checkpoint of the family
(:func:`tests.multiprocess.test_hf_import.make_hf_model`) becomes a Focus export through the
package's own writer (:func:`focus_pretrain.convert.hf_export.hf_export_config`,
:func:`~focus_pretrain.convert.hf_export.save_export`) with random routers; the export is loaded
back as a user would and its hard and soft logits and greedy tokens are saved beside it
(``expected.pt``): the other environments must reproduce them.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from focus_pretrain.convert import hf_model_config, load_hf_tensors
from focus_pretrain.convert.hf_export import hf_export_config, save_export
from focus_pretrain.focus import FocusConfig
from tests.compat.cases import CASES, expected_outputs
from tests.multiprocess.test_hf_import import make_hf_model


def write_export(name: str, out: Path, scratch: Path) -> Path:
    """The export of case ``name`` at ``out / name``, with its ``expected.pt``."""
    from transformers import AutoModelForCausalLM

    hf_name, focus = CASES[name]
    make_hf_model(hf_name, scratch)
    model_cfg = hf_model_config(scratch / hf_name, focus=FocusConfig(**focus))
    model_cls, hf_config = hf_export_config(model_cfg)
    hf_config.pad_token_id = hf_config.bos_token_id = hf_config.eos_token_id = 0
    torch.manual_seed(len(name))
    model = model_cls(hf_config)
    missing, unexpected = model.load_state_dict(load_hf_tensors(scratch / hf_name), strict=False)
    assert not unexpected and all(".router." in k or k == "lm_head.weight" for k in missing)
    with torch.no_grad():
        for key, tensor in model.state_dict().items():
            if ".router." in key:  # random routers, balance offsets not zero
                tensor.add_(0.3 * torch.randn_like(tensor))
    export = save_export(model, out / name, record={"compat_case": name})
    loaded = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True).eval()
    torch.save(expected_outputs(loaded), export / "expected.pt")
    return export


def write_exports(out: Path) -> list[Path]:
    with tempfile.TemporaryDirectory() as scratch:
        return [write_export(name, out, Path(scratch)) for name in CASES]


if __name__ == "__main__":
    for path in write_exports(Path(sys.argv[1])):
        print(path)
