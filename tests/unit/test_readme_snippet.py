"""The README's "Use it in your own script" snippet, run as written (a tiny model and CPU-sized batch swapped in),
then restarted twice into the same folder: every restart continues from the newest checkpoint, never from step 0."""

from __future__ import annotations

import json
import re
import sys

from hf_dist.testing import REPO_ROOT, cpu_env, run_checked

# What the snippet leaves to the reader, made concrete; everything else is the README's own text.
SWAPS = {
    'AutoModelForCausalLM.from_pretrained("meta-llama/Llama-3.1-8B")': "AutoModelForCausalLM.from_config(tiny_llama_config())",
    "global_batch_size=64, seq_len=4096": "global_batch_size=2, seq_len=16, max_steps=STEPS, save_steps=2, report_to=[]",
    '"out"': "OUT",
}
PRELUDE = """
import json, sys
import torch
from hf_dist.testing import TokenDataset, tiny_llama_config
OUT, STEPS = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
ds = TokenDataset(64)
"""
EPILOGUE = """
json.dump({"steps_run": trainer.state.global_step - (int(resume.rsplit("-", 1)[1]) if resume else 0),
           "resumed_from": resume, "global_step": trainer.state.global_step}, open(OUT + "/run.json", "w"))
"""


def readme_snippet() -> str:
    text = (REPO_ROOT / "README.md").read_text()
    section = text[text.index("## Use it in your own script") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    for old, new in SWAPS.items():
        assert old in code, f"the README snippet no longer contains {old!r}: update SWAPS"
        code = code.replace(old, new)
    # name the checkpoint auto_resume chose, for the report
    code = code.replace(
        "trainer.train(resume_from_checkpoint=hf_dist.auto_resume(OUT, training_args=args))",
        "resume = hf_dist.auto_resume(OUT, training_args=args)\ntrainer.train(resume_from_checkpoint=resume)",
    )
    assert "resume = hf_dist.auto_resume" in code, "the README snippet's train line changed: update this test"
    return PRELUDE + code + EPILOGUE


def test_the_readme_snippet_restarted_twice_continues_every_time(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(readme_snippet())
    out = tmp_path / "out"
    runs = []
    for steps in (2, 4, 6):  # a first launch, then two restarts of the same script that ask for more steps
        run_checked([sys.executable, str(script), str(out), str(steps)], env=cpu_env(), timeout=300)
        runs.append(json.loads((out / "run.json").read_text()))
    assert [r["resumed_from"] for r in runs] == [None, str(out / "checkpoint-2"), str(out / "checkpoint-4")]
    assert [r["steps_run"] for r in runs] == [2, 2, 2] and runs[-1]["global_step"] == 6
    assert (out / "checkpoint-6" / "hf_dist_complete.json").is_file()  # attach() put the markers there
