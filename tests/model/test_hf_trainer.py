"""transformers' Trainer on a hybridlm model: a run resumed from its checkpoint continues exactly as the
uninterrupted run (Trainer reloads ``config.json`` through the base ``PreTrainedConfig``)."""

import pytest
import torch
from transformers import PreTrainedConfig, Trainer, TrainingArguments

import hybridlm

pytest.importorskip("accelerate")


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, vocab: int, rows: int = 16, length: int = 12):
        self.ids = torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def tiny_model():
    torch.manual_seed(0)
    config = hybridlm.HybridConfig(vocab_size=64, hidden_size=32, layer_pattern="SA", num_attention_heads=2,
                                   mamba2_head_dim=8, mamba2_d_state=8, mamba2_chunk_size=4, intermediate_size=48)
    return hybridlm.HybridForCausalLM(config)


def train(out, resume=None, steps: int = 4):
    args = TrainingArguments(output_dir=str(out), max_steps=steps, save_steps=2, per_device_train_batch_size=4,
                             learning_rate=1e-2, report_to=[], use_cpu=True, seed=0, logging_steps=1,
                             dataloader_num_workers=0)
    trainer = Trainer(model=tiny_model(), args=args, train_dataset=RandomTokens(64))
    trainer.train(resume_from_checkpoint=resume)
    return trainer.model.state_dict()


def test_saved_config_passes_transformers_base_validation(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    assert PreTrainedConfig.from_json_file(str(tmp_path / "config.json")).layer_types[0] == "mamba2"
    assert hybridlm.HybridForCausalLM.from_pretrained(tmp_path).config.num_hidden_layers == 2


def test_trainer_resume_is_exact(tmp_path):
    uninterrupted = train(tmp_path / "a")
    train(tmp_path / "b", steps=4)  # writes checkpoint-2 on its way
    resumed = train(tmp_path / "c", resume=str(tmp_path / "b" / "checkpoint-2"))
    start = tiny_model().state_dict()
    assert any(not torch.equal(start[k], uninterrupted[k]) for k in start), "training changed nothing"
    for name, tensor in uninterrupted.items():
        assert torch.equal(tensor, resumed[name]), name
