"""GGUF files: a tiny Llama written as llama.cpp lays it out (q/k rows permuted, some tensors Q8_0) loads into
hybridlm with the logits of the transformers model it was written from, converts to a checkpoint directory, and
every bad file is a clear error naming it."""

import sys

import numpy as np
import pytest
import torch
import transformers

import hybridlm

from .compare import check_logits, random_ids, tiny_transformers_model

gguf = pytest.importorskip("gguf")

VOCAB = 258  # the tokenizer's: 256 byte symbols, one merge, <|endoftext|>
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
              tie_word_embeddings=True)


def llama_cpp_rows(weight: torch.Tensor, heads: int) -> np.ndarray:
    """q/k rows in llama.cpp's order (each head's two rotary halves interleaved), as its converter writes them."""
    out, width = weight.shape
    return weight.reshape(heads, 2, out // heads // 2, width).swapaxes(1, 2).reshape(out, width).numpy()


def add_tokenizer(writer) -> None:
    """A byte-level BPE vocabulary (:data:`VOCAB` tokens) and a chat template, as llama.cpp stores them."""
    from tokenizers import pre_tokenizers

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["ab", "<|endoftext|>"]
    assert len(tokens) == VOCAB
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (VOCAB - 1) + [3])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(VOCAB - 1)
    writer.add_eos_token_id(VOCAB - 1)
    writer.add_chat_template("{% for m in messages %}<|endoftext|>{{ m['content'] }}{% endfor %}"
                             "{% if add_generation_prompt %}<|endoftext|>{% endif %}")


def write_gguf(model, path, quantized=("ffn_up", "ffn_down"), qtype=None, tokenizer=True) -> None:
    """``model`` (a tiny LlamaForCausalLM) as a GGUF file with (``tokenizer``) a vocabulary; tensors whose name
    contains one of ``quantized`` are stored as ``qtype`` (default Q8_0), the rest as F32."""
    qtype = qtype or gguf.GGMLQuantizationType.Q8_0
    c = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    if tokenizer:
        add_tokenizer(writer)
    state = model.state_dict()
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    for i in range(c.num_hidden_layers):
        names.update({f"model.layers.{i}.{ours}.weight": f"blk.{i}.{theirs}.weight"
                      for ours, theirs in per_layer.items()})
    for ours, theirs in names.items():
        weight = state[ours].float()
        if theirs.endswith("attn_q.weight"):
            array = llama_cpp_rows(weight, c.num_attention_heads)
        elif theirs.endswith("attn_k.weight"):
            array = llama_cpp_rows(weight, c.num_key_value_heads)
        else:
            array = weight.numpy()
        if any(part in theirs for part in quantized):
            if qtype == gguf.GGMLQuantizationType.Q8_0:
                writer.add_tensor(theirs, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
            else:  # raw blocks of a type without a dequantizer
                block, size = gguf.GGML_QUANT_SIZES[qtype]
                raw = np.zeros((array.shape[0], array.shape[1] // block * size), dtype=np.uint8)
                writer.add_tensor(theirs, raw, raw_dtype=qtype)
        else:
            writer.add_tensor(theirs, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """``(transformers model, GGUF path)``: the F32 parts of the file are that model's weights exactly."""
    hf = tiny_transformers_model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**CONFIG))
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(hf, path)
    return hf, path


def test_gguf_loads_like_transformers_reads_it(gguf_file):
    """hybridlm's model of the file equals transformers' (same dequantized weights), and, the Q8_0 MLPs aside,
    the model the file was written from: the q/k rows are put back in order."""
    original, path = gguf_file
    ours = hybridlm.load(path)
    assert ours.config.layer_types == ["attention"] * 2 and ours.config.tie_word_embeddings
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    check_logits(theirs, ours, random_ids(VOCAB, 2, 17), atol=1e-5)
    ids = random_ids(VOCAB, 2, 17)
    with torch.no_grad():
        reference = original(ids).logits
        error = ((ours(ids).logits - reference).abs().max() / reference.abs().max()).item()
    assert error < 2e-2, f"the GGUF model is not the one written (relative error {error:.3g})"
    assert torch.equal(ours.model.layers[0].mixer.q_proj.weight, original.model.layers[0].self_attn.q_proj.weight)
    same = hybridlm.load(path.parent, gguf_file=path.name)
    assert torch.equal(same.model.layers[1].mlp.up_proj.weight, ours.model.layers[1].mlp.up_proj.weight)


def test_convert_gguf_to_a_llama_directory(gguf_file, tmp_path, capsys):
    """``hybridlm convert model.gguf OUT`` writes the file's own family with its tokenizer; generate then runs
    from either with the same tokens, the chat template applied with --chat."""
    from hybridlm.cli import main

    _, path = gguf_file
    main(["convert", str(path), str(tmp_path / "out")])
    assert "(llama, with its tokenizer)" in capsys.readouterr().out
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert isinstance(back, transformers.LlamaForCausalLM)
    check_logits(back, hybridlm.load(path), random_ids(VOCAB, 2, 11), atol=1e-5)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer("abc")["input_ids"] == [256, 66]
    outputs = []
    for model in (str(path), str(tmp_path / "out")):
        main(["generate", "--model", model, "--prompt", "abc", "--chat", "--max-new-tokens", "5"])
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].strip()


def test_tokenizer_that_does_not_fit_is_refused(gguf_file, tmp_path):
    from hybridlm.formats.gguf import read_gguf_tokenizer
    from hybridlm.training.tokenizer import tokenizer_for

    _, path = gguf_file
    read_gguf_tokenizer(path.parent, path.name).save_pretrained(tmp_path)
    assert len(tokenizer_for(tmp_path, VOCAB)) == VOCAB
    with pytest.raises(ValueError, match=rf"{tmp_path} has {VOCAB} tokens but the model has vocab_size=200"):
        tokenizer_for(tmp_path, 200)


def test_truncated_gguf_is_named(gguf_file, tmp_path):
    _, path = gguf_file
    data = path.read_bytes()
    for cut in (len(data) - 1000, 200):
        short = tmp_path / f"cut{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=rf"{short.name}.*truncated"):
            hybridlm.load(short)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="bad.gguf"):
        hybridlm.load(bad)


def test_quantization_without_a_dequantizer_is_named(tmp_path):
    hf = tiny_transformers_model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**CONFIG))
    path = tmp_path / "q81.gguf"
    write_gguf(hf, path, quantized=("ffn_up",), qtype=gguf.GGMLQuantizationType.Q8_1)
    with pytest.raises(ValueError, match=r"q81.gguf: tensor blk.0.ffn_up.weight is Q8_1, which transformers cannot"):
        hybridlm.load(path)


def test_missing_extra_is_named(gguf_file, monkeypatch):
    _, path = gguf_file
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    with pytest.raises(ImportError, match=r"hybridlm\[gguf\]"):
        hybridlm.load(path)


def test_missing_gguf_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.gguf"):
        hybridlm.load(tmp_path / "nothing.gguf")
    with pytest.raises(FileNotFoundError, match="other.gguf"):
        hybridlm.load(tmp_path, gguf_file="other.gguf")
