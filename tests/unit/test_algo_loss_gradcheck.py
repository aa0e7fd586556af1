"""Gradient of the full loss through a tiny real causal LM, checked by finite differences."""

from __future__ import annotations

import pytest
import torch
import transformers

from exgrpo_trainer.algo import LossConfig, token_entropy, token_logprobs

VOCAB, PROMPT_LEN, RESPONSE_LEN, ROWS = 64, 3, 5, 4
BETA = 0.1
CAP = 2.0


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).double().eval()
    # The stock RMSNorm normalises in float32 whatever the model dtype; finite differences need the
    # whole forward pass in float64, so swap in torch's RMSNorm (same formula, same weights).
    for name, module in list(model.named_modules()):
        if type(module).__name__ == "Qwen2RMSNorm":
            norm = torch.nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=torch.float64)
            with torch.no_grad():
                norm.weight.copy_(module.weight)
            model.set_submodule(name, norm)
    return model


@pytest.fixture(scope="module")
def batch(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Row 0 is a replayed stored trajectory, rows 1-3 fresh rollouts; rows 2-3 have padding."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (ROWS, PROMPT_LEN + RESPONSE_LEN), generator=generator)
    loss_mask = torch.tensor([[1] * 5, [1] * 5, [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    replay_mask = torch.zeros(ROWS, RESPONSE_LEN, dtype=torch.bool)
    replay_mask[0] = True
    with torch.no_grad():
        current = _response_logprobs(model, input_ids)
    noise = torch.randn(ROWS, RESPONSE_LEN, generator=generator, dtype=torch.float64)
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "replay_mask": replay_mask,
        # one optimizer step stale, and a much older behaviour policy for the replayed row
        "old_logprobs": current + 0.05 * noise,
        "past_logprobs": current - 1.0 + 0.5 * noise,
        "ref_logprobs": current + 0.2 * noise.flip(0),
        # an older sampler on the fresh rows: weights b = exp(old - behaviour) between about 0.5 and
        # 2.3, so the cap of 2 below masks one token
        "behaviour_logprobs": current + 0.05 * noise - 0.6 * noise.flip(1),
        "advantages": torch.tensor([0.625, 0.625, -0.375, -0.375], dtype=torch.float64),
    }


def _response_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    # position t predicts token t + 1: the response tokens come from positions P-1 .. P+T-2
    return model(input_ids=input_ids).logits[:, PROMPT_LEN - 1 : -1]


def _response_logprobs(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    return token_logprobs(_response_logits(model, input_ids), input_ids[:, PROMPT_LEN:])


def _full_loss(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    *,
    keep: list[torch.Tensor] | None = None,
    decoupled: bool = False,
) -> torch.Tensor:
    logits = _response_logits(model, batch["input_ids"])
    lp = token_logprobs(logits, batch["input_ids"][:, PROMPT_LEN:], chunk_size=7)
    if keep is not None:
        lp.retain_grad()
        keep.append(lp)
    loss_fn = LossConfig(
        normalizer=2.0, entropy_coeff=0.05, kl_coeff=0.1, beta=BETA, behaviour_weight_cap=CAP
    ).build()
    loss, _ = loss_fn(
        lp,
        old_logprobs=batch["old_logprobs"],
        past_logprobs=batch["past_logprobs"],
        advantages=batch["advantages"],
        loss_mask=batch["loss_mask"],
        replay_mask=batch["replay_mask"],
        entropy=token_entropy(logits, chunk_size=7),
        ref_logprobs=batch["ref_logprobs"],
        behaviour_logprobs=batch["behaviour_logprobs"] if decoupled else None,
        mixed_phase=True,
    )
    return loss


@pytest.mark.parametrize("decoupled", [False, True], ids=["sync", "decoupled"])
def test_gradient_wrt_token_logprobs_matches_the_closed_form(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], decoupled: bool
) -> None:
    """d loss / d lp: -A r / N on fresh tokens, -A beta w / (w + beta)^2 / N on replayed ones
    (plus the KL term, reproduced here), and exactly 0 on padding. Decoupled: fresh tokens get
    -A b r / N with b = pi_old / pi_behav, and 0 where b is above the cap."""
    kept: list[torch.Tensor] = []
    model.zero_grad()
    _full_loss(model, batch, keep=kept, decoupled=decoupled).backward()
    lp = kept[0].detach()
    grad = kept[0].grad
    assert grad is not None
    adv = batch["advantages"][:, None].expand_as(lp)
    mask, replay = batch["loss_mask"], batch["replay_mask"]
    ratio = (lp - batch["old_logprobs"]).exp()
    w = (lp - batch["past_logprobs"]).exp()
    b = (batch["old_logprobs"] - batch["behaviour_logprobs"]).exp()
    if decoupled:
        assert bool((mask & ~replay & (b > CAP)).any()) and bool((mask & ~replay & (b <= CAP)).any())
        fresh_weight = torch.where(b > CAP, 0.0, b)
    else:
        fresh_weight = torch.ones_like(b)
    pg = torch.where(replay, -adv * BETA * w / (w + BETA) ** 2, -adv * fresh_weight * ratio) / 2.0
    delta = batch["ref_logprobs"] - lp
    kl = 0.1 * (1.0 - delta.exp()) / mask.sum()  # d/d lp of the k3 estimate, token mean
    expected = torch.where(mask, pg + kl, 0.0)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("decoupled", [False, True], ids=["sync", "decoupled"])
def test_parameter_gradients_match_central_finite_differences(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], decoupled: bool
) -> None:
    model.zero_grad()
    _full_loss(model, batch, decoupled=decoupled).backward()
    params = dict(model.named_parameters())
    probes = [
        ("model.embed_tokens.weight", (int(batch["input_ids"][0, PROMPT_LEN]), 3)),
        ("model.embed_tokens.weight", (int(batch["input_ids"][2, 1]), 0)),
        ("model.layers.0.self_attn.q_proj.weight", (1, 2)),
        ("model.layers.1.self_attn.v_proj.weight", (5, 7)),
        ("model.layers.1.mlp.down_proj.weight", (0, 9)),
        ("model.norm.weight", (4,)),
        ("lm_head.weight", (int(batch["input_ids"][0, -1]), 11)),
        ("lm_head.weight", (int(batch["input_ids"][3, -2]), 30)),
    ]
    step = 1e-5
    analytics = []
    with torch.no_grad():
        for name, index in probes:
            param = params[name]
            assert param.grad is not None
            analytic = float(param.grad[index])
            analytics.append(analytic)
            original = float(param[index])
            param[index] = original + step
            plus = _full_loss(model, batch, decoupled=decoupled).item()
            param[index] = original - step
            minus = _full_loss(model, batch, decoupled=decoupled).item()
            param[index] = original
            numeric = (plus - minus) / (2 * step)
            assert analytic == pytest.approx(numeric, rel=1e-6, abs=1e-10), name
    assert any(abs(a) > 1e-6 for a in analytics)
