"""``import hybridlm`` is enough for transformers' Auto classes, whichever of the two is imported first."""

import subprocess
import sys

import pytest

from tests.helpers import tiny_model


@pytest.mark.parametrize("imports", ["import hybridlm\nimport transformers", "import transformers\nimport hybridlm"])
def test_auto_classes_load_a_checkpoint_after_import_hybridlm(imports, tmp_path):
    tiny_model().save_pretrained(tmp_path)
    script = (f"{imports}\nfrom transformers import AutoModelForCausalLM\n"
              f"model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})\nprint(type(model).__name__)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("HybridForCausalLM")
