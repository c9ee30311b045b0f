"""Performer: the stabilised FAVOR+ computation against the plain formula in float64, and feature redraws that
happen per optimizer step only (never in a forward or a checkpoint recompute), identically wherever the same
weights and step count are."""

import copy

import pytest
import torch

from hybridlm import HybridForCausalLM
from tests.helpers import assert_close_rel, random_ids, tiny_model
from tests.mixers.test_mixers import build, run_in_pieces


def favor_reference(mixer, x: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain FAVOR+ formula in float64 with the mixer's weights and random features: ``out_t = sum_s w_ts v_s``
    with ``w_ts`` proportional to ``phi(q_t).phi(k_s)`` over the real keys ``s <= t``, computed in log space
    (``log phi(q).phi(k) = logsumexp_f(log phi_f(q) + log phi_f(k))``), so no stabiliser is involved.
    Returns the output and the key log-features ``[batch, heads, time, features]``."""
    m = copy.deepcopy(mixer).double()
    batch, time, _ = x.shape
    q, k, v = (proj(x.double()).view(batch, time, m.num_heads, -1).transpose(1, 2)
               for proj in (m.q_proj, m.k_proj, m.v_proj))

    def log_phi(z):
        z = z * m.head_dim**-0.25
        return z @ m.projection.double().T - z.square().sum(-1, keepdim=True) / 2

    log_q, log_k = log_phi(q), log_phi(k)
    scores = torch.logsumexp(log_q[:, :, :, None, :] + log_k[:, :, None, :, :], dim=-1)  # [b, h, t, s]
    allowed = torch.ones(time, time, dtype=torch.bool).tril()
    if mask is not None:
        allowed = allowed & mask[:, None, None, :]
    out = scores.masked_fill(~allowed, -torch.inf).softmax(-1).nan_to_num() @ v  # a query with no key: 0
    return m.o_proj(out.transpose(1, 2).reshape(batch, time, -1)), log_k


@pytest.mark.parametrize("scale, rel", [(1e-3, 1e-5), (1.0, 1e-5), (10.0, 2e-5), (30.0, 1e-4)])
def test_matches_the_plain_formula_at_every_input_scale(scale, rel):
    """Tiny inputs (all features near 1), normal ones, and large ones whose key log-features span far beyond
    fp32's exp range (at 30: all below -30, down to about -1500); the error grows only with the rounding of
    the log-features themselves."""
    mixer, config = build("performer")
    x = torch.randn(2, 20, config.hidden_size, generator=torch.Generator().manual_seed(9)) * scale
    with torch.no_grad():
        expected, _ = favor_reference(mixer, x)
        full = mixer(x)
        stepped, _ = run_in_pieces(mixer, x, [3, 7] + list(range(8, 20)))
    assert_close_rel(full, expected, rel=rel)
    assert_close_rel(stepped, expected, rel=rel)


def test_keys_whose_log_features_are_all_far_below_zero():
    """Keys 60x larger than the queries: every key log-feature is below -150, so every key feature underflows
    unless the running maximum starts from the first real key. Left padding and decode included."""
    mixer, config = build("performer")
    with torch.no_grad():
        mixer.k_proj.weight.mul_(60.0)
    x = torch.randn(2, 16, config.hidden_size, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[1, :5] = False
    with torch.no_grad():
        expected, log_k = favor_reference(mixer, x, mask)
        assert log_k.amax() < -150
        full = mixer(x, mask=mask)
        state = mixer.init_state(2)
        pieces = [mixer(x[:, :3], state, mask=mask[:, :3])]  # row 1: padding only, its maximum stays -inf
        assert state.max[0].isfinite().all() and (state.max[1] == -torch.inf).all()
        pieces += [mixer(x[:, 3:9], state, mask=mask[:, 3:9])]
        pieces += [mixer(x[:, t:t + 1], state) for t in range(9, 16)]
    real = mask[:, :, None]
    assert_close_rel(full * real, expected * real, rel=1e-4)
    assert_close_rel(torch.cat(pieces, 1) * real, expected * real, rel=1e-4)
    assert_close_rel(state.max, log_k.masked_fill(~mask[:, None, :, None], -torch.inf).amax((-1, -2)), rel=1e-5)


# --- redrawing the random features --------------------------------------------------------------------


def performer_projections(model) -> list[torch.Tensor]:
    return [module.projection.clone() for name, module in model.named_modules() if name.endswith("mixer")
            and hasattr(module, "projection")]


def test_forward_never_redraws_and_checkpointing_gives_the_same_gradients():
    model = tiny_model(layer_pattern="PAP", performer_redraw_interval=1).train()
    before = performer_projections(model)
    ids = random_ids(2, 12)
    model(ids, labels=ids).loss.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.gradient_checkpointing_enable()
    model(ids, labels=ids).loss.backward()  # the backward recomputes each block's forward
    for name, param in model.named_parameters():
        assert_close_rel(param.grad, plain[name], rel=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(performer_projections(model), before))


def test_loaded_features_survive_training_and_the_step_count_is_saved(tmp_path):
    model = tiny_model(layer_pattern="PA", performer_redraw_interval=3)
    for _ in range(2):
        model.after_optimizer_step()
    model.save_pretrained(tmp_path)
    loaded = HybridForCausalLM.from_pretrained(tmp_path).train()
    saved = performer_projections(model)
    ids = random_ids(1, 8)
    loaded(ids, labels=ids).loss.backward()
    assert all(torch.equal(a, b) for a, b in zip(performer_projections(loaded), saved))
    loaded.after_optimizer_step()  # step 3: the first redraw, in both
    model.after_optimizer_step()
    redrawn = performer_projections(loaded)
    assert not any(torch.equal(a, b) for a, b in zip(redrawn, saved))
    assert all(torch.equal(a, b) for a, b in zip(redrawn, performer_projections(model)))


def test_same_weights_and_step_redraw_the_same_features_whatever_the_global_rng():
    """What keeps data-parallel ranks in agreement: the features depend on the saved seed and step only."""
    first = tiny_model(seed=0, layer_pattern="PP", performer_redraw_interval=2)
    second = tiny_model(seed=1, layer_pattern="PP", performer_redraw_interval=2)
    second.load_state_dict(first.state_dict())
    history = [performer_projections(first)]  # per step: both layers' features
    assert not torch.equal(history[0][0], history[0][1])  # each layer has its own features (and seed)
    for step in range(1, 5):
        torch.manual_seed(step)
        first.after_optimizer_step()
        torch.manual_seed(100 + step)
        second.after_optimizer_step()
        history.append(performer_projections(first))
        assert all(torch.equal(a, b) for a, b in zip(history[-1], performer_projections(second)))
    same = [all(torch.equal(a, b) for a, b in zip(history[s], history[s - 1])) for s in range(1, 5)]
    assert same == [True, False, True, False]  # redrawn at steps 2 and 4 only
    assert not torch.equal(history[4][0], history[4][1]) and not torch.equal(history[4][0], history[2][0])


def test_the_training_loop_redraws_once_per_optimizer_step(tmp_path):
    """Three optimizer steps of two micro-batches each, with activation checkpointing: six forwards and six
    recomputes, but the step count is 3 and the features are those of one redraw (at step 2)."""
    from hybridlm.training.loop import TrainConfig, train
    from tests.training.test_loop import tiny_rows

    model = tiny_model(layer_pattern="PA", performer_redraw_interval=2)
    expected = copy.deepcopy(model)
    for _ in range(3):
        expected.after_optimizer_step()
    config = TrainConfig(steps=3, batch_size=4, grad_accum=2, checkpointing=True, warmup=0, log_every=10,
                         eval_every=100, save_every=100)
    train(model, tiny_rows(), config, tmp_path)
    assert [int(m.optimizer_steps) for m in model.modules() if hasattr(m, "optimizer_steps")] == [3]
    assert all(torch.equal(a, b) for a, b in zip(performer_projections(model), performer_projections(expected)))
    assert not torch.equal(performer_projections(model)[0], performer_projections(tiny_model(
        layer_pattern="PA", performer_redraw_interval=2))[0])  # redrawn: not the initial features


def test_redrawn_features_are_orthogonal_blocks_of_gaussian_norms():
    mixer, config = build("performer", performer_redraw_interval=1, performer_num_features=20)
    mixer.after_optimizer_step()
    w = mixer.projection  # [20, head_dim=8]: blocks of 8 orthogonal rows
    block = w[:8] / w[:8].norm(dim=1, keepdim=True)
    assert_close_rel(block @ block.T, torch.eye(8), rel=1e-5)
    assert int(mixer.optimizer_steps) == 1
