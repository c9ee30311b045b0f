"""The remote-code shim every hybridlm checkpoint carries, so that tools which load custom architectures with
``trust_remote_code=True`` (lm-eval, serving engines, ``AutoModelForCausalLM.from_pretrained``) find hybridlm's
classes without importing hybridlm first.

``config.json`` names two small files saved beside the weights (its ``auto_map``, the transformers convention);
each only imports the installed ``hybridlm`` package, so no model code travels with a checkpoint. Where hybridlm is
not installed, transformers' import check says so: "requires the following packages that were not found in your
environment: hybridlm. Run `pip install hybridlm`".
"""

from __future__ import annotations

import os
from pathlib import Path

#: ``config.json``'s ``auto_map``: the Auto class -> ``file.Class`` beside the weights.
AUTO_MAP = {
    "AutoConfig": "configuration_hybridlm.HybridConfig",
    "AutoModel": "modeling_hybridlm.HybridModel",
    "AutoModelForCausalLM": "modeling_hybridlm.HybridForCausalLM",
}

_HEADER = '"""hybridlm checkpoint shim (trust_remote_code): the classes come from the installed hybridlm package."""\n'

#: The shim files, by name.
FILES = {
    "configuration_hybridlm.py": _HEADER + "from hybridlm import HybridConfig  # noqa: F401\n",
    "modeling_hybridlm.py": _HEADER + "from hybridlm import HybridForCausalLM, HybridModel  # noqa: F401\n",
}


def write_remote_code(directory: str | os.PathLike) -> None:
    """Write the shim files into a checkpoint directory (each crash-safely)."""
    from hybridlm.files import write_file

    for name, text in FILES.items():
        write_file(Path(directory) / name, text)
