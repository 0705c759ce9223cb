"""docs/recipes.md's "Packing chat data" snippets, run as written on a tiny Llama and ten conversations (the hub model,
the sizes and the output folder swapped in): the own-script one with hf_dist's packing, the TRL one with TRL's."""

from __future__ import annotations

import re
import sys

import pytest

from hf_dist.testing import REPO_ROOT, cpu_env, run_checked

SWAPS = {
    "2048": "64",
    "global_batch_size=64": "global_batch_size=2, max_steps=2, report_to=[]",
    '"out"': "OUT",
}
PRELUDE = """
import sys
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from hf_dist.data import build_tokenizer
from hf_dist.embedded.task import train_eval_examples
from hf_dist.testing import tiny_llama_config
OUT = sys.argv[1]
torch.manual_seed(0)
tokenizer = build_tokenizer()
model = AutoModelForCausalLM.from_config(tiny_llama_config(vocab_size=len(tokenizer)))
examples, _ = train_eval_examples(10, 1, seed=0)
chats = Dataset.from_list([{"messages": ex.messages()} for ex in examples])
"""
EPILOGUE = """
assert trainer.state.global_step == 2, trainer.state.global_step
print("trained", trainer.state.global_step)
"""


def snippets() -> list[str]:
    text = (REPO_ROOT / "docs" / "recipes.md").read_text()
    section = text[text.index("## Packing chat data") : text.index("## While it runs")]
    found = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(found) == 2, "docs/recipes.md's packing section should hold its two snippets"
    out = []
    for code in found:
        for old, new in SWAPS.items():
            assert old in code, f"the packing snippet no longer contains {old!r}: update SWAPS"
            code = code.replace(old, new)
        out.append(code)
    own, trl = out
    return [PRELUDE + own + EPILOGUE, PRELUDE + "import hf_dist\n" + trl + EPILOGUE]


@pytest.mark.parametrize("which", ["own_script", "trl"])
def test_the_packing_snippets_train(tmp_path, which):
    if which == "trl":
        pytest.importorskip("trl", reason="TRL is the [trl] extra, installed by `make test`, not by the lowest set")
    script = tmp_path / "train.py"
    script.write_text(snippets()[which == "trl"])
    proc = run_checked([sys.executable, str(script), str(tmp_path / "out")], env=cpu_env(), timeout=300)
    assert "trained 2" in proc.stdout
    if which == "own_script":
        assert "[hf_dist] truncation to 64 tokens:" in proc.stdout
