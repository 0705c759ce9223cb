"""Run several recipes one after another in the same launched ranks (one launch per strategy).

usage: recipes_matrix.py OUT_DIR RECIPE[,RECIPE...] [recipe args...]
Each recipe writes OUT_DIR/<recipe>/results.json. Sharing the launch saves the ~10-20 s of
imports and process-group start per recipe that separate launches would cost.
"""

import os
import sys
import traceback
from pathlib import Path

from runs import reset_between_runs

from hf_dist.recipe_utils import load_recipe
from hf_dist.runtime.dist import shutdown

RECIPES = Path(__file__).resolve().parents[3] / "recipes"


def main() -> None:
    out, names, rest = Path(sys.argv[1]), sys.argv[2].split(","), sys.argv[3:]
    failed = []
    # TrainingArguments exports ACCELERATE_USE_FSDP/DEEPSPEED; a later recipe would read them as an accelerate config
    # chosen by the user, so each recipe starts from the launch environment and a fresh accelerate state
    environ = dict(os.environ)
    for index, name in enumerate(names):
        if index:
            reset_between_runs(environ)
        try:
            load_recipe(RECIPES / f"{name}.py").main(["--output_dir", str(out / name), *rest])
        except Exception:  # recorded for the test of this recipe; the next recipe still runs
            (out / name).mkdir(parents=True, exist_ok=True)
            (out / name / f"error_rank{os.environ.get('RANK', '0')}.txt").write_text(traceback.format_exc())
            failed.append(name)
    if failed:
        sys.exit(f"recipes failed: {failed}")
    shutdown()


if __name__ == "__main__":
    main()
